"""Segments whose K and V codecs split the kv heads into groups (`HeadsCodec`): each group through its own entry.

Heads attend independently, so the groups' partials, scattered back to their kv heads, are the segment's exactly.
"""

from __future__ import annotations

import torch

from . import table
from .table import Kernel, Partial, Request, SegmentData, register


def heads_partial(q: torch.Tensor, seg, req: Request) -> Partial | None:
    """Each group's partial on its kv heads' query rows `(b, group heads, rows, d)`, scattered back to `(b, kv, rows, ·)`.
    None when the K and V partitions differ or a group has no entry."""
    kc, vc = seg.key_codec, seg.value_codec
    if kc.partition != vc.partition:
        return None
    out: list[torch.Tensor] = []
    for g, (ks, vs, kp, vp) in enumerate(zip(kc.inner, vc.inner, kc.split(seg.keys), vc.split(seg.values), strict=True)):
        idx = kc.heads_of(g, q.device)
        part = table.segment_partial(q.index_select(1, idx), SegmentData(ks, vs, kp, vp), req.scale, req.first_position, req.skip)
        if part is None:
            return None
        out = out or [t.new_empty(t.shape[0], q.shape[1], *t.shape[2:]) for t in part]
        for full, t in zip(out, part, strict=True):
            full.index_copy_(1, idx, t)
    return out[0], out[1], out[2]


HEADS = register(Kernel(("heads", "heads"), heads_partial, devices=("cpu", "cuda"), positions=True, head_dims="its groups' entries'"))
