"""A memory budget (kvpack/cache/budget.py): never exceeded after a forward, every move logged, tiers compressed
further before anything is evicted, evicted K/V rematerialized within the codec's own error, and clear refusals."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from transformers import DynamicCache

import kvpack
from kvpack import Tier
from kvpack.cache.budget import BudgetError, BudgetSplit, PromptTarget
from kvpack.cache.serialize import save_cache
from kvpack.models import tiny_random_model
from kvpack.registry import BUDGET_ONLY, LayerCodecs, get_method

PROMPT = 400


@pytest.fixture(scope="module")
def tiny():
    model, _ = tiny_random_model(seed=0)
    kvpack.enable(model)
    yield model
    kvpack.disable(model)


def _ids(n: int = PROMPT, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(n + batch))


def _binding(unlimited, part: float) -> kvpack.MemoryBudget:
    """A budget that makes `part` of the compressed bytes `unlimited` ended with go (the exact part and codec state stay)."""
    compressed = sum(seg.nbytes() for layer in unlimited.compressed_layers() for seg in layer.segments)
    return kvpack.MemoryBudget(int(sum(_held(unlimited)) - part * compressed))


def _held(cache) -> list[int]:
    """Bytes each compressed layer holds, counted from its tensors (sinks, window, block runs, codec state)."""
    return [layer.nbytes() for layer in cache.compressed_layers()]


@torch.no_grad()
def _generate_checking(model, cache, ids, n: int, **kwargs) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy tokens, and the bytes of every layer after every forward (read by a hook on the model)."""
    seen: list[list[int]] = []
    hook = model.register_forward_hook(lambda *_: seen.append(_held(cache)))
    try:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
    finally:
        hook.remove()
    return out, seen


@pytest.mark.parametrize("method", ["int8", "turboquant:k3v2", "shard"])
def test_budget_is_never_exceeded_and_every_move_is_logged(tiny, method, caplog):
    unlimited = kvpack.KVCache(tiny, method)
    _generate_checking(tiny, unlimited, _ids(), 128)
    budget = _binding(unlimited, 0.5)
    limit = budget.max_bytes
    cache = kvpack.KVCache(tiny, method, budget=budget)
    with caplog.at_level(logging.INFO, logger="kvpack.budget"):
        out, seen = _generate_checking(tiny, cache, _ids(), 128)
    assert len(seen) == 128 and all(sum(step) <= limit for step in seen)
    evictions = [e for e in cache.budget_events if e.action == "evict"]
    assert evictions and all(e.bytes_after <= e.limit for e in cache.budget_events)
    assert sum(layer.budget.limit for layer in cache.compressed_layers()) <= limit
    assert len(caplog.records) == len(cache.budget_events)
    for layer in cache.compressed_layers():  # the log accounts for every evicted token, which follow the sinks
        assert layer.evicted_tokens == sum(e.tokens for e in evictions if e.layer == layer.layer_idx) > 0
        assert layer.evicted[0][0] == layer.sink_k.shape[2]
    # evicted tokens keep their positions and their ids stay with the cache
    assert cache.get_seq_length() == out.shape[1] - 1
    assert torch.equal(cache.token_ids[:, : cache.get_seq_length()], out[:, :-1])
    report = cache.memory_report()
    assert report["evicted_tokens"] == max(layer.evicted_tokens for layer in cache.compressed_layers())


def test_shares_follow_each_layers_measured_need_and_never_sum_past_the_budget():
    split = BudgetSplit(1000, (0, 3, 5))
    assert split.limits == {0: 333, 3: 333, 5: 333}  # nothing measured: even
    assert split.assign(3, None) == 333
    assert split.assign(0, 100.0) == 333  # the others counted at the mean of those measured: even still
    # Layer 3 needs 3x layer 0 (layer 5 not measured: the mean, 200): its target 1000 * 300 / 600 = 500 takes only the room
    # the others' shares leave (1000 - 333 - 333), so the shares never pass the budget while they move.
    assert split.assign(3, 300.0) == 334
    assert split.assign(5, 100.0) == 200  # 1000 * 100 / 500
    assert split.assign(0, 100.0) == 200 and split.assign(3, 300.0) == 600  # settled: in proportion to the needs
    assert sum(split.limits.values()) <= 1000


