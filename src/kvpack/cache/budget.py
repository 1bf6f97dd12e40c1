"""A byte budget for a kvpack cache (ADR-004): compress further, then evict the oldest blocks; rematerialize on demand.

`KVCache(model, method, budget=MemoryBudget(max_bytes))` splits the budget over the cache's compressed layers
(`BudgetSplit`): each layer's share follows what it would hold with every compressed token at its oldest tier's
cost per token, measured (evenly until the layers have measured it). Layers hold the same tokens but not the same
bytes per token (an archive fitted per layer keeps a different key rank in each; widths placed per layer differ), so
an even split would make the costlier layers evict while others still held warm blocks; in proportion, the layers
run out of blocks to demote at about the same time once their needs are measured. In the forward that first fills the
cache a layer's need is known only once its oldest tier holds tokens, so the layers before a costlier one have taken
shares it needs: before it evicts, those layers compress their warm blocks down to their targets (`reclaim`).
After every forward each layer holds at most its share, counted as `KVPackLayer.memory()` counts: every tensor it
holds, capacity slack and codec state included, and the shares never sum to more than the budget. A layer over its
share, in this order:

0. frees its block runs' spare capacity (growth slack: a copy, no token moves);
1. **compresses further** (`compress_first`, methods with tiers): moves its oldest warm block into its oldest
   tier now instead of when the block ages past the boundary; with none left, has the layers before it that hold
   more than their target do the same (`reclaim`);
2. **evicts** its oldest compressed tokens, right after the sinks, in whole blocks. Evicted tokens leave
   attention (sinks and everything newer stay, as in StreamingLLM) but keep their positions, and their
   token ids stay with the cache.

`KVCache.rematerialize(model)` recomputes the evicted K/V by running the model over the recorded token ids
up to the last evicted token (an exact prefill: the context before an evicted block is the exact tokens
before it) and stores them again with the codecs that held them. Every move is a `BudgetEvent`, kept in
`KVCache.budget_events` and logged to the `kvpack.budget` logger. Only the fixed exact part (sinks, the
window and one block in flight) bounds how small a budget can be; the first update checks it.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..registry import EXACT_DTYPES
from ..support import cache_kwargs
from .placement import PlacementPolicy

LOG = logging.getLogger("kvpack.budget")


@dataclass(frozen=True)
class MemoryBudget:
    """max_bytes: bytes the cache's compressed layers may hold after any forward (all layers together).
    compress_first: before evicting, move warm blocks into the method's oldest tier (when it has tiers)."""

    max_bytes: int
    compress_first: bool = True

    def __post_init__(self):
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"MemoryBudget.max_bytes must be a positive int (bytes), got {self.max_bytes!r}")
        if not isinstance(self.compress_first, bool):
            raise ValueError(f"MemoryBudget.compress_first must be True or False, got {self.compress_first!r}")


@dataclass(frozen=True)
class BudgetEvent:
    """One decision: `action` ("demote" | "evict" | "rematerialize") moved tokens [start, start + tokens) of `layer`."""

    layer: int
    action: str
    start: int
    tokens: int
    bytes_after: int  # what the layer holds after the move
    limit: int  # the layer's share of the budget


class BudgetError(ValueError):
    """The budget cannot be kept: the message names the bytes needed and the fix."""


