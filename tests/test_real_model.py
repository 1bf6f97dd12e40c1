"""Integration on the real default model (SmolLM2-135M, offline from PyPI): lossless methods give
DynamicCache's greedy tokens, and Shard's 8-bit decode stream is lossless against an fp16 stream."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpack
from kvpack.text import token_stream

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(eval_smollm2):
    model, tok = eval_smollm2
    yield model, tok
    kvpack.disable(model)


def _greedy(model, ids, cache, n, enabled=True):
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        with torch.no_grad():
            return model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, ids.shape[1] :]
    finally:
        kvpack.disable(model)


@pytest.mark.parametrize("method", ["fp16", "int8"])
def test_lossless_methods_match_dynamic_cache_on_real_model(smol, method):
    model, tok = smol
    ids = token_stream(tok, "news", 700).view(1, -1)
    ref = _greedy(model, ids, DynamicCache(config=model.config), 64, enabled=False)
    out = _greedy(model, ids, kvpack.KVCache(model, method), 64)
    assert torch.equal(out, ref)


def test_shard_int8_stream_is_lossless_against_fp16_stream(smol):
    """The blog's streaming check: same compressed prefill, 150 decode tokens, 8-bit vs fp16 stream."""
    model, tok = smol
    ids = token_stream(tok, "news", 1100).view(1, -1)
    ref_cache = kvpack.KVCache(model, "shard:fp16")
    ref = _greedy(model, ids, ref_cache, 150)
    cache = kvpack.KVCache(model, "shard")
    out = _greedy(model, ids, cache, 150)
    assert (out == ref).float().mean().item() == 1.0
    report = cache.memory_report()
    assert any(k.startswith("prefill:pca/vq") for k in report["segments"]) and any(k.startswith("stream:int8") for k in report["segments"])


def test_default_method_predicts_like_uncompressed_cache(smol):
    """Teacher-forced next-token agreement: after a 900-token prompt, both caches read the same 32
    reference tokens one at a time; the lossy default cache must pick the same top-1 token at
    nearly every step (free-running greedy text diverges for good after one differing token)."""
    model, tok = smol
    ids = token_stream(tok, "news", 932).view(1, -1)
    prompt, follow = ids[:, :900], ids[:, 900:]

    def top1(cache, enabled):
        (kvpack.enable if enabled else kvpack.disable)(model)
        try:
            with torch.no_grad():
                model(prompt, past_key_values=cache)
                return torch.stack([model(follow[:, i : i + 1], past_key_values=cache).logits[0, -1].argmax() for i in range(follow.shape[1])])
        finally:
            kvpack.disable(model)

    ref = top1(DynamicCache(config=model.config), False)
    out = top1(kvpack.KVCache(model, kvpack.DEFAULT_METHOD), True)
    assert (out == ref).float().mean().item() >= 0.9