@torch.no_grad()
def test_a_costlier_layer_gets_a_larger_share_so_layers_evict_the_same_tokens(tiny):
    # Layer 0 in int8 (132 B per token and kv head), layer 1 in 2-bit TurboQuant (36 B): an even split would make
    # layer 0 evict most of its tokens while layer 1 kept all of them. Shares in proportion to what every token costs
    # each layer evict the same tokens from both, whole blocks apart at most.
    method = get_method("int8")
    method = method.__class__(**{**vars(method), "layer_codecs": (LayerCodecs((1,), get_method("turboquant:k2v2").key,
                                                                               get_method("turboquant:k2v2").value),)})
    unlimited = kvpack.KVCache(tiny, method)
    _generate_checking(tiny, unlimited, _ids(), 64)
    budget = _binding(unlimited, 0.5)
    cache = kvpack.KVCache(tiny, method, budget=budget)
    _, seen = _generate_checking(tiny, cache, _ids(), 64)
    assert all(sum(step) <= budget.max_bytes for step in seen)
    layers = cache.compressed_layers()
    evicted = [layer.evicted_tokens for layer in layers]
    assert min(evicted) > 0 and max(evicted) - min(evicted) <= 2 * method.block_size, evicted
    split = layers[0].budget.split
    assert layers[0].budget.limit > layers[1].budget.limit  # in proportion to the needs (which count the exact parts too)
    assert layers[0].budget.limit / layers[1].budget.limit == pytest.approx(split.need[0] / split.need[1], rel=0.01)


@torch.no_grad()
def test_layers_that_took_their_share_first_compress_before_a_costlier_layer_evicts(tiny):
    # In the forward that first fills a budgeted cache a layer's need is known only once its archive holds tokens, so
    # layer 0 takes half the budget and keeps warm blocks in it. Layer 1's archive costs more per token (4-bit codes
    # where layer 0's are 3/2-bit, as Shard archives keep different key ranks per layer): it needs more than half, and
    # it fits only if layer 0 archives its warm blocks. A budget of exactly what both hold fully archived: layer 0
    # compresses first, nothing is evicted (taking the half share instead, layer 1 evicted 256 of its 1,500 tokens).
    method = get_method("tiered:budget:tq")
    k4v4 = get_method("turboquant:k4v4")
    costly = method.with_options(tiers=(Tier(k4v4.key, k4v4.value, BUDGET_ONLY),))

    def cache_with(budget: kvpack.MemoryBudget | None, after: int = BUDGET_ONLY) -> kvpack.KVCache:
        cache = kvpack.KVCache(tiny, method.with_options(tiers=(Tier(method.tiers[0].key, method.tiers[0].value, after),)), budget=budget)
        cache.layers[1].method = costly.with_options(tiers=(Tier(k4v4.key, k4v4.value, after),))
        return cache

    archived = cache_with(None, after=128)  # every token older than the window and a block in its archive
    tiny(_ids(1500), past_key_values=archived, use_cache=True)
    budget = kvpack.MemoryBudget(sum(_held(archived)))
    cache = cache_with(budget)
    tiny(_ids(1500), past_key_values=cache, use_cache=True)
    assert sum(_held(cache)) <= budget.max_bytes
    assert [layer.evicted_tokens for layer in cache.compressed_layers()] == [0, 0]
    split = cache.layers[0].budget.split
    assert split.limits[1] > budget.max_bytes // 2 > split.limits[0]  # layer 1's share grew as layer 0's fell
    assert {e.action for e in cache.budget_events if e.layer == 0} == {"demote"}


def test_tiers_are_compressed_further_before_anything_is_evicted(tiny):
    unlimited = kvpack.KVCache(tiny, "tiered:512")
    _generate_checking(tiny, unlimited, _ids(1200), 64)
    budget = _binding(unlimited, 1 / 8)
    limit = budget.max_bytes
    cache = kvpack.KVCache(tiny, "tiered:512", budget=budget)
    _, seen = _generate_checking(tiny, cache, _ids(1200), 64)
    actions = [e.action for e in cache.budget_events]
    assert "demote" in actions and all(sum(step) <= limit for step in seen)
    assert "evict" not in actions[: actions.index("demote") + 1]
    assert any(seg.kind == "tier1" and seg.start + seg.length > cache.get_seq_length() - 512 for seg in cache.layers[0].segments)


def _archived(cache) -> list[int]:
    """Tokens each compressed layer holds in its archive (`tier1` segments)."""
    return [sum(seg.length for seg in layer.segments if seg.kind == "tier1") for layer in cache.compressed_layers()]