@dataclass
class BudgetSplit:
    """A cache's budget over its compressed layers, shared by their `LayerShare`s.

    `need[i]`: the bytes layer i would hold with every compressed token at its oldest tier's cost per token
    (`oldest_tier_need`), as the layer last measured it after a flush. A layer's target is the
    budget times its need over the sum of needs, a layer not yet measured counted at the mean of those measured (all
    even until one is). `limits` are the shares in force; a layer takes its target only as far as the others' shares
    leave room, so the shares never sum to more than `max_bytes` while the needs move (the next forward evens it out).
    """

    max_bytes: int
    order: tuple[int, ...]  # indices of the cache's compressed layers
    need: dict[int, float] = field(default_factory=dict)
    limits: dict[int, int] = field(init=False)
    # The layers themselves, by index (set by `KVCache.set_budget`): a layer about to evict asks the layers before it
    # that hold more than their target to demote first (`reclaim`).
    members: dict[int, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        even = self.max_bytes // len(self.order)
        self.limits = {i: even for i in self.order}

    def target(self, layer: int) -> int | None:
        """The budget times layer `layer`'s need over the sum of needs (None before any layer measured one)."""
        if not self.need:
            return None
        mean = sum(self.need.values()) / len(self.need)
        needs = {i: self.need.get(i, mean) for i in self.order}
        return int(self.max_bytes * needs[layer] / max(sum(needs.values()), 1e-9))

    def note(self, layer: int, need: float | None) -> None:
        """Record layer `layer`'s first need without moving its share (it has just been brought within that share)."""
        if need is not None and layer not in self.need:
            self.need[layer] = float(need)

    def assign(self, layer: int, need: float | None) -> int:
        """Record layer `layer`'s need (None: not measurable yet, or unchanged) and return its share from now on."""
        if need is not None:
            self.need[layer] = float(need)
        target = self.target(layer)
        if target is None:
            return self.limits[layer]
        room = self.max_bytes - sum(v for i, v in self.limits.items() if i != layer)
        self.limits[layer] = min(target, room)
        return self.limits[layer]


def oldest_tier_need(layer, held: int) -> float | None:
    """Bytes `layer` would hold with every compressed token it was given, the evicted ones included, at its oldest
    tier's cost per token (live bytes of that tier's runs over their tokens, spare capacity not counted), beside its
    exact part and codec state: what a layer needs once a budget has demoted all it can, and a measure that neither a
    demotion nor an eviction moves (a share that shrank with each eviction would make the layer that evicted first
    evict ever more). The oldest tier of a method without tiers is its compressed segments. `held`: the layer's
    `nbytes()`. None while that tier holds nothing (its cost is not known yet)."""
    tiers = len(layer.method.tiers)
    oldest = [seg for seg in layer.segments if (not tiers or seg.kind == f"tier{tiers}") and seg.length]
    if not oldest:
        return None
    runs = [run for seg in oldest for run in (seg.key_run, seg.value_run)]
    per_token = sum(run.nbytes() * run.length / max(run.capacity, 1) for run in runs) / sum(seg.length for seg in oldest)
    fixed = held - sum(seg.nbytes() for seg in layer.segments)  # sinks, window, anchors, codec state
    tokens = sum(seg.length for seg in layer.segments) + layer.evicted_tokens
    return fixed + per_token * tokens


@dataclass
class LayerShare:
    """One layer's part of a cache's budget: `split` is the cache's `BudgetSplit`, which holds the layer's share
    (`limit`) and moves it after each of the layer's flushes; `log` is the cache's event list, shared by its layers."""

    split: BudgetSplit
    index: int  # the layer's index in the model (its key in `split`)
    compress_first: bool
    layers: int  # compressed layers sharing the budget
    log: list[BudgetEvent] = field(default_factory=list)

    @property
    def limit(self) -> int:
        return self.split.limits[self.index]

    def record(self, event: BudgetEvent) -> None:
        self.log.append(event)
        LOG.info("layer %d: %s %d tokens from %d; now %d of %d bytes", event.layer, event.action, event.tokens, event.start,
                 event.bytes_after, event.limit)


@dataclass
class PromptTarget:
    """A method's `prompt_ratio` over one cache's compressed layers, shared by them. Each layer's share is its fp16
    bytes over the ratio; layers encode their prompt in index order and each records what it then holds, so a layer
    may also take `carry`: what the layers before it left under their shares (or took over them), spread evenly over
    the layers still to come. Codebooks come in halvings, so a layer alone overshoots or misses its share; spreading
    what it left keeps the cache near the target without starving the last layers. The last layer to record warns
    when the cache as a whole holds less than `ratio` times fewer bytes than fp16."""

    ratio: float
    order: tuple[int, ...]  # indices of the cache's compressed layers
    held: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # layer -> (fp16 bytes, bytes spent, fitted)

    def carry(self, layer: int) -> int:
        """Bytes layer `layer` may spend beyond its share (negative: owed)."""
        before = [h for i, h in self.held.items() if i < layer]  # records of later layers are a rolled-back forward's
        spare = sum(fp16 / self.ratio - spent for fp16, spent, _ in before)
        return int(spare / max(1, sum(1 for i in self.order if i >= layer)))

    def record(self, layer: int, fp16: int, spent: int, fitted: bool) -> None:
        """Layer `layer`'s prompt is encoded: `spent` bytes held (counting derived kernel state) for `fp16` bytes of fp16."""
        self.held[layer] = (fp16, spent, fitted)
        if layer != max(self.order):
            return
        fp16_total, spent_total = sum(h[0] for h in self.held.values()), sum(h[1] for h in self.held.values())
        missed = sorted(i for i, h in self.held.items() if not h[2])
        if fp16_total < self.ratio * spent_total:
            warnings.warn(
                f"after this prompt the cache holds {fp16_total / spent_total:.2f}x fewer bytes than fp16 (its decode kernels' "
                f"state counted), short of the method's {self.ratio:g}x target: {len(missed)} of {len(self.order)} layers could "
                "not fit even the smallest value codebook beside their keys, sinks and window (on a short prompt they keep the "
                "full one: the exact sinks and window weigh most there). Lower the target (e.g. shard:8x), the window "
                "(@window=32) or the key rank (shard:e5)",
                stacklevel=4,
            )


def exact_bytes_at_most(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
    """Bytes of the exact part a layer may hold after a forward: sinks, window and a block not yet flushed."""
    method = layer.method
    per_token = key_states.shape[0] * key_states.shape[1] * (key_states.shape[3] + value_states.shape[3])
    elem = torch.empty((), dtype=EXACT_DTYPES[method.exact_dtype] or key_states.dtype).element_size()
    return (method.sink_tokens + method.window + method.block_size) * per_token * elem


def check_share(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Refuse, before anything is stored, a share smaller than the layer's fixed exact part."""
    need = exact_bytes_at_most(layer, key_states, value_states)
    if layer.budget.limit <= need:
        raise BudgetError(
            f"layer {layer.layer_idx}: the memory budget gives each compressed layer {layer.budget.limit:,} bytes, but its "
            f"sinks, window and one block in flight alone take up to {need:,} (batch {key_states.shape[0]}, "
            f"{key_states.shape[1]} kv heads); raise MemoryBudget.max_bytes above {need * layer.budget.layers:,}, "
            "with room for compressed tokens and codec state"
        )


class BudgetPolicy(PlacementPolicy):
    """After every forward (a flush or not: the window grows between flushes), bring a layer over its share of the
    cache's `MemoryBudget` back within it (`enforce`); inert for a layer without a budget."""

    def after_flush(self, layer, flushed: bool) -> None:
        if layer.budget is not None:
            enforce(layer)


def enforce(layer) -> None:
    """Bring `layer` within its share after a flush: demote warm blocks (if allowed), then evict the oldest."""
    share = layer.budget
    held = layer.nbytes()
    share.split.assign(share.index, oldest_tier_need(layer, held))
    while held > share.limit:
        held = _compress_to(layer, share, share.limit, held)
        if held <= share.limit:
            break
        # Its demotions may have just made its oldest tier, whose cost its share did not know: measure again
        # before evicting (no lending between layers: a layer without tiers can only evict, so a loan would
        # move evictions to the lender, not save them).
        if held <= share.split.assign(share.index, oldest_tier_need(layer, held)):
            continue
        # Layers that took their share before this layer's cost was known (in the forward that first fills the
        # cache) may hold more than their target in warm blocks: they compress those first, then it takes the room.
        if share.compress_first and reclaim(share) and held <= share.split.assign(share.index, None):
            continue
        event = _evict_oldest(layer, held - share.limit, share)
        if event is None:
            raise BudgetError(
                f"layer {layer.layer_idx} holds {held:,} bytes with nothing left to evict (its share is {share.limit:,}): "
                "raise MemoryBudget.max_bytes"
            )
        share.record(event)
        held = event.bytes_after
    # Demotions may have made the oldest tier whose cost its need was missing: a later layer's `reclaim` reads it.
    share.split.note(share.index, oldest_tier_need(layer, held))


def _compress_to(layer, share: LayerShare, limit: int, held: int) -> int:
    """Free `layer`'s spare run capacity (a copy, not accuracy), then demote its oldest warm blocks (when the budget
    allows it), until it holds at most `limit` bytes or has nothing left to demote. Returns what it then holds."""
    while held > limit:
        freed = sum(seg.compact() for seg in layer.segments)
        if freed:
            held -= freed
            continue
        event = share.compress_first and _demote_oldest_block(layer, share)
        if not event:
            break
        share.record(event)
        held = event.bytes_after
    return held


def reclaim(share: LayerShare) -> bool:
    """Before the layer of `share` evicts: every layer before it in the model (already stored in this forward, so a
    rolled-back forward restores it too) that holds a share above its target demotes warm blocks until it holds at most
    its target or has none left, and its share falls to what it then holds. Returns whether any share fell.

    This is what keeps eviction the last step in the forward that first fills a budgeted cache: a layer's need is known
    only once its oldest tier holds tokens, so the layers before a costlier one have taken the shares it needs."""
    split, freed = share.split, False
    earlier = [i for i in split.order if i < share.index and i in split.members]
    targets = {i: split.target(i) for i in earlier}
    over = sorted((i for i in earlier if targets[i] is not None and split.limits[i] > targets[i]),
                  key=lambda i: split.limits[i] - targets[i], reverse=True)
    for i in over:  # the largest excess first
        other = split.members[i]
        if other.budget is None:
            continue
        lower = max(targets[i], _compress_to(other, other.budget, targets[i], other.nbytes()))
        if lower < split.limits[i]:
            split.limits[i], freed = lower, True
    return freed


def _demote_oldest_block(layer, share: LayerShare) -> BudgetEvent | None:
    """Move the warm segment's first block into the method's oldest tier (decode + re-encode), or None. A fresh fit of
    that tier's codecs takes up to `Tier.fit_tokens` at once (what the warm segment has), not a block's worth."""
    tiers = len(layer.method.tiers)
    src = next((seg for seg in layer.segments if seg.kind == "stream"), None)
    if not tiers or src is None:
        return None
    step = math.lcm(layer.method.block_size, src.token_multiple)
    fit = layer.method.tiers[-1].fit_tokens if layer.holds_nothing(layer.codec(f"tier{tiers}", "key")) else 0
    m = min(max(step, -(-fit // step) * step), src.length // src.token_multiple * src.token_multiple)
    if not m:
        return None
    start = src.start
    layer.move_front(src, m, f"tier{tiers}")
    return BudgetEvent(layer.layer_idx, "demote", start, m, layer.nbytes(), share.limit)


def _evict_oldest(layer, over: int, share: LayerShare) -> BudgetEvent | None:
    """Drop enough whole blocks from the oldest segment to free `over` bytes (at most the whole segment), or None."""
    if not layer.segments:
        return None
    seg = layer.segments[0]
    step = math.lcm(layer.method.block_size, seg.token_multiple)
    per_token = max(seg.nbytes() / max(seg.length, 1), 1e-9)
    n = min(math.ceil(over / per_token / step) * step, seg.length)
    layer.replace_front(seg, n)
    layer.note_evicted(seg.start, n, seg.kind)
    return BudgetEvent(layer.layer_idx, "evict", seg.start, n, layer.nbytes(), share.limit)


@torch.no_grad()
def rematerialize(cache, model) -> int:
    """Recompute every evicted token's K/V and store it again; returns the tokens restored (per layer, at most).

    All or nothing: if the restored tokens would not fit the budget, every layer is left as it was and
    BudgetError names the bytes needed.
    """
    layers = [layer for layer in cache.compressed_layers() if layer.evicted]
    if not layers:
        return 0
    end = max(start + n for layer in layers for start, n, _ in layer.evicted)
    ids = cache.token_ids
    if ids is None or ids.shape[1] < end:
        raise ValueError(
            "the ids of the evicted tokens were not recorded (the cache records input_ids from each forward through the "
            "model it was built with; a forward with inputs_embeds, or a cache built from a config, leaves them unknown): "
            "these tokens cannot be recomputed"
        )
    recomputed = _prefill(model, ids[:, :end], layers[0])
    snapshots = [(layer, layer.snapshot()) for layer in layers]
    restored = 0
    for layer in layers:
        restored = max(restored, _restore_layer(layer, recomputed.layers[layer.layer_idx]))
    over = [(layer, layer.nbytes()) for layer in layers if layer.budget is not None and layer.nbytes() > layer.budget.limit]
    if over:
        for layer, state in snapshots:
            layer.restore(state)
        layer, held = over[0]
        raise BudgetError(
            f"rematerializing would make layer {layer.layer_idx} hold {held:,} bytes, over its share of {layer.budget.limit:,}: "
            f"raise the budget first (cache.set_budget(MemoryBudget({held * len(cache.compressed_layers()):,})) or None)"
        )
    return restored


def _prefill(model, ids: torch.Tensor, layer):
    """An exact prefill of `ids (batch, n)` into a fresh DynamicCache, with the cache's padding and positions."""
    kwargs = {}
    if layer.pad is not None:
        idx = torch.arange(ids.shape[1], device=ids.device)
        kwargs["attention_mask"] = (idx[None, :] >= layer.pad.to(ids.device)[:, None]).long()
        kwargs["position_ids"] = (idx[None, :] + layer.pos_offset.to(ids.device)[:, None]).clamp_min(0)
    dyn = DynamicCache(config=model.config)
    model(ids, use_cache=True, **cache_kwargs(model, dyn), **kwargs)
    return dyn


def _restore_layer(layer, recomputed) -> int:
    """Store the recomputed K/V of `layer`'s evicted chunks with the codecs that held them."""
    count = 0
    for start, n, kind in layer.evicted:
        k, v = recomputed.keys[:, :, start : start + n], recomputed.values[:, :, start : start + n]
        layer.store(kind, k, v, start)
        count += n
    layer.evicted = ()
    if layer.budget is not None:
        layer.budget.record(BudgetEvent(layer.layer_idx, "rematerialize", layer.sink_k.shape[2], count, layer.nbytes(), layer.budget.limit))
    return count
