"""A paged KV pool whose pages hold kvpack codes, and attention that reads them through a block table.

A serving engine's pool is `(blocks, kv_heads, block_size, row_bytes)` uint8: one row per (token, head), written
once when the token's K and V are computed. A row holds, in order, the key's and the value's fp16 scale (int8) or
norm (TurboQuant), then the key's codes and the value's codes:

    [k_scale: 2 B | v_scale: 2 B | k_codes: kc B | v_codes: vc B]     kc, vc = ceil(d * bits / 8) (int8: d)

so SmolLM2's d = 64 takes 132 B per (token, head) with int8 (bf16: 256 B) and 44 B with TurboQuant k3v2. `int8:rotated`
rows are int8 rows of each vector after a seeded randomized Hadamard rotation (`codecs.int8_rotated`), in the same
bytes: a key whose outlier channels set its per-token scale loses less of its other channels.

Codec state is static: TurboQuant's rotation is seeded per (layer, head) from one seed and its Lloyd-Max codebook
is fixed by (d, bits); nothing is fitted on a prompt. Centering and channel scales are either off or fitted once per
model on calibration text (`calibrated`, `pool_calibration`), so a row depends only on its own token and a full block
is the same whichever request wrote it (prefix caching shares it as is).

Attention gathers only the blocks of the sequences in the batch (never the whole pool) and computes scores and
weighted sums on the codes through the codec's own compressed-domain ops (`Codec.scores`, `Codec.weighted_sum`, which
run kvpack's CPU kernels for decode-sized row counts). The keys and values of the tokens being computed in this
step are attended exactly and merged with the compressed history by log-sum-exp (`exact_chunk=True`); with
`exact_chunk=False` every token, the step's own included, is read back from the pool (a strict measure of what the
codes cost: every position sees only compressed keys and values). Slots past a sequence's length are zeroed after
the gather, so an unwritten or stale slot never reaches a score or a sum, whatever bytes it holds.

A window (`WindowSlots`, `WindowStore`) keeps each running sequence's last tokens beside the pool in int8 rows; a
query reads the tokens within the window of its position from there (or, for the step's own, exactly) and only
older ones from the pool.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..codecs.base import Codec, Packed, group_query, ungroup
from ..codecs.int8 import Int8Codec, Int8Config, Int8Packed
from ..codecs.int8_rotated import RotatedInt8Codec, RotatedInt8Config
from ..codecs.turboquant import TurboQuantCodec, TurboQuantConfig, TurboQuantPacked
from ..kernels import cpu_lut, ops

KEY_CHANNEL_SCALE = 0.5  # calibrated keys: RMS^0.5 per channel, as kvpack's turboquant:kXvY methods scale them
INT8_METHODS = ("int8", "int8:rotated")  # int8 rows, plain or after a seeded rotation: `PoolFormat.bits` is None
POOL_METHODS = (*INT8_METHODS, "turboquant:kXvY (X, Y in 1..4; '+match': the stored norms make each reconstruction as long as its input)")
NORM_BYTES = 2  # fp16 scale or norm per (token, head) and side
ROW_CHUNK = 512  # query rows per score matrix in a prefill: bounds the (heads, rows, tokens) float temporary
PAGED_ROWS = 16  # query rows per kv head that the paged kernel takes (a decode step's GQA group, or a short chunk's)
DENSE_CHUNK_ROWS = 64  # prefill chunks of at least this many rows read their stored history decoded, once per chunk


@dataclass(frozen=True)
class PoolFormat:
    """What a pool row holds: `int8` (per-token symmetric int8, fp16 scale), `int8:rotated` (the same after a seeded
    randomized Hadamard rotation) or TurboQuant with `key_bits`/`value_bits`.

    method: "int8", "int8:rotated" or "turboquant:kXvY" with X, Y in 1..4 (scalar Lloyd-Max codes after a seeded rotation),
        optionally "+match" (each row's norm stored so that its reconstruction is as long as the input,
        `TurboQuantConfig.norm`: the same bytes, read by the same kernels).
    head_dim: the model's head size d.
    seed: base seed of the rotations, TurboQuant's and `int8:rotated`'s (each (layer, head) derives its own).
    calibrated: TurboQuant keys centered and channel-scaled, values centered, by per-layer state fitted once on
        calibration text (`pool_calibration`; `codecs` then takes each layer's state). The rows are the same size.
    """

    method: str
    head_dim: int
    seed: int = 0
    calibrated: bool = False

    def __post_init__(self):
        if not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"calibrated must be True or False, got {self.calibrated!r}")
        bits = self.bits  # validates the method name
        if self.calibrated and bits is None:
            raise ValueError("calibration (key/value centering and channel scales) applies to TurboQuant pools, not int8")

    @property
    def bits(self) -> tuple[int, int] | None:
        """(key bits, value bits) for TurboQuant, None for int8 rows (plain or rotated)."""
        if self.method in INT8_METHODS:
            return None
        match = re.fullmatch(r"turboquant:k([1-4])v([1-4])(\+match)?", self.method)
        if match:
            return int(match[1]), int(match[2])
        raise ValueError(
            f"the kvpack KV pool stores {', '.join(POOL_METHODS)}, got method {self.method!r}. Methods whose codec state is "
            "fitted per prompt or per block (shard, kivi, kvquant, pca, vq, TurboQuant's '+ropemean' centering and channel "
            "scales), QJL residuals ('+qjl') and trellis codes ('+tcq') have no place in a write-once page yet; their "
            "compressed prefixes are served by kvpack's KV connector (kvpack.serve.vllm_connector)"
        )

    @property
    def code_bytes(self) -> tuple[int, int]:
        """Bytes of the key's and the value's codes per (token, head)."""
        if self.bits is None:
            return self.head_dim, self.head_dim
        return tuple(math.ceil(self.head_dim * b / 8) for b in self.bits)  # type: ignore[return-value]

    @property
    def row_bytes(self) -> int:
        """Bytes per (token, head): both scales or norms and both sides' codes."""
        return 2 * NORM_BYTES + sum(self.code_bytes)

    @property
    def offsets(self) -> tuple[int, int, int, int]:
        """Byte offsets within a row of the key's and the value's scale or norm, then of their codes."""
        return 0, NORM_BYTES, 2 * NORM_BYTES, 2 * NORM_BYTES + self.code_bytes[0]

    def codecs(self, kv_heads: int, layer_idx: int, state: dict[str, torch.Tensor] | None = None) -> tuple[Codec, Codec]:
        """The (key, value) codecs of one layer: static, seeded per (layer, head); when `calibrated`, loaded with the
        layer's `state` (key_mean, key_scale, value_mean `(kv_heads, d)` float32, from `pool_calibration`)."""
        if self.method == "int8:rotated":  # keys and values rotated by the same signs: each side is its own codec
            config = RotatedInt8Config(self.seed)
            return RotatedInt8Codec(config, self.head_dim, kv_heads, layer_idx), RotatedInt8Codec(config, self.head_dim, kv_heads, layer_idx)
        if self.bits is None:
            return Int8Codec(Int8Config(), self.head_dim, kv_heads, layer_idx), Int8Codec(Int8Config(), self.head_dim, kv_heads, layer_idx)
        if self.calibrated != (state is not None):
            raise ValueError("a calibrated pool's codecs take each layer's state, an uncalibrated pool's none")
        kb, vb = self.bits
        scaled = {"center": True, "channel_scale": KEY_CHANNEL_SCALE} if self.calibrated else {}
        norm = "match" if self.method.endswith("+match") else "input"
        key = TurboQuantCodec(TurboQuantConfig(bits=kb, seed=self.seed, norm=norm, **scaled), self.head_dim, kv_heads, layer_idx)
        value = TurboQuantCodec(TurboQuantConfig(bits=vb, seed=self.seed, center=self.calibrated, norm=norm), self.head_dim, kv_heads,
                                layer_idx)
        if state is not None:
            key.load_state_dict({"mean": state["key_mean"].float(), "scale": state["key_scale"].float()})
            value.load_state_dict({"mean": state["value_mean"].float()})
        return key, value


def _scale_and_codes(packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scale or norm (b, h, t, 2) uint8, codes (b, h, t, c) uint8)` of an int8 or TurboQuant packed block."""
    if isinstance(packed, Int8Packed):
        return packed.scale.view(torch.uint8), packed.codes.view(torch.uint8)
    if isinstance(packed, TurboQuantPacked) and packed.signs is None:
        return packed.norm.view(torch.uint8), packed.codes
    raise TypeError(f"a pool row holds int8 or scalar TurboQuant codes, got {type(packed).__name__}")


def encode_rows(fmt: PoolFormat, codecs: tuple[Codec, Codec], key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Pool rows `(tokens, kv_heads, row_bytes)` uint8 of `key, value (tokens, kv_heads, d)`."""
    k = codecs[0].encode(key.transpose(0, 1).unsqueeze(0))  # codecs take (batch, kv_heads, tokens, d)
    v = codecs[1].encode(value.transpose(0, 1).unsqueeze(0))
    ks, kc = _scale_and_codes(k)
    vs, vc = _scale_and_codes(v)
    rows = torch.cat([ks, vs, kc, vc], dim=-1)[0]  # (kv_heads, tokens, row_bytes)
    assert rows.shape[-1] == fmt.row_bytes, (rows.shape, fmt.row_bytes)
    return rows.transpose(0, 1)


def write_rows(pool: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `rows (tokens, kv_heads, row_bytes)` at `slot_mapping (tokens,)` (block * block_size + offset) of
    `pool (blocks, kv_heads, block_size, row_bytes)`, in place. Negative slots (padding) are skipped."""
    slots = slot_mapping[: rows.shape[0]].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, rows = slots[keep], rows[keep]
    block_size = pool.shape[2]
    pool[slots // block_size, :, slots % block_size] = rows


def unpack_rows(fmt: PoolFormat, rows: torch.Tensor) -> tuple[Packed, Packed]:
    """Packed key and value blocks `(b, kv_heads, tokens, ·)` of pool rows `rows (b, kv_heads, tokens, row_bytes)`."""
    kc, vc = fmt.code_bytes
    n = rows.shape[2]
    kn, vn, kat, vat = fmt.offsets
    ks = rows[..., kn : kn + NORM_BYTES].contiguous().view(torch.float16)
    vs = rows[..., vn : vn + NORM_BYTES].contiguous().view(torch.float16)
    k_codes = rows[..., kat : kat + kc].contiguous()
    v_codes = rows[..., vat : vat + vc].contiguous()
    if fmt.bits is None:
        return Int8Packed(n, k_codes.view(torch.int8), ks), Int8Packed(n, v_codes.view(torch.int8), vs)
    return TurboQuantPacked(n, ks, k_codes), TurboQuantPacked(n, vs, v_codes)


def gather_rows(pool: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Rows `(b, kv_heads, T, row_bytes)` of sequences `b` whose blocks are `block_table (b, ≥ ceil(T / block_size))`,
    T = max(lengths): only their blocks are read. Rows at or past each sequence's length are zero (an unwritten,
    stale or foreign slot never reaches attention; a zero scale or norm decodes to a zero vector)."""
    b = block_table.shape[0]
    block_size = pool.shape[2]
    t = int(lengths.max()) if b else 0
    nb = max(-(-t // block_size), 1)
    ids = block_table[:, :nb].long().clamp_min(0)
    rows = pool[ids]  # (b, nb, kv_heads, block_size, C)
    rows = rows.permute(0, 2, 1, 3, 4).reshape(b, pool.shape[1], nb * block_size, pool.shape[3])[:, :, :t]
    past = torch.arange(t, device=pool.device)[None, :] >= lengths[:, None].to(pool.device)  # (b, T)
    return rows.masked_fill(past[:, None, :, None], 0)


def _partial(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(m, l, p)`: row max `(…, 1)`, Σ exp(s - m) `(…, 1)` and exp(s - m) of masked scores (-inf = masked).
    A row with every score masked gets m = 0, l = 0, p = 0."""
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    return m, p.sum(-1, keepdim=True), p


def _merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One partial `(m, l, o)` of online-softmax partials over disjoint key sets (log-sum-exp merge)."""
    m = torch.stack([p[0] for p in parts]).amax(0)
    w = [torch.where(p[1] > 0, torch.exp(p[0] - m), torch.zeros_like(m)) for p in parts]
    num = sum(wi * p[2] for wi, p in zip(w, parts, strict=True))
    den = sum(wi * p[1] for wi, p in zip(w, parts, strict=True))
    return m, den, num


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Normalized output of online-softmax partials `(m, l, o)` over disjoint key sets."""
    _, den, num = _merge_partials(parts)
    return num / den.clamp_min(torch.finfo(torch.float32).tiny)


# torch's CPU flash attention with its log-sum-exp (private, so looked up once and used only where present): an exact band
# of a prefill chunk is a few hundred keys per query row, where score matrices built in torch ops cost 4x its time.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _band_partial(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """Partial of `query (b, heads, r, d)` over `key, value (b, S, kv_heads, d)` at token `positions (b, S)`, query
    row i of sequence s seeing token j when `lo[s, i, j] <= positions[s, j] <= hi[s, i, j]` (`lo`, `hi` `(b, r)` or
    `(b, r, S)`; a row that sees none gets m = l = o = 0). Decode rows: one grouped product per kv head. Longer
    chunks: torch's CPU flash attention, whose normalized output and log-sum-exp are the partial (m = lse, l = 1)."""
    b, heads, r, d = query.shape
    kv = key.shape[2]
    lo = lo if lo.dim() == 3 else lo[:, :, None]
    hi = hi if hi.dim() == 3 else hi[:, :, None]
    pos = positions[:, None, :]
    hidden = (pos < lo) | (pos > hi)  # (b, r, S)
    if r > 1 and _FLASH_CPU is not None and query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16):
        dtype = query.dtype
        k = key.to(dtype).transpose(1, 2).repeat_interleave(heads // kv, 1)  # (b, heads, S, d)
        v = value.to(dtype).transpose(1, 2).repeat_interleave(heads // kv, 1)
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))[:, None]
        out, lse = _FLASH_CPU(query, k, v, 0.0, False, attn_mask=mask, scale=scale)
        empty = hidden.all(-1)[:, None, :, None]  # rows that see no token here (m = l = o = 0, not NaN)
        zero = torch.zeros((), dtype=torch.float32)
        return (torch.where(empty, zero, lse.float().view(b, heads, r, 1)), (~empty).float().expand(b, heads, r, 1),
                torch.where(empty, zero, out.float()))
    k = key.float().transpose(1, 2)  # (b, kv, S, d)
    v = value.float().transpose(1, 2)
    s = (group_query(query.float(), kv) @ k.mT).view(b, kv, heads // kv, r, -1) * scale  # (b, kv, group, r, S)
    m, denom, p = _partial(s.masked_fill(hidden[:, None, None], float("-inf")))
    o = p.view(b, kv, heads // kv * r, -1) @ v  # (b, kv, group * r, d)
    return m.view(b, heads, r, 1), denom.view(b, heads, r, 1), o.view(b, heads, r, d)


def _decoded_history(fmt: PoolFormat, codecs: tuple[Codec, Codec], pool: torch.Tensor, block_table: torch.Tensor,
                     lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `(b, T, kv_heads, d)` float32 decoded from the first `lengths (b,)` rows of sequences `block_table (b, ·)`,
    T = max(lengths) (rows past a sequence's length decode from zeros: the caller masks them)."""
    k, v = unpack_rows(fmt, gather_rows(pool, block_table, lengths))
    return codecs[0].decode(k).transpose(1, 2), codecs[1].decode(v).transpose(1, 2)


def history_partial(fmt: PoolFormat, codecs: tuple[Codec, Codec], query: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor,
                    scale: float, first: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention partial of `query (b, heads, r, d)` over compressed rows `(b, kv_heads, T, row_bytes)`, query row i of
    sequence s seeing tokens `first <= t < visible[s, i]` (`visible (b, r)`; the first `first` are read exactly
    elsewhere). Returns m, l `(b, heads, r, 1)`, o `(b, heads, r, d)` float32 (o unnormalized: Σ exp(s - m) v̂)."""
    k, v = unpack_rows(fmt, rows)
    s = codecs[0].scores(query, k) * scale  # (b, heads, r, T)
    t = torch.arange(rows.shape[2], device=query.device)
    hidden = (t[None, None, None, :] >= visible[:, None, :, None]) | (t < first)[None, None, None, :]
    m, denom, p = _partial(s.masked_fill(hidden, float("-inf")))
    return m, denom, codecs[1].weighted_sum(p, v)


def pool_partial(fmt: PoolFormat, codecs: tuple[Codec, Codec], query: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                 visible: torch.Tensor, scale: float, first: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`history_partial` of `query (b, heads, r, d)` over sequences whose blocks are `block_table (b, ·)` in `pool`.

    Rows whose query rows of a sequence all see the same tokens (a decode step; `visible (b, r)` equal along r) and
    fit the kernels (`PAGED_ROWS` rows per kv head) are read where they lie, through the block table, by
    `kvpack::tq_paged_attention` or `kvpack::int8_paged_attention` (C++ on CPU, their pure-torch references
    elsewhere): no gather, no float keys. Other calls gather the sequences' rows (`gather_rows`) and run the codecs'
    ops on them."""
    kv = pool.shape[1]
    rows_per_head = query.shape[1] // kv * query.shape[2]
    paged = rows_per_head <= PAGED_ROWS and pool.is_contiguous() and fmt.row_bytes % 2 == 0 and bool((visible == visible[:, :1]).all())
    start = torch.full((query.shape[0],), first, dtype=torch.int64)
    heads = query.shape[1]
    if paged and fmt.bits is None:  # int8 rows: read as stored; rotated rows take the query rotated and rotate the sum back
        kc, vc = codecs
        q_codes, _ = kc.kernel_query(group_query(query.float(), kv))
        m, denom, o = ops.run("int8_paged_attention", q_codes, pool, block_table, start, visible[:, 0].long(), list(fmt.offsets), scale)
        return ungroup(m, heads), ungroup(denom, heads), ungroup(vc.kernel_output(o, denom), heads)
    if paged:
        kc, vc = codecs
        q_rot, offset = kc.kernel_query(group_query(query.float(), kv))
        m, denom, o = ops.run("tq_paged_attention", q_rot, offset, pool, block_table, start, visible[:, 0].long(), list(fmt.offsets),
                              kc.kernel_table(query.device), fmt.bits[0], vc.kernel_table(query.device), fmt.bits[1], scale)
        return ungroup(m, heads), ungroup(denom, heads), ungroup(vc.kernel_output(o, denom), heads)
    rows = gather_rows(pool, block_table, visible.amax(1))
    return history_partial(fmt, codecs, query, rows, visible, scale, first)


CausalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int], float], torch.Tensor]


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_lengths: list[int], key_lengths: list[int],
                scale: float) -> torch.Tensor:
    """Causal attention of sequences laid end to end, each over its own tokens only: `query (tokens, heads, d)` holds
    sequence i's last `query_lengths[i]` positions, `key, value (keys, kv_heads, d)` all its `key_lengths[i]` positions
    (query row j of a sequence of n queries and t keys sits at position t - n + j and sees keys 0..t - n + j);
    `(tokens, heads, d)` in the query's dtype (torch's SDPA, one call per sequence)."""
    out, a, b = [], 0, 0
    for n, t in zip(query_lengths, key_lengths, strict=True):
        q = query[a : a + n].transpose(0, 1)[None]  # (1, heads, n, d)
        k, v = (x[b : b + t].transpose(0, 1)[None].to(q.dtype) for x in (key, value))  # (1, kv_heads, t, d)
        mask = None if n == t else torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=n == t, scale=scale, enable_gqa=True)[0].transpose(0, 1))
        a, b = a + n, b + t
    return torch.cat(out)


