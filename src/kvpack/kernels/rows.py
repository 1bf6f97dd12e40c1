"""Segments stored with one codec per batch row (`RowsCodec`): each row through its inner codecs' entry.

Batch rows attend independently, so the rows' partials, stacked along the batch, are the segment's exactly. A family
whose entry has a `rows` form (TurboQuant: the rows' centering, scales and turning means stacked, one op call for the
batch) serves every row at once; any other runs once per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import table
from .table import Kernel, Partial, Request, SegmentData, register


def _row_position(first_position: Callable[[], torch.Tensor] | None, i: int) -> Callable[[], torch.Tensor] | None:
    """Row `i`'s `(1,)` first position, read from the segment's `(b,)` only if the row's kernel asks for it."""
    if first_position is None:
        return None
    return lambda: first_position()[i : i + 1]


def _row(packed, i: int):
    """Row `i` of a packed block as a batch of one (views)."""
    return packed.map_tensors(lambda t: t[i : i + 1])


def rows_partial(q: torch.Tensor, seg, req: Request) -> Partial | None:
    """Each row's partial on its query rows `(1, kv, rows, d)`, concatenated to `(b, kv, rows, ·)`; None when the key and
    value codecs hold different row counts or a row's codecs have no entry."""
    kc, vc = seg.key_codec, seg.value_codec
    if kc.rows != vc.rows or kc.rows != q.shape[0]:
        return None
    inner = table.lookup(kc.inner[0], vc.inner[0])
    if inner is not None and inner.rows is not None:  # the family reads every row's state in one call
        return inner.rows(q, seg, req)
    parts = []
    for i, (ks, vs) in enumerate(zip(kc.inner, vc.inner, strict=True)):
        part = table.segment_partial(q[i : i + 1], SegmentData(ks, vs, _row(seg.keys, i), _row(seg.values, i)), req.scale,
                                     _row_position(req.first_position, i), req.skip)
        if part is None:
            return None
        parts.append(part)
    m, denom, o = (torch.cat(ts, dim=0) for ts in zip(*parts, strict=True))  # (b, kv, rows, ·) each
    return m, denom, o


ROWS = register(Kernel(("rows", "rows"), rows_partial, devices=("cpu", "cuda"), positions=True, head_dims="its rows' entries'"))
