"""Older tiers by age: compressed blocks move from the stream segment into a method's older tiers as they age.

`MethodConfig.tiers` lists the tiers, youngest first, each a codec pair and an age boundary (`Tier.after`, in tokens
behind the newest). Tokens already past a boundary when they leave the window (a long prompt) go straight to that
tier; later, whole blocks that age past it move there at each flush, decoded from the younger tier and re-encoded
(the extra error is measured in tests and the tiers guide). The boundaries are read from the layer's method on every
call, so `kvpack.cache.adaptive` can move them on a live cache.
"""

from __future__ import annotations

import math

from .placement import PlacementPolicy, Route


def tier_count(layer, level: int, start: int, n: int) -> int:
    """How many of tokens [start, start + n) lie past tier `level`'s age boundary, in whole blocks."""
    tier = layer.method.tiers[level - 1]
    kc, vc = layer.codec(f"tier{level}", "key"), layer.codec(f"tier{level}", "value")
    step = math.lcm(layer.method.block_size, kc.token_multiple, vc.token_multiple)
    older = min(layer.length - tier.after - start, n)
    return max(older, 0) // step * step


def demote(layer) -> None:
    """Move blocks that aged past a tier's boundary from the next younger tier's segment into that tier.

    Whole blocks move; the younger run drops its front (a shorter copy), nothing else is copied.
    """
    for level in range(1, len(layer.method.tiers) + 1):
        younger = "stream" if level == 1 else f"tier{level - 1}"
        src = next((seg for seg in layer.segments if seg.kind == younger), None)
        if src is None:
            continue
        m = min(tier_count(layer, level, src.start, src.length), src.length // src.token_multiple * src.token_multiple)
        if not m:
            continue
        k, v = layer.decode_front(src, m)
        layer.replace_front(src, m)
        layer.store(f"tier{level}", k, v, src.start)


class AgeTiers(PlacementPolicy):
    """Route tokens past a tier's boundary straight into it (no double encode); demote aged blocks after each flush."""

    def route(self, layer, kind: str, start: int, n: int) -> Route | None:
        if kind == "prefill" or not layer.method.tiers:  # a prompt codec (Shard) holds the whole prompt middle
            return None
        runs, done = [], 0
        for level in range(len(layer.method.tiers), 0, -1):  # oldest tier first: the oldest tokens lead
            m = tier_count(layer, level, start + done, n - done)
            if m:
                runs.append((f"tier{level}", m))
                done += m
        return [*runs, (kind, n - done)]

    def after_flush(self, layer, flushed: bool) -> None:
        if flushed and layer.method.tiers:
            demote(layer)
