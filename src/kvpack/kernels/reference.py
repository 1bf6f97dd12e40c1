"""Pure-torch references of kvpack's fused ops: the contract every backend (C++, Triton) is held to.

Attention ops return an online-softmax *partial* over one compressed segment, so segments (and the
splits of a flash-decoding kernel) merge exactly by log-sum-exp:

    m (B, H, R, 1)   row max of the scores (0 for a row whose every score is -inf)
    l (B, H, R, 1)   Σ_t p[r, t] with p = exp(s - m)
    o (B, H, R, dv)  Σ_t p[r, t] · v(t), unnormalized

all float32. Queries are grouped for GQA (`group_query` in codecs/base.py): `q (B, H, R, d)` holds the
R = group · q_len rows (group-major: r = g · q_len + i) that read kv head H. Scores are

    s[r, t] = softcap(scale · (<q[r], k(t)> + row_offset[r])) + bias[r % n, t]

with softcap(x) = c · tanh(x / c) when c > 0. `bias (B|1, H|1, n, T)`, R % n == 0, is an additive mask
(-inf = masked): row r reads bias row r % n, so one `(B, 1, q_len, T)` mask serves every head of a group.

Every reference walks the segment in chunks of `TOKEN_CHUNK` tokens, so its float temporaries are
bounded by B·H·TOKEN_CHUNK·max(d, R) elements on any device: it never widens a whole segment's codes
into a float (T, d) tensor. `compute_dtype` lets tests build the low-precision baseline (float16 or
bfloat16 math) that float kernels are compared against.

`check_*` validate an op's arguments (shapes, dtypes, devices; never values, so no host sync); the
references and the Triton launchers call them before any work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..primitives import trellis
from ..primitives.affine import quantize_affine
from ..primitives.packing import pack_bits, packed_length, unpack_bits
from ..primitives.rope import apply_rope, rope_cos_sin
from ..primitives.rotation import is_power_of_two, randomized_hadamard

# Tokens per step of the references. Bounds temporaries to B·H·TOKEN_CHUNK·max(d, R) floats; 512 keeps
# each step a matmul large enough that the Python loop costs little.
TOKEN_CHUNK = 512
# The floor of a reconstruction's length when `tq_encode` matches it to the input's (centroids given): a code's
# unit-scale centroids have a length near 1, so only a degenerate codebook comes near it.
MATCH_FLOOR = 1e-6
TQ_BITS = (1, 2, 3, 4)
TRELLIS_MAX_BITS = 12  # the widest trellis state a TurboQuant table may index (a 16 KiB table)
KIVI_BITS = (2, 4)
KIVI_AXES = ("channel", "token")
VQ_BITS = tuple(range(1, 9))  # VQ index widths: codebooks of 2..256 entries
_TINY = torch.finfo(torch.float32).tiny


# -- validation ----------------------------------------------------------------------------------
def expect(name: str, t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...], shape: tuple, device: torch.device) -> None:
    """`t` a tensor on `device` with a dtype in `dtypes` and `shape` (None entries are free)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the query is on {device}; move all inputs to one device")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=True)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_query(name: str, q: torch.Tensor) -> tuple[int, int, int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{name} must be a 4-D tensor (batch, kv_heads, rows, head_dim), got {getattr(q, 'shape', type(q).__name__)}")
    expect(name, q, _FLOATS, (None,) * 4, q.device)
    return tuple(q.shape)


def check_mask(q: torch.Tensor, t: int, row_offset: torch.Tensor | None, bias: torch.Tensor | None, softcap: float) -> None:
    b, h, r, _ = q.shape
    if row_offset is not None:
        expect("row_offset", row_offset, _FLOATS, (b, h, r, 1), q.device)
    if bias is not None:
        expect("bias", bias, _FLOATS, (None, None, None, t), q.device)
        bb, bh, n, _ = bias.shape
        if bb not in (1, b) or bh not in (1, h) or n < 1 or r % n:
            raise ValueError(f"bias must have shape (1 or {b}, 1 or {h}, n, {t}) with n dividing the {r} query rows, got {tuple(bias.shape)}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0 disables), got {softcap!r}")


