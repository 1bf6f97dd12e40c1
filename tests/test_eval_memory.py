"""Real bytes held by caches: against the tensors a real DynamicCache holds, or hand-computed layouts."""

import pytest
import torch
from transformers import DynamicCache

from kvpack.eval.generate import forward
from kvpack.eval.memory import memory_report, tensor_bytes
from kvpack.eval.methods import make_cache
from kvpack.models import tiny_random_model


def test_tensor_bytes_counts_shared_storage_once():
    base = torch.zeros(10, 8)  # 320 bytes
    assert tensor_bytes([base, base[:5], {"view": base[2:]}]) == 320
    assert tensor_bytes((torch.zeros(4, dtype=torch.int8), torch.zeros(2, dtype=torch.float16))) == 8


def _real_bytes(cache: DynamicCache) -> tuple[int, int]:
    """(bytes held by a DynamicCache's K/V tensors, the same elements at fp16 size), read off the tensors."""
    tensors = [t for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values)]
    return sum(t.nbytes for t in tensors), sum(t.numel() * 2 for t in tensors)


def test_dynamic_cache_report_matches_its_tensors(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    cache = DynamicCache()
    forward(model, eval_tiny_ids[:100], cache)
    real, real_fp16 = _real_bytes(cache)
    report = memory_report(cache, model.config)
    assert report["tokens"] == 100
    assert report["total_bytes"] == real
    assert report["fp16_bytes"] == real_fp16
    assert report["ratio"] == pytest.approx(real_fp16 / real)
    assert report["bytes_per_token"] == real / 100


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


def test_kvpack_fp16_holds_exactly_an_fp16_dynamic_cache(eval_tiny_ids):
    """The lossless fp16 method stores fp16 K and V and nothing else: its bytes are a real fp16 DynamicCache's."""
    model, _ = tiny_random_model(seed=0, dtype=torch.float16)
    reference = DynamicCache()
    forward(model, eval_tiny_ids[:100], reference)
    cache = make_cache(model, "fp16")
    forward(model, eval_tiny_ids[:100], cache)
    real, real_fp16 = _real_bytes(reference)
    assert real == real_fp16
    report = memory_report(cache, model.config)
    assert report["tokens"] == 100
    assert report["total_bytes"] == report["fp16_bytes"] == real
    assert report["bytes_per_token"] == real / 100


def test_kvpack_fp16_bytes_follow_a_real_fp32_dynamic_cache(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    reference = DynamicCache(config=model.config)
    forward(model, eval_tiny_ids[:400], reference)
    cache = make_cache(model, "kivi:2")
    forward(model, eval_tiny_ids[:400], cache)
    _, real_fp16 = _real_bytes(reference)
    report = memory_report(cache, model.config)
    assert report["fp16_bytes"] == real_fp16
    assert report["total_bytes"] < real_fp16 / 2  # 2-bit codes: well under half of fp16 even with the exact window