@torch.no_grad()
def test_a_budget_never_archives_what_a_fixed_boundary_with_its_peak_bytes_keeps_warm(tiny):
    # A fixed age boundary archives every token older than it; a budget of the most bytes that boundary ever held
    # archives the oldest warm blocks only when the bytes would pass it. So at every step it holds at most the fixed
    # boundary's archive (never a token the boundary keeps warm) within the same peak: more of the context precise.
    def trace(cache):
        seen: list[tuple[list[int], int]] = []
        hook = tiny.register_forward_hook(lambda *_: seen.append((_archived(cache), sum(_held(cache)))))
        try:
            tiny.generate(_ids(300), past_key_values=cache, max_new_tokens=200, min_new_tokens=200, do_sample=False)
        finally:
            hook.remove()
        return seen

    fixed = trace(kvpack.KVCache(tiny, "tiered:128:tq"))
    peak = max(held for _, held in fixed)
    cache = kvpack.KVCache(tiny, "tiered:budget:tq", budget=kvpack.MemoryBudget(peak))
    placed = trace(cache)
    pairs = [(p, f) for (ps, _), (fs, _) in zip(placed, fixed, strict=True) for p, f in zip(ps, fs, strict=True)]
    assert len(placed) == 200 and max(held for _, held in placed) <= peak
    assert all(p <= f for p, f in pairs) and sum(p < f for p, f in pairs) > 50
    assert placed[-1][0][0] > 0 and not any(e.action == "evict" for e in cache.budget_events)  # it did archive, never evict


def test_a_budget_only_archive_without_a_budget_warns_and_names_the_fix(tiny):
    with pytest.warns(UserWarning, match=r"only when a memory budget needs.*kvpack.MemoryBudget\(max_bytes\).*tiered:1024:shard"):
        cache = kvpack.KVCache(tiny, "tiered:budget:shard")
    assert cache.method.name == "tiered:budget:shard" and cache.method.tiers[0].after > 2**29
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvpack.KVCache(tiny, "tiered:budget", budget=kvpack.MemoryBudget(2**20))
        kvpack.KVCache(tiny, "tiered:1024:shard")
    with pytest.raises(ValueError, match=r"or 'budget'.*tiered:budget:shard"):
        kvpack.get_method("tiered:budgets")


@pytest.mark.parametrize("method", ["int8", "turboquant:k4v4", "kivi:4"])
@pytest.mark.parametrize("batch", [1, 2])
def test_rematerialized_kv_are_within_the_codec_error_of_the_originals(tiny, method, batch):
    ids = _ids(PROMPT, batch)
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :5] = 0  # a left-padded row: recomputation must use the cache's padding and positions
    # positions as generate() gives them: a left-padded row's first real token is at 0 (what the cache assumes)
    kw = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1), "use_cache": True}
    exact = DynamicCache(config=tiny.config)
    kvpack.disable(tiny)
    try:
        with torch.no_grad():
            tiny(ids, past_key_values=exact, **kw)
    finally:
        kvpack.enable(tiny)
    unlimited = kvpack.KVCache(tiny, method)
    with torch.no_grad():
        tiny(ids, past_key_values=unlimited, **kw)
    cache = kvpack.KVCache(tiny, method, budget=_binding(unlimited, 0.3))
    with torch.no_grad():
        tiny(ids, past_key_values=cache, **kw)
    evicted = [layer.evicted for layer in cache.compressed_layers()]
    assert all(evicted)
    before = _held(cache)
    with pytest.raises(BudgetError, match="raise the budget first"):
        cache.rematerialize(tiny)  # no room: all or nothing
    assert [layer.evicted for layer in cache.compressed_layers()] == evicted and _held(cache) == before
    cache.set_budget(None)
    assert cache.rematerialize(tiny) == sum(n for _, n, _ in evicted[0])
    for i, layer in enumerate(cache.compressed_layers()):
        assert not layer.evicted and [(s.start, s.length) for s in layer.segments] != []
        for got, ref, orig in ((layer.keys, unlimited.layers[i].keys, exact.layers[i].keys),
                               (layer.values, unlimited.layers[i].values, exact.layers[i].values)):
            real = slice(None) if batch == 1 else (slice(None), slice(None), slice(5, None))
            err_codec = (ref - orig)[real].norm()  # the codec's own error against the exact prefill
            assert (got - orig)[real].norm() <= 1.05 * err_codec + 1e-4 * orig[real].norm()
    assert any(e.action == "rematerialize" for e in cache.budget_events)


