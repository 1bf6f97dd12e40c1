"""Attention-output fidelity per layer."""

import math

import pytest
import torch
from transformers import DynamicCache

from kvpack.eval.fidelity import attention_fidelity, attention_modules, capture_attention, compare_outputs, summarize
from kvpack.eval.generate import forward


def test_identical_caches_are_perfect(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    rows = attention_fidelity(model, eval_tiny_ids, DynamicCache(), DynamicCache(), prefix=100, steps=4)
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert r["cosine"] == pytest.approx(1.0, abs=1e-6)
        assert r["rel_error"] == pytest.approx(0.0, abs=1e-6)


def test_compare_outputs_hand_computed():
    ref = [torch.tensor([[1.0, 0.0], [3.0, 4.0]])]
    cand = [torch.tensor([[0.0, 1.0], [3.0, 4.0]])]
    (row,) = compare_outputs(ref, cand)
    assert row["cosine"] == pytest.approx(0.5)  # mean of 0 and 1
    assert row["rel_error"] == pytest.approx(math.sqrt(2) / 2)  # mean of sqrt(2) and 0
    assert summarize([row, {**row, "cosine": 0.25}])["cosine_min"] == 0.25


def test_a_damaged_cache_is_detected_from_its_first_layer(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    ref, cand = DynamicCache(), DynamicCache()
    outputs = []
    for cache, damage in ((ref, False), (cand, True)):
        forward(model, eval_tiny_ids[:100], cache)
        if damage:
            cache.layers[0].values.mul_(0.5)
        outputs.append(capture_attention(model, cache, eval_tiny_ids[100:104])[0])
    rows = compare_outputs(*outputs)
    assert rows[0]["cosine"] > 0.5 and rows[0]["rel_error"] > 0.05
    assert outputs[0][0].shape == (4, model.config.hidden_size)  # [steps, hidden]


def test_one_attention_module_per_layer(eval_tiny):
    assert len(attention_modules(eval_tiny[0])) == eval_tiny[0].config.num_hidden_layers
