"""Per-token int4: 4-bit asymmetric codes with an fp16 scale and zero per (token, head), two codes per byte.

The plain baseline of 4-bit KV quantization (as in KIVI's value path, arXiv:2402.02750, but with one group per
token's whole head): each token's head vector is rounded to 16 evenly spaced levels between its min and max, so
its error is at most half a step, (max - min) / 30. 4.5 bits per value with d = 64 (codes plus 32 bits of scale
and zero per token), 3.6x fewer bytes than fp16. Attention reads the codes as stored through the
`kvpack::int4_attention` kernel (`kernels/int4.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import int4 as _kernel  # noqa: F401  (registers the ("int4", "int4") entry `kernel_kind` names)
from ..primitives.affine import quantize_affine
from ..primitives.packing import pack_bits, unpack_bits
from .base import FP16_MAX, Codec, Packed

BITS = 4


@dataclass(frozen=True)
class Int4Config:
    """No options: per-token asymmetric int4 over each head's channels, scale = (max - min) / 15 and zero = min in fp16."""


@dataclass
class Int4Packed(Packed):
    codes: torch.Tensor  # (batch, kv_heads, tokens, head_dim / 2) uint8: channel 2j in the low nibble of byte j
    scale: torch.Tensor  # (batch, kv_heads, tokens, 1) float16
    zero: torch.Tensor  # (batch, kv_heads, tokens, 1) float16: x = code * scale + zero


class Int4Codec(Codec):
    config_class = Int4Config
    name = "int4"

    kernel_kind = "int4"  # the kernel table's ("int4", "int4") entry reads codes, scales and zeros as stored

    @classmethod
    def max_entry(cls, config: Int4Config, head_dim: int) -> float:
        # Scale (max - min) / 15 and zero (min) are float16: entries within float16's range keep both finite.
        return FP16_MAX

    def __init__(self, config: Int4Config, head_dim: int, kv_heads: int, layer_idx: int = 0):
        if head_dim % 2:
            raise ValueError(f"int4 packs two channels per byte: head_dim must be even, got {head_dim}")
        super().__init__(config, head_dim, kv_heads, layer_idx)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Int4Packed:
        self._check(x)
        q = quantize_affine(x, BITS, self.head_dim)  # codes computed against the fp16 scale and zero a decode reads
        return Int4Packed(x.shape[2], pack_bits(q.codes, BITS), q.scale, q.zero)

    def decode(self, packed: Int4Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        return unpack_bits(packed.codes, BITS, self.head_dim).float() * packed.scale.float() + packed.zero.float()
