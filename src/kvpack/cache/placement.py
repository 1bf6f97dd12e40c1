"""Where a layer's tokens live: the one object `KVPackLayer` consults for every block.

The layer stores (sinks, segments of codes, the exact window) and speaks transformers' cache API; a placement decides:

- `route`: which segment kind each run of the tokens leaving the window joins ("stream", an older "tier<N>", ...);
- `keep_exact`: which of those tokens also stay exact beside their codes (anchors);
- `stored`: what follows from a run just encoded (a tier measures its codecs' error there);
- `after_flush`: what moves once a forward is stored (blocks aging into an older tier, the byte budget's demotions and
  evictions).

A placement is a sequence of policies (`PlacementPolicy`), each deciding what it knows about and passing on the rest:
the first policy with an answer routes a run and chooses the exact tokens; every policy acts after a flush, in order.
Policies hold no per-layer state (what they remember lives on the layer: `anchor_credit`, `evicted`, the budget's
share), so one placement serves every layer and a rolled-back forward leaves nothing behind in it.

The policies are registered by name in `kvpack.cache.policies` (one entry each), which builds a method's placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layer import KVPackLayer

Route = list[tuple[str, int]]  # (segment kind, tokens) runs, oldest first, covering the tokens routed


class PlacementPolicy:
    """One placement rule. Every hook's default has no opinion, so a policy overrides only what it decides."""

    def route(self, layer: KVPackLayer, kind: str, start: int, n: int) -> Route | None:
        """Where tokens [start, start + n), leaving the window for segment kind `kind` ("prefill" for the prompt's
        middle with a prompt codec, else "stream"), are stored: runs covering all n tokens, or None for no opinion."""
        return None

    def keep_exact(self, layer: KVPackLayer, start: int, n: int, first: bool) -> torch.Tensor | None:
        """Indices `(h,)` int64, ascending, into tokens [start, start + n) about to be compressed that stay exact beside
        their codes; None for none. `first`: this is the prompt's flush."""
        return None

    def stored(self, layer: KVPackLayer, kind: str, k: torch.Tensor, v: torch.Tensor, start: int, fresh: bool) -> None:
        """Called by `layer.store` after it encoded tokens [start, start + n) into segment kind `kind`, with their
        originals `k`, `v` `(b, kv, n, d)`; `fresh`: `kind`'s codecs were built (and fitted) for this run."""
        return None

    def after_flush(self, layer: KVPackLayer, flushed: bool) -> None:
        """Called after every forward's flush; `flushed`: tokens left the window in this one."""
        return None


@dataclass(frozen=True)
class Placement(PlacementPolicy):
    """Policies consulted in order: the first answer routes and chooses exact tokens; all act after a flush."""

    policies: Sequence[PlacementPolicy] = ()

    def __post_init__(self):
        bad = [p for p in self.policies if not isinstance(p, PlacementPolicy)]
        if bad:
            raise TypeError(f"a Placement takes PlacementPolicy objects, got {', '.join(type(p).__name__ for p in bad)}")
        object.__setattr__(self, "policies", tuple(self.policies))

    def route(self, layer: KVPackLayer, kind: str, start: int, n: int) -> Route:
        for policy in self.policies:
            runs = policy.route(layer, kind, start, n)
            if runs is not None:
                if sum(count for _, count in runs) != n or any(count < 0 for _, count in runs):
                    raise ValueError(f"{type(policy).__name__}.route must cover the {n} tokens routed exactly, got {runs}")
                return runs
        return [(kind, n)]

    def keep_exact(self, layer: KVPackLayer, start: int, n: int, first: bool) -> torch.Tensor | None:
        for policy in self.policies:
            chosen = policy.keep_exact(layer, start, n, first)
            if chosen is not None:
                return chosen
        return None

    def stored(self, layer: KVPackLayer, kind: str, k: torch.Tensor, v: torch.Tensor, start: int, fresh: bool) -> None:
        for policy in self.policies:
            policy.stored(layer, kind, k, v, start, fresh)

    def after_flush(self, layer: KVPackLayer, flushed: bool) -> None:
        for policy in self.policies:
            policy.after_flush(layer, flushed)
