"""Decode attention over a kvpack layer in a few kernel calls: one online-softmax partial per part.

A decode step's query attends to the sinks, each segment's block run and the window. Each part
becomes one partial `(m, l, o)` from one fused kernel that reads the part in its stored form (fp16
rows, int8 codes, TurboQuant codes: see `Codec.kernel_kind`); parts whose codecs have no fused
form fall back to their codecs' `scores` / `weighted_sum`. The partials merge exactly by
log-sum-exp, as split-K flash decoding merges its splits.
"""

from __future__ import annotations

import torch

from ..primitives.validation import DEBUG
from . import cpu_lut

# The cache's own calls skip the launchers' Python checks (its codecs built the tensors); KVPACK_DEBUG=1 restores them.
VALIDATE = DEBUG

Partial = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # m, l (b, kv, rows, 1); o (b, kv, rows, d_v)


def exact_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Partial | None:
    """Uncompressed rows (sinks, window) `(b, kv, t, d)` in fp16 or fp32; None for other dtypes."""
    if k.dtype not in (torch.float16, torch.float32):
        return None
    return cpu_lut.dense_attention(q, k, None, v, None, scale, validate=VALIDATE)


def segment_partial(q: torch.Tensor, seg, scale: float, first_position=None) -> Partial | None:
    """One segment's partial from its fused kernel, or None when its codec pair has none.

    `first_position()` gives the RoPE position `(b,)` of the segment's first token, for codecs that
    store keys without RoPE (called only for them)."""
    kc, vc = seg.key_codec, seg.value_codec
    kind = (kc.kernel_kind, vc.kernel_kind)
    if kind == ("tq", "tq"):
        keys, values = seg.keys, seg.values
        q_rot, offset = kc.kernel_query(q)
        m, denom, o = cpu_lut.tq_attention(
            q_rot, offset, keys.codes, keys.norm, kc.codebook.centroids, kc.mse_bits,
            values.codes, values.norm, vc.codebook.centroids, vc.mse_bits, scale, validate=VALIDATE,
        )
        return m, denom, vc.kernel_output(o, denom)
    if kind == ("pca", "vq") and first_position is not None:
        m, denom, o = cpu_lut.pca_vq_attention(
            q, first_position(), kc.kernel_state(), seg.keys.codes, vc.kernel_state(), seg.values.indices, seg.values.norm, scale, validate=VALIDATE
        )
        return m, denom, vc.kernel_output(o)
    if kind == ("int8", "int8"):
        keys, values = seg.keys, seg.values
        return cpu_lut.dense_attention(q, keys.codes, keys.scale, values.codes, values.scale, scale, validate=VALIDATE)
    return None


def merge(parts: list[Partial]) -> torch.Tensor:
    """Normalized attention output `(b, kv, rows, d_v)` from the parts' partials (one C++ call)."""
    return cpu_lut.merge_partials([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])

