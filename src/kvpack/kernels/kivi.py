"""KIVI segments (keys quantized per channel, values per token): the `kvpack::kivi_attention` table entry.

Triton on CUDA; on CPU the op's torch reference (no C++ kernel: KIVI is a baseline, not a default).
"""

from __future__ import annotations

import torch

from . import ops
from .table import Kernel, Partial, Request, register


def kivi_partial(q: torch.Tensor, seg, req: Request) -> Partial | None:
    kc, vc = seg.key_codec, seg.value_codec
    if kc.config.axis != "channel" or vc.config.axis != "token":  # the op reads KIVI's own layout only
        return None
    keys, values = seg.keys, seg.values
    return ops.run("kivi_attention", q, keys.codes, keys.scale, keys.zero, kc.config.bits, kc.group, values.codes, values.scale, values.zero,
                              vc.config.bits, vc.group, req.scale, None, 0.0, req.skip)


KIVI = register(Kernel(("kivi", "kivi"), kivi_partial, op="kivi_attention", devices=("cuda",),
                       head_dims="groups that tile the head"))
