"""Older tiers by age: compressed blocks move from the stream segment into a method's older tiers as they age.

`MethodConfig.tiers` lists the tiers, youngest first, each a codec pair and an age boundary (`Tier.after`, in tokens
behind the newest). Tokens already past a boundary when they leave the window (a long prompt) go straight to that
tier; later, whole blocks that age past it move there at each flush, decoded from the younger tier and re-encoded
(the extra error is measured in tests and the tiers guide). The boundaries are read from the layer's method on every
call, so `kvpack.cache.adaptive` can move them on a live cache.

Codecs fitted on data (Shard's PCA keys and VQ values) fit on the first run a tier stores. `Tier.fit_tokens` makes a
fresh fit wait for that many tokens past the boundary (the tokens wait in the younger tier), and `Tier.refit` measures
every later run's error against the first run's after the fit: once the data has drifted from what the codecs were fitted on, their
generation ends (`KVPackLayer.retire_codecs`: they keep reading what they coded) and the next run fits new ones.
"""

from __future__ import annotations

import math

import torch

from .placement import PlacementPolicy, Route


def tier_count(layer, level: int, start: int, n: int) -> int:
    """How many of tokens [start, start + n) lie past tier `level`'s age boundary, in whole blocks; 0 while a fresh fit
    of the tier's codecs waits for `Tier.fit_tokens` of them."""
    tier = layer.method.tiers[level - 1]
    kc, vc = layer.codec(f"tier{level}", "key"), layer.codec(f"tier{level}", "value")
    fresh = tier.fit_tokens and layer.holds_nothing(kc)
    step = math.lcm(layer.method.block_size, kc.token_multiple, vc.token_multiple)
    older = max(min(layer.length - tier.after - start, n), 0) // step * step
    return 0 if fresh and older < tier.fit_tokens else older


def relative_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """`sum((approx - x)^2) / sum(x^2)` over every entry (0 for an all-zero `x`)."""
    x, approx = x.float(), approx.float()
    total = float(x.square().sum())
    return float((approx - x).square().sum()) / total if total > 0 else 0.0


def measure_tier(layer, kind: str, k: torch.Tensor, v: torch.Tensor, start: int, fresh: bool) -> tuple[float, float] | None:
    """After tokens [start, start + n) were stored by tier `kind` (originals `k`, `v` `(b, kv, n, d)`), measure their
    error; end the codecs' fit when it rose more than `Tier.refit` above the reference. Returns the run's (key, value)
    relative squared errors, None for a tier that never refits (nothing measured).

    The reference is the error of the first run after the fit, not of the run fitted on: codecs fitted on some tokens
    code those better than any others (on SmolLM2 the PCA keys' error is 20-50% higher on the very next block), which
    is not drift. The error is read back from what the segment holds (its codes decoded): the error attention sees."""
    tier = layer.method.tiers[int(kind[4:]) - 1]
    if not tier.refit:
        return None
    n = k.shape[2]
    seg = next(seg for seg in layer.segments if seg.kind == kind and seg.start <= start and start + n <= seg.start + seg.length)
    dk, dv = layer.decode_front(seg, n, start - seg.start)
    errors = (relative_error(k, dk), relative_error(v, dv))
    reference = layer.tier_fit.get(kind)
    if fresh:
        layer.tier_fit = {name: e for name, e in layer.tier_fit.items() if name != kind}
    elif reference is None:  # the first run coded after the fit (or after a reload of a file that kept no reference)
        layer.tier_fit = {**layer.tier_fit, kind: errors}
    elif any(e > r * (1 + tier.refit) for e, r in zip(errors, reference, strict=True)):
        layer.retire_codecs(kind)
    return errors


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
        layer.move_front(src, m, f"tier{level}")


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

    def stored(self, layer, kind: str, k, v, start: int, fresh: bool) -> None:
        if kind.startswith("tier") and "@" not in kind:
            measure_tier(layer, kind, k, v, start, fresh)

    def after_flush(self, layer, flushed: bool) -> None:
        if flushed and layer.method.tiers:
            demote(layer)
