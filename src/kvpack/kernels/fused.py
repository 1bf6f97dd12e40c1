"""Decode attention over a kvpack layer in a few kernel calls: one online-softmax partial per part.

A decode step's query attends to the sinks, each segment's block run and the window. Each part
becomes one partial `(m, l, o)` from one fused kernel that reads the part in its stored form (fp16
rows, int8 codes, TurboQuant codes: see `Codec.kernel_kind`); parts whose codecs have no fused
form fall back to their codecs' `scores` / `weighted_sum`. The partials merge exactly by
log-sum-exp, as split-K flash decoding merges its splits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..primitives.validation import DEBUG
from . import cpu_lut, ops

# The cache's own calls skip the launchers' Python checks (its codecs built the tensors); KVPACK_DEBUG=1 restores them.
VALIDATE = DEBUG

Partial = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # m, l (b, kv, rows, 1); o (b, kv, rows, d_v)


def exact_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Partial | None:
    """Uncompressed rows (sinks, window) `(b, kv, t, d)` in fp16 or fp32; None for other dtypes."""
    if k.dtype not in (torch.float16, torch.float32):
        return None
    return cpu_lut.dense_attention(q, k, None, v, None, scale, validate=VALIDATE)


def segment_partial(q: torch.Tensor, seg, scale: float, first_position=None, skip: torch.Tensor | None = None) -> Partial | None:
    """One segment's partial from its fused kernel, or None when its codec pair has none.

    `first_position()` gives the RoPE position `(b,)` of the segment's first token, for codecs that
    store keys without RoPE (called only for them). `skip (S,)` int64: ascending offsets of tokens to
    leave out (the segment's anchors, held exact in another part), or None."""
    kc, vc = seg.key_codec, seg.value_codec
    kind = (kc.kernel_kind, vc.kernel_kind)
    if kind == ("heads", "heads"):
        return head_groups_partial(q, seg, lambda qg, group: segment_partial(qg, group, scale, first_position, skip))
    if not _fp16_meta(seg):
        return None
    if kind == ("tq", "tq"):
        keys, values = seg.keys, seg.values
        turning = None
        if getattr(kc, "rope_mean", None) is not None:  # keys centered on a turning mean: the kernel adds its per-token term
            if first_position is None:
                return None
            turning = kc.kernel_turning(q, first_position)
        q_rot, offset = kc.kernel_query(q)
        m, denom, o = cpu_lut.tq_attention(
            q_rot, offset, keys.codes, keys.norm, kc.kernel_table(q.device), kc.mse_bits,
            values.codes, values.norm, vc.kernel_table(q.device), vc.mse_bits, scale, validate=VALIDATE, skip=skip, turning=turning,
        )
        return m, denom, vc.kernel_output(o, denom)
    if kind == ("pca", "vq") and first_position is not None:
        m, denom, o = cpu_lut.pca_vq_attention(
            q, first_position(), kc.kernel_state(), seg.keys.codes, vc.kernel_state(), seg.values.indices, seg.values.norm, scale,
            validate=VALIDATE, skip=skip,
        )
        return m, denom, vc.kernel_output(o)
    if kind == ("int8", "int8"):
        keys, values = seg.keys, seg.values
        return cpu_lut.dense_attention(q, keys.codes, keys.scale, values.codes, values.scale, scale, validate=VALIDATE, skip=skip)
    return None


def _fp16_meta(seg) -> bool:
    """Whether a segment's per-token norms and scales are float16, the form the kernels read. A block whose norms passed
    fp16's range keeps float32 ones (`codecs.base.storable`); its segment then runs its codecs' torch paths."""
    return all(getattr(p, name, None) is None or getattr(p, name).dtype == torch.float16
               for p in (seg.keys, seg.values) for name in ("norm", "scale"))


class _GroupSegment(NamedTuple):
    """One head group of a segment whose codecs split the kv heads (`HeadsCodec`): what the partials read."""

    key_codec: Any
    value_codec: Any
    keys: Any
    values: Any


def head_groups_partial(q: torch.Tensor, seg, each: Callable[[torch.Tensor, _GroupSegment], Partial | None]) -> Partial | None:
    """A segment whose K and V codecs split the kv heads into the same groups: `each(q_group, group_segment)` per group on
    its kv heads' query rows `(b, group heads, rows, d)`, scattered back to `(b, kv, rows, ·)`. Heads attend independently,
    so the groups' partials are the segment's exactly. None when the partitions differ or a group has no partial."""
    kc, vc = seg.key_codec, seg.value_codec
    if kc.partition != vc.partition:
        return None
    out: list[torch.Tensor] = []
    for g, (ks, vs, kp, vp) in enumerate(zip(kc.inner, vc.inner, kc.split(seg.keys), vc.split(seg.values), strict=True)):
        idx = kc.heads_of(g, q.device)
        part = each(q.index_select(1, idx), _GroupSegment(ks, vs, kp, vp))
        if part is None:
            return None
        out = out or [t.new_empty(t.shape[0], q.shape[1], *t.shape[2:]) for t in part]
        for full, t in zip(out, part, strict=True):
            full.index_copy_(1, idx, t)
    return out[0], out[1], out[2]


def merge(parts: list[Partial]) -> torch.Tensor:
    """Normalized attention output `(b, kv, rows, d_v)` from the parts' partials (one C++ call)."""
    return cpu_lut.merge_partials([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])


# -- any device: the `kvpack::` custom ops (Triton on CUDA, C++ or torch on CPU; see kernels/ops.py) --------
def ops_exact_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Partial:
    """Sinks or window `(b, kv, t, d)` in any float dtype: at most 127 + sinks tokens, so plain torch."""
    return cpu_lut.partial_reference((q @ k.float().mT) * scale, v.float())


_PCA_TENSORS = ("bitpos", "bits", "qmax", "basis_t", "mean", "inv_freq")  # `PCAKeyCodec.kernel_state()` tensors the op takes


def ops_segment_partial(q: torch.Tensor, seg, scale: float, first_position=None) -> Partial | None:
    """One segment's partial through the custom ops, on the query's device; None without an op for its codecs.

    `first_position()`: as in `segment_partial`."""
    kc, vc = seg.key_codec, seg.value_codec
    kind = (kc.kernel_kind, vc.kernel_kind)
    if kind == ("heads", "heads"):
        return head_groups_partial(q, seg, lambda qg, group: ops_segment_partial(qg, group, scale, first_position))
    if not _fp16_meta(seg):
        return None
    keys, values = seg.keys, seg.values
    if kind == ("tq", "tq"):
        turning = ()
        if getattr(kc, "rope_mean", None) is not None:  # keys centered on a turning mean: the op's kernel adds their term
            if first_position is None:
                return None
            turning = kc.ops_turning(q, first_position) or ()
        q_rot, offset = kc.kernel_query(q)
        cent_k, cent_v = kc.kernel_table(q.device), vc.kernel_table(q.device)
        m, denom, o = ops.tq_attention(q_rot, keys.codes, keys.norm, cent_k, kc.mse_bits, values.codes, values.norm, cent_v,
                                       vc.mse_bits, q.shape[-1], scale, offset, None, 0.0, *turning)
        return m, denom, vc.kernel_output(o, denom)
    if kind == ("pca", "vq") and first_position is not None:
        ks, vs = kc.kernel_state(), vc.kernel_state()
        if not ks["basis_t"].numel():  # dropped by the CPU kernel's integer rebuild (cpu_lut.pca_vq_attention): derive it again
            ks["basis_t"] = kc.kernel_basis_t()
        key_state = [kc._on(f"kernel_{name}", ks[name], q.device) for name in _PCA_TENSORS]
        books = vc._on("kernel_books", vs["books"], q.device).float()  # the ops' contract: float32 codebooks
        m, denom, o = ops.pca_vq_attention(q, first_position().to(q.device), *key_state, float(ks["rope_scale"]), keys.codes, books,
                                           vs["bits"], values.indices, values.norm, scale)
        return m, denom, vc.kernel_output(o)
    if kind == ("int8", "int8"):
        return ops.int8_attention(q, keys.codes, keys.scale, values.codes, values.scale, scale)
    if kind == ("kivi", "kivi") and kc.config.axis == "channel" and vc.config.axis == "token":
        return ops.kivi_attention(q, keys.codes, keys.scale, keys.zero, kc.config.bits, kc.group, values.codes, values.scale, values.zero,
                                  vc.config.bits, vc.group, scale)
    return None


def merge_torch(parts: list[Partial]) -> torch.Tensor:
    """`merge` in torch ops, for any device."""
    ms = torch.cat([p[0] for p in parts], dim=-1)  # (b, kv, rows, parts)
    w = torch.exp(ms - ms.amax(-1, keepdim=True))
    total = (w * torch.cat([p[1] for p in parts], dim=-1)).sum(-1, keepdim=True)
    out = (torch.stack([p[2] for p in parts], dim=-1) @ w.unsqueeze(-1)).squeeze(-1)
    return out / total.clamp_min(1e-30)
