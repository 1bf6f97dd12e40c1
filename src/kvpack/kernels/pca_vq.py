"""Shard segments (PCA-coefficient keys stored without RoPE, VQ values): the `kvpack::pca_vq_attention` entry.

The kernel rebuilds keys tile by tile from their coefficients, re-applies RoPE from the segment's first position
and gathers value codewords in L1 (cpp/pca_vq.cpp, `triton_shard.py`); the output stays in VQ's rotated space
until `kernel_output`. On CPU the basis' integer form (VNNI) is derived once per fit (`cpu_lut.pca_integer_form`).
"""

from __future__ import annotations

import torch

from . import cpu_lut, ops
from .table import Kernel, Partial, Request, register

_KEY_TENSORS = ("bitpos", "bits", "qmax", "basis_t", "mean", "inv_freq")  # `PCAKeyCodec.kernel_state()` tensors the op takes


def pca_vq_partial(q: torch.Tensor, seg, req: Request) -> Partial | None:
    if req.first_position is None:
        return None
    kc, vc = seg.key_codec, seg.value_codec
    ks, vs = kc.kernel_state(), vc.kernel_state()
    if q.device.type == "cpu" and cpu_lut.available():
        cpu_lut.pca_integer_form(ks)  # derived once per fit; the float basis is then dropped from the state
    integer = ks.get("int8")  # the reference and Triton rebuild the float basis from it when it was dropped
    w8, col_scale, mean8 = (None,) * 3 if integer is None else (kc._on(f"kernel_{n}", integer[n], q.device) for n in ("w8", "col_scale", "mean8"))
    key_state = [kc._on(f"kernel_{name}", ks[name], q.device) for name in _KEY_TENSORS]
    books = vc._on("kernel_books", vs["books"], q.device)
    m, denom, o = ops.run("pca_vq_attention", q, req.first_position().to(q.device), *key_state, float(ks["rope_scale"]), seg.keys.codes, books,
                                       vs["bits"], seg.values.indices, seg.values.norm, req.scale, None, 0.0, w8, col_scale, mean8,
                                       req.skip)
    return m, denom, vc.kernel_output(o)


PCA_VQ = register(Kernel(("pca", "vq"), pca_vq_partial, op="pca_vq_attention", positions=True,
                         head_dims="even (rotate-half RoPE); VQ groups dividing the head"))
