"""Triton flash-decoding attention over compressed KV segments (TurboQuant MSE, int8, KIVI).

Same contract as `reference.py` (partial softmax `(m, denom, o)` over one segment; GQA rows grouped per
kv head; optional row offset, softcap and additive bias). Grid: (B·H, row blocks, splits). Each
program loads its kv head's query rows once, then walks its split of the sequence a tile of
BLOCK_T tokens at a time: it loads packed codes, unpacks bits and looks up centroids (or scales
and zero points) in registers, and folds the tile into an online softmax. So one pass over a kv
head's codes serves its whole GQA group and all query tokens, and no float K or V ever reaches
global memory. With more than one split, `_merge_kernel` combines the split partials by log-sum-exp.

Launchers accept CUDA tensors, or CPU tensors when the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1` set before `triton` is first imported, as the tests do).
Block sizes and split counts: first choices, except the tiles and centroid lookup that `_Plan` picks by head dim
for TurboQuant and int8, chosen from H200 sweeps (docs/guide/gpu.md).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .reference import check_int8_attention, check_kivi_attention, check_query, check_tq_attention, check_turning, skip_bias


# -- shared device helpers -------------------------------------------------------------------------
@triton.jit
def _unpack(row_ptrs, cols, mask, BITS: tl.constexpr, NBYTES: tl.constexpr):
    """b-bit codes at channel `cols (1, BD)` of LSB-first packed rows `row_ptrs (BT, 1)` -> int32 (BT, BD)."""
    bit = cols * BITS
    byte = bit // 8
    word = tl.load(row_ptrs + byte, mask=mask, other=0).to(tl.int32)
    if 8 % BITS != 0:  # widths that do not divide a byte (3 bits) straddle two bytes
        hi = tl.load(row_ptrs + byte + 1, mask=mask & (byte + 1 < NBYTES), other=0).to(tl.int32)
        word = word | (hi << 8)
    return (word >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def _unpack_groups(row_ptrs, groups, mask, BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """b-bit codes of 8-code groups `groups (1, BG)` of LSB-first packed rows `row_ptrs (BT, 1)` -> int32 (BT, 8·BG).

    Eight b-bit codes fill exactly b bytes, so a group is b byte loads and eight shifts: b/8 loads per code
    instead of the one or two of `_unpack`, and the address arithmetic is per group, not per code. Loads and
    address math were what bounded the per-code version on an H200 (docs/guide/gpu.md). Needs d % 8 == 0."""
    word = tl.zeros([BLOCK_T, BLOCK_G], tl.int64 if BITS > 4 else tl.int32)
    for i in tl.static_range(BITS):
        byte = tl.load(row_ptrs + groups * BITS + i, mask=mask, other=0)
        word = word | (byte.to(word.dtype) << (8 * i))
    # (an arithmetic shift of a word with its top bit set only smears ones above the mask)
    codes = (word[:, :, None] >> (tl.arange(0, 8) * BITS)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes.to(tl.int32), (BLOCK_T, BLOCK_G * 8))


@triton.jit
def _codes(row_ptrs, cols, groups, tok_ok, C: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, GROUPED: tl.constexpr):
    """The (BT, BLOCK_C) int32 codes of C channels, by 8-code groups when C % 8 == 0 (GROUPED), else per code."""
    if GROUPED:
        return _unpack_groups(row_ptrs, groups[None, :], tok_ok[:, None] & (groups[None, :] < C // 8), BITS, BLOCK_T, BLOCK_C // 8)
    else:
        return _unpack(row_ptrs, cols[None, :], tok_ok[:, None] & (cols[None, :] < C), BITS, NBYTES)


@triton.jit
def _windows(row_ptrs, cols, mask, C: tl.constexpr, BITS: tl.constexpr, STATE: tl.constexpr, NBYTES: tl.constexpr):
    """Trellis codes (`reference.code_values`): int32 (BT, BD) table indices of channels `cols (1, BD)`, each the STATE
    bits of the row's circular string of BITS-bit symbols that end at its own symbol, the oldest lowest: STATE / BITS
    symbol reads (each L1-resident after the first) shifted into place."""
    w = tl.zeros(cols.shape, tl.int32)
    for j in tl.static_range(STATE // BITS):
        src = (cols + (C - STATE // BITS + 1 + j)) % C
        w = w | (_unpack(row_ptrs, src, mask, BITS, NBYTES) << (BITS * j))
    return w


@triton.jit
def _windows_groups(row_ptrs, groups, mask, BITS: tl.constexpr, STATE: tl.constexpr, NBYTES: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """`_windows` by 8-channel groups (`_unpack_groups`' layout; needs C % 8 == 0 and STATE - BITS <= 8): a group's
    windows lie in its BITS bytes and the byte before them (the row's last byte for group 0: the string is circular
    and whole bytes long), so BITS + 1 loads and eight shifts give eight windows. The per-channel form's STATE / BITS
    symbol reads per channel were what made trellis tiles 2-3x the scalar ones on an H200 (docs/guide/gpu.md)."""
    prev = tl.where(groups == 0, NBYTES - 1, groups * BITS - 1)
    word = tl.load(row_ptrs + prev, mask=mask, other=0).to(tl.int64)
    for i in tl.static_range(BITS):
        byte = tl.load(row_ptrs + groups * BITS + i, mask=mask, other=0)
        word = word | (byte.to(tl.int64) << (8 * (i + 1)))
    shifts = (8 - (STATE - BITS)) + tl.arange(0, 8) * BITS  # channel j's window starts STATE - BITS bits before its symbol
    win = (word[:, :, None] >> shifts[None, None, :]) & ((1 << STATE) - 1)
    return tl.reshape(win.to(tl.int32), (BLOCK_T, BLOCK_G * 8))


@triton.jit
def _pair_values(row_ptrs, units, mask, pair_ptr, BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                 WORDS: tl.constexpr):
    """float16 unit values (BT, BLOCK_C) of TurboQuant code rows `row_ptrs (BT, 1)`, two channels per table read.

    `pair_ptr` holds `2**(2·BITS)` int32 entries (`pair_table`): entry `lo | hi << BITS` is fp16(centroid[lo]) in its
    low half and fp16(centroid[hi]) in its high half, so the 2·BITS bits of channels 2k and 2k + 1 (LSB first) index
    both values at once. Against one float32 read per code this halves the reads and their 64-bit address arithmetic,
    which with the byte assembly were most of the loop's instructions (docs/guide/gpu.md), and the values need no
    conversion to the float16 the dots take. `units (1, BU)`: 8-code groups (BITS bytes each, assembled from byte
    loads), or with WORDS (BITS dividing 32, rows of whole 32-bit words) the rows' words, one load per 32 / BITS codes."""
    if WORDS:
        word = tl.load(row_ptrs.to(tl.pointer_type(tl.int32)) + units, mask=mask, other=0)
    else:
        word = tl.zeros([BLOCK_T, units.shape[1]], tl.int32)
        for i in tl.static_range(BITS):
            byte = tl.load(row_ptrs + units * BITS + i, mask=mask, other=0)
            word = word | (byte.to(tl.int32) << (8 * i))
    per: tl.constexpr = BLOCK_C // (2 * units.shape[1])  # pairs per unit: 4 per group, 16 / BITS per word
    idx = (word[:, :, None] >> (tl.arange(0, per) * (2 * BITS))[None, None, :]) & ((1 << (2 * BITS)) - 1)
    both = tl.load(pair_ptr + idx)  # int32: two fp16 values each
    lo = (both & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (both >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (BLOCK_T, BLOCK_C))


@triton.jit
def _values(row_ptrs, cols, groups, tok_ok, table_ptr, C: tl.constexpr, BITS: tl.constexpr, STATE: tl.constexpr,
            NBYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, GROUPED: tl.constexpr, SELECT: tl.constexpr):
    """Unit values (BT, BLOCK_C) float32 of TurboQuant code rows: centroids of scalar codes (STATE == BITS), or a
    trellis table read at each channel's window (STATE > BITS)."""
    if STATE > BITS:
        if GROUPED and STATE - BITS <= 8:
            win = _windows_groups(row_ptrs, groups[None, :], tok_ok[:, None] & (groups[None, :] < C // 8), BITS, STATE, NBYTES,
                                  BLOCK_T, BLOCK_C // 8)
        else:
            win = _windows(row_ptrs, cols[None, :], tok_ok[:, None] & (cols[None, :] < C), C, BITS, STATE, NBYTES)
        return tl.load(table_ptr + win)
    else:
        return _lookup(table_ptr, _codes(row_ptrs, cols, groups, tok_ok, C, BITS, NBYTES, BLOCK_T, BLOCK_C, GROUPED), BITS, SELECT)


@triton.jit
def _lookup(table_ptr, code, BITS: tl.constexpr, SELECT: tl.constexpr):
    """Centroids `table[code]` (float32): a gather from the (cached) table, or with SELECT a chain of 2^b - 1
    selects among values held in registers (no load per code; more arithmetic)."""
    if SELECT:
        out = tl.zeros(code.shape, tl.float32) + tl.load(table_ptr)
        for j in tl.static_range(1, 1 << BITS):
            out = tl.where(code == j, tl.load(table_ptr + j), out)
        return out
    else:
        return tl.load(table_ptr + code)


@triton.jit
def _scaled_fp16(q):
    """Rows of q divided by their largest magnitude, in float16, and that magnitude: fp16 tensor-core operands
    that cannot overflow whatever the query's scale (fp16 rounding is relative, so nothing else is lost)."""
    amax = tl.max(tl.abs(q), 1)
    amax = tl.where(amax > 0, amax, 1.0)
    return (q / amax[:, None]).to(tl.float16), amax


@triton.jit
def _finish_scores(s, b, h, rows, toks, row_ok, tok_ok, scale, softcap,
                   bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows,
                   HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Scale, softcap, add the bias (row r reads bias row r % bias_rows), and mask tokens past the split."""
    s = s * scale
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to ±1 without overflow and needs no libdevice.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    if HAS_BIAS:
        ptrs = bias_ptr + b * sb_b + h * sb_h + (rows % bias_rows)[:, None] * sb_r + toks[None, :] * sb_t
        s += tl.load(ptrs, mask=row_ok[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)
    return tl.where(tok_ok[None, :], s, float("-inf"))


@triton.jit
def _turning_coefficients(tq_ptr, stq_b, stq_h, stq_r, pair_ptr, mu_ptr, b, h, rows, row_ok, M, PB,
                          HALF: tl.constexpr, BLOCK_M: tl.constexpr):
    """`(A, B (BR, BM))` of the turning-mean term `A cos(θp) + B sin(θp)` per query row and turning pair, from the
    unrotated query's RoPE pair (a, b) = (i, i + d/2) and the pair's un-RoPEd mean; and the pairs' indices and mask."""
    mm = tl.arange(0, BLOCK_M)
    m_ok = mm < M
    state = b * PB + h  # PB: heads per batch row when each row holds its own pairs and means, else 0
    pair = tl.load(pair_ptr + state * M + mm, mask=m_ok, other=0)
    mu_a = tl.load(mu_ptr + (state * M + mm) * 2, mask=m_ok, other=0.0)
    mu_b = tl.load(mu_ptr + (state * M + mm) * 2 + 1, mask=m_ok, other=0.0)
    q_row = tq_ptr + b * stq_b + h * stq_h + rows[:, None] * stq_r
    ok = row_ok[:, None] & m_ok[None, :]
    q_a = tl.load(q_row + pair[None, :], mask=ok, other=0.0).to(tl.float32)
    q_b = tl.load(q_row + pair[None, :] + HALF, mask=ok, other=0.0).to(tl.float32)
    return q_a * mu_a[None, :] + q_b * mu_b[None, :], q_b * mu_a[None, :] - q_a * mu_b[None, :], pair, m_ok


@triton.jit
def _turning_table(rate, DTYPE: tl.constexpr, BLOCK_T: tl.constexpr):
    """`cos(jθ), sin(jθ) (BT, BM)` in DTYPE for the tile's token offsets j < BLOCK_T and the pairs' `θ = 2π·rate`: the
    same for every tile, so a program forms it once (j·θ <= BLOCK_T·θ is exact enough in float32)."""
    j = tl.arange(0, BLOCK_T).to(tl.float32)
    angle = j[:, None] * (rate.to(tl.float32) * 6.283185307179586)[None, :]
    return tl.cos(angle).to(DTYPE), tl.sin(angle).to(DTYPE)


@triton.jit
def _turning_scores(coef_a, coef_b, rate, pos, cos_j, sin_j, PRECISION: tl.constexpr, F16: tl.constexpr):
    """`(BR, BT)` turning-mean term of the tile whose first token sits at RoPE position `pos`, for the pairs' turns per
    token `rate = θ/2π (BM,)` float64. The tile's first phase φ0 is reduced to a fraction of a turn in float64 (θ·p
    reaches 10^4-10^6 rad, where a float32 product is off by 10^-3 rad or more; the rate comes in float64 because a
    literal 1/2π here would be a float32 one). Then A cos(φ0 + jθ) + B sin(φ0 + jθ) = E cos(jθ) + F sin(jθ) with
    E = A c0 + B s0, F = B c0 - A s0: two small dots against the program's table, no transcendental per token. With
    F16 the dots take fp16 operands as the kernel's others do (E, F divided by their row's largest magnitude)."""
    turns = pos.to(tl.float64) * rate
    phase0 = (turns - tl.floor(turns)).to(tl.float32) * 6.283185307179586
    c0, s0 = tl.cos(phase0)[None, :], tl.sin(phase0)[None, :]
    e = coef_a * c0 + coef_b * s0  # (BR, BM)
    f = coef_b * c0 - coef_a * s0
    if F16:
        amax = tl.maximum(tl.max(tl.abs(e), 1), tl.max(tl.abs(f), 1))
        amax = tl.where(amax > 0, amax, 1.0)
        e16, f16 = (e / amax[:, None]).to(tl.float16), (f / amax[:, None]).to(tl.float16)
        out = (tl.dot(e16, tl.trans(cos_j)) + tl.dot(f16, tl.trans(sin_j))) * amax[:, None]
    else:  # (an explicit else: code after a constexpr branch's return is still compiled, with fp16 tables here)
        out = tl.dot(e, tl.trans(cos_j), input_precision=PRECISION) + tl.dot(f, tl.trans(sin_j), input_precision=PRECISION)
    return out


@triton.jit
def _program_rows(q_ptr, sq_b, sq_h, sq_r, H, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    """A program's (batch·kv head, row block): `pid_bh, b, h`, its query rows and their mask, the key and value channel
    ranges, and its query rows `(BR, BD)` float32 (padded rows and channels 0)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    dk = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + dk[None, :], mask=row_ok[:, None] & (dk[None, :] < D),
                other=0.0).to(tl.float32)
    return pid_bh, b, h, rows, row_ok, dk, tl.arange(0, BLOCK_DV), q


@triton.jit
def _softmax_step(s, m_i):
    """New running max, the rescale factor of the old sums, and p = exp(s - max) for one tile."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows masked so far keep p = 0, never NaN
    return m_new, tl.exp(m_i - m_safe), tl.exp(s - m_safe[:, None])


@triton.jit
def _store_partial(m_i, l_i, acc, m_ptr, l_ptr, o_ptr, pid_bh, rows, row_ok, dv, R,
                   DV: tl.constexpr, FINAL: tl.constexpr):
    """Write this split's (m, denom, o) at [pid_bh, split, rows]; with one split these are the outputs."""
    split = pid_bh * tl.num_programs(2) + tl.program_id(2)
    out = split * R + rows
    if FINAL:
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    tl.store(m_ptr + out, m_i, mask=row_ok)
    tl.store(l_ptr + out, l_i, mask=row_ok)
    tl.store(o_ptr + out[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv[None, :] < DV))


# -- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _tq_attention_kernel(
    q_ptr, sq_b, sq_h, sq_r,
    kc_ptr, skc_b, skc_h, skc_t, kn_ptr, skn_b, skn_h, skn_t, kcent_ptr,
    vc_ptr, svc_b, svc_h, svc_t, vn_ptr, svn_b, svn_h, svn_t, vcent_ptr,
    off_ptr, so_b, so_h, so_r,
    bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows,
    tq_ptr, stq_b, stq_h, stq_r, pair_ptr, mu_ptr, rate_ptr, pos0_ptr, M, PB,
    m_ptr, l_ptr, o_ptr,
    H, R, T, split_len, scale, softcap,
    D: tl.constexpr, DV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KBYTES: tl.constexpr, VBYTES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FINAL: tl.constexpr,
    PRECISION: tl.constexpr, F16: tl.constexpr, GROUPED: tl.constexpr, SELECT: tl.constexpr,
    HAS_TURN: tl.constexpr, BLOCK_M: tl.constexpr, KSTATE: tl.constexpr, VSTATE: tl.constexpr,
    KPAIRS: tl.constexpr = False, VPAIRS: tl.constexpr = False, KWORDS: tl.constexpr = False, VWORDS: tl.constexpr = False,
):
    pid_bh, b, h, rows, row_ok, dk, dv, q = _program_rows(q_ptr, sq_b, sq_h, sq_r, H, R, D, BLOCK_R, BLOCK_D, BLOCK_DV)  # q (BR, BD)
    if F16:
        q16, q_amax = _scaled_fp16(q)
    if HAS_OFFSET:
        offset = tl.load(off_ptr + b * so_b + h * so_h + rows * so_r, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_TURN:  # keys centered on a turning mean: their per-token term, computed here (no (rows x tokens) bias in memory)
        coef_a, coef_b, pair, m_ok = _turning_coefficients(tq_ptr, stq_b, stq_h, stq_r, pair_ptr, mu_ptr, b, h, rows, row_ok, M, PB,
                                                           D // 2, BLOCK_M)
        rate = tl.load(rate_ptr + pair, mask=m_ok, other=0.0)
        pos0 = tl.load(pos0_ptr + b)
        if F16:  # (one return type per jitted function: the compiler refuses a dtype chosen inside it)
            cos_j, sin_j = _turning_table(rate, tl.float16, BLOCK_T)
        else:
            cos_j, sin_j = _turning_table(rate, tl.float32, BLOCK_T)
    gk = tl.arange(0, BLOCK_D // 8)
    gv = tl.arange(0, BLOCK_DV // 8)
    # The pair path's units: the rows' 32-bit words (KWORDS / VWORDS) or their 8-code groups, and how many a row holds.
    uk = tl.arange(0, BLOCK_D * KBITS // 32) if KWORDS else gk
    uv = tl.arange(0, BLOCK_DV * VBITS // 32) if VWORDS else gv
    KUNITS: tl.constexpr = KBYTES // 4 if KWORDS else D // 8
    VUNITS: tl.constexpr = VBYTES // 4 if VWORDS else DV // 8
    kc = kc_ptr + b * skc_b + h * skc_h
    kn = kn_ptr + b * skn_b + h * skn_h
    vc = vc_ptr + b * svc_b + h * svc_h
    vn = vn_ptr + b * svn_b + h * svn_h

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    start = tl.program_id(2) * split_len
    end = tl.minimum(start + split_len, T)
    for t0 in range(start, end, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        tok_ok = toks < end
        if KPAIRS:  # (a jitted helper returns one dtype, so the float16 pair path is chosen here)
            k = _pair_values(kc + toks[:, None] * skc_t, uk[None, :], tok_ok[:, None] & (uk[None, :] < KUNITS), kcent_ptr, KBITS,
                             BLOCK_T, BLOCK_D, KWORDS)
        else:
            k = _values(kc + toks[:, None] * skc_t, dk, gk, tok_ok, kcent_ptr, D, KBITS, KSTATE, KBYTES, BLOCK_T, BLOCK_D, GROUPED,
                        SELECT)  # (BT, BD) unit values; padded channels meet q = 0
        k_norm = tl.load(kn + toks * skn_t, mask=tok_ok, other=0.0).to(tl.float32)
        if F16:  # one tensor-core pass; |centroid| <= 1 and the scaled query <= 1, so fp16 holds them
            s = tl.dot(q16, tl.trans(k.to(tl.float16))) * (q_amax[:, None] * k_norm[None, :])
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_norm[None, :]
        if HAS_OFFSET:
            s += offset[:, None]
        if HAS_TURN:
            s += _turning_scores(coef_a, coef_b, rate, pos0 + t0, cos_j, sin_j, PRECISION, F16)
        s = _finish_scores(s, b, h, rows, toks, row_ok, tok_ok, scale, softcap,
                           bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows, HAS_BIAS, HAS_SOFTCAP)
        m_i, alpha, p = _softmax_step(s, m_i)
        if VPAIRS:
            v = _pair_values(vc + toks[:, None] * svc_t, uv[None, :], tok_ok[:, None] & (uv[None, :] < VUNITS), vcent_ptr, VBITS,
                             BLOCK_T, BLOCK_DV, VWORDS)
        else:
            v = _values(vc + toks[:, None] * svc_t, dv, gv, tok_ok, vcent_ptr, DV, VBITS, VSTATE, VBYTES, BLOCK_T, BLOCK_DV, GROUPED,
                        SELECT)  # (BT, BDV)
        v_norm = tl.load(vn + toks * svn_t, mask=tok_ok, other=0.0).to(tl.float32)
        # The value norm scales p (BR x BT) rather than the (BT x BDV) centroid tile: fewer multiplies.
        # In fp16, p·norm <= norm, itself an fp16 value: no overflow.
        if F16:
            acc = acc * alpha[:, None] + tl.dot((p * v_norm[None, :]).to(tl.float16), v.to(tl.float16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p * v_norm[None, :], v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
    _store_partial(m_i, l_i, acc, m_ptr, l_ptr, o_ptr, pid_bh, rows, row_ok, dv, R, DV, FINAL)


@triton.jit
def _int8_attention_kernel(
    q_ptr, sq_b, sq_h, sq_r,
    kc_ptr, skc_b, skc_h, skc_t, ks_ptr, sks_b, sks_h, sks_t,
    vc_ptr, svc_b, svc_h, svc_t, vs_ptr, svs_b, svs_h, svs_t,
    bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows,
    m_ptr, l_ptr, o_ptr,
    H, R, T, split_len, scale, softcap,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FINAL: tl.constexpr, PRECISION: tl.constexpr,
    F16: tl.constexpr,
):
    pid_bh, b, h, rows, row_ok, dk, dv, q = _program_rows(q_ptr, sq_b, sq_h, sq_r, H, R, D, BLOCK_R, BLOCK_D, BLOCK_DV)  # q (BR, BD)
    if F16:
        q16, q_amax = _scaled_fp16(q)
    kc = kc_ptr + b * skc_b + h * skc_h
    ks = ks_ptr + b * sks_b + h * sks_h
    vc = vc_ptr + b * svc_b + h * svc_h
    vs = vs_ptr + b * svs_b + h * svs_h

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    start = tl.program_id(2) * split_len
    end = tl.minimum(start + split_len, T)
    for t0 in range(start, end, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        tok_ok = toks < end
        k = tl.load(kc + toks[:, None] * skc_t + dk[None, :], mask=tok_ok[:, None] & (dk[None, :] < D), other=0)
        k_scale = tl.load(ks + toks * sks_t, mask=tok_ok, other=0.0).to(tl.float32)
        if F16:  # int8 codes are exact in fp16: one tensor-core pass, rounding only the scaled query
            s = tl.dot(q16, tl.trans(k.to(tl.float16))) * (q_amax[:, None] * k_scale[None, :])
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * k_scale[None, :]
        s = _finish_scores(s, b, h, rows, toks, row_ok, tok_ok, scale, softcap,
                           bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows, HAS_BIAS, HAS_SOFTCAP)
        m_i, alpha, p = _softmax_step(s, m_i)
        v = tl.load(vc + toks[:, None] * svc_t + dv[None, :], mask=tok_ok[:, None] & (dv[None, :] < DV), other=0)
        v_scale = tl.load(vs + toks * svs_t, mask=tok_ok, other=0.0).to(tl.float32)
        if F16:  # p·scale <= scale, an fp16 value
            acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(tl.float16), v.to(tl.float16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p * v_scale[None, :], v.to(tl.float32), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
    _store_partial(m_i, l_i, acc, m_ptr, l_ptr, o_ptr, pid_bh, rows, row_ok, dv, R, DV, FINAL)


@triton.jit
def _kivi_attention_kernel(
    q_ptr, sq_b, sq_h, sq_r,
    kc_ptr, skc_b, skc_h, skc_t, ks_ptr, kz_ptr, sks_b, sks_h, sks_t,
    vc_ptr, svc_b, svc_h, svc_t, vs_ptr, vz_ptr, svs_b, svs_h, svs_t,
    bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows,
    m_ptr, l_ptr, o_ptr,
    H, R, T, split_len, scale, softcap,
    D: tl.constexpr, DV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KBYTES: tl.constexpr, VBYTES: tl.constexpr, KGROUP: tl.constexpr, KPER: tl.constexpr, VGROUP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FINAL: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_bh, b, h, rows, row_ok, dk, dv, q = _program_rows(q_ptr, sq_b, sq_h, sq_r, H, R, D, BLOCK_R, BLOCK_D, BLOCK_DV)  # q (BR, BD)
    kc = kc_ptr + b * skc_b + h * skc_h
    k_meta = b * sks_b + h * sks_h
    vc = vc_ptr + b * svc_b + h * svc_h
    v_meta = b * svs_b + h * svs_h

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    start = tl.program_id(2) * split_len
    end = tl.minimum(start + split_len, T)
    for t0 in range(start, end, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        tok_ok = toks < end
        k_ok = tok_ok[:, None] & (dk[None, :] < D)
        code = _unpack(kc + toks[:, None] * skc_t, dk[None, :], k_ok, KBITS, KBYTES).to(tl.float32)
        # Spread layout: channel c of token group g sits at row g·KGROUP + c // KPER, column c % KPER.
        meta = k_meta + ((toks // KGROUP) * KGROUP)[:, None] * sks_t + (dk // KPER)[None, :] * sks_t + (dk % KPER)[None, :]
        k = code * tl.load(ks_ptr + meta, mask=k_ok, other=0.0).to(tl.float32) + tl.load(kz_ptr + meta, mask=k_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = _finish_scores(s, b, h, rows, toks, row_ok, tok_ok, scale, softcap,
                           bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows, HAS_BIAS, HAS_SOFTCAP)
        m_i, alpha, p = _softmax_step(s, m_i)
        v_ok = tok_ok[:, None] & (dv[None, :] < DV)
        code = _unpack(vc + toks[:, None] * svc_t, dv[None, :], v_ok, VBITS, VBYTES).to(tl.float32)
        meta = v_meta + toks[:, None] * svs_t + (dv // VGROUP)[None, :]
        v = code * tl.load(vs_ptr + meta, mask=v_ok, other=0.0).to(tl.float32) + tl.load(vz_ptr + meta, mask=v_ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
    _store_partial(m_i, l_i, acc, m_ptr, l_ptr, o_ptr, pid_bh, rows, row_ok, dv, R, DV, FINAL)


@triton.jit
def _merge_kernel(m_ptr, l_ptr, o_ptr, m_out, l_out, o_out, R, S,
                  DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Log-sum-exp merge of S split partials (B·H, S, R[, DV]) into (B·H, R[, DV])."""
    pid_bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    dv = tl.arange(0, BLOCK_DV)
    o_ok = row_ok[:, None] & (dv[None, :] < DV)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, S):
        m = tl.maximum(m, tl.load(m_ptr + (pid_bh * S + s) * R + rows, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for s in range(0, S):
        part = (pid_bh * S + s) * R + rows
        w = tl.exp(tl.load(m_ptr + part, mask=row_ok, other=float("-inf")) - m)  # masked splits weigh 0
        l_sum += w * tl.load(l_ptr + part, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(o_ptr + part[:, None] * DV + dv[None, :], mask=o_ok, other=0.0)
    out = pid_bh * R + rows
    tl.store(m_out + out, m, mask=row_ok)
    tl.store(l_out + out, l_sum, mask=row_ok)
    tl.store(o_out + out[:, None] * DV + dv[None, :], acc, mask=o_ok)


@triton.jit
def _exact_merge_kernel(
    q_ptr, sq_b, sq_h, sq_r,
    k_ptr, sk_b, sk_h, sk_t, v_ptr, sv_b, sv_h, sv_t,
    pm_ptr, pl_ptr, po_ptr, P, N,
    out_ptr, H, R, E, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):
    """A decode step's last stage in one program per (batch·kv head, row block): the online softmax over the E
    uncompressed rows (sinks, window, anchors), then its log-sum-exp merge with the P segment partials
    `pm, pl (P, N)`, `po (P, N, DV)`, N = B·H·R, into the normalized output (N, DV) (`reference.exact_merge`)."""
    pid_bh, b, h, rows, row_ok, dk, dv, q = _program_rows(q_ptr, sq_b, sq_h, sq_r, H, R, D, BLOCK_R, BLOCK_D, BLOCK_DV)  # q (BR, BD)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for t0 in range(0, E, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        tok_ok = toks < E
        k = tl.load(k_ptr + b * sk_b + h * sk_h + toks[:, None] * sk_t + dk[None, :], mask=tok_ok[:, None] & (dk[None, :] < D),
                    other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_i, alpha, p = _softmax_step(s, m_i)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + toks[:, None] * sv_t + dv[None, :], mask=tok_ok[:, None] & (dv[None, :] < DV),
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
    m_i = tl.where(m_i == float("-inf"), 0.0, m_i)  # as a partial reports a row it does not attend to
    flat = pid_bh * R + rows
    o_ok = row_ok[:, None] & (dv[None, :] < DV)
    big = m_i
    for j in range(0, P):
        big = tl.maximum(big, tl.load(pm_ptr + j * N + flat, mask=row_ok, other=0.0))
    w = tl.exp(m_i - big)
    total = w * l_i
    out = acc * w[:, None]
    for j in range(0, P):
        part = j * N + flat
        wj = tl.exp(tl.load(pm_ptr + part, mask=row_ok, other=0.0) - big)
        total += wj * tl.load(pl_ptr + part, mask=row_ok, other=0.0)
        out += wj[:, None] * tl.load(po_ptr + part[:, None] * DV + dv[None, :], mask=o_ok, other=0.0)
    tl.store(out_ptr + flat[:, None] * DV + dv[None, :], out / tl.maximum(total, 1e-30)[:, None], mask=o_ok)


# True when Triton's interpreter runs these kernels, CPU tensors allowed: TRITON_INTERPRET=1 was set before
# triton (whose `tl.zeros`, `tl.sum`... are jit functions too) and this module were imported.
INTERPRETED = not any(isinstance(f, triton.runtime.JITFunction) for f in (tl.zeros, _tq_attention_kernel))


# -- launchers -------------------------------------------------------------------------------------
@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda" or (INTERPRETED and t.device.type == "cpu"):
        return
    hint = "; CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported)" if t.device.type == "cpu" else ""
    raise ValueError(f"Triton kernels need CUDA tensors, got {t.device}{hint}")


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """Kernels index batch, head and token dims by stride but need the last dim contiguous: slices of a
    preallocated cache buffer along tokens stay zero-copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _same_strides(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI's scale and zero share one set of strides in the kernels (they are sliced from alike buffers)."""
    scale, zero = _rows_last(scale), _rows_last(zero)
    return (scale, zero) if scale.stride() == zero.stride() else (scale.contiguous(), zero.contiguous())


def _strides(t: torch.Tensor, dims: int = 3) -> tuple[int, ...]:
    return tuple(t.stride(i) if t.shape[i] > 1 else 0 for i in range(dims))


def _float32_buffers(rows: int, dv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat m, l (rows,) and o (rows·dv,) float32, whatever torch's default dtype."""
    return (torch.empty(rows, dtype=torch.float32, device=device), torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows * dv, dtype=torch.float32, device=device))


_SHRUNK: dict[tuple, tuple[int, int]] = {}  # (kernel, tile sizes) -> (BLOCK_T, num_stages) that fit in shared memory


class _Plan:
    """Grid and block sizes of one attention call."""

    def __init__(self, q: torch.Tensor, t: int, d: int, dv: int, num_splits: int | None, kernel: str = ""):
        b, h, r, _ = q.shape
        self.b, self.h, self.r, self.dv = b, h, r, dv
        self.block_d = max(16, triton.next_power_of_2(d))
        self.block_dv = max(16, triton.next_power_of_2(dv))
        self.block_r = min(64, max(16, triton.next_power_of_2(r)))  # tl.dot needs >= 16 rows
        width = max(self.block_d, self.block_dv)
        # Register budget: a (BLOCK_T x BLOCK_D) code tile and a (BLOCK_R x BLOCK_DV) accumulator.
        self.block_t = 64 if width <= 128 else 32
        # TurboQuant's centroids: gathered from the table, or by a chain of selects over values in registers.
        self.select = False
        # Chosen from H200 sweeps (bench/results/gpu/sweep-fp16.json, sweep-d64.json; docs/guide/gpu.md), by head dim:
        # TurboQuant and int8 at 65-128 dims take 128-token tiles (2.5x less time than 64 for TurboQuant at batch 1
        # and 32; int8 about even); TurboQuant at 33-64 dims the select chain with 128-token tiles (1.7x less than
        # the gather with 64-token tiles at batch 32, twice confirmed; the select chain was 1.5x slower at 128 dims).
        # Trellis codes ("tq-tcq") read a table per channel whatever the width: the gather, and at 33-64 dims 64-token
        # tiles (0.81 against 1.01 ms for 128, batch 32, 32K, with the turning term; sweep-turn-tcq.json).
        if kernel in ("int8", "tq-tcq") and width == 128:
            self.block_t = 128
        # TurboQuant's scalar codes: two channels' fp16 centroids per table read (`_pair_values`), 32-bit word loads
        # where the width divides 32, 64-token tiles, and no software pipelining. The plan above had asked 128-token
        # tiles pipelined over 3 stages at 65-128 dims, which needs 264 KB of shared memory where an H200 has 227 KB:
        # every such launch fell back to 64-token tiles in one stage (`launch`), the configuration its figures were
        # measured in. In the sm_90 code Triton compiles (`kvpack.bench.kernel_code`), the pair path's loop holds 120
        # registers against 255 and takes 0.26 warp instructions per code against 0.38 at d = 128 (0.32 against the
        # select chain's 0.77 at d = 64); not yet timed on a GPU (docs/guide/gpu.md).
        # Up to 32 query rows a program: Triton 3.6 fails to compile the pair tile as the operand of a 64-row
        # (warpgroup) dot ("Illegal shared layout"; 3.9 compiles it), so longer query blocks gather single centroids.
        self.pairs = self.words = kernel == "tq" and self.block_r <= 32
        self.num_stages: int | None = 1 if kernel == "tq" else None
        self.num_warps = 4 if width <= 128 else 8
        self.row_blocks = triton.cdiv(r, self.block_r)
        tiles = triton.cdiv(t, self.block_t)
        if num_splits is None:
            num_splits = 1
            if q.device.type == "cuda":  # enough programs for two waves over the SMs, >= 4 tiles each
                want = triton.cdiv(2 * _sm_count(q.device.index or 0), b * h * self.row_blocks)
                num_splits = max(1, min(want, tiles // 4))
        split_tiles = triton.cdiv(tiles, max(1, min(num_splits, tiles)))
        self.split_len = split_tiles * self.block_t
        self.splits = triton.cdiv(t, self.split_len)
        self.precision = "tf32x3" if q.device.type == "cuda" and torch.version.hip is None else "ieee"
        # TurboQuant's and int8's dots take fp16 operands (one tensor-core pass, fp32 accumulation) instead of
        # float32 at `precision` (tf32x3: three passes and the operand splits); their error stays within the
        # fp16 reference's, which the tests bound. Codes unpack by 8-code groups where the dims allow.
        self.f16 = True
        self.grouped = d % 8 == 0 and dv % 8 == 0

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.b * self.h, self.row_blocks, self.splits)

    def launch(self, kernel, *args, **constexprs) -> None:
        """`kernel[grid](*args, BLOCK_T=..., num_warps=..., **constexprs)`. A launch that needs more shared memory
        than the GPU has (tl.dot operands of a 64-row x 128-dim tile with the loop software-pipelined: 288 KB
        asked of an H200's 227 KB) retries with half the token tile and no pipelining, and the shape keeps that
        choice. Splits stay whole tiles: split_len is a multiple of any smaller power-of-two tile."""
        key = (id(kernel), self.block_r, self.block_d, self.block_dv, self.block_t, self.num_stages, self.num_warps,
               tuple(sorted(constexprs.items())))
        block_t, stages = _SHRUNK.get(key, (self.block_t, self.num_stages))
        while True:
            try:
                # (the compiled kernel is kept for inspection: registers and spills, scripts/gpu_sweep.py)
                self.compiled = kernel[self.grid](*args, BLOCK_T=block_t, num_warps=self.num_warps,
                                                  **({} if stages is None else {"num_stages": stages}), **constexprs)
                self.block_t_run, self.stages_run = block_t, stages
                return
            except OutOfResources:
                if block_t <= 16:
                    raise
                block_t, stages = block_t // 2, 1
                _SHRUNK[key] = (block_t, stages)

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split partials (B·H, S, R[, DV]); with one split, the outputs themselves."""
        return _float32_buffers(self.b * self.h * self.splits * self.r, self.dv, device)

    def finish(self, m: torch.Tensor, denom: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, h, r, dv = self.b, self.h, self.r, self.dv
        if self.splits > 1:
            outs = _float32_buffers(b * h * r, dv, m.device)
            _merge_kernel[(b * h, self.row_blocks)](m, denom, o, *outs, r, self.splits, DV=dv, BLOCK_R=self.block_r, BLOCK_DV=self.block_dv)
            m, denom, o = outs
        return m.view(b, h, r, 1), denom.view(b, h, r, 1), o.view(b, h, r, dv)


def _empty(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial of a segment with no tokens (or no rows): every row fully masked."""
    b, h, r, _ = q.shape
    z = q.new_zeros((b, h, r, 1), dtype=torch.float32)
    return z, z.clone(), q.new_zeros((b, h, r, dv), dtype=torch.float32)


_RATES: dict[int, tuple] = {}


def _turns_per_token(freq: torch.Tensor) -> torch.Tensor:
    """`θ / 2π` float64 of a layer's RoPE frequencies `(d/2,)`, computed once per frequency tensor while it lives (the
    codec's device copy, shared by its calls): no extra launch per decode step."""
    hit = _RATES.get(id(freq))
    if hit is None or hit[0]() is not freq:
        key = id(freq)
        hit = _RATES[key] = (weakref.ref(freq, lambda _, key=key: _RATES.pop(key, None)), (freq.double() / (2 * math.pi)).contiguous())
    return hit[1]


_PAIRS: dict[int, tuple] = {}


def pair_table(centroids: torch.Tensor) -> torch.Tensor:
    """`(n²,)` int32 table of fp16 centroid pairs for `_pair_values`: entry `lo + n·hi` holds fp16(centroids[lo]) in its
    low 16 bits and fp16(centroids[hi]) in its high 16. Built once per centroid tensor while it lives (the codec's
    device copy, shared by its calls): no extra launch per decode step."""
    hit = _PAIRS.get(id(centroids))
    if hit is None or hit[0]() is not centroids:
        n = centroids.numel()
        half = centroids.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
        idx = torch.arange(n * n, device=centroids.device)
        word = half[idx % n] | (half[idx // n] << 16)
        table = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()
        key = id(centroids)
        hit = _PAIRS[key] = (weakref.ref(centroids, lambda _, key=key: _PAIRS.pop(key, None)), table)
    return hit[1]


def _words_ok(codes: torch.Tensor, bits: int, block_c: int) -> bool:
    """Whether code rows can be read as 32-bit words: a width dividing 32, rows and token strides of whole words, an
    aligned base, and at least one word per row tile."""
    return (bits in (1, 2, 4) and codes.shape[-1] % 4 == 0 and all(st % 4 == 0 for st in codes.stride()[:-1])
            and codes.data_ptr() % 4 == 0 and block_c * bits >= 32)


def _bias_args(bias: torch.Tensor | None, q: torch.Tensor) -> tuple:
    """Bias pointer, strides (b, h, row, token; 0 on broadcast dims) and row count; a dummy without bias."""
    if bias is None:
        return (q, 0, 0, 0, 0, 1)
    return (bias, *_strides(bias, 3), bias.stride(3), bias.shape[2])


def tq_attention(
    q_rot: torch.Tensor,
    k_codes: torch.Tensor,
    k_norm: torch.Tensor,
    k_centroids: torch.Tensor,
    k_bits: int,
    v_codes: torch.Tensor,
    v_norm: torch.Tensor,
    v_centroids: torch.Tensor,
    v_bits: int,
    d: int,
    scale: float,
    row_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    turn_q: torch.Tensor | None = None,
    turn_pair: torch.Tensor | None = None,
    turn_mu: torch.Tensor | None = None,
    turn_freq: torch.Tensor | None = None,
    turn_pos0: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `reference.tq_attention`; `num_splits` overrides the sequence split count (tests)."""
    check_tq_attention(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, row_offset, bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q_rot.device)
    check_turning(q_rot, turn_q, turn_pair, turn_mu, turn_freq, turn_pos0)
    _check_device(q_rot)
    t = k_codes.shape[2]
    if t == 0 or q_rot.numel() == 0:
        return _empty(q_rot, d)
    q, kc, kn, vc, vn = (_rows_last(x) for x in (q_rot, k_codes, k_norm, v_codes, v_norm))
    k_state, v_state = (table.numel().bit_length() - 1 for table in (k_centroids, v_centroids))  # > bits: trellis windows
    plan = _Plan(q, t, q.shape[-1], d, num_splits, kernel="tq-tcq" if max(k_state - k_bits, v_state - v_bits) > 0 else "tq")
    m, denom, o = plan.buffers(q.device)
    pairs_ok = plan.pairs and plan.grouped and plan.f16
    k_pairs, v_pairs = (pairs_ok and state == bits <= 4 for state, bits in ((k_state, k_bits), (v_state, v_bits)))
    k_words = k_pairs and plan.words and _words_ok(kc, k_bits, plan.block_d)
    v_words = v_pairs and plan.words and _words_ok(vc, v_bits, plan.block_dv)
    k_table = pair_table(k_centroids) if k_pairs else k_centroids.contiguous()
    v_table = pair_table(v_centroids) if v_pairs else v_centroids.contiguous()
    off = (q, 0, 0, 0) if row_offset is None else (row_offset, *_strides(row_offset))
    turn, block_m = (q, 0, 0, 0, q, q, q, q, 0, 0), 16
    if turn_q is not None:
        tq = _rows_last(turn_q)
        turn = (tq, *_strides(tq), turn_pair.contiguous(), turn_mu.contiguous(), _turns_per_token(turn_freq), turn_pos0.contiguous(),
                turn_pair.shape[-1], turn_pair.shape[-2] if turn_pair.dim() == 3 else 0)
        block_m = max(16, triton.next_power_of_2(turn_pair.shape[-1]))  # tl.dot's smallest inner size
    plan.launch(
        _tq_attention_kernel,
        q, *_strides(q), kc, *_strides(kc), kn, *_strides(kn), k_table,
        vc, *_strides(vc), vn, *_strides(vn), v_table,
        *off, *_bias_args(bias, q), *turn, m, denom, o,
        plan.h, plan.r, t, plan.split_len, float(scale), float(softcap),
        D=q.shape[-1], DV=d, KBITS=k_bits, VBITS=v_bits, KBYTES=kc.shape[-1], VBYTES=vc.shape[-1],
        BLOCK_R=plan.block_r, BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv,
        HAS_OFFSET=row_offset is not None, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0,
        FINAL=plan.splits == 1, PRECISION=plan.precision, F16=plan.f16, GROUPED=plan.grouped, SELECT=plan.select,
        HAS_TURN=turn_q is not None, BLOCK_M=block_m, KSTATE=k_state, VSTATE=v_state,
        KPAIRS=k_pairs, VPAIRS=v_pairs, KWORDS=k_words, VWORDS=v_words,
    )
    return plan.finish(m, denom, o)


def int8_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    skip: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `reference.int8_attention`."""
    check_int8_attention(q, k_codes, k_scale, v_codes, v_scale, bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q.device)
    _check_device(q)
    t, dv = k_codes.shape[2], v_codes.shape[-1]
    if t == 0 or q.numel() == 0:
        return _empty(q, dv)
    q, kc, ks, vc, vs = (_rows_last(x) for x in (q, k_codes, k_scale, v_codes, v_scale))
    plan = _Plan(q, t, q.shape[-1], dv, num_splits, kernel="int8")
    m, denom, o = plan.buffers(q.device)
    plan.launch(
        _int8_attention_kernel,
        q, *_strides(q), kc, *_strides(kc), ks, *_strides(ks), vc, *_strides(vc), vs, *_strides(vs),
        *_bias_args(bias, q), m, denom, o,
        plan.h, plan.r, t, plan.split_len, float(scale), float(softcap),
        D=q.shape[-1], DV=dv,
        BLOCK_R=plan.block_r, BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, FINAL=plan.splits == 1, PRECISION=plan.precision, F16=plan.f16,
    )
    return plan.finish(m, denom, o)


def kivi_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    k_bits: int,
    k_group: int,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    v_bits: int,
    v_group: int,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    skip: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `reference.kivi_attention`."""
    check_kivi_attention(q, k_codes, k_scale, k_zero, k_bits, k_group, v_codes, v_scale, v_zero, v_bits, v_group, bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q.device)
    _check_device(q)
    t, dv = k_codes.shape[2], v_scale.shape[-1] * v_group
    if t == 0 or q.numel() == 0:
        return _empty(q, dv)
    q, kc, vc = (_rows_last(x) for x in (q, k_codes, v_codes))
    ks, kz = _same_strides(k_scale, k_zero)
    vs, vz = _same_strides(v_scale, v_zero)
    plan = _Plan(q, t, q.shape[-1], dv, num_splits)
    m, denom, o = plan.buffers(q.device)
    plan.launch(
        _kivi_attention_kernel,
        q, *_strides(q), kc, *_strides(kc), ks, kz, *_strides(ks), vc, *_strides(vc), vs, vz, *_strides(vs),
        *_bias_args(bias, q), m, denom, o,
        plan.h, plan.r, t, plan.split_len, float(scale), float(softcap),
        D=q.shape[-1], DV=dv, KBITS=k_bits, VBITS=v_bits, KBYTES=kc.shape[-1], VBYTES=vc.shape[-1],
        KGROUP=k_group, KPER=ks.shape[-1], VGROUP=v_group,
        BLOCK_R=plan.block_r, BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, FINAL=plan.splits == 1, PRECISION=plan.precision,
    )
    return plan.finish(m, denom, o)


def exact_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, m: list[torch.Tensor], l: list[torch.Tensor],  # noqa: E741
                o: list[torch.Tensor]) -> torch.Tensor:
    """Triton `reference.exact_merge`: one launch for the exact rows' partial and the merge of every partial."""
    b, h, r, d = check_query("q", q)
    if not len(m) == len(l) == len(o):
        raise ValueError(f"m, l and o must list the same partials, got {len(m)}, {len(l)} and {len(o)}")
    _check_device(q)
    dv = v.shape[-1]
    if k.shape[2] == 0 and not m:
        return q.new_zeros((b, h, r, dv), dtype=torch.float32)
    q, k, v = (_rows_last(x) for x in (q, k, v))
    n = b * h * r
    pm = torch.stack([x.reshape(n) for x in m]).float() if m else q.new_zeros((0,), dtype=torch.float32)
    pl = torch.stack([x.reshape(n) for x in l]).float() if l else pm
    po = torch.stack([x.reshape(n, dv) for x in o]).float() if o else pm
    out = torch.empty((b, h, r, dv), dtype=torch.float32, device=q.device)
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    block_r = min(64, max(16, triton.next_power_of_2(r)))
    precision = "tf32x3" if q.device.type == "cuda" and torch.version.hip is None else "ieee"
    launch(_exact_merge_kernel, (b * h, triton.cdiv(r, block_r)),
           q, *_strides(q), k, *_strides(k), v, *_strides(v), pm, pl, po, len(m), n, out, h, r, k.shape[2], float(scale),
           D=d, DV=dv, BLOCK_R=block_r, BLOCK_T=32 if max(block_d, block_dv) <= 128 else 16, BLOCK_D=block_d, BLOCK_DV=block_dv,
           PRECISION=precision, num_warps=4)
    return out


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`: the launch of kernels without a `_Plan` (`kvpack.bench.kernel_code` compiles
    them for a GPU it does not have by standing in here)."""
    kernel[grid](*args, **kwargs)
