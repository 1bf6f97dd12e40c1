"""Per-token symmetric int8 with an fp16 scale: near-lossless streaming at 2x fewer bytes than fp16.

Scores and weighted sums factor the per-token scale out of the matmul, so the int8 codes are
multiplied directly and never rescaled into a float copy of K or V; on CPU they run in
`kvpack.kernels` (codes widened one token row at a time, in registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import int8 as _kernel  # noqa: F401  (registers the ("int8", "int8") entry `kernel_kind` names)
from .base import Codec, Packed, chunked_scores, chunked_sum, group_query, storable, ungroup


@dataclass(frozen=True)
class Int8Config:
    """No options: symmetric per-token int8, scale = absmax / 127 in fp16."""


@dataclass
class Int8Packed(Packed):
    codes: torch.Tensor  # (batch, kv_heads, tokens, head_dim) int8
    scale: torch.Tensor  # (batch, kv_heads, tokens, 1) float16 (float32 past its range: entries beyond 8.3e6)


class Int8Codec(Codec):
    config_class = Int8Config
    name = "int8"

    kernel_kind = "int8"  # fused kernels read codes and scales directly (kvpack.kernels.int8)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Int8Packed:
        self._check(x)
        scale = storable((x.float().abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8))
        codes = (x.float() / scale.float()).round_().clamp_(-127, 127).to(torch.int8)
        return Int8Packed(x.shape[2], codes, scale)

    def decode(self, packed: Int8Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        return packed.codes.float() * packed.scale.float()

    # -- what the int8 kernels (kvpack.kernels.int8, the paged pool's) read: the same two maps as TurboQuant's ---------
    def kernel_query(self, q: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Grouped query `(b, kv, rows, d)` -> (the query the codes are scored against, no mean term): `q` itself."""
        return q, None

    def kernel_output(self, o: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        """The kernels' weighted sum of the codes `(b, kv, rows, d)` -> the weighted sum of the values: `o` itself."""
        return o

    def _use_kernels(self, packed: Int8Packed, rows: int) -> bool:
        """The CPU kernels for decode-sized row counts over float16 scales (a block past fp16's range keeps float32 ones)."""
        return rows <= kernels.MAX_KERNEL_ROWS and packed.codes.device.type == "cpu" and packed.scale.dtype == torch.float16 and kernels.available()

    def scores(self, query: torch.Tensor, packed: Int8Packed, query_positions=None, key_positions=None) -> torch.Tensor:
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)
        if self._use_kernels(packed, q.shape[2]):
            return ungroup(kernels.int8_scores(q, packed.codes, packed.scale), query.shape[1])

        def part(block: Int8Packed, start: int, stop: int) -> torch.Tensor:
            return (q @ block.codes.to(q.dtype).mT) * block.scale.float().mT  # (b, kv, rows, t)

        return ungroup(chunked_scores(part, packed, q, self._width(q.shape[2])), query.shape[1])

    def weighted_sum(self, probs: torch.Tensor, packed: Int8Packed) -> torch.Tensor:
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        if self._use_kernels(packed, p.shape[2]):
            return ungroup(kernels.int8_weighted_sum(p, packed.codes, packed.scale), probs.shape[1])

        def part(pc: torch.Tensor, block: Int8Packed) -> torch.Tensor:
            return (pc * block.scale.float().mT) @ block.codes.to(pc.dtype)  # (b, kv, rows, d)

        return ungroup(chunked_sum(part, p, packed, self._width(p.shape[2])), probs.shape[1])
