"""Per-token int4 segments: the `kvpack::int4_attention` op and its kernel-table entry.

Layout (`codecs/int4.py`): codes `(b, kv, t, d/2)` uint8, channel 2j in the low nibble of byte j, channel 2j + 1 in
the high one; scale, zero `(b, kv, t, 1)` float16; x = code · scale + zero. The C++ kernel (cpp/int4.cpp) decodes
four token rows at a time into L1 inside the shared online-softmax loop; `int4_attention_reference` is the
contract it is held to. There is no Triton kernel: on CUDA the reference serves.
"""

from __future__ import annotations

import torch

from ..primitives.packing import unpack_bits
from . import cpu_lut, ops, reference
from .table import Kernel, Partial, Request, register


def check_int4_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bias, softcap) -> None:
    b, h, _, d = reference.check_query("q", q)
    if d % 2:
        raise ValueError(f"int4 packs two channels per byte: head_dim must be even, got {d}")
    dev = q.device
    reference.expect("k_codes", k_codes, (torch.uint8,), (b, h, None, d // 2), dev)
    t = k_codes.shape[2]
    reference.expect("v_codes", v_codes, (torch.uint8,), (b, h, t, None), dev)
    for name, x in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        reference.expect(name, x, (torch.float16,), (b, h, t, 1), dev)
    reference.check_mask(q, t, None, bias, softcap)


def int4_attention_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    skip: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention over per-token int4 K/V (layout above): q (B, H, R, d) float, d even; values of
    dv = 2 · v_codes.shape[-1] channels. bias, softcap, skip and the result as in `reference.py`'s module docstring."""
    check_int4_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bias, softcap)
    bias = reference.skip_bias(bias, skip, k_codes.shape[2], q.device)
    b, h, r, d = q.shape
    dv = 2 * v_codes.shape[-1]
    qc = q.to(compute_dtype)

    def rows(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, n: int, t0: int, t1: int) -> torch.Tensor:
        x = unpack_bits(codes[:, :, t0:t1], 4, n).to(compute_dtype)  # (B, H, C, n)
        return x * s[:, :, t0:t1].to(compute_dtype) + z[:, :, t0:t1].to(compute_dtype)

    def scores(t0: int, t1: int) -> torch.Tensor:
        return qc @ rows(k_codes, k_scale, k_zero, d, t0, t1).mT

    def values(t0: int, t1: int) -> torch.Tensor:
        return rows(v_codes, v_scale, v_zero, dv, t0, t1)

    return reference.online_softmax((b, h, r), dv, k_codes.shape[2], reference.TOKEN_CHUNK, scores, values, scale, bias, softcap,
                                    compute_dtype, q.device)


def _int4_cpu(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, bias=None, softcap=0.0, skip=None):
    """The C++ kernel behind the op's arguments: no mask or softcap, float32 queries, rows contiguous along tokens
    (views of a capacity buffer narrowed along tokens pass); other calls take the reference."""
    if bias is not None or softcap or q.dtype != torch.float32 or k_codes.shape[2] == 0:
        return int4_attention_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, bias, softcap, skip)
    if ops.VALIDATE:
        check_int4_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bias, softcap)
    none = torch.empty(0, dtype=torch.long)
    return tuple(cpu_lut.extension().int4_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, float(scale),
                                                    none if skip is None else skip))


int4_attention = ops.define(
    "int4_attention",
    "(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor v_codes, Tensor v_scale, Tensor v_zero, float scale, "
    "Tensor? bias=None, float softcap=0., Tensor? skip=None) -> (Tensor, Tensor, Tensor)",
    int4_attention_reference,
    lambda q, k_codes, k_scale, k_zero, v_codes, *args: ops.partial_fake(q, 2 * v_codes.shape[-1]),
    cpu=_int4_cpu,
)


def int4_partial(q: torch.Tensor, seg, req: Request) -> Partial:
    keys, values = seg.keys, seg.values
    return ops.run("int4_attention", q, keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero, req.scale, None, 0.0, req.skip)


INT4 = register(Kernel(("int4", "int4"), int4_partial, op="int4_attention", devices=("cpu",), head_dims="even"))
