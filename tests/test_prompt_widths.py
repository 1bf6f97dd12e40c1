"""Key widths placed by the prompt's own Fisher signal (`@fisher=N`, kvpack/cache/prompt_widths.py)."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack.cache import prompt_widths
from kvpack.eval.generate import forward, greedy
from kvpack.eval.memory import memory_report
from kvpack.models import tiny_random_model
from kvpack.registry import get_method
from kvpack.text import token_stream

METHOD = "turboquant:k3v2+ropemean@anchors=0.5%@window=8"


def test_pairs_trade_the_largest_gains_against_the_smallest_costs():
    """Hand-worked: gains (3 -> 4 bits) 9, 5, 1, 0.5 and costs (3 -> 2 bits) 8, 4, 0.3, 0.2 for layers 0-3. Pair 1:
    gain 9 (layer 0) against cost 0.2 (layer 3); pair 2: gain 5 (layer 1) against cost 0.3 (layer 2); pair 3 would
    promote layer 2, already demoted: stop."""
    pred = {0: {2: 18, 3: 10, 4: 1}, 1: {2: 10, 3: 6, 4: 1}, 2: {2: 2.3, 3: 2, 4: 1}, 3: {2: 1.7, 3: 1.5, 4: 1}}
    assert prompt_widths.pairs(pred) == ([0, 1], [3, 2])
    # A gain below the cost it would pay for is not taken: no pair when every fourth bit is worth less than a second.
    flat = {i: {2: 10.0, 3: 5.0, 4: 4.0} for i in range(4)}
    assert prompt_widths.pairs(flat) == ([], [])


def test_the_suffix_is_parsed_and_refused_where_no_bit_can_move():
    method = get_method(f"{kvpack.DEFAULT_METHOD}@fisher=128@seed=2")
    assert method.fisher_tail == 128 and method.name.endswith("@fisher=128@seed=2")
    for bad, words in (("turboquant:k4v4@fisher=64", "3-bit TurboQuant"), ("int8@fisher=64", "3-bit TurboQuant"),
                       ("turboquant:k3v2+tcq@fisher=64", "3-bit TurboQuant"), (f"{kvpack.DEFAULT_METHOD}@fisher=8", "from 16 to")):
        with pytest.raises(ValueError, match=words):
            get_method(bad)
    model, _ = tiny_random_model(seed=0)
    with pytest.raises(ValueError, match="needs the model itself"):
        kvpack.KVCache(model.config, f"{METHOD}@fisher=16")


def _prefilled(model, ids, method):
    kvpack.enable(model)
    try:
        cache = kvpack.KVCache(model, method)
        logits = forward(model, ids, cache)
        return cache, logits, memory_report(cache, model.config)["total_bytes"]
    finally:
        kvpack.disable(model)


def test_placed_widths_move_key_bits_between_layers_at_the_same_bytes(monkeypatch, tmp_path):
    """With predictions that make layer 1's keys worth a fourth bit and layer 0's a second bit less, the prompt is
    stored with those widths: the layers' key codecs hold 4 and 2 bits, the bytes are the uniform method's exactly,
    a saved and loaded cache holds the same keys, and the cache decodes on."""
    model, tokenizer = tiny_random_model(seed=0)
    ids = token_stream(tokenizer, "pydoc", 300)
    seen = []

    def forced(g2, keys, layer_idx, tokens):
        seen.append((layer_idx, tuple(g2.shape), tuple(keys.shape), tokens))
        return {2: 1.0, 3: 0.9, 4: 0.85} if layer_idx == 0 else {2: 9.0, 3: 5.0, 4: 1.0}

    monkeypatch.setattr(prompt_widths, "predicted_key_kl", forced)
    cache, logits, placed_bytes = _prefilled(model, ids, f"{METHOD}@fisher=16")
    assert cache.prompt_widths["promoted"] == [1] and cache.prompt_widths["demoted"] == [0]
    # the Fisher covers the 284 tokens before the tail; the 8-token window plus half a 64-token block is left out
    assert [s[0] for s in seen] == [0, 1] and all(s[1] == s[2] == (1, 2, 300 - 16 - 4 - 8 - 32, 64) and s[3] == 16 for s in seen)
    layers = cache.compressed_layers()
    assert [layer.codec("stream", "key").config.bits for layer in layers] == [2, 4]
    assert all(layer.codec("stream", "value").config.bits == 2 for layer in layers)
    assert all(layer.segments and not layer.hold_prompt for layer in layers)
    _, _, uniform_bytes = _prefilled(model, ids, METHOD)
    assert placed_bytes == uniform_bytes
    # The placed widths are the cache's method now: a saved file keeps them and a loaded cache reads the same keys.
    assert cache.method.fisher_tail == 0 and [e.layers for e in cache.method.layer_codecs] == [(1,), (0,)]
    path = tmp_path / "placed.kvpack"
    cache.save(path)
    loaded = kvpack.KVCache.load(path, model)
    assert [layer.codec("stream", "key").config.bits for layer in loaded.compressed_layers()] == [2, 4]
    assert not any(layer.hold_prompt for layer in loaded.compressed_layers())
    for a, b in zip(cache.compressed_layers(), loaded.compressed_layers(), strict=True):
        torch.testing.assert_close(a.dequantized()[0], b.dequantized()[0], rtol=0, atol=0)
    kvpack.enable(model)
    try:
        assert len(greedy(model, cache, logits, 6)) == 6
    finally:
        kvpack.disable(model)


def test_the_real_signal_places_pairs_or_nothing_and_keeps_the_bytes():
    model, tokenizer = tiny_random_model(seed=0)
    ids = token_stream(tokenizer, "pydoc", 300)
    cache, _, placed_bytes = _prefilled(model, ids, f"{METHOD}@fisher=16")
    record = cache.prompt_widths
    assert len(record["promoted"]) == len(record["demoted"]) and not set(record["promoted"]) & set(record["demoted"])
    bits = {layer.layer_idx: layer.codec("stream", "key").config.bits for layer in cache.compressed_layers()}
    assert {i for i, b in bits.items() if b == 4} == set(record["promoted"]) and {i for i, b in bits.items() if b == 2} == set(record["demoted"])
    assert placed_bytes == _prefilled(model, ids, METHOD)[2]


@pytest.mark.parametrize("case", ["short", "padded"])
def test_a_prompt_it_cannot_place_from_keeps_its_widths_and_says_why(case):
    model, tokenizer = tiny_random_model(seed=0)
    ids = token_stream(tokenizer, "pydoc", 80 if case == "short" else 300)[None]  # 80: a block to compress, under the 92 the tail needs
    mask = torch.ones_like(ids)
    if case == "padded":  # the second row left-padded by 5 tokens
        ids = torch.cat([ids, torch.cat([torch.zeros_like(ids[:, :5]), ids[:, :-5]], 1)])
        mask = torch.cat([mask, torch.cat([torch.zeros_like(mask[:, :5]), mask[:, :-5]], 1)])
    kvpack.enable(model)
    try:
        with pytest.warns(RuntimeWarning, match="keeps its 3-bit keys everywhere"):
            cache = kvpack.KVCache(model, f"{METHOD}@fisher=16")
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        assert "skipped" in cache.prompt_widths and ("left-padded" in cache.prompt_widths["skipped"]) == (case == "padded")
        assert all(layer.codec("stream", "key").config.bits == 3 and layer.segments for layer in cache.compressed_layers())
        uniform = kvpack.KVCache(model, METHOD)
        model(input_ids=ids, attention_mask=mask, past_key_values=uniform, use_cache=True)
    finally:
        kvpack.disable(model)
    assert memory_report(cache, model.config)["total_bytes"] == memory_report(uniform, model.config)["total_bytes"]


def test_a_batch_of_rows_of_one_length_gets_one_set_of_widths(monkeypatch):
    """Two unpadded rows: the prediction reads both rows' keys and Fisher diagonal (their signal summed, per scored
    token of both), the widths it places hold for both rows, the bytes are the uniform method's, decoding goes on."""
    model, tokenizer = tiny_random_model(seed=0)
    one = token_stream(tokenizer, "pydoc", 300)
    ids = torch.stack([one, token_stream(tokenizer, "news", 300)])
    seen = []
    real = prompt_widths.predicted_key_kl

    def recorded(g2, keys, layer_idx, tokens):
        seen.append((tuple(g2.shape), tuple(keys.shape), tokens))
        return real(g2, keys, layer_idx, tokens)

    monkeypatch.setattr(prompt_widths, "predicted_key_kl", recorded)
    cache, logits, placed_bytes = _prefilled(model, ids, f"{METHOD}@fisher=16")
    assert "promoted" in cache.prompt_widths
    assert seen and all(g == k == (2, 2, 300 - 16 - 4 - 8 - 32, 64) and t == 2 * 16 for g, k, t in seen)
    bits = {layer.layer_idx: layer.codec("stream", "key").config.bits for layer in cache.compressed_layers()}
    assert {i for i, b in bits.items() if b == 4} == set(cache.prompt_widths["promoted"])
    assert placed_bytes == _prefilled(model, ids, METHOD)[2]
    kvpack.enable(model)
    try:
        step = model(input_ids=logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits
    finally:
        kvpack.disable(model)
    assert step.shape[:2] == (2, 1) and torch.isfinite(step).all()


def test_place_reads_the_held_prompt_and_changes_nothing():
    """`place` is a function of the held prompt: the same seed gives the same predictions, the held K/V are untouched,
    and another tail (other scored tokens, another prefix) predicts otherwise."""
    model, tokenizer = tiny_random_model(seed=0)
    ids = token_stream(tokenizer, "pydoc", 300)[None]
    seen = {}

    class Probed(kvpack.KVCache):
        def place_prompt(self, model) -> None:
            layers = self.compressed_layers()
            before = [(layer.win_k.clone(), layer.win_v.clone()) for layer in layers]
            a = prompt_widths.place(self, model, self._prompt_ids, tail=16, draws=2, seed=3)
            b = prompt_widths.place(self, model, self._prompt_ids, tail=16, draws=2, seed=3)
            c = prompt_widths.place(self, model, self._prompt_ids, tail=48, draws=1, seed=3)
            seen.update(a=a, b=b, c=c)
            for layer, (k, v) in zip(layers, before, strict=True):
                assert torch.equal(layer.win_k, k) and torch.equal(layer.win_v, v) and layer.hold_prompt
            super().place_prompt(model)

    kvpack.enable(model)
    try:
        cache = Probed(model, f"{METHOD}@fisher=16")
        forward(model, ids[0], cache)
    finally:
        kvpack.disable(model)
    a, b, c = seen["a"], seen["b"], seen["c"]
    assert a["predicted"] == b["predicted"] and (a["promoted"], a["demoted"]) == (b["promoted"], b["demoted"])
    assert set(a["predicted"]) == set(c["predicted"]) == {0, 1}
    assert all(c["predicted"][i] != a["predicted"][i] for i in (0, 1))
    assert not any(layer.hold_prompt for layer in cache.compressed_layers())


def test_a_hybrid_model_places_from_the_prompts_own_sliding_layer_states(monkeypatch):
    """Gemma3 with a sliding-window layer: while the prompt is held its sliding layer records every token, so the
    Fisher pass reads the prefix's K/V from the cache instead of prefilling it again; its predictions equal those of
    the pass that prefills the prefix itself (the independent route), and afterwards the sliding layer keeps its
    window only and the bytes are the uniform method's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(1))
    calls, real = [], prompt_widths.fisher_diagonal

    def recorded(model, prompt, scored, draws, seed=0, cache=None):
        calls.append(cache is not None)
        out = real(model, prompt, scored, draws, seed=seed, cache=cache)
        if cache is not None:  # the same signal from a prefix prefilled again
            again = real(model, prompt, scored, draws, seed=seed)
            for layer in (1, 2):
                torch.testing.assert_close(out[layer][0], again[layer][0], rtol=1e-3, atol=1e-9)
        return out

    monkeypatch.setattr(prompt_widths, "fisher_diagonal", recorded)
    cache, _, placed_bytes = _prefilled(model, ids, f"{METHOD}@fisher=16")
    assert calls == [True] and "promoted" in cache.prompt_widths
    sliding = cache.layers[0]
    assert isinstance(sliding, DynamicSlidingWindowLayer) and not sliding.record_past and sliding.keys.shape[-2] == 15
    assert placed_bytes == _prefilled(model, ids, f"{METHOD}@sliding=exact")[2]  # '@fisher' keeps the windows exact
