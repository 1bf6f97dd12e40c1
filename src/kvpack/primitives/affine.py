"""Asymmetric (zero-point + scale) integer quantization in groups along one axis.

`axis=-1` with `group_size=32` gives per-token groups of 32 channels (KIVI values); `axis=-2`
gives per-channel groups of `group_size` tokens (KIVI keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AffineQuantized:
    """codes: uint8 with x's shape; scale, zero: float16 with the grouped axis reduced to groups."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def _grouped(x: torch.Tensor, group_size: int, axis: int) -> torch.Tensor:
    """Move `axis` last and split it into (groups, group_size)."""
    size = x.shape[axis]
    if group_size <= 0 or size % group_size:
        raise ValueError(f"group_size must divide the quantized axis ({size}), got {group_size}")
    moved = x.movedim(axis, -1)
    return moved.reshape(*moved.shape[:-1], size // group_size, group_size)


def quantize_affine(x: torch.Tensor, bits: int, group_size: int, axis: int = -1) -> AffineQuantized:
    """Round `x` to `2**bits` evenly spaced levels between each group's min and max."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    g = _grouped(x.float(), group_size, axis)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    # Store scale and zero in fp16 first, and quantize against the stored values, so decode
    # reproduces exactly what encode assumed.
    scale, lo = scale.half().float(), lo.half().float()
    codes = ((g - lo) / scale).round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)
    codes = codes.flatten(-2).movedim(-1, axis)
    return AffineQuantized(codes, scale.squeeze(-1).movedim(-1, axis).half(), lo.squeeze(-1).movedim(-1, axis).half())


def dequantize_affine(q: AffineQuantized, group_size: int, axis: int = -1) -> torch.Tensor:
    """float32 reconstruction `codes * scale + zero` with scale/zero broadcast over each group."""
    scale = q.scale.float().repeat_interleave(group_size, dim=axis)
    zero = q.zero.float().repeat_interleave(group_size, dim=axis)
    return q.codes.float() * scale + zero
