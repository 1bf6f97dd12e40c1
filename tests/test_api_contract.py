"""Nothing silent: enable/disable restore what they replaced, unsupported requests raise, the transformers
layer API (`keys`/`values`, offload) returns real data, copies follow the model, export refuses clearly."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack.attention import kvpack_attention_forward

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=4096)


def _model(attn: str = "sdpa"):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("original", ["eager", "sdpa"])
def test_disable_restores_the_implementation_enable_replaced(original):
    model = _model(original)
    kvpack.enable(model)
    assert model.config._attn_implementation == "kvpack"
    kvpack.enable(model)  # twice: still restores the original, not "kvpack"
    kvpack.disable(model)
    assert model.config._attn_implementation == original
    kvpack.disable(model)  # a model kvpack does not drive keeps its implementation
    assert model.config._attn_implementation == original


def test_output_attentions_is_refused_not_empty():
    model = _model()
    kvpack.enable(model)
    try:
        with pytest.raises(ValueError, match="output_attentions"), torch.no_grad():
            model(_ids(200), past_key_values=kvpack.KVCache(model, "int8"), output_attentions=True)
    finally:
        kvpack.disable(model)
    model.config._attn_implementation = "eager"
    out = model(_ids(200), past_key_values=kvpack.KVCache(model, "int8"), output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 200, 200)  # disabled: real weights


def test_keys_losing_the_layer_tag_raise_instead_of_attending_to_new_tokens_only():
    model = _model()
    cache = kvpack.KVCache(model, "int8")
    kvpack.enable(model)
    try:
        with torch.no_grad():
            model(_ids(300), past_key_values=cache)
        layer = cache.layers[0]
        k = torch.randn(1, 2, 1, 16)
        tagged, v = layer.update(k, k.clone())
        q = torch.randn(1, 4, 1, 16)
        module = model.model.layers[0].self_attn
        with pytest.raises(RuntimeError, match="lost kvpack's tag"):
            kvpack_attention_forward(module, q, tagged.clone(), v, None)  # clone(): a tensor without the tag
    finally:
        kvpack.disable(model)


@pytest.mark.parametrize("method", ["int8", "turboquant:k3v2", "shard"])
def test_layer_keys_and_values_are_the_dequantized_cache(method):
    model = _model()
    cache = kvpack.KVCache(model, method)
    with torch.no_grad():
        model(_ids(390), past_key_values=cache)
    layer = cache.layers[1]
    k, v = layer.dequantized()
    assert layer.keys.shape == (1, 2, 390, 16) and torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(390), past_key_values=ref)
    rel = (layer.keys - ref.layers[1].keys).norm() / ref.layers[1].keys.norm()
    assert rel < (0.01 if method == "int8" else 0.35)  # real tokens, within the codec's error
    with pytest.raises(AttributeError, match="read-only"):
        layer.keys = k


def test_copy_made_while_enabled_follows_disable():
    model = _model()
    ids = _ids(300)
    cache = kvpack.KVCache(model, "int8")
    kvpack.enable(model)
    try:
        with torch.no_grad():
            model(ids, past_key_values=cache)
        twin = copy.deepcopy(cache)
    finally:
        kvpack.disable(model)
    with torch.no_grad():  # disabled: both copies return dequantized K/V and agree
        a = model(_ids(1, 1), past_key_values=cache).logits
        b = model(_ids(1, 1), past_key_values=twin).logits
    torch.testing.assert_close(a, b)
    assert twin.layers[0].model_config is model.config


def test_pickle_round_trip_continues_identically():
    model = _model()
    cache = kvpack.KVCache(model, "turboquant:k3v2")
    with torch.no_grad():
        model(_ids(300), past_key_values=cache)
    twin = pickle.loads(pickle.dumps(cache))
    with torch.no_grad():
        a = model(_ids(1, 1), past_key_values=cache).logits
        b = model(_ids(1, 1), past_key_values=twin).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_offload_and_prefetch_keep_the_data():
    model = _model()
    cache = kvpack.KVCache(model, "int8")
    with torch.no_grad():
        model(_ids(300), past_key_values=cache)
    before = cache.layers[0].keys
    cache.layers[0].offload()
    cache.layers[0].prefetch()
    assert torch.equal(cache.layers[0].keys, before)


def test_torch_export_refuses_with_a_clear_message():
    model = _model()
    cache = kvpack.KVCache(model, "int8")
    with pytest.raises(Exception, match="torch.export cannot trace a kvpack.KVCache"):
        torch.export.export(model, (_ids(8),), {"past_key_values": cache})


def _poison_layer(model, idx: int, exc: Exception | None = None):
    """A hook that makes layer `idx`'s keys NaN (the cache must refuse them), or raises `exc` in its MLP."""
    attn = model.model.layers[idx].self_attn
    if exc is None:
        return attn.k_proj.register_forward_hook(lambda m, a, out: out * float("nan"))
    mlp = model.model.layers[idx].mlp

    def boom(*_):
        raise exc

    return mlp.register_forward_hook(boom)


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("method", ["turboquant:k3v2", "shard"])
def test_rejected_forward_leaves_every_layer_as_it_was(method, enabled):
    model = _model()
    ids, more, nxt = _ids(300), _ids(70, 1), _ids(1, 2)
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        clean, cache = kvpack.KVCache(model, method), kvpack.KVCache(model, method)
        with torch.no_grad():
            model(ids, past_key_values=clean)
            model(ids, past_key_values=cache)
            handle = _poison_layer(model, 1)
            with pytest.raises(ValueError, match="nothing was stored"):
                model(more, past_key_values=cache)  # layer 0 accepted (and flushed a block) before layer 1 refused
            handle.remove()
            assert [layer.length for layer in cache.layers] == [300, 300]
            want = model(nxt, past_key_values=clean).logits
            got = model(nxt, past_key_values=cache).logits
    finally:
        kvpack.disable(model)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_forward_broken_between_layers_is_rolled_back_on_the_next_one():
    model = _model()
    ids, more, nxt = _ids(300), _ids(70, 1), _ids(1, 2)
    clean, cache = kvpack.KVCache(model, "int8"), kvpack.KVCache(model, "int8")
    with torch.no_grad():
        model(ids, past_key_values=clean)
        model(ids, past_key_values=cache)
        handle = _poison_layer(model, 0, RuntimeError("out of memory"))
        with pytest.raises(RuntimeError, match="out of memory"):
            model(more, past_key_values=cache)  # layer 0 stored 70 tokens, layer 1 never ran
        handle.remove()
        assert [layer.length for layer in cache.layers] == [370, 300]
        with pytest.warns(RuntimeWarning, match="stopped between layers"):
            got = model(nxt, past_key_values=cache).logits
        want = model(nxt, past_key_values=clean).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
