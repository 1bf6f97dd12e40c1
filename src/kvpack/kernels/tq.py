"""TurboQuant segments (MSE codes, scalar or trellis, K and V): the `kvpack::tq_attention` table entry.

The query is rotated once into the key codec's space (`kernel_query`), the op reads both sides' codes through
their lookup tables (cpp/tq.cpp, `triton_attention.py`), and the rotated-space output is mapped back to the
values' space once (`kernel_output`). Keys centered on a turning mean (`+ropemean`) add their per-token term in
the kernel, from the segment's first RoPE position.
"""

from __future__ import annotations

import torch

from . import ops
from .table import Kernel, Partial, Request, register


def tq_partial(q: torch.Tensor, seg, req: Request) -> Partial | None:
    kc, vc = seg.key_codec, seg.value_codec
    keys, values = seg.keys, seg.values
    turning = ()
    if getattr(kc, "rope_mean", None) is not None:  # keys centered on a turning mean: the kernel adds their term
        if req.first_position is None:
            return None
        turning = kc.ops_turning(q, req.first_position) or ()
    q_rot, offset = kc.kernel_query(q)
    turn = turning or (None,) * 5
    m, denom, o = ops.run("tq_attention", q_rot, keys.codes, keys.norm, kc.kernel_table(q.device), kc.mse_bits, values.codes, values.norm,
                                   vc.kernel_table(q.device), vc.mse_bits, q.shape[-1], req.scale, offset, None, 0.0, *turn, req.skip)
    return m, denom, vc.kernel_output(o, denom)


def tq_rows_partial(q: torch.Tensor, seg, req: Request) -> Partial | None:
    """`tq_partial` for a batch whose rows hold their own codecs (`seg.key_codec.inner`, one per row): the rows' query and
    output maps and turning means stacked along the batch (`TurboQuantCodec.rows_*`), one op call for every row."""
    ks, vs = seg.key_codec.inner, seg.value_codec.inner
    first, vfirst = ks[0], vs[0]
    turning = ()
    if any(getattr(c, "rope_mean", None) is not None for c in ks):
        if req.first_position is None:
            return None
        turning = first.rows_ops_turning(ks, q, req.first_position) or ()
    q_rot, offset = first.rows_kernel_query(ks, q)
    turn = turning or (None,) * 5
    keys, values = seg.keys, seg.values
    m, denom, o = ops.run("tq_attention", q_rot, keys.codes, keys.norm, first.kernel_table(q.device), first.mse_bits, values.codes, values.norm,
                          vfirst.kernel_table(q.device), vfirst.mse_bits, q.shape[-1], req.scale, offset, None, 0.0, *turn, req.skip)
    return m, denom, vfirst.rows_kernel_output(vs, o, denom)


TQ = register(Kernel(("tq", "tq"), tq_partial, op="tq_attention", positions=True,
                     head_dims="any in C++ (values of the keys' head dim); Triton: any", rows=tq_rows_partial))