def strict_attention(fmt: PoolFormat, codecs: tuple[Codec, Codec], query: torch.Tensor, pool: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_attention(strict=True)`: query `(tokens, heads, d)` of sequences at rows `query_start_loc[s]:[s + 1]`,
    their rows already in `pool`; `(tokens, heads, d)` in the query's dtype. Each token is its own row of one
    `pool_partial` call (the paged kernel with one position per kv head's group, as a decode step runs), reading
    positions 0..p of its sequence: the kernel's work for a row does not depend on the other rows of the call (its
    token splits start at the row's first position; empty splits add nothing), so the result is the same for any
    batch, chunking or prefix-cache hit. The codec's query and output maps run in C++ up to a number of rows and
    through torch's matmul past it, which round differently, so the rows go in pieces that C++ takes."""
    starts = query_start_loc.long()
    counts = starts[1:] - starts[:-1]
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)  # (tokens,) each token's sequence
    position = seq_lens.long()[seq] - counts[seq] + torch.arange(query.shape[0]) - starts[:-1][seq]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    piece = cpu_lut.serial_rows(query.shape[1], query.shape[2])
    for a in range(0, query.shape[0], piece):
        e = min(a + piece, query.shape[0])
        _, denom, o = pool_partial(fmt, codecs, query[a:e].float()[:, :, None], pool, block_table[seq[a:e]], (position[a:e] + 1)[:, None], scale)
        out[a:e] = (o / denom.clamp_min(torch.finfo(torch.float32).tiny))[:, :, 0].to(query.dtype)
    return out


def _dense_prefix(fmt: PoolFormat, codecs: tuple[Codec, Codec], pool: torch.Tensor, block_table: torch.Tensor, sel: list[int],
                  before: list[int], sinks: tuple[torch.Tensor, torch.Tensor] | None,
                  window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | WindowRead | None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K, V `(before[i], kv_heads, d)` float32 of positions `[0, before[i])` of sequences `sel[i]`, as `paged_attention`
    holds them best: the sinks exact, the window's positions (from its `held` on) as the window holds them, every
    other position decoded from the pool (decoded once for all `sel`)."""
    if not sel:
        return {}
    k, v = _decoded_history(fmt, codecs, pool, block_table[sel], torch.tensor(before))  # (b, T, kv_heads, d)
    if window is not None:
        rows = window if isinstance(window, WindowRead) else None
        width = rows.width if rows is not None else window[0].shape[1]
        held = (rows.held if rows is not None else window[2])[sel].tolist()
        wk, wv = rows.dense(sel) if rows is not None else (window[0][sel], window[1][sel])  # positions [before - W, before)
        for i, t in enumerate(before):
            if held[i] < t:
                k[i, held[i] : t] = wk[i, held[i] - t + width :].float()
                v[i, held[i] : t] = wv[i, held[i] - t + width :].float()
    if sinks is not None:
        first = sinks[0].shape[1]
        k[:, :first] = sinks[0][sel, : k.shape[1]].float()
        v[:, :first] = sinks[1][sel, : k.shape[1]].float()
    return {s: (k[i, : before[i]], v[i, : before[i]]) for i, s in enumerate(sel)}


def paged_attention(fmt: PoolFormat, codecs: tuple[Codec, Codec], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    pool: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    scale: float, exact_chunk: bool = True, sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
                    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | WindowRead | None = None,
                    causal: CausalAttention | None = None, strict: bool = False) -> torch.Tensor:
    """Causal attention of a batch of sequences over the pool, `(tokens, heads, d)` in the query's dtype.

    query `(tokens, heads, d)`, key/value `(tokens, kv_heads, d)`: this step's tokens, sequence s's at rows
    `query_start_loc[s]:query_start_loc[s + 1]`, already written to `pool` (`write_rows`); `seq_lens (b,)` each
    sequence's length including them; `block_table (b, max_blocks)` its blocks. Sequences computing one token (decode)
    are attended in one batched call, the others (prefill chunks) one at a time. `sinks`: exact K, V
    `(b, S, kv_heads, d)` of each sequence's first S positions (those it has), attended in place of their rows.
    `window`: the W positions before each sequence's first token of this step (`[before - W, before)`), valid from
    position `held (b,)` on, as K, V `(b, W, kv_heads, d)` and `held`, or as the store's int8 rows (`WindowRead`, which
    `WindowStore.read` gives: decode rows read them where they lie, through `kvpack::int8_paged_attention`); a query at
    position p then reads the tokens in `[max(p - W + 1, held), p]` from there (this step's own from `key`/`value`,
    exact) and only the older ones from the pool.
    With `exact_chunk`, the step's tokens are also read exactly by each other (a query never reads compressed what
    the step computed). A sequence's first step is then causal attention over its own tokens, and a chunk of
    `DENSE_CHUNK_ROWS` rows or more continuing a history is causal attention over its sinks, its stored history
    decoded once, the whole window (every row of the chunk reads exactly all the window holds) and its own tokens:
    `causal` computes every such sequence at once (`causal_sdpa`, torch's, when none is given; a serving engine passes
    its own kernel).
    `strict`: every query row reads every position up to its own from the pool, each row through one call of the
    paged kernel as if it were a decode step (`strict_attention`), so a position's output depends only on the stored
    rows: never on how the engine batched or chunked the step, nor on whether a prefix-cache hit or the step itself
    wrote them. Takes no exact chunk, sinks or window (each would be read only by some schedules).
    """
    if strict:
        if exact_chunk or sinks is not None or window is not None:
            raise ValueError("strict attention reads every position from the pool through the paged kernel: it takes exact_chunk=False, "
                             "no sinks and no window (each would be read exactly by some schedules and compressed by others)")
        return strict_attention(fmt, codecs, query, pool, query_start_loc, seq_lens, block_table, scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    first = 0 if sinks is None else sinks[0].shape[1]
    rows = window if isinstance(window, WindowRead) else None
    width = 0 if window is None else rows.width if rows is not None else window[0].shape[1]
    window_held = None if window is None else rows.held if rows is not None else window[2]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)

    def attend(sel: list[int], q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, before: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Normalized output `(b, heads, r, d)` of sequences `sel` for queries `q (b, heads, r, d)` at positions
        `pos (b, r)`, their step's tokens `k_new, v_new (b, n, kv_heads, d)` at positions `before (b, 1)` on."""
        held = before if window is None else window_held[sel][:, None].to(before.dtype)
        lo = torch.maximum(pos - width + 1, held)  # the first position each query reads exactly
        if exact_chunk:
            lo = torch.minimum(lo, before)
        parts = []
        r = pos.shape[1]
        # One band: the sinks (each read from position 0 on), then the window and the step's tokens (each read from
        # `lo` on, and never below the sinks they would repeat), all exact; a long chunk's stored history too, decoded.
        ek, ev = [k_new], [v_new]
        epos = [before + torch.arange(k_new.shape[1], device=q.device)[None]]
        elo = [lo.clamp_min(first)[:, :, None].expand(-1, -1, k_new.shape[1])]
        ehi = [pos[:, :, None].expand(-1, -1, k_new.shape[1])]
        if int(lo.max()) > first and r >= DENSE_CHUNK_ROWS:
            # A long prefill chunk that reads even its own tokens from the pool (no `exact_chunk`; with it, such chunks are
            # `causal` calls) reads its stored history (positions [first, lo)) decoded once, then attends to it with the
            # exact tokens in one flash call: each of its r query rows reads every history row anyway, so the decode
            # costs 1/r of the scores, and the lookup-table ops would build (heads, r, T) score matrices in torch.
            hk, hv = _decoded_history(fmt, codecs, pool, block_table[sel], lo.amax(1))
            ek.insert(0, hk.to(k_new.dtype))
            ev.insert(0, hv.to(v_new.dtype))
            epos.insert(0, torch.arange(hk.shape[1], device=q.device)[None].expand(len(sel), -1))
            elo.insert(0, torch.full((len(sel), r, hk.shape[1]), first, dtype=lo.dtype, device=q.device))
            ehi.insert(0, (lo - 1)[:, :, None].expand(-1, -1, hk.shape[1]))
        elif int(lo.max()) > first:
            parts.append(pool_partial(fmt, codecs, q, pool, block_table[sel], lo, scale, first))
        if width and rows is not None and pos.shape[1] == 1 and q.shape[1] // rows.rows.shape[1] <= PAGED_ROWS and int(held.min()) < int(before.max()):
            # Decode rows read the window's int8 rows where they lie (positions [max(lo, first), before)), a partial
            # of its own, instead of widening them into the band.
            parts.append(rows.partial(q, sel, lo[:, 0].clamp_min(first), before[:, 0], scale))
        elif width and (rows is None or int(held.min()) < int(before.max())):
            wk, wv = rows.dense(sel) if rows is not None else (window[0][sel], window[1][sel])
            ek.insert(0, wk.to(k_new.dtype))
            ev.insert(0, wv.to(v_new.dtype))
            epos.insert(0, before - width + torch.arange(width, device=q.device)[None])
            elo.insert(0, lo.clamp_min(first)[:, :, None].expand(-1, -1, width))
            ehi.insert(0, pos[:, :, None].expand(-1, -1, width))
        if sinks is not None:
            ek.insert(0, sinks[0][sel].to(k_new.dtype))
            ev.insert(0, sinks[1][sel].to(v_new.dtype))
            epos.insert(0, torch.arange(first, device=q.device).expand(len(sel), first))
            elo.insert(0, torch.zeros(len(sel), r, first, dtype=lo.dtype, device=q.device))
            ehi.insert(0, pos[:, :, None].expand(-1, -1, first))
        parts.append(_band_partial(q, torch.cat(ek, 1), torch.cat(ev, 1), torch.cat(epos, 1), torch.cat(elo, 2), torch.cat(ehi, 2), scale))
        return parts[0][2] / parts[0][1].clamp_min(torch.finfo(torch.float32).tiny) if len(parts) == 1 else _merge(parts)

    decode = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if decode:
        idx = torch.tensor([starts[s] for s in decode])
        before = torch.tensor([lens[s] - 1 for s in decode])[:, None]
        q = query[idx].unsqueeze(2)  # (b, heads, 1, d)
        out[idx] = attend(decode, q, key[idx].unsqueeze(1), value[idx].unsqueeze(1), before, before)[:, :, 0]
    # Prefill chunks with `exact_chunk`: a sequence's first step, and a chunk of DENSE_CHUNK_ROWS rows or more continuing a
    # stored history, are causal attention over exact-or-decoded keys and values laid end to end (`_dense_prefix`),
    # every such sequence in one `causal` call (a serving engine passes its own kernel). A continuation decodes its
    # history once, 1/r of its scores' work, and every row of the chunk reads the exact window before the chunk (a
    # query never reads compressed a token the step holds exactly).
    dense = [s for s in range(len(lens)) if exact_chunk and 1 < (n := starts[s + 1] - starts[s]) and (lens[s] == n or n >= DENSE_CHUNK_ROWS)]
    if dense:
        idx = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in dense])
        cont = [s for s in dense if lens[s] > starts[s + 1] - starts[s]]
        prefix = _dense_prefix(fmt, codecs, pool, block_table, cont, [lens[s] - starts[s + 1] + starts[s] for s in cont], sinks, window)
        keys, values = [], []
        for s in dense:
            if s in prefix:
                keys.append(prefix[s][0].to(key.dtype))
                values.append(prefix[s][1].to(value.dtype))
            keys.append(key[starts[s] : starts[s + 1]])
            values.append(value[starts[s] : starts[s + 1]])
        out[idx] = (causal or causal_sdpa)(query[idx], torch.cat(keys), torch.cat(values), [starts[s + 1] - starts[s] for s in dense],
                                           [lens[s] for s in dense], scale).float()
    for s in range(len(lens)):
        a, e = starts[s], starts[s + 1]
        n = e - a
        if n <= 1 or s in dense:
            continue
        before = torch.tensor([[lens[s] - n]])
        for c in range(0, n, ROW_CHUNK):
            ce = min(c + ROW_CHUNK, n)
            q = query[a + c : a + ce].transpose(0, 1).unsqueeze(0)  # (1, heads, r, d)
            pos = before + torch.arange(c, ce)[None]
            out[a + c : a + ce] = attend([s], q, key[None, a:ce + a], value[None, a:ce + a], before, pos)[0].transpose(0, 1)
    return out.to(query.dtype)


@dataclass(frozen=True)
class WindowPlan:
    """One step's use of the window store, the same for every layer.

    slot: `(b,)` int64 the store row of each sequence (-1: none free; it reads every older token compressed).
    held: `(b,)` int64 the first position its row holds exactly (its step's first position when the row holds nothing).
    copies: (source, destination) rows to copy before the step reads (a sequence continuing another's held tokens, as
        a prefix-cache hit does, while that one continues too).
    writes: `(token, row, place)`, `(n,)` int64 each: after the step, the step's token `token[i]` goes to store row
        `row[i]` at `place[i]` (each sequence with a row keeps its last `width` tokens; the same for every layer).
    """

    slot: torch.Tensor
    held: torch.Tensor
    copies: tuple[tuple[int, int], ...]
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class WindowSlots:
    """Which row of each layer's exact-window store holds each running sequence's last `width` tokens, across steps.

    A serving engine names no sequence to its attention backend, only block tables; a sequence is recognised by the
    block that holds its last token and its length: a row left at (block B, length L) is continued by the sequence
    whose step starts at position L with its position L - 1 in block B. A prefix-cache hit that lands on the same
    (block, length) continues it too (the same tokens at the same positions), by a copy when the owner also runs in
    the step. Rows no sequence continued are reused least recently used first. A sequence that finds no row reads
    its older tokens compressed: the window is a gain in accuracy, never a source of wrong tokens.
    """

    def __init__(self, slots: int, width: int):
        if slots < 1 or width < 1:
            raise ValueError(f"a window store needs at least one row and one token, got {slots} rows of {width}")
        self.slots, self.width = slots, width
        self.key: list[int | None] = [None] * slots  # the block holding the row's last token
        self.end = [0] * slots  # tokens its sequence had after its last step
        self.start = [0] * slots  # the first position the row holds exactly
        self.used = [-1] * slots  # the step that last wrote it
        self.owner: dict[int, int] = {}  # block id -> row
        self.step = 0
        self._plan: WindowPlan | None = None
        self._readers: set[int] = set()

    def plan(self, reader: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             block_size: int) -> WindowPlan:
        """This step's plan for layer `reader`; the first call of a step (a layer that already read the current plan
        calls again) makes it."""
        if self._plan is None or reader in self._readers:
            self._plan = self._make(query_start_loc.tolist(), seq_lens.tolist(), block_table, block_size)
            self._readers = set()
        self._readers.add(reader)
        return self._plan

    def _make(self, starts: list[int], lens: list[int], table: torch.Tensor, block_size: int) -> WindowPlan:
        self.step += 1
        b = len(lens)
        before = [lens[s] - (starts[s + 1] - starts[s]) for s in range(b)]
        source: list[int | None] = []
        for s in range(b):  # the row each sequence continues, read before any row changes hands
            row = self.owner.get(int(table[s, (before[s] - 1) // block_size])) if before[s] > 0 else None
            ok = row is not None and self.end[row] == before[s] and self.key[row] == int(table[s, (before[s] - 1) // block_size])
            source.append(row if ok else None)
        busy = {r for r in source if r is not None}
        free = sorted((r for r in range(self.slots) if r not in busy), key=lambda r: self.used[r], reverse=True)
        slot, held, copies, claimed = [], [], [], set()
        for s in range(b):
            src = source[s]
            if src is not None and src not in claimed:
                row, start = src, self.start[src]
            else:
                row = free.pop() if free else -1
                start = before[s] if src is None else self.start[src]
                if row >= 0 and src is not None:
                    copies.append((src, row))
            last = int(table[s, (lens[s] - 1) // block_size])
            if row < 0:
                self.owner.pop(last, None)  # computed here without a row: no older row may claim its block
                slot.append(-1)
                held.append(before[s])
                continue
            if self.key[row] is not None and self.owner.get(self.key[row]) == row:
                del self.owner[self.key[row]]
            claimed.add(row)
            self.key[row], self.end[row], self.start[row], self.used[row] = last, lens[s], start, self.step
            self.owner[last] = row
            slot.append(row)
            held.append(max(start, before[s] - self.width))
        tokens, rows, places = [], [], []  # what each layer writes after the step: each sequence's last `width` tokens
        for s, row in enumerate(slot):
            if row >= 0:
                a = max(starts[s], starts[s + 1] - self.width)
                tokens.extend(range(a, starts[s + 1]))
                rows.extend([row] * (starts[s + 1] - a))
                places.extend(p % self.width for p in range(lens[s] - (starts[s + 1] - a), lens[s]))
        writes = tuple(torch.tensor(x, dtype=torch.int64) for x in (tokens, rows, places))
        return WindowPlan(torch.tensor(slot, dtype=torch.int64), torch.tensor(held, dtype=torch.int64), tuple(copies), writes)


@dataclass(frozen=True)
class WindowRead:
    """One layer's window rows for a step, as `paged_attention(window=...)` reads them: sequence s's positions
    `[held[s], before[s])` (at most the `width` before its step) lie in store row `slot[s]` at `position % width`.

    rows: `(store rows, kv_heads, width, row_bytes)` uint8, int8 pool rows (each store row one block of `width` slots).
    slot, held, before: `(b,)` int64; a sequence without a row (slot -1) holds nothing (held = before).
    """

    rows: torch.Tensor
    slot: torch.Tensor
    held: torch.Tensor
    before: torch.Tensor
    format: PoolFormat
    codecs: tuple[Codec, Codec]

    @property
    def width(self) -> int:
        return self.rows.shape[2]

    def dense(self, sel: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `(len(sel), width, kv_heads, d)` float32 of sequences `sel` at positions `[before - width, before)`,
        zeros at positions the row does not hold (below `held`: what it held for another sequence, or never wrote)."""
        slot, before = self.slot[sel], self.before[sel]
        position = before[:, None] - self.width + torch.arange(self.width)[None]  # (b, W)
        rows = self.rows[slot.clamp_min(0)[:, None], :, position % self.width]  # (b, W, kv, C)
        rows = rows.masked_fill((position < self.held[sel][:, None])[:, :, None, None], 0)  # a zero scale decodes to zeros
        k, v = unpack_rows(self.format, rows.transpose(1, 2))
        return self.codecs[0].decode(k).transpose(1, 2), self.codecs[1].decode(v).transpose(1, 2)

    def partial(self, query: torch.Tensor, sel: list[int], lo: torch.Tensor, hi: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
        """Partial `(m, l, o)` of `query (b, heads, r, d)` (every row of a sequence reading the same tokens) over
        positions `[lo, hi)` (`(b,)`, within `[held, before)`) of sequences `sel`'s rows, read where they lie by
        `kvpack::int8_paged_attention`. A store row is a block of `width` slots holding position p at `p % width`, so
        the range, shifted by a multiple of `width` to start in `[0, width)`, spans at most two blocks: the same row twice."""
        slot = self.slot[sel]
        lo, hi = lo.long(), torch.maximum(hi.long(), lo.long())
        base = lo.div(self.width, rounding_mode="floor") * self.width
        table = slot.clamp_min(0)[:, None].expand(-1, 2).contiguous()  # a sequence without a row has an empty range
        heads, kv = query.shape[1], self.rows.shape[1]
        m, denom, o = ops.run("int8_paged_attention", group_query(query.float(), kv), self.rows, table, lo - base, hi - base,
                              list(self.format.offsets), scale)
        return ungroup(m, heads), ungroup(denom, heads), ungroup(o, heads)


class WindowStore:
    """One layer's window rows: each running sequence's last `width` tokens as int8 pool rows (per-token symmetric
    int8 with an fp16 scale, `4 + 2d` bytes per (token, head)), `(rows, kv_heads, width, row_bytes)` uint8 (a pool
    whose blocks are the rows), position p of a sequence at `p % width` of its row. int8 because it reads as well as
    exact here: SmolLM2-135M's next-token agreement with a 32-token window was 88.5% in int8 against 88.4% exact
    (docs/guide/vllm-pool.md), at half of bf16's bytes."""

    def __init__(self, rows: int, width: int, kv_heads: int, head_dim: int):
        self.format = PoolFormat("int8", head_dim)
        self.codecs = self.format.codecs(kv_heads, 0)  # int8 holds no state: any layer's are the same
        self.rows = torch.empty(rows, kv_heads, width, self.format.row_bytes, dtype=torch.uint8).zero_()  # written: held now
        self.width = width

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    def read(self, plan: WindowPlan, before: torch.Tensor) -> WindowRead:
        """The step's window for `paged_attention(window=...)`, after the plan's copies. `before (b,)`: each sequence's
        first position of the step."""
        for src, dst in plan.copies:
            self.rows[dst] = self.rows[src]
        return WindowRead(self.rows, plan.slot, plan.held, before.long(), self.format, self.codecs)

    def write(self, plan: WindowPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep each sequence's last `width` tokens of this step's `key, value (tokens, kv_heads, d)` in its row
        (`plan.writes`, worked out once per step for every layer), in one encode."""
        token, row, place = plan.writes
        if token.numel():
            self.rows[row, :, place] = encode_rows(self.format, self.codecs, key[token], value[token])
