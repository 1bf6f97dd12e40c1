"""Sliding-window models: kvpack's layer kinds and memory report against transformers' own DynamicCache.

A Mistral-style config sets `sliding_window` without `layer_types`; transformers then keeps only the
window in every layer. kvpack must do the same, and `memory_report()["fp16_bytes"]` must be what a
real DynamicCache holds for the same tokens (its tensors counted at fp16 size), not a formula.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Qwen2Config,
)
from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

import kvpack
from kvpack.cache import KVPackLayer
from kvpack.cache.kvcache import layer_kinds

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
WINDOW = 16


def _mistral():
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **TINY)).eval()


def _hybrid():
    """Gemma3 text with one sliding and one full-attention layer."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], **TINY)
    return Gemma3ForCausalLM(cfg).eval()


@torch.no_grad()
def _drive(model, cache, prompt: int = 40, steps: int = 6) -> torch.Tensor:
    """Prefill `prompt` tokens, then greedy-decode `steps` tokens; the last logits of every forward."""
    ids = torch.randint(0, 64, (1, prompt), generator=torch.Generator().manual_seed(1))
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


def _held(cache: DynamicCache) -> tuple[int, int]:
    """(bytes the DynamicCache's tensors hold, the same tensors at 2 bytes per element)."""
    tensors = [t for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values)]
    return sum(t.numel() * t.element_size() for t in tensors), sum(t.numel() * 2 for t in tensors)


@pytest.mark.parametrize(
    "config",
    [
        MistralConfig(sliding_window=WINDOW, **TINY),
        MistralConfig(sliding_window=None, **TINY),
        LlamaConfig(**TINY),
        Qwen2Config(use_sliding_window=True, max_window_layers=1, sliding_window=WINDOW, **TINY),
        Gemma2Config(sliding_window=WINDOW, **TINY),
        Gemma3TextConfig(sliding_window=WINDOW, **{**TINY, "num_hidden_layers": 6}),
        Phi3Config(sliding_window=WINDOW, **{k: v for k, v in TINY.items() if k != "head_dim"}),
    ],
    ids=["mistral-window", "mistral-no-window", "llama", "qwen2-window", "gemma2", "gemma3", "phi3-window"],
)
def test_layer_kinds_match_transformers(config):
    types, kwargs = get_layer_types_and_kwargs(config)
    assert layer_kinds(config) == [(t, k.get("sliding_window")) for t, k in zip(types, kwargs, strict=True)]


def test_mistral_without_layer_types_keeps_a_window_like_dynamic_cache():
    model = _mistral()
    assert getattr(model.config, "layer_types", None) is None
    reference = DynamicCache(config=model.config)
    expected = _drive(model, reference)
    with pytest.warns(UserWarning, match="sliding-window"):
        cache = kvpack.KVCache(model, "int8")
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    got = _drive(model, cache)
    assert torch.equal(got, expected)
    real, real_fp16 = _held(reference)
    report = cache.memory_report()
    assert report["tokens"] == reference.get_seq_length() == 46
    assert report["fp16_bytes"] == real_fp16
    assert report["total_bytes"] == real  # nothing compressed: the same fp32 window
    assert report["fp16_bytes"] < 46 * 2 * 2 * 2 * 16 * 2  # far less than every token of both layers


@pytest.mark.parametrize("method", ["fp16", "int8", "kivi:2", "turboquant:k3v2"])
def test_hybrid_fp16_bytes_equal_a_real_dynamic_cache(method):
    model = _hybrid()
    reference = DynamicCache(config=model.config)
    _drive(model, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with a full-attention layer is compressed: no warning
        cache = kvpack.KVCache(model, method)
    _drive(model, cache)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, KVPackLayer]
    _, real_fp16 = _held(reference)
    report = cache.memory_report()
    assert report["fp16_bytes"] == real_fp16
    window = reference.layers[0]  # the sliding layer: kvpack holds transformers' own window, bytes included
    assert report["segments"]["sliding_window"] == window.keys.nbytes + window.values.nbytes


def test_fp16_method_holds_what_a_dynamic_cache_would_in_fp16():
    """With the lossless fp16 method the full layer holds exactly fp16 K and V: total equals a real fp16 DynamicCache's bytes."""
    model = _hybrid().half()
    reference = DynamicCache(config=model.config)
    _drive(model, reference)
    cache = kvpack.KVCache(model, "fp16")
    _drive(model, cache)
    real, real_fp16 = _held(reference)
    assert real == real_fp16  # an fp16 model: the reference tensors are fp16 already
    report = cache.memory_report()
    assert report["total_bytes"] == report["fp16_bytes"] == real
    assert report["ratio"] == 1.0
