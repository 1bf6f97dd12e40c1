"""Per-token int8 after a seeded randomized Hadamard rotation: the `int8` codec's bytes, outlier channels spread.

A per-token absmax scale is set by a token's largest entry; where one channel is many times the others (Gemma-3's
keys on its single 256-wide kv head), every other channel of that token is left a few of int8's 255 levels. Rotating
each vector by H·diag(signs) (orthonormal, signs seeded per (layer, kv head)) spreads that channel over all of them
before the int8 step, as TurboQuant does before its scalar codes. Attention never rotates the codes back: scores are
`(R q) · (R k)` and the weighted sum `Σ p_t R v_t = R (Σ p_t v_t)`, so the query is rotated once, the int8 codes are
read as stored (the `int8` kernels), and the `(rows, head_dim)` result is rotated back once. Head dims that are not a
power of two rotate in power-of-two blocks (`primitives.rotation.hadamard_transform`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import int8 as _kernel  # noqa: F401  (registers the ("int8_rotated", "int8_rotated") entry `kernel_kind` names)
from ..primitives.rotation import derive_seed, hadamard_dense, random_signs
from ..primitives.validation import check_query
from .int8 import Int8Codec, Int8Packed


@dataclass(frozen=True)
class RotatedInt8Config:
    """seed: the rotation's signs (one draw per (layer, kv head))."""

    seed: int = 0

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")


class RotatedInt8Codec(Int8Codec):
    config_class = RotatedInt8Config
    name = "int8_rotated"

    kernel_kind = "int8_rotated"  # the int8 kernels on a rotated query, the result rotated back (kvpack.kernels.int8)

    def __init__(self, config: RotatedInt8Config, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        signs = [random_signs(head_dim, derive_seed(config.seed, layer_idx, h)) for h in range(kv_heads)]
        self.signs = torch.stack(signs).to(torch.int8)  # (kv_heads, head_dim)

    def _rotation(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 signs `(kv_heads, 1, head_dim)`, made once per device, and the Hadamard matrix every codec of this
        head dim shares (`hadamard_dense`, held outside the codec so its bytes count once): a decode step rotates a few
        query rows per layer, where each extra torch call costs more than the product."""
        cached = self.__dict__.get("_signs_on")
        if cached is None or cached[0] != device or cached[1] is not self.signs:
            cached = self._signs_on = (device, self.signs, self.signs.to(device=device, dtype=torch.float32)[:, None])
        return cached[2], hadamard_dense(self.head_dim, device, torch.float32)

    def _signs_for(self, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        signs, h = self._rotation(device)
        return (signs if heads == self.kv_heads else signs.repeat_interleave(heads // self.kv_heads, 0)), h

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """`(b, heads, n, d)` -> the same rotated by each head's kv head's H·diag(signs), float32 (heads: the kv heads,
        or query heads grouped over them)."""
        signs, h = self._signs_for(x.shape[1], x.device)
        return (x.float() * signs) @ h

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of `rotate`."""
        signs, h = self._signs_for(y.shape[1], y.device)
        return (y.float() @ h) * signs

    def kernel_query(self, q: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The query rotated as the keys were: `(R q) · (R k) = q · k`."""
        return self.rotate(q), None

    def kernel_output(self, o: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        """`Σ p_t R v_t` rotated back to `Σ p_t v_t`."""
        return self.unrotate(o)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Int8Packed:
        self._check(x)
        return super().encode(self.rotate(x), positions)

    def decode(self, packed: Int8Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.unrotate(super().decode(packed, positions))

    def scores(self, query: torch.Tensor, packed: Int8Packed, query_positions=None, key_positions=None) -> torch.Tensor:
        check_query(query, self.kv_heads, self.head_dim)  # before the rotation pairs query heads with kv heads
        return super().scores(self.rotate(query), packed, query_positions, key_positions)

    def weighted_sum(self, probs: torch.Tensor, packed: Int8Packed) -> torch.Tensor:
        return self.unrotate(super().weighted_sum(probs, packed))
