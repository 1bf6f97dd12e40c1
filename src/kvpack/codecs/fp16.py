"""Uncompressed storage in a 16-bit float (or the input's own dtype): sinks, windows, baselines."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, Packed, chunked_scores, chunked_sum, group_query, storable, ungroup

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "native": None}


@dataclass(frozen=True)
class Fp16Config:
    """dtype: one of float16 | bfloat16 | float32 | native (keep the incoming dtype: lossless)."""

    dtype: str = "float16"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


@dataclass
class Fp16Packed(Packed):
    data: torch.Tensor  # (batch, kv_heads, tokens, head_dim) in the configured dtype (float16: float32 past its range)


class Fp16Codec(Codec):
    config_class = Fp16Config
    name = "fp16"

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Fp16Packed:
        self._check(x)
        dtype = DTYPES[self.config.dtype] or x.dtype
        # float16 storage of entries past its range keeps that block in float32 (`storable`) rather than inf.
        data = storable(x) if dtype == torch.float16 and x.dtype != torch.float16 else x.to(dtype)
        return Fp16Packed(x.shape[2], data.contiguous())

    def decode(self, packed: Fp16Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        return packed.data.float()

    def scores(self, query: torch.Tensor, packed: Fp16Packed, query_positions=None, key_positions=None) -> torch.Tensor:
        # fp32 math: half-precision matmuls are slow on CPU and lose accuracy in the sum
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)
        return ungroup(chunked_scores(lambda block, s, e: q @ block.data.float().mT, packed, q, self._width(q.shape[2])), query.shape[1])

    def weighted_sum(self, probs: torch.Tensor, packed: Fp16Packed) -> torch.Tensor:
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        return ungroup(chunked_sum(lambda pc, block: pc @ block.data.float(), p, packed, self._width(p.shape[2])), probs.shape[1])
