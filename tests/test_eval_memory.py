"""Real bytes held by caches, hand-computed."""

import pytest
import torch
from transformers import DynamicCache

from kvpack.eval.generate import forward
from kvpack.eval.memory import memory_report, tensor_bytes
from kvpack.eval.methods import make_cache


def test_tensor_bytes_counts_shared_storage_once():
    base = torch.zeros(10, 8)  # 320 bytes
    assert tensor_bytes([base, base[:5], {"view": base[2:]}]) == 320
    assert tensor_bytes((torch.zeros(4, dtype=torch.int8), torch.zeros(2, dtype=torch.float16))) == 8


def test_dynamic_cache_fp32_is_twice_fp16(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    cache = DynamicCache()
    forward(model, eval_tiny_ids[:100], cache)
    report = memory_report(cache, model.config)
    per_token = 2 * 2 * 2 * 64 * 4  # (K, V) x layers x kv heads x head_dim x fp32 bytes
    assert report["tokens"] == 100
    assert report["total_bytes"] == 100 * per_token
    assert report["fp16_bytes"] == 100 * per_token // 2
    assert report["ratio"] == pytest.approx(0.5)
    assert report["bytes_per_token"] == per_token


@pytest.mark.parametrize("peer, package", [("hf-quanto:4", "optimum.quanto"), ("hf-hqq:4", "hqq")])
def test_4bit_peers_hold_packed_codes_and_group_scales(eval_tiny, eval_tiny_ids, peer, package):
    pytest.importorskip(package)
    model, _ = eval_tiny
    cache = make_cache(model, peer)
    forward(model, eval_tiny_ids[:127], cache)  # the first update quantizes everything, the residual stays empty
    report = memory_report(cache, model.config)
    elements = 2 * 2 * 2 * 64 * 127
    # 4-bit codes: half a byte per element; per group of 64 elements one fp32 scale and one fp32 shift.
    assert report["total_bytes"] == elements // 2 + elements // 64 * (4 + 4)
    assert report["ratio"] == pytest.approx(3.2)


def test_kvpack_cache_reports_itself(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    cache = make_cache(model, "fp16")
    forward(model, eval_tiny_ids[:100], cache)
    report = memory_report(cache, model.config)
    own = cache.memory_report()
    assert report["tokens"] == own["tokens"] == 100
    assert report["total_bytes"] == own["total_bytes"] >= 100 * 2 * 2 * 2 * 64 * 2  # at least fp16 K and V
    assert report["bytes_per_token"] == own["total_bytes"] / 100
