"""What a codec that stores keys with RoPE undone needs (Shard's PCA keys, KVQuant keys): the layer's
rotary parameters and the cos/sin of token positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..primitives.rope import rope_cos_sin


@dataclass(frozen=True)
class Rope:
    """The model's rotary parameters: borrowed, not codec state (kept out of `state_nbytes`)."""

    inv_freq: torch.Tensor
    scaling: float


class UnRopedKeys:
    """Mixin (placed before `Codec`): `set_rope` and cos/sin lookup for codecs with `uses_positions`."""

    uses_positions = True
    head_dim: int

    def _init_rope(self) -> None:
        self.rope = Rope(torch.zeros(self.head_dim // 2), 1.0)
        self.rope_set = False

    def set_rope(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        if inv_freq.shape != (self.head_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({self.head_dim // 2},), got {tuple(inv_freq.shape)}")
        self.rope = Rope(inv_freq.detach().float().cpu(), float(attention_scaling))
        self.rope_set = True

    def _cos_sin(self, positions: torch.Tensor | None, batch: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `(batch, tokens, head_dim)` of `positions (batch, tokens)`; position 0 when RoPE was never set."""
        if positions is None:
            if self.rope_set:
                raise ValueError("this codec undoes RoPE: pass positions (batch, tokens) to encode/decode/scores")
            positions = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        if positions.shape != (batch, tokens):
            raise ValueError(f"positions must have shape ({batch}, {tokens}), got {tuple(positions.shape)}")
        return rope_cos_sin(positions, self._on("inv_freq", self.rope.inv_freq, device), self.rope.scaling)
