"""Fused encode in Triton: TurboQuant MSE (center, scale, norm, randomized Hadamard, codebook search,
pack) and KIVI (group min/max, fp16 scale and zero, affine codes, pack).

Same contracts as `reference.tq_encode` / `reference.kivi_encode`; vectors stay in registers from the
load of x to the store of the packed bytes. TurboQuant's Walsh-Hadamard transform runs as log2(d)
butterfly stages in the order of `primitives.rotation.fwht`, each an exact add/subtract, so codes
differ from the torch path only where the norm's summation order moves a value across a codebook
boundary (a tie at float32 rounding). KIVI's arithmetic is elementwise IEEE (divisions `div_rn`,
round half to even), so its codes and fp16 metadata equal the torch path's bit for bit.

Launchers accept CUDA tensors, or CPU tensors under Triton's interpreter (see triton_attention.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reference import MATCH_FLOOR, check_kivi_encode, check_tq_encode, check_trellis_encode


@triton.jit
def _store_packed(code, row_ptrs, row_ok, BITS: tl.constexpr, NBYTES: tl.constexpr, WIDTH: tl.constexpr):
    """Pack int32 codes `(ROWS, WIDTH)` LSB-first and store each row's first NBYTES bytes at `row_ptrs (ROWS, 1)`.

    8 codes fill exactly BITS bytes, assembled in one 32-bit word (BITS <= 4); codes past the row's
    length must be 0, as `pack_bits` pads.
    """
    groups = tl.reshape(code, (code.shape[0], WIDTH // 8, 8))
    word = tl.sum(groups << (tl.arange(0, 8) * BITS)[None, None, :], 2)
    first = tl.arange(0, WIDTH // 8) * BITS
    for k in tl.static_range(BITS):
        byte = first[None, :] + k
        tl.store(row_ptrs + byte, ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=row_ok & (byte < NBYTES))


@triton.jit
def _tq_encode_kernel(
    x_ptr, sx_b, sx_h, sx_t,
    mean_ptr, inv_ptr, signs_ptr, bounds_ptr, cent_ptr,
    norm_ptr, codes_ptr,
    H, T, sqrt_d, tiny, floor,
    D: tl.constexpr, LOG2_D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr, MATCH: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + toks[:, None] * sx_t + cols[None, :], mask=tok_ok[:, None], other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + h * D + cols)[None, :]
    if HAS_SCALE:
        x = x * tl.load(inv_ptr + h * D + cols)[None, :]
    norm = tl.sqrt_rn(tl.sum(x * x, 1))
    # IEEE division (not the GPU's approximate one) so the direction matches torch's to the last bit.
    y = tl.div_rn(x, tl.maximum(norm, tiny)[:, None]) * tl.load(signs_ptr + h * D + cols)[None, :]
    # Butterflies of fwht: stage `half` pairs element j with j + half inside blocks of 2·half.
    # (A constexpr cannot be reassigned in a compiled loop, so `half` = 1 << stage is written out.)
    for stage in tl.static_range(LOG2_D):
        pairs = tl.permute(tl.reshape(y, (BLOCK_T, D >> (stage + 1), 2, 1 << stage)), (0, 1, 3, 2))
        lo, hi = tl.split(pairs)
        y = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2)), (BLOCK_T, D))
    y = tl.div_rn(y, tl.zeros_like(y) + sqrt_d)
    # Code = number of boundaries strictly below y (torch.bucketize, right=False).
    code = tl.zeros([BLOCK_T, D], tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        code += (y > tl.load(bounds_ptr + i)).to(tl.int32)
    _store_packed(code, codes_ptr + (pid_bh * T + toks)[:, None] * (D * BITS // 8), tok_ok[:, None], BITS, D * BITS // 8, D)
    if MATCH:  # the stored scalar makes the reconstruction as long as the input: ||x'|| / ||c[code]||
        c = tl.load(cent_ptr + code)
        norm = tl.div_rn(norm, tl.maximum(tl.sqrt_rn(tl.sum(c * c, 1)), floor))
    tl.store(norm_ptr + pid_bh * T + toks, norm.to(tl.float16), mask=tok_ok)


# True when Triton's interpreter runs the kernels, CPU tensors allowed (see triton_attention.INTERPRETED).
INTERPRETED = not any(isinstance(f, triton.runtime.JITFunction) for f in (tl.zeros, _tq_encode_kernel))


def _check_device(x: torch.Tensor) -> None:
    if not (x.device.type == "cuda" or (INTERPRETED and x.device.type == "cpu")):
        raise ValueError(f"Triton kernels need CUDA tensors (or CPU tensors under the interpreter), got {x.device}")


def tq_encode(
    x: torch.Tensor,
    mean: torch.Tensor | None,
    inv_scale: torch.Tensor | None,
    signs: torch.Tensor,
    boundaries: torch.Tensor,
    bits: int,
    centroids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `reference.tq_encode`: -> (norm (B, H, T, 1) float16, codes (B, H, T, d·bits/8) uint8)."""
    check_tq_encode(x, mean, inv_scale, signs, boundaries, bits, centroids)
    _check_device(x)
    b, h, t, d = x.shape
    norm = torch.empty((b, h, t, 1), dtype=torch.float16, device=x.device)
    codes = torch.empty((b, h, t, d * bits // 8), dtype=torch.uint8, device=x.device)
    if norm.numel() == 0:
        return norm, codes
    if x.stride(-1) != 1:
        x = x.contiguous()
    # On a GPU a (BLOCK_T x d) tile and its butterfly copies stay in registers; the interpreter's cost
    # is per program, so it takes bigger tiles (the tail masking is exercised either way: 217 tokens).
    block_t = 64 if INTERPRETED else 16 if d <= 128 else 8
    signs = signs.contiguous()
    _tq_encode_kernel[(b * h, triton.cdiv(t, block_t))](
        x, x.stride(0), x.stride(1), x.stride(2),
        signs if mean is None else mean.contiguous(), signs if inv_scale is None else inv_scale.contiguous(),
        signs, boundaries.contiguous(), signs if centroids is None else centroids.contiguous(), norm, codes,
        h, t, math.sqrt(d), torch.finfo(torch.float32).tiny, MATCH_FLOOR,
        D=d, LOG2_D=d.bit_length() - 1, BITS=bits, BLOCK_T=block_t,
        HAS_MEAN=mean is not None, HAS_SCALE=inv_scale is not None, MATCH=centroids is not None,
    )
    return norm, codes


@triton.jit
def _affine_meta(lo, hi, BITS: tl.constexpr):
    """`quantize_affine`'s scale and zero, rounded to the fp16 they are stored in (returned as float32)."""
    levels = tl.zeros_like(hi) + ((1 << BITS) - 1)
    scale = tl.maximum(tl.div_rn(hi - lo, levels), 1e-8)
    return scale.to(tl.float16).to(tl.float32), lo.to(tl.float16).to(tl.float32)


@triton.jit
def _affine_codes(x, lo, scale, BITS: tl.constexpr):
    """round((x - lo) / scale) half to even, clamped to [0, 2**BITS - 1], as `quantize_affine` (torch.round)."""
    v = tl.div_rn(x - lo, scale)
    v = tl.where(v == v, v, 0.0)  # 0/0 of a constant group (its scale rounds to 0 in fp16): code 0, as torch on CPU
    r = tl.floor(v + 0.5)  # exact here: |v| < 2**5, so v + 0.5 does not round
    odd = r * 0.5 != tl.floor(r * 0.5)
    r = tl.where((r - v == 0.5) & odd, r - 1.0, r)
    return tl.minimum(tl.maximum(r, 0.0), (1 << BITS) - 1).to(tl.int32)


@triton.jit
def _kivi_keys_kernel(
    x_ptr, sx_b, sx_h, sx_t, codes_ptr, scale_ptr, zero_ptr, H, T,
    D: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One token group of one kv head: per-channel min/max over GROUP tokens."""
    pid_bh = tl.program_id(0).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    first = tl.program_id(1) * GROUP
    offs = tl.arange(0, BLOCK_G)
    toks = first + offs
    tok_ok = offs < GROUP
    cols = tl.arange(0, BLOCK_D)
    ok = tok_ok[:, None] & (cols[None, :] < D)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + toks[:, None] * sx_t + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    lo = tl.where(cols < D, tl.min(tl.where(ok, x, float("inf")), 0), 0.0)  # padded channels: 0, not inf - inf
    hi = tl.where(cols < D, tl.max(tl.where(ok, x, float("-inf")), 0), 0.0)
    scale, zero = _affine_meta(lo, hi, BITS)
    code = tl.where(ok, _affine_codes(x, zero[None, :], scale[None, :], BITS), 0)
    _store_packed(code, codes_ptr + (pid_bh * T + toks)[:, None] * NBYTES, tok_ok[:, None], BITS, NBYTES, BLOCK_D)
    # Spread layout: channel c of this group goes to row first + c // PER_ROW, column c % PER_ROW.
    meta = (pid_bh * T + first + cols // PER_ROW) * PER_ROW + cols % PER_ROW
    tl.store(scale_ptr + meta, scale.to(tl.float16), mask=cols < D)
    tl.store(zero_ptr + meta, zero.to(tl.float16), mask=cols < D)


@triton.jit
def _kivi_values_kernel(
    x_ptr, sx_b, sx_h, sx_t, codes_ptr, scale_ptr, zero_ptr, H, T,
    D: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_T tokens of one kv head: per-token min/max over each group of GROUP channels (any GROUP dividing D)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    cols = tl.arange(0, BLOCK_D)
    ok = tok_ok[:, None] & (cols[None, :] < D)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + toks[:, None] * sx_t + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale_t = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    zero_t = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    meta = (pid_bh * T + toks) * (D // GROUP)
    for g in tl.static_range(D // GROUP):
        in_group = (cols[None, :] >= g * GROUP) & (cols[None, :] < (g + 1) * GROUP)
        scale, zero = _affine_meta(tl.min(tl.where(in_group, x, float("inf")), 1), tl.max(tl.where(in_group, x, float("-inf")), 1), BITS)
        tl.store(scale_ptr + meta + g, scale.to(tl.float16), mask=tok_ok)
        tl.store(zero_ptr + meta + g, zero.to(tl.float16), mask=tok_ok)
        scale_t = tl.where(in_group, scale[:, None], scale_t)
        zero_t = tl.where(in_group, zero[:, None], zero_t)
    code = tl.where(ok, _affine_codes(x, zero_t, scale_t, BITS), 0)
    _store_packed(code, codes_ptr + (pid_bh * T + toks)[:, None] * NBYTES, tok_ok[:, None], BITS, NBYTES, BLOCK_D)


def kivi_encode(x: torch.Tensor, bits: int, group: int, axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `reference.kivi_encode`: -> (codes uint8, scale float16, zero float16)."""
    check_kivi_encode(x, bits, group, axis)
    _check_device(x)
    b, h, t, d = x.shape
    nbytes = (d * bits + 7) // 8
    codes = torch.empty((b, h, t, nbytes), dtype=torch.uint8, device=x.device)
    meta = -(-d // group) if axis == "channel" else d // group
    # Zeros: the spread layout pads each key group's last row, and the kernels write only real channels.
    scale = torch.zeros((b, h, t, meta), dtype=torch.float16, device=x.device)
    zero = torch.zeros_like(scale)
    if codes.numel() == 0:
        return codes, scale, zero
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_d = max(16, triton.next_power_of_2(d))
    strides = (x.stride(0), x.stride(1), x.stride(2))
    if axis == "channel":
        _kivi_keys_kernel[(b * h, t // group)](
            x, *strides, codes, scale, zero, h, t,
            D=d, BITS=bits, NBYTES=nbytes, GROUP=group, PER_ROW=meta, BLOCK_G=triton.next_power_of_2(group), BLOCK_D=block_d,
        )
    else:
        block_t = 64 if INTERPRETED else 16  # as in tq_encode: the interpreter's cost is per program
        _kivi_values_kernel[(b * h, triton.cdiv(t, block_t))](
            x, *strides, codes, scale, zero, h, t, D=d, BITS=bits, NBYTES=nbytes, GROUP=group, BLOCK_T=block_t, BLOCK_D=block_d,
        )
    return codes, scale, zero


# -- trellis-coded TurboQuant: the tail-biting Viterbi search -------------------------------------------------------------
@triton.jit
def _trellis_forward(y_ptr, r, ok, book, back, wrap, SHIFT: tl.constexpr, HAS_WRAP: tl.constexpr, N: tl.constexpr,
                     BITS: tl.constexpr, STATE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Costs (BLOCK_N, 2**STATE) after the last coordinate of rows `r`, read from coordinate SHIFT on around the circle;
    step i's best predecessor high parts go to `back + i * TAIL` (BLOCK_N, TAIL) as bytes. With HAS_WRAP the first state's
    high STATE - BITS bits are held to `wrap`."""
    S: tl.constexpr = 1 << STATE
    FAN: tl.constexpr = 1 << BITS
    TAIL: tl.constexpr = S // FAN
    s = tl.arange(0, S)
    x = tl.load(y_ptr + r * N + SHIFT % N, mask=ok, other=0.0)
    e = x[:, None] - book[None, :]
    cost = e * e
    if HAS_WRAP:
        cost = tl.where((s[None, :] >> BITS) == wrap[:, None], cost, float("inf"))
    book3 = tl.reshape(book, (1, TAIL, FAN))  # state lo·FAN + new: its low part lo, its new symbol
    for i in range(1, N):
        folded = tl.reshape(cost, (BLOCK_N, FAN, TAIL))  # predecessor hi·TAIL + lo
        best = tl.min(folded, axis=1)
        arg = tl.argmin(folded, axis=1, tie_break_left=True)
        tl.store(back + (i - 1) * TAIL, arg.to(tl.uint8), mask=ok[:, None])
        x = tl.load(y_ptr + r * N + (i + SHIFT) % N, mask=ok, other=0.0)
        diff = x[:, None, None] - book3  # (a loop-carried name must keep its shape: not `e`)
        cost = tl.reshape(best[:, :, None] + diff * diff, (BLOCK_N, S))
    return cost


@triton.jit
def _trellis_last(cost, wrap, HAS_WRAP: tl.constexpr, STATE: tl.constexpr, BITS: tl.constexpr):
    """Each row's least-cost final state (the first on ties), held to `wrap` in its low STATE - BITS bits."""
    TAIL: tl.constexpr = (1 << STATE) >> BITS
    s = tl.arange(0, 1 << STATE)
    if HAS_WRAP:
        cost = tl.where((s[None, :] & (TAIL - 1)) == wrap[:, None], cost, float("inf"))
    return tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32)


@triton.jit
def _trellis_encode_kernel(y_ptr, book_ptr, back_ptr, out_ptr, rows, N: tl.constexpr, BITS: tl.constexpr,
                           STATE: tl.constexpr, BLOCK_N: tl.constexpr):
    """`reference.trellis_encode` for BLOCK_N rows per program: a free pass over each row rotated by N/2, whose path's
    state at coordinate N - 1 gives the wrap-around bits, then a pass held to them; symbols by walking the back-pointers
    (`back_ptr`: (rows, N - 1, TAIL) bytes, this program's rows only, reused by the second pass)."""
    TAIL: tl.constexpr = (1 << STATE) >> BITS
    HALF: tl.constexpr = N // 2
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = r < rows
    r = r.to(tl.int64)
    book = tl.load(book_ptr + tl.arange(0, 1 << STATE))
    back = back_ptr + r[:, None] * ((N - 1) * TAIL) + tl.arange(0, TAIL)[None, :]
    rows_back = back_ptr + r * ((N - 1) * TAIL)
    none = tl.zeros([BLOCK_N], tl.int32)
    cost = _trellis_forward(y_ptr, r, ok, book, back, none, HALF, False, N, BITS, STATE, BLOCK_N)
    tl.debug_barrier()  # the walk below reads other threads' back-pointer stores
    state = _trellis_last(cost, none, False, STATE, BITS)
    for j in range(HALF):  # position N - 1 - j -> N - 2 - j of the rotated row: ends at coordinate N - 1
        lo = state >> BITS
        hi = tl.load(rows_back + (N - 2 - j) * TAIL + lo, mask=ok, other=0).to(tl.int32)
        state = hi * TAIL + lo
    wrap = state & (TAIL - 1)
    tl.debug_barrier()  # every walk is done before the second pass overwrites the back-pointers
    cost = _trellis_forward(y_ptr, r, ok, book, back, wrap, 0, True, N, BITS, STATE, BLOCK_N)
    tl.debug_barrier()
    state = _trellis_last(cost, wrap, True, STATE, BITS)
    for j in range(N - 1):
        i = N - 1 - j
        tl.store(out_ptr + r * N + i, (state & ((1 << BITS) - 1)).to(tl.uint8), mask=ok)
        lo = state >> BITS
        hi = tl.load(rows_back + (i - 1) * TAIL + lo, mask=ok, other=0).to(tl.int32)
        state = hi * TAIL + lo
    tl.store(out_ptr + r * N, (state & ((1 << BITS) - 1)).to(tl.uint8), mask=ok)


TRELLIS_ROWS = 1 << 16  # rows per launch: (rows, n - 1, 2**(L - bits)) back-pointer bytes, 258 MB at n = 64, L = 9, bits = 3


def trellis_encode(y: torch.Tensor, codebook: torch.Tensor, bits: int) -> torch.Tensor:
    """Triton `reference.trellis_encode`: y (..., n) float -> (..., n) uint8 symbols."""
    check_trellis_encode(y, codebook, bits)
    _check_device(y)
    n = y.shape[-1]
    flat = y.reshape(-1, n).float().contiguous()
    out = torch.empty(flat.shape, dtype=torch.uint8, device=y.device)
    state = codebook.numel().bit_length() - 1
    # A program's (BLOCK_N x 2**L) costs sit in registers: 4 rows at L <= 9 on a GPU; the interpreter's cost is per program.
    block_n = 16 if INTERPRETED else 4 if state <= 9 else 2
    book = codebook.float().contiguous()
    for r0 in range(0, flat.shape[0], TRELLIS_ROWS):
        part = flat[r0 : r0 + TRELLIS_ROWS]
        back = torch.empty((part.shape[0], n - 1, 1 << (state - bits)), dtype=torch.uint8, device=y.device)
        _trellis_encode_kernel[(triton.cdiv(part.shape[0], block_n),)](part, book, back, out[r0 : r0 + TRELLIS_ROWS], part.shape[0],
                                                                     N=n, BITS=bits, STATE=state, BLOCK_N=block_n)
    return out.view(y.shape)
