"""The default method on a model whose rotary embedding kvpack cannot read (GPT-J rotates part of each head inside its
attention module, with no rotary module to read): it runs without its position terms, with one warning naming what is
lost, and computes exactly what the position-free method computes. A method with no position-free form still refuses."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

import kvpack
from kvpack.registry import DEFAULT_METHOD, CodecSpec, get_method


def _gptj() -> GPTJForCausalLM:
    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=128, n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
    model = GPTJForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _position_free_default():
    method = get_method(DEFAULT_METHOD)
    return method.with_options(key=CodecSpec("turboquant", {**method.key.options, "rope_center": False}))


def _generate(model, cache, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                              min_new_tokens=8, do_sample=False)


def test_default_on_gptj_warns_once_and_runs_as_the_position_free_method():
    model = _gptj()
    assert get_method(DEFAULT_METHOD).key.uses_positions  # the default's keys read positions (+ropemean)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = kvpack.KVCache(model, DEFAULT_METHOD, allow_untested=True)
    lost = [w for w in caught if "rotary" in str(w.message)]
    assert len(lost) == 1 and issubclass(lost[0].category, RuntimeWarning)
    assert "'+ropemean' off" in str(lost[0].message) and "GPTJForCausalLM" in str(lost[0].message)
    assert not cache.method.key.uses_positions and cache.method.key.options["rope_center"] is False
    assert cache.method.anchors == get_method(DEFAULT_METHOD).anchors and cache.method.window == get_method(DEFAULT_METHOD).window
    ids = torch.randint(1, 128, (1, 160), generator=torch.Generator().manual_seed(3))
    got = _generate(model, cache, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = _generate(model, kvpack.KVCache(model, _position_free_default(), allow_untested=True), ids)
    assert not [w for w in caught if "rotary" in str(w.message)]  # the explicit position-free method needs no fallback
    assert torch.equal(got, want)
    assert any(layer.segments for layer in cache.compressed_layers())  # the prompt was compressed


@pytest.mark.parametrize("method", ["shard", "kvquant:3"])
def test_methods_without_a_position_free_form_still_refuse(method):
    with pytest.raises(ValueError, match="rotary"):
        kvpack.KVCache(_gptj(), method, allow_untested=True)


def test_models_with_a_readable_rotary_module_get_no_warning(eval_tiny):
    model, _ = eval_tiny
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = kvpack.KVCache(model, DEFAULT_METHOD)
    assert not [w for w in caught if "rotary" in str(w.message)]
    assert cache.method == get_method(DEFAULT_METHOD)