def test_refusals_name_the_problem_and_leave_the_cache_empty(tiny):
    for bad in (0, -5, True, 1.5, "1e6"):
        with pytest.raises(ValueError, match="max_bytes must be a positive int"):
            kvpack.MemoryBudget(bad)
    small = kvpack.KVCache(tiny, "int8", budget=kvpack.MemoryBudget(10_000))
    with pytest.raises(BudgetError, match="raise MemoryBudget.max_bytes above"), torch.no_grad():
        tiny(_ids(), past_key_values=small, use_cache=True)
    assert small.get_seq_length() == 0
    kvpack.disable(tiny)
    try:
        plain = kvpack.KVCache(tiny, "int8", budget=kvpack.MemoryBudget(10**7))
        with pytest.raises(ValueError, match="kvpack.enable"), torch.no_grad():
            tiny(_ids(), past_key_values=plain, use_cache=True)
        assert plain.get_seq_length() == 0
    finally:
        kvpack.enable(tiny)
    with pytest.raises(TypeError, match="MemoryBudget"):
        kvpack.KVCache(tiny, "int8", budget=10**7)


@torch.no_grad()
def _prompt_with_evictions(model) -> kvpack.KVCache:
    """An int8 cache holding the prompt under a budget that made it evict 30% of its compressed bytes."""
    unlimited = kvpack.KVCache(model, "int8")
    model(_ids(), past_key_values=unlimited, use_cache=True)
    cache = kvpack.KVCache(model, "int8", budget=_binding(unlimited, 0.3))
    model(_ids(), past_key_values=cache, use_cache=True)
    return cache


def test_a_cache_with_evicted_tokens_is_saved_only_after_rematerializing(tiny, tmp_path):
    cache = _prompt_with_evictions(tiny)
    with pytest.raises(ValueError, match="rematerialize"):
        save_cache(cache, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    cache.set_budget(None)
    cache.rematerialize(tiny)
    save_cache(cache, tmp_path / "c")
    assert kvpack.KVCache.load(tmp_path / "c", tiny).get_seq_length() == PROMPT


def test_crop_into_the_evicted_range_then_generate(tiny):
    cache = _prompt_with_evictions(tiny)
    start, n, _ = cache.layers[0].evicted[0]
    cache.crop(start + n // 2 - cache.get_seq_length())  # keep half of the evicted range only
    assert cache.get_seq_length() == start + n // 2
    assert all(layer.evicted == ((start, n // 2, "stream"),) and not layer.segments for layer in cache.compressed_layers())
    out, _ = _generate_checking(tiny, cache, _ids()[:, : start + n // 2 + 1], 8)
    assert out.shape[1] == start + n // 2 + 1 + 8


def test_budget_bench_reports_the_peak_against_the_budget(tmp_path):
    from kvpack.bench import budget as bench

    out = tmp_path / "b.json"
    assert bench.main(["--model", "tiny-random", "--method", "int8", "--context", "400", "--ppl-tokens", "128", "--chunk", "64",
                       "--fractions", "1.0,0.6", "--threads", "1", "--out", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    base, row = data["rows"]
    assert base["max_bytes"] is None and base["evicted_tokens"] == 0
    assert row["peak_bytes"] <= row["max_bytes"] and sum(row["layer_shares"]) <= row["max_bytes"]
    assert row["evicted_tokens"] > 0 and row["rematerialize_s"] > 0
    assert data["environment"]["command"].startswith("python -m kvpack.bench.budget")


def test_prompt_target_spreads_what_earlier_layers_left_over_the_layers_to_come():
    """`PromptTarget.carry`: the bytes earlier layers left under their shares (fp16 / ratio), or took over them, split
    evenly over the layers still to encode; a rolled-back forward's records of later layers do not count; only the
    last layer warns, and only when the cache as a whole misses the target."""
    import warnings

    target = PromptTarget(10.0, (0, 1, 2, 4))  # layer 3 sliding (not compressed)
    assert target.carry(0) == 0
    target.record(4, 1000, 10, True)  # a stale record from a forward that was rolled back
    target.record(0, 1000, 70, True)  # 30 under its share of 100
    assert target.carry(1) == 10  # 30 over layers 1, 2 and 4
    target.record(1, 1000, 120, False)  # 20 over
    assert target.carry(2) == 5  # (30 - 20) over layers 2 and 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.record(2, 1000, 100, True)  # not the last layer: no verdict yet
    with pytest.warns(UserWarning, match=r"holds 9\.76x fewer bytes .* 1 of 4 layers"):
        target.record(4, 1000, 120, True)  # 410 spent for 4000 / 10: missed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.record(4, 1000, 100, True)  # 390: met