def _check_bits(name: str, bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {bits!r}")


def turning_given(*turning: torch.Tensor | None) -> bool:
    """Whether `tq_attention`'s five turning-mean tensors are given; ValueError when only some are."""
    given = [t is not None for t in turning]
    if any(given) and not all(given):
        raise ValueError("turn_q, turn_pair, turn_mu, turn_freq and turn_pos0 go together: pass all five or none")
    return given[0]


def check_turning(q_rot: torch.Tensor, turn_q, turn_pair, turn_mu, turn_freq, turn_pos0) -> None:
    """The turning-mean tensors of `tq_attention`: all five or none, with the query's shapes."""
    if not turning_given(turn_q, turn_pair, turn_mu, turn_freq, turn_pos0):
        return
    b, h, r, d = q_rot.shape
    if d % 2:
        raise ValueError(f"turning means need an even head dim (RoPE pairs), got {d}")
    dev = q_rot.device
    expect("turn_q", turn_q, (torch.float32,), (b, h, r, d), dev)
    rows = (b,) if turn_pair.dim() == 3 else ()  # one state per batch row, or one shared by the rows
    expect("turn_pair", turn_pair, (torch.int64,), (*rows, h, None), dev)
    m = turn_pair.shape[-1]
    if not 1 <= m <= d // 2:
        raise ValueError(f"turn_pair must hold 1..{d // 2} RoPE pairs per head, got {m}")
    expect("turn_mu", turn_mu, (torch.float32,), (*rows, h, m, 2), dev)
    expect("turn_freq", turn_freq, (torch.float64,), (d // 2,), dev)
    expect("turn_pos0", turn_pos0, (torch.int64,), (b,), dev)


def turning_scores(turn_q, turn_pair, turn_mu, turn_freq, turn_pos0, t0: int, t1: int) -> torch.Tensor:
    """Raw-score term `(B, H, R, t1 - t0)` of keys centered on a turning mean, for tokens [t0, t1) of the segment:
    `Σ_m A_m cos(θ_m p) + B_m sin(θ_m p)` at position p = pos0 + t, with `A = q_a μ_a + q_b μ_b`, `B = q_b μ_a - q_a μ_b`
    from the query's RoPE pair (a, b) = (i_m, i_m + d/2) and the pair's un-RoPEd mean (what `<q, RoPE(μ, p)>` is on
    those pairs). float64 with a cos/sin per token and pair: the kernels' fast forms are checked against this."""
    half = turn_q.shape[-1] // 2
    pair = turn_pair.expand(turn_q.shape[0], *turn_pair.shape[-2:])  # (B, H, M): shared by the rows, or one per row
    mu = turn_mu.expand(turn_q.shape[0], *turn_mu.shape[-3:])  # (B, H, M, 2)
    idx = pair[:, :, None, :].expand(-1, -1, turn_q.shape[2], -1)
    qa, qb = turn_q.double().gather(-1, idx), turn_q.double().gather(-1, idx + half)  # (B, H, R, M)
    ma, mb = mu[:, :, None, :, 0].double(), mu[:, :, None, :, 1].double()
    a, b = qa * ma + qb * mb, qb * ma - qa * mb
    positions = turn_pos0.double()[:, None] + torch.arange(t0, t1, dtype=torch.float64, device=turn_q.device)  # (B, T)
    phase = positions[:, None, :, None] * turn_freq.double()[pair][:, :, None, :]  # (B, H, T, M)
    return a @ phase.cos().mT + b @ phase.sin().mT


def check_tq_attention(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, row_offset, bias, softcap) -> None:
    b, h, _, dk = check_query("q_rot", q_rot)
    _check_bits("k_bits", k_bits, TQ_BITS)
    _check_bits("v_bits", v_bits, TQ_BITS)
    dev = q_rot.device
    expect("k_codes", k_codes, (torch.uint8,), (b, h, None, packed_length(dk, k_bits)), dev)
    t = k_codes.shape[2]
    expect("k_norm", k_norm, (torch.float16,), (b, h, t, 1), dev)
    check_table("k_centroids", k_centroids, k_bits, dev)
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"d (the value head dim) must be a positive int, got {d!r}")
    expect("v_codes", v_codes, (torch.uint8,), (b, h, t, packed_length(d, v_bits)), dev)
    expect("v_norm", v_norm, (torch.float16,), (b, h, t, 1), dev)
    check_table("v_centroids", v_centroids, v_bits, dev)
    check_mask(q_rot, t, row_offset, bias, softcap)


def check_table(name: str, table: torch.Tensor, bits: int, device: torch.device) -> None:
    """A TurboQuant lookup table: `(2**bits,)` centroids of scalar codes, or `(2**L,)` for trellis codes (L a multiple of
    bits, bits < L <= TRELLIS_MAX_BITS; see `code_values`)."""
    expect(name, table, (torch.float32,), (None,), device)
    size = table.numel()
    state_bits = size.bit_length() - 1
    if size != 1 << state_bits or state_bits % bits or not bits <= state_bits <= TRELLIS_MAX_BITS:
        raise ValueError(f"{name} must have 2**bits = {2**bits} entries (scalar codes) or 2**L for trellis codes with L a multiple of "
                         f"{bits} in {2 * bits}..{TRELLIS_MAX_BITS}, got {size}")


def code_values(codes: torch.Tensor, table: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Values `(..., n)` of TurboQuant codes `(..., ceil(n·bits/8))` packed LSB-first. With a `(2**bits,)` table each
    coordinate is table[its code]; with a `(2**L,)` table (L > bits) the codes are the symbols of a tail-biting trellis
    (`primitives.trellis`) and coordinate i is table[w_i], w_i the L bits of the row's circular bit string starting at
    bit bits·(i - L/bits + 1): its state, oldest symbol lowest (`trellis.window_table` reorders a state codebook so)."""
    symbols = unpack_bits(codes, bits, n)
    state_bits = table.numel().bit_length() - 1
    if state_bits == bits:
        return table[symbols.long()]
    return table[trellis.window_indices(symbols, bits, state_bits)]


def check_int8_attention(q, k_codes, k_scale, v_codes, v_scale, bias, softcap) -> None:
    b, h, _, d = check_query("q", q)
    expect("k_codes", k_codes, (torch.int8,), (b, h, None, d), q.device)
    t = k_codes.shape[2]
    expect("k_scale", k_scale, (torch.float16,), (b, h, t, 1), q.device)
    expect("v_codes", v_codes, (torch.int8,), (b, h, t, None), q.device)
    expect("v_scale", v_scale, (torch.float16,), (b, h, t, 1), q.device)
    check_mask(q, t, None, bias, softcap)


def check_kivi_attention(q, k_codes, k_scale, k_zero, k_bits, k_group, v_codes, v_scale, v_zero, v_bits, v_group, bias, softcap) -> None:
    b, h, _, d = check_query("q", q)
    _check_bits("k_bits", k_bits, KIVI_BITS)
    _check_bits("v_bits", v_bits, KIVI_BITS)
    for name, g in (("k_group", k_group), ("v_group", v_group)):
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"{name} must be a positive int, got {g!r}")
    dev = q.device
    expect("k_codes", k_codes, (torch.uint8,), (b, h, None, packed_length(d, k_bits)), dev)
    t = k_codes.shape[2]
    if t % k_group:
        raise ValueError(f"KIVI keys hold whole groups of k_group={k_group} tokens, got {t} tokens")
    per_row = -(-d // k_group)
    expect("k_scale", k_scale, (torch.float16,), (b, h, t, per_row), dev)
    expect("k_zero", k_zero, (torch.float16,), (b, h, t, per_row), dev)
    expect("v_scale", v_scale, (torch.float16,), (b, h, t, None), dev)
    dv = v_scale.shape[-1] * v_group
    expect("v_zero", v_zero, (torch.float16,), (b, h, t, v_scale.shape[-1]), dev)
    expect("v_codes", v_codes, (torch.uint8,), (b, h, t, packed_length(dv, v_bits)), dev)
    check_mask(q, t, None, bias, softcap)


def check_pca_vq_attention(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm,
                           bias, softcap) -> None:
    b, kv, _, d = check_query("q", q)
    dev = q.device
    if d % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {d}")
    expect("pos0", pos0, (torch.int64,), (b,), dev)
    expect("basis_t", basis_t, (torch.float32,), (None, None, None), dev)
    groups, rank, gdim = basis_t.shape
    if groups < 1 or kv % groups or gdim != kv // groups * d:
        raise ValueError(f"basis_t must be (groups, rank, kv_heads / groups * {d}) with groups dividing the {kv} kv heads, got {tuple(basis_t.shape)}")
    for name, t, dtype in (("bitpos", bitpos, torch.int32), ("bits", bits, torch.uint8), ("qmax", qmax, torch.float32)):
        expect(name, t, (dtype,), (rank,), dev)
    expect("mean", mean, (torch.float32,), (groups, gdim), dev)
    expect("inv_freq", inv_freq, (torch.float32,), (d // 2,), dev)
    if not rope_scale > 0:
        raise ValueError(f"rope_scale (the model's attention scaling) must be > 0, got {rope_scale!r}")
    expect("k_codes", k_codes, (torch.uint8,), (b, groups, None, None), dev)
    t = k_codes.shape[2]
    expect("books", books, (torch.float32, torch.float16), (None, None, None), dev)
    n_books, _, gsize = books.shape
    if n_books not in (1, kv) or gsize < 1 or d % gsize:
        raise ValueError(f"books must be (1 or {kv}, entries, group size dividing {d}), got {tuple(books.shape)}")
    _check_bits("v_bits", v_bits, VQ_BITS)
    expect("v_idx", v_idx, (torch.uint8,), (b, kv, t, packed_length(d // gsize, v_bits)), dev)
    if v_norm is not None:
        expect("v_norm", v_norm, (torch.float16,), (b, kv, t, 1), dev)
    check_mask(q, t, None, bias, softcap)


def check_tq_encode(x, mean, inv_scale, signs, boundaries, bits, centroids=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-D tensor (batch, kv_heads, tokens, head_dim), got {getattr(x, 'shape', type(x).__name__)}")
    expect("x", x, _FLOATS, (None,) * 4, x.device)
    _, h, _, d = x.shape
    if not is_power_of_two(d) or d < 8:
        raise ValueError(f"tq_encode needs a power-of-two head_dim >= 8 (the Walsh-Hadamard rotation), got {d}")
    _check_bits("bits", bits, TQ_BITS)
    for name, t in (("mean", mean), ("inv_scale", inv_scale)):
        if t is not None:
            expect(name, t, (torch.float32,), (h, d), x.device)
    expect("signs", signs, (torch.float32,), (h, d), x.device)
    expect("boundaries", boundaries, (torch.float32,), (2**bits - 1,), x.device)
    if centroids is not None:
        expect("centroids", centroids, (torch.float32,), (2**bits,), x.device)


def check_trellis_encode(y, codebook, bits) -> None:
    if not isinstance(y, torch.Tensor) or y.dim() < 1 or y.shape[-1] < 2:
        raise ValueError(f"y must be a float tensor (..., n) with n >= 2, got {getattr(y, 'shape', type(y).__name__)}")
    expect("y", y, _FLOATS, (None,) * y.dim(), y.device)
    if bits not in TQ_BITS:
        raise ValueError(f"bits must be one of {TQ_BITS}, got {bits!r}")
    check_table("codebook", codebook, bits, y.device)
    if codebook.numel() == 2**bits:
        raise ValueError(f"codebook must have 2**L entries with L > bits = {bits} (a trellis state codebook), got {codebook.numel()}")


def check_kivi_encode(x, bits, group, axis) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-D tensor (batch, kv_heads, tokens, head_dim), got {getattr(x, 'shape', type(x).__name__)}")
    expect("x", x, _FLOATS, (None,) * 4, x.device)
    _check_bits("bits", bits, KIVI_BITS)
    if axis not in KIVI_AXES:
        raise ValueError(f"axis must be one of {KIVI_AXES}, got {axis!r}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    size = x.shape[2] if axis == "channel" else x.shape[3]
    if size % group:
        raise ValueError(f"group {group} must divide the {'tokens' if axis == 'channel' else 'head_dim'} ({size}) for axis={axis!r}")


# -- attention -----------------------------------------------------------------------------------
def _bias_rows(bias: torch.Tensor, rows: int, t0: int, t1: int) -> torch.Tensor:
    """Tokens [t0, t1) of `bias (B|1, H|1, n, T)` with row r reading row r % n: `(B|1, H|1, rows, t1 - t0)`."""
    chunk = bias[..., t0:t1]
    return chunk if chunk.shape[2] == rows else chunk.repeat(1, 1, rows // chunk.shape[2], 1)


def skip_bias(bias: torch.Tensor | None, skip: torch.Tensor | None, tokens: int, device: torch.device) -> torch.Tensor | None:
    """`bias` with the `skip (S,)` int64 token offsets masked (-inf) for every row: how the reference and the Triton
    kernels leave a segment's anchors out (the C++ kernels skip them in place). `(1, 1, 1, tokens)` float32 without a
    bias; None when neither is given."""
    if skip is None:
        return bias
    expect("skip", skip, (torch.int64,), (None,), device)
    out = torch.zeros(1, 1, 1, tokens, device=device) if bias is None else bias.clone()
    return out.index_fill_(-1, skip, float("-inf"))


def partial_from_scores(s: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, o) of scaled scores `s (B, H, R, T)` over float `values (B, H, T, dv)` in one step (no chunks); a row
    whose every score is -inf gives m = 0, l = o = 0."""
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    return m, p.sum(-1, keepdim=True), p @ values


def online_softmax(
    shape: tuple[int, int, int],
    dv: int,
    tokens: int,
    chunk: int,
    scores: Callable[[int, int], torch.Tensor],
    values: Callable[[int, int], torch.Tensor],
    scale: float,
    bias: torch.Tensor | None,
    softcap: float,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold tokens [t0, t1) chunk by chunk: `scores(t0, t1)` gives raw `(B, H, R, t1 - t0)` products,
    `values(t0, t1)` the `(B, H, t1 - t0, dv)` decoded values (both in `dtype`)."""
    b, h, r = shape
    m = torch.full((b, h, r, 1), float("-inf"), dtype=dtype, device=device)
    denom = torch.zeros((b, h, r, 1), dtype=dtype, device=device)
    o = torch.zeros((b, h, r, dv), dtype=dtype, device=device)
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        s = scores(t0, t1) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            s = s + _bias_rows(bias, r, t0, t1).to(dtype)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a fully masked row so far: p = 0, never NaN
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + p @ values(t0, t1)
        m = m_new
    m = m.masked_fill(m == float("-inf"), 0.0)
    return m.float(), denom.float(), o.float()


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    skip: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention over uncompressed rows (sinks, window, anchors): q (B, H, R, d) float; k (B, H, T, d) and
    v (B, H, T, dv) float (any float dtype, one for both)."""
    b, h, r, d = check_query("q", q)
    expect("k", k, _FLOATS, (b, h, None, d), q.device)
    t = k.shape[2]
    expect("v", v, (k.dtype,), (b, h, t, None), q.device)
    check_mask(q, t, None, bias, softcap)
    bias = skip_bias(bias, skip, t, q.device)
    qc = q.to(compute_dtype)

    def scores(t0: int, t1: int) -> torch.Tensor:
        return qc @ k[:, :, t0:t1].to(compute_dtype).mT

    def values(t0: int, t1: int) -> torch.Tensor:
        return v[:, :, t0:t1].to(compute_dtype)

    return online_softmax((b, h, r), v.shape[-1], t, TOKEN_CHUNK, scores, values, scale, bias, softcap, compute_dtype, q.device)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Normalized attention `(B, H, R, dv)` from partials `(m, l (B, H, R, 1), o (B, H, R, dv))`:
    `Σ e^(m_i - M) o_i / Σ e^(m_i - M) l_i`, M = max m_i (a row no part attends to gives 0)."""
    ms = torch.cat([p[0] for p in parts], dim=-1)  # (B, H, R, parts)
    w = torch.exp(ms - ms.amax(-1, keepdim=True))
    total = (w * torch.cat([p[1] for p in parts], dim=-1)).sum(-1, keepdim=True)
    out = (torch.stack([p[2] for p in parts], dim=-1) @ w.unsqueeze(-1)).squeeze(-1)
    return out / total.clamp_min(1e-30)


def exact_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, m: list[torch.Tensor], l: list[torch.Tensor],  # noqa: E741
                o: list[torch.Tensor]) -> torch.Tensor:
    """A decode step's last stage: the partial over uncompressed rows `k, v` (`exact_attention`) merged with the
    segments' partials `(m[i], l[i], o[i])` into the normalized output `(B, H, R, dv)` float32 (`merge_partials`)."""
    if not len(m) == len(l) == len(o):
        raise ValueError(f"m, l and o must list the same partials, got {len(m)}, {len(l)} and {len(o)}")
    return merge_partials([exact_attention(q, k, v, scale), *zip(m, l, o, strict=True)])


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
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention over TurboQuant MSE codes, in the rotated space.

    q_rot (B, H, R, dk) float: queries already rotated (and multiplied by the codec's channel scale).
    k_codes (B, H, T, ceil(dk·k_bits/8)) uint8, k_norm (B, H, T, 1) float16, k_centroids (2**k_bits,)
    float32: k(t) = k_norm[t] · k_centroids[code(t)]; or (2**L,) for trellis codes, each coordinate a window of
    L bits (`code_values`). v_* likewise with v_bits and d (the value head dim). row_offset (B, H, R, 1) is added
    to <q, k> before scaling (e.g. q·μ of a centered codec).
    Keys centered on a turning mean (`TurboQuantConfig.rope_center`) add `turning_scores` before scaling:
    turn_q (B, H, R, dk) float32 the query as the model formed it (unrotated), turn_pair (H, M) int64 each head's
    turning RoPE pairs (a head with fewer repeats a pair whose mean is 0), turn_mu (H, M, 2) float32 their un-RoPEd
    means times RoPE's scaling, turn_freq (dk/2,) float64 RoPE's inv_freq, turn_pos0 (B,) int64 the RoPE position
    of token 0. `skip (S,)` int64: token offsets left out (`skip_bias`), or None.
    Returns (m, denom, o) as in the module docstring; o stays in the rotated space.
    """
    check_tq_attention(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, row_offset, bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q_rot.device)
    turning = (turn_q, turn_pair, turn_mu, turn_freq, turn_pos0)
    check_turning(q_rot, *turning)
    b, h, r, dk = q_rot.shape
    q = q_rot.to(compute_dtype)
    k_table, v_table = k_centroids.to(compute_dtype), v_centroids.to(compute_dtype)

    def scores(t0: int, t1: int) -> torch.Tensor:
        k = code_values(k_codes[:, :, t0:t1], k_table, k_bits, dk)  # (B, H, C, dk)
        s = (q @ k.mT) * k_norm[:, :, t0:t1].to(compute_dtype).mT
        if turn_q is not None:
            s = s + turning_scores(*turning, t0, t1).to(compute_dtype)
        return s if row_offset is None else s + row_offset.to(compute_dtype)

    def values(t0: int, t1: int) -> torch.Tensor:
        return code_values(v_codes[:, :, t0:t1], v_table, v_bits, d) * v_norm[:, :, t0:t1].to(compute_dtype)

    return online_softmax((b, h, r), d, k_codes.shape[2], TOKEN_CHUNK, scores, values, scale, bias, softcap, compute_dtype, q.device)


def paged_rows(pool: torch.Tensor, block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `(B, H, T, C)` of a paged pool `(blocks, H, bs, C)` uint8, T = max(end), sequence b's token t from block
    `block_table[b, t // bs]` at slot `t % bs`, zero outside `[start[b], end[b])`; and that mask `(B, T)` bool. A block id
    is read only inside the range (the rest of a table may hold anything)."""
    b, bs = block_table.shape[0], pool.shape[2]
    t = torch.arange(int(end.max()) if b else 0, device=pool.device)
    live = (t[None] >= start[:, None]) & (t[None] < end[:, None])
    column = (t // bs).clamp_max(max(block_table.shape[1] - 1, 0))
    ids = torch.where(live, block_table.long()[:, column], 0)
    rows = pool[ids, :, t % bs].transpose(1, 2)  # (B, T, H, C) -> (B, H, T, C)
    return rows * live[:, None, :, None], live


def paged_fields(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                 offsets: list[int], widths: tuple[int, int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A paged pool's rows for the queries `q (B, H, R, ·)` as a segment's tensors: (key codes, key fp16 scale or norm,
    value codes, value scale or norm) `(B, H, T, ·)` uint8 / float16, each side's codes `widths` bytes at byte
    `offsets[2]` / `offsets[3]` and its fp16 at `offsets[0]` / `offsets[1]`; and the bias `(B, 1, 1, T)` masking
    tokens outside each sequence's range (`paged_rows`)."""
    expect("pool", pool, (torch.uint8,), (None, q.shape[1], None, None), q.device)
    rows, live = paged_rows(pool, block_table, start, end)

    def field(at: int, width: int) -> torch.Tensor:
        return rows[..., at : at + width].contiguous()

    fields = (field(offsets[2], widths[0]), field(offsets[0], 2).view(torch.float16), field(offsets[3], widths[1]),
              field(offsets[1], 2).view(torch.float16))
    return fields, torch.zeros(live.shape, device=q.device).masked_fill(~live, float("-inf"))[:, None, None, :]


def tq_paged_attention(
    q_rot: torch.Tensor,
    row_offset: torch.Tensor | None,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    offsets: list[int],
    k_centroids: torch.Tensor,
    k_bits: int,
    v_centroids: torch.Tensor,
    v_bits: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tq_attention` over a paged pool's rows: `pool (blocks, H, bs, C)` uint8, one row of C bytes per (token, head)
    holding the key's and the value's fp16 norm at byte offsets `offsets[0]`, `offsets[1]` and their scalar codes at
    `offsets[2]`, `offsets[3]`; sequence b reads its tokens `[start[b], end[b])` (`(B,)` int64) through `block_table (B, M)`
    (`paged_rows`). q_rot `(B, H, R, d)`, row_offset `(B, H, R, 1)` or None, as in `tq_attention`; a sequence with no
    token gives m = l = o = 0."""
    d = q_rot.shape[-1]
    (kc, kn, vc, vn), bias = paged_fields(q_rot, pool, block_table, start, end, offsets, (packed_length(d, k_bits), packed_length(d, v_bits)))
    return tq_attention(q_rot, kc, kn, k_centroids, k_bits, vc, vn, v_centroids, v_bits, d, scale, row_offset, bias)



def int8_paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    offsets: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`int8_attention` over a paged pool's rows (`tq_paged_attention` has the layout): each side's fp16 scale at byte
    `offsets[0]` / `offsets[1]` and its d int8 codes at `offsets[2]` / `offsets[3]`. q `(B, H, R, d)`."""
    d = q.shape[-1]
    (kc, ks, vc, vs), bias = paged_fields(q, pool, block_table, start, end, offsets, (d, d))
    return int8_attention(q, kc.view(torch.int8), ks, vc.view(torch.int8), vs, scale, bias)

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
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention over per-token int8: q (B, H, R, d) float; k_codes (B, H, T, d) int8 with
    k_scale (B, H, T, 1) float16 (k = scale · code); v_codes (B, H, T, dv) int8, v_scale likewise."""
    check_int8_attention(q, k_codes, k_scale, v_codes, v_scale, bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q.device)
    b, h, r, _ = q.shape
    qc = q.to(compute_dtype)

    def scores(t0: int, t1: int) -> torch.Tensor:
        return (qc @ k_codes[:, :, t0:t1].to(compute_dtype).mT) * k_scale[:, :, t0:t1].to(compute_dtype).mT

    def values(t0: int, t1: int) -> torch.Tensor:
        return v_codes[:, :, t0:t1].to(compute_dtype) * v_scale[:, :, t0:t1].to(compute_dtype)

    dv = v_codes.shape[-1]
    return online_softmax((b, h, r), dv, k_codes.shape[2], TOKEN_CHUNK, scores, values, scale, bias, softcap, compute_dtype, q.device)


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
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention over KIVI keys (axis "channel") and values (axis "token"), codecs/kivi.py layout.

    q (B, H, R, d) float. Keys: k_codes (B, H, T, ceil(d·k_bits/8)) uint8 packed along channels, T a
    multiple of k_group; k_scale, k_zero (B, H, T, ceil(d/k_group)) float16 *spread*: the d values of
    token group g sit in rows g·k_group ... as row-major (k_group, ceil(d/k_group)), so channel c of
    token t reads row (t // k_group)·k_group + c // ceil(d/k_group), column c % ceil(d/k_group).
    k = code · scale + zero. Values: v_codes (B, H, T, ceil(dv·v_bits/8)) uint8, v_scale, v_zero
    (B, H, T, dv / v_group) float16 per token and channel group: v[j] = code[j] · scale[j // v_group] + zero[...].
    """
    check_kivi_attention(q, k_codes, k_scale, k_zero, k_bits, k_group, v_codes, v_scale, v_zero, v_bits, v_group, bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q.device)
    b, h, r, d = q.shape
    dv = v_scale.shape[-1] * v_group
    qc = q.to(compute_dtype)

    def key_meta(meta: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Spread rows [t0, t1) -> per-token channel values (B, H, t1 - t0, d)."""
        spread = meta[:, :, t0:t1].to(compute_dtype)
        groups = spread.reshape(b, h, (t1 - t0) // k_group, -1)[..., :d]  # (B, H, groups, d)
        return groups.repeat_interleave(k_group, dim=2)

    def scores(t0: int, t1: int) -> torch.Tensor:
        codes = unpack_bits(k_codes[:, :, t0:t1], k_bits, d).to(compute_dtype)
        k = codes * key_meta(k_scale, t0, t1) + key_meta(k_zero, t0, t1)
        return qc @ k.mT

    def values(t0: int, t1: int) -> torch.Tensor:
        codes = unpack_bits(v_codes[:, :, t0:t1], v_bits, dv).to(compute_dtype)
        s = v_scale[:, :, t0:t1].to(compute_dtype).repeat_interleave(v_group, dim=-1)
        z = v_zero[:, :, t0:t1].to(compute_dtype).repeat_interleave(v_group, dim=-1)
        return codes * s + z

    chunk = max(k_group, TOKEN_CHUNK // k_group * k_group)  # whole key groups per step
    return online_softmax((b, h, r), dv, k_codes.shape[2], chunk, scores, values, scale, bias, softcap, compute_dtype, q.device)


def _pca_levels(codes: torch.Tensor, bitpos: torch.Tensor, bits: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """Signed levels `(..., rank)` float32 of packed rows `codes (..., nbytes)` uint8: component r is the
    `bits[r]`-bit code at bit `bitpos[r]` (LSB-first) minus `qmax[r]`. Read through a 16-bit window,
    since a code of up to 8 bits may straddle two bytes."""
    pos = bitpos.long()
    row = torch.nn.functional.pad(codes.long(), (0, 1))  # a code that ends in the last byte reads a zero byte past it
    word = row[..., pos // 8] | (row[..., pos // 8 + 1] << 8)
    return ((word >> (pos % 8)) & ((1 << bits.long()) - 1)).float() - qmax


def pca_basis_t(basis_t: torch.Tensor, w8: torch.Tensor | None, col_scale: torch.Tensor | None, rank: int) -> torch.Tensor:
    """`basis_t (groups, rank, gdim)` float32, rebuilt from its integer form `w8 (groups, ceil(rank/4), gdim, 4)` int8 times
    `col_scale (groups, gdim)` when the C++ kernel dropped it (an empty tensor); else `basis_t` itself."""
    if basis_t.numel() or w8 is None:
        return basis_t
    groups, rank4, gdim, _ = w8.shape
    w = w8.permute(0, 1, 3, 2).reshape(groups, 4 * rank4, gdim)[:, :rank]
    return (w.float() * col_scale[:, None]).contiguous()


def pca_vq_attention(
    q: torch.Tensor,
    pos0: torch.Tensor,
    bitpos: torch.Tensor,
    bits: torch.Tensor,
    qmax: torch.Tensor,
    basis_t: torch.Tensor,
    mean: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    k_codes: torch.Tensor,
    books: torch.Tensor,
    v_bits: int,
    v_idx: torch.Tensor,
    v_norm: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    w8: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    mean8: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention over a Shard segment: PCA-coefficient keys stored without RoPE, VQ values.

    q (B, kv, R, d) float: the model's RoPE'd queries grouped by kv head. pos0 (B,) int64: the RoPE
    position of the segment's first token per batch row (token t sits at pos0 + t). Keys, as
    `PCAKeyCodec.kernel_state()` gives them: k_codes (B, groups, T, nbytes) uint8 packed rows, where
    component r is the bits[r]-bit code at bit bitpos[r] (bits (rank,) uint8, bitpos (rank,) int32)
    and its level is code - qmax[r] (qmax (rank,) float32); basis_t (groups, rank, gdim) float32 with
    the coefficient scale folded in, mean (groups, gdim) float32, gdim = kv / groups · d (head
    h = g · kv / groups + j reads columns [j·d, (j+1)·d) of group g): k0(t) = levels(t) @ basis_t + mean,
    un-RoPEd. inv_freq (d/2,) float32 and rope_scale (the model's
    attention scaling) re-apply RoPE at pos0 + t in float32, as transformers does:
    k(t) = RoPE(k0(t)). Values, as `VQValueCodec.kernel_state()`: books (1 or kv, entries, gsize)
    float32; v_idx (B, kv, T, ceil(d/gsize · v_bits / 8)) uint8, the packed codeword index of each
    group of gsize channels; v_norm (B, kv, T, 1) float16 or None: v(t) = v_norm[t] · codewords.
    w8, col_scale, mean8: the basis' integer form (`cpu_lut.int8_basis`) for the C++ kernel's VNNI rebuild, or None;
    with them basis_t may be empty (the C++ kernel dropped it), and is then rebuilt from them exactly.
    Returns (m, denom, o) as in the module docstring; o stays in VQ's rotated, channel-normalized
    space (`VQValueCodec.kernel_output` maps it back).
    """
    basis_t = pca_basis_t(basis_t, w8, col_scale, qmax.numel())
    check_pca_vq_attention(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm,
                           bias, softcap)
    bias = skip_bias(bias, skip, k_codes.shape[2], q.device)
    b, kv, r, d = q.shape
    groups, _, gdim = basis_t.shape
    qc, basis, mu = q.to(compute_dtype), basis_t.to(compute_dtype), mean.to(compute_dtype)[None, :, None]
    book = books.to(compute_dtype)
    heads = torch.arange(kv, device=q.device) if books.shape[0] == kv else torch.zeros(kv, dtype=torch.long, device=q.device)

    def scores(t0: int, t1: int) -> torch.Tensor:
        k0 = _pca_levels(k_codes[:, :, t0:t1], bitpos, bits, qmax).to(compute_dtype) @ basis + mu  # (B, G, C, gdim)
        k0 = k0.unflatten(-1, (kv // groups, d)).transpose(2, 3).reshape(b, kv, t1 - t0, d)
        cos, sin = rope_cos_sin(pos0[:, None] + torch.arange(t0, t1, device=q.device), inv_freq, rope_scale)
        return qc @ apply_rope(k0, cos.to(compute_dtype), sin.to(compute_dtype)).mT

    def values(t0: int, t1: int) -> torch.Tensor:
        idx = unpack_bits(v_idx[:, :, t0:t1], v_bits, d // books.shape[2]).long()  # (B, kv, C, d / gsize)
        v = book[heads[None, :, None, None], idx].flatten(-2)  # (B, kv, C, d)
        return v if v_norm is None else v * v_norm[:, :, t0:t1].to(compute_dtype)

    return online_softmax((b, kv, r), d, k_codes.shape[2], TOKEN_CHUNK, scores, values, scale, bias, softcap, compute_dtype, q.device)


# -- encode ----------------------------------------------------------------------------------------
def tq_rotated_unit(
    x: torch.Tensor, mean: torch.Tensor | None, inv_scale: torch.Tensor | None, signs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float stage of `tq_encode` for one chunk: `(norm (B, H, T, 1), y (B, H, T, d))` float32 with
    y = FWHT(signs ⊙ u) / sqrt(d), u = x' / ||x'||, x' = (x - mean) ⊙ inv_scale (u = 0 when x' = 0)."""
    xf = x.float()
    if mean is not None:
        xf = xf - mean[None, :, None, :]
    if inv_scale is not None:
        xf = xf * inv_scale[None, :, None, :]
    norm = xf.norm(dim=-1, keepdim=True)
    unit = xf / norm.clamp_min(_TINY)
    return norm, randomized_hadamard(unit, signs[None, :, None, :])


def tq_encode(
    x: torch.Tensor,
    mean: torch.Tensor | None,
    inv_scale: torch.Tensor | None,
    signs: torch.Tensor,
    boundaries: torch.Tensor,
    bits: int,
    centroids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant MSE encode: x (B, H, T, d) float, d a power of two; mean, inv_scale (H, d) float32 or
    None; signs (H, d) float32 ±1 (the randomized Hadamard of each head); boundaries (2**bits - 1,)
    float32, sorted. Code = number of boundaries strictly below y (`torch.bucketize`, as
    `Codebook.quantize`), bit-packed LSB-first (`pack_bits`). centroids (2**bits,) float32 or None: when given, the
    stored scalar is ||x'|| / ||c[codes]|| (floored at 1e-6), the reconstruction as long as the input
    (`TurboQuantConfig.norm = "match"`); otherwise ||x'||.

    Returns (norm (B, H, T, 1) float16, codes (B, H, T, d·bits/8) uint8).
    """
    check_tq_encode(x, mean, inv_scale, signs, boundaries, bits, centroids)
    norms, codes = [], []
    for t0 in range(0, x.shape[2], TOKEN_CHUNK):
        norm, y = tq_rotated_unit(x[:, :, t0 : t0 + TOKEN_CHUNK], mean, inv_scale, signs)
        idx = torch.bucketize(y, boundaries)
        if centroids is not None:
            norm = norm / centroids[idx].square().sum(-1, keepdim=True).sqrt().clamp_min(MATCH_FLOOR)
        norms.append(norm.half())
        codes.append(pack_bits(idx, bits))
    if not norms:  # no tokens
        b, h, _, d = x.shape
        return x.new_empty((b, h, 0, 1), dtype=torch.float16), x.new_empty((b, h, 0, d * bits // 8), dtype=torch.uint8)
    return torch.cat(norms, dim=2), torch.cat(codes, dim=2)


def trellis_encode(y: torch.Tensor, codebook: torch.Tensor, bits: int) -> torch.Tensor:
    """Trellis-coded TurboQuant symbols: y (..., n) float, coordinates already rotated and scaled to N(0, 1);
    codebook (2**L,) float32 the state codebook (`trellis.gaussian_codebook`, state = symbols oldest-highest).
    Returns (..., n) uint8 `bits`-bit symbols of a tail-biting path (`trellis.encode_symbols`: a free Viterbi pass over
    the sequence rotated by n/2 reads the wrap-around bits, a second pass is held to them at both ends; ties to the
    first predecessor and the first final state)."""
    check_trellis_encode(y, codebook, bits)
    return trellis.encode_symbols(y, codebook, bits)


def kivi_encode(x: torch.Tensor, bits: int, group: int, axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI encode (codecs/kivi.py): min/max affine codes of `bits` bits over groups of `group` values,
    scale and zero stored in fp16 and the codes computed against the stored values (`quantize_affine`).

    x (B, H, T, d) float. axis "channel" (keys): per channel over each group of `group` tokens (T a
    multiple of group); axis "token" (values): per token over each group of `group` channels. Returns
    codes (B, H, T, ceil(d·bits/8)) uint8 packed along channels, and scale, zero float16: "channel"
    spread to (B, H, T, ceil(d/group)) (layout in `kivi_attention`, zero-padded), "token" (B, H, T, d/group).
    """
    check_kivi_encode(x, bits, group, axis)
    b, h, _, d = x.shape
    chunk = max(group, TOKEN_CHUNK // group * group)  # whole token groups per step
    codes, scales, zeros = [], [], []
    for t0 in range(0, x.shape[2], chunk):
        q = quantize_affine(x[:, :, t0 : t0 + chunk], bits, group, axis=-2 if axis == "channel" else -1)
        codes.append(pack_bits(q.codes, bits))
        scales.append(q.scale if axis == "token" else _spread(q.scale, group))
        zeros.append(q.zero if axis == "token" else _spread(q.zero, group))
    if not codes:
        meta = -(-d // group) if axis == "channel" else d // group
        empty = x.new_empty((b, h, 0, meta), dtype=torch.float16)
        return x.new_empty((b, h, 0, packed_length(d, bits)), dtype=torch.uint8), empty, empty.clone()
    return torch.cat(codes, dim=2), torch.cat(scales, dim=2), torch.cat(zeros, dim=2)


def _spread(meta: torch.Tensor, group: int) -> torch.Tensor:
    """Per-(token group, channel) `(B, H, groups, d)` -> `(B, H, groups·group, ceil(d/group))`, zero-padded."""
    b, h, ng, d = meta.shape
    per_row = -(-d // group)
    return torch.nn.functional.pad(meta, (0, group * per_row - d)).reshape(b, h, ng * group, per_row)
