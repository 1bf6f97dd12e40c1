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
    """q `(b, kv, rows, d)` grouped; the codecs' `kernel_query` / `kernel_output` map it onto the codes and the sum back
    (the identity for plain rows, the rotation and its inverse for rotated ones)."""
    keys, values = seg.keys, seg.values
    q_codes, _ = seg.key_codec.kernel_query(q)
    m, denom, o = ops.run("int8_attention", q_codes, keys.codes, keys.scale, values.codes, values.scale, req.scale, None, 0.0, req.skip)
    return m, denom, seg.value_codec.kernel_output(o, denom)


INT8 = register(Kernel(("int8", "int8"), int8_partial, op="int8_attention"))
ROTATED_INT8 = register(Kernel(("int8_rotated", "int8_rotated"), int8_partial, op="int8_attention"))
