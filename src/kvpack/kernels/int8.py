"""Per-token int8 segments (codes with an fp16 scale, K and V): the `kvpack::int8_attention` table entries.

The codes are read as stored (cpp/dense.cpp widens one token row at a time in L1; `triton_attention.py`). Rotated int8
(`codecs.int8_rotated`) runs the same op on the query rotated as its keys were, and rotates the partial's weighted sum
back with the values' rotation: the softmax's max and sum do not change under an orthonormal rotation.
"""

from __future__ import annotations

import torch

from . import ops
from .table import Kernel, Partial, Request, register


def int8_partial(q: torch.Tensor, seg, req: Request) -> Partial:
    keys, values = seg.keys, seg.values
    return ops.run("int8_attention", q, keys.codes, keys.scale, values.codes, values.scale, req.scale, None, 0.0, req.skip)


INT8 = register(Kernel(("int8", "int8"), int8_partial, op="int8_attention"))


def rotated_int8_partial(q: torch.Tensor, seg, req: Request) -> Partial:
    m, denom, o = int8_partial(seg.key_codec.rotate(q), seg, req)  # q (b, kv, rows, d): rotated per kv head
    return m, denom, seg.value_codec.unrotate(o)


ROTATED_INT8 = register(Kernel(("int8_rotated", "int8_rotated"), rotated_int8_partial, op="int8_attention"))
