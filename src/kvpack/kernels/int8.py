"""Per-token int8 segments (codes with an fp16 scale, K and V): the `kvpack::int8_attention` table entry.

The codes are read as stored (cpp/dense.cpp widens one token row at a time in L1; `triton_attention.py`).
"""

from __future__ import annotations

import torch

from . import ops
from .table import Kernel, Partial, Request, register


def int8_partial(q: torch.Tensor, seg, req: Request) -> Partial:
    keys, values = seg.keys, seg.values
    return ops.run("int8_attention", q, keys.codes, keys.scale, values.codes, values.scale, req.scale, None, 0.0, req.skip)


INT8 = register(Kernel(("int8", "int8"), int8_partial, op="int8_attention"))
