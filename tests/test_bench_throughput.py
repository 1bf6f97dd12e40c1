"""`kvpack.bench.throughput`: the batch each cache fits in a KV budget is what its measured bytes allow, and the
cache it then decodes with holds no more than the budget."""

from __future__ import annotations

import pytest
import torch

from kvpack.bench import throughput
from kvpack.eval.memory import memory_report


def test_fit_batch_is_the_budget_over_the_bytes_per_sequence():
    assert throughput.fit_batch(1000, 10_500, 64) == 10
    assert throughput.fit_batch(1000, 999, 64) == 0
    assert throughput.fit_batch(1000, 10**9, 64) == 64
    with pytest.raises(ValueError, match="positive"):
        throughput.fit_batch(0, 10, 4)


def test_each_cache_runs_at_the_batch_its_measured_bytes_fit(eval_tiny):
    model, _ = eval_tiny
    ids = torch.randint(0, 256, (320,), generator=torch.Generator().manual_seed(0))
    methods = ["dynamic", "turboquant:k3v2"]
    # fp32 tiny model: 2 layers x 2 kv heads x 64 dims x (K + V) x 4 bytes = 2 KiB per token uncompressed.
    budget = 4 * 340 * 2048
    rows = {r["method"]: r for r in throughput.run(model, ids, methods, budget, steps=4, warmup=1, max_batch=64, log=lambda *_: None)}
    dyn, tq = rows["dynamic"], rows["turboquant:k3v2"]
    # By hand: 320 prompt tokens + 5 decoded = 325 tokens of 2 KiB each in a DynamicCache (its tensors may hold a
    # little capacity beyond them, never less).
    assert dyn["bytes_per_sequence"] >= 325 * 2048
    for row in (dyn, tq):
        assert row["batch"] == min(budget // row["bytes_per_sequence"], 64)
        assert row["within_budget"] and row["kv_bytes_held"] <= budget
        assert row["tok_s"] == pytest.approx(row["batch"] / (row["mean_ms"] / 1e3))
    assert tq["batch"] > 2 * dyn["batch"] >= 2  # codes several times smaller than fp32: several times the rows
    assert dyn["tok_s_vs_first"] == 1.0


def test_a_budget_below_one_sequence_runs_nothing_for_that_method(eval_tiny):
    model, _ = eval_tiny
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    rows = throughput.run(model, ids, ["dynamic"], 1000, steps=2, warmup=0, max_batch=8, log=lambda *_: None)
    assert rows[0]["batch"] == 0 and "tok_s" not in rows[0]


def test_the_replicated_cache_holds_the_rows_it_claims(eval_tiny):
    from transformers import DynamicCache

    from kvpack.eval.generate import forward

    model, _ = eval_tiny
    cache = DynamicCache(config=model.config)
    forward(model, torch.randint(0, 256, (1, 50)), cache)
    one = memory_report(cache, model.config)["total_bytes"]
    cache.batch_repeat_interleave(3)
    assert memory_report(cache, model.config)["total_bytes"] == 3 * one
