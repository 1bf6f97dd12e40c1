"""Sliding-window models: kvpack's layer kinds and memory report against transformers' own DynamicCache.

A Mistral-style config sets `sliding_window` without `layer_types`; transformers then keeps only the
window in every layer. kvpack must do the same, and `memory_report()["fp16_bytes"]` must be what a
real DynamicCache holds for the same tokens (its tensors counted at fp16 size), not a formula.
"""

from __future__ import annotations

import dataclasses
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
        cache = kvpack.KVCache(model, "int8@sliding=exact")
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    got = _drive(model, cache)
    assert torch.equal(got, expected)
    real, real_fp16 = _held(reference)
    report = cache.memory_report()
    assert report["tokens"] == reference.get_seq_length() == 46
    assert report["fp16_bytes"] == real_fp16
    assert report["total_bytes"] == real  # nothing compressed: the same fp32 window
    assert report["fp16_bytes"] < 46 * 2 * 2 * 2 * 16 * 2  # far less than every token of both layers


@pytest.mark.parametrize("method", ["fp16", "int8@sliding=exact", "kivi:2@sliding=exact", "turboquant:k3v2@sliding=exact"])
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


# -- sliding-window layers compressed (`MethodConfig.sliding`, name suffix `@sliding=METHOD`) ------------------------
WIDE = 200  # wider than a method's exact window plus a block (64 + 64), so a sliding layer's oldest tokens are coded


def _wide(kind: str):
    """A model whose sliding layers keep WIDE tokens: Gemma3 (one sliding, one full layer) or Mistral (every layer sliding)."""
    torch.manual_seed(0)
    if kind == "gemma3":
        cfg = Gemma3TextConfig(sliding_window=WIDE, layer_types=["sliding_attention", "full_attention"], **TINY)
        return Gemma3ForCausalLM(cfg).eval()
    return MistralForCausalLM(MistralConfig(sliding_window=WIDE, **TINY)).eval()


@pytest.fixture
def enabled():
    made = []

    def build(kind: str):
        model = _wide(kind)
        kvpack.enable(model)
        made.append(model)
        return model

    yield build
    for model in made:
        kvpack.disable(model)


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_lossless_compressed_sliding_layers_follow_dynamic_cache_and_hold_its_window(kind, enabled):
    """fp16 codes in the sliding layers: the logits of a prompt longer than the window and 200 decode steps past it
    match transformers' DynamicCache (its own sliding layers) to fp16 storage precision, and after every forward a
    sliding layer holds every token transformers' sliding layer holds and at most a 16th of its window more (the tokens
    it drops a few at a time; the logits above show they are never read)."""
    model = enabled(kind)
    reference = DynamicCache(config=model.config)
    expected = _drive(model, reference, prompt=300, steps=0)
    cache = kvpack.KVCache(model, "fp16@sliding=fp16")
    got = [_drive(model, cache, prompt=300, steps=0)]
    extra = set()
    ids = torch.randint(0, 64, (1, 200), generator=torch.Generator().manual_seed(2))
    for t in range(ids.shape[1]):
        with torch.no_grad():
            expected = torch.cat([expected, model(ids[:, t : t + 1], past_key_values=reference).logits[:, -1:]], 1)
            got.append(model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1:])
        held = [layer.length - layer.dropped for layer in cache.layers if layer.sliding_window]
        window = [layer.keys.shape[2] for layer in reference.layers if layer.is_sliding]
        assert all(w <= h < w + WIDE // 16 for h, w in zip(held, window, strict=True)), (held, window)
        extra.update(h - w for h, w in zip(held, window, strict=True))
    assert extra == set(range(WIDE // 16))  # a drop every 12 steps: 0 to 11 tokens past the window, each in turn
    assert torch.allclose(torch.cat(got, 1), expected, atol=2e-3, rtol=0)
    sliding = [layer for layer in cache.layers if layer.sliding_window]
    assert sliding and all(layer.segments for layer in sliding)  # the window's older tokens were coded, not only held exact
    assert cache.memory_report()["fp16_bytes"] == _held(reference)[1]


def test_int8_sliding_layer_holds_a_quarter_of_the_fp32_window(enabled):
    model = enabled("gemma3")
    reference = DynamicCache(config=model.config)
    expected = _drive(model, reference, prompt=300, steps=80)
    cache = kvpack.KVCache(model, "fp16@sliding=int8")
    got = _drive(model, cache, prompt=300, steps=80)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    window = reference.layers[0]
    exact_bytes = window.keys.nbytes + window.values.nbytes  # fp32
    assert cache.layers[0].nbytes() < 0.4 * exact_bytes  # int8 rows for most of it, an fp16 exact window of 64 tokens
    assert cache.memory_report()["fp16_bytes"] == _held(reference)[1]


def test_a_sliding_decode_step_takes_the_fused_kernels(enabled, monkeypatch):
    """The window's mask is all True over what a sliding layer still holds, so its decode step is the unmasked one."""
    from kvpack import attention

    model = enabled("gemma3")
    cache = kvpack.KVCache(model, "fp16@sliding=int8")
    _drive(model, cache, prompt=300, steps=1)
    masked = []
    segmented = attention.segmented_attention
    monkeypatch.setattr(attention, "segmented_attention", lambda layer, q, *a, **k: masked.append(layer.layer_idx) or segmented(layer, q, *a, **k))
    _drive_more(model, cache, 3)
    assert masked == []


@pytest.mark.parametrize("sliding", ["int8", "int8:rotated", "turboquant:k4v4"])
def test_a_fused_sliding_step_leaves_out_the_tokens_past_the_window_as_the_mask_does(enabled, monkeypatch, sliding):
    """Between drops a sliding layer holds up to a 16th of its window past it; the fused step (no mask) must leave them
    out exactly as transformers' sliding mask does on the masked path, step for step through a drop."""
    from kvpack import attention

    model = enabled("mistral")  # every layer sliding
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(5))
    fused, masked = (kvpack.KVCache(model, f"int8@sliding={sliding}") for _ in range(2))
    _drive(model, fused, prompt=300, steps=0)
    _drive(model, masked, prompt=300, steps=0)
    hidden, got, want = set(), [], []
    for t in range(ids.shape[1]):
        with torch.no_grad():
            got.append(model(ids[:, t : t + 1], past_key_values=fused).logits)
            hidden.add(fused.layers[0].hidden_front())
            with monkeypatch.context() as m:
                m.setattr(attention, "fused_decode", lambda *a, **k: None)  # the masked path over the same codes
                want.append(model(ids[:, t : t + 1], past_key_values=masked).logits)
    assert len(hidden) > 5 and 0 in hidden  # tokens past the window were held, and dropped, along the way
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-4, rtol=1e-4)


def _drive_more(model, cache, steps: int) -> None:
    ids = torch.randint(0, 64, (1, steps), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for t in range(steps):
            model(ids[:, t : t + 1], past_key_values=cache)


def test_a_saved_cache_with_dropped_tokens_loads_and_continues_alike(enabled, tmp_path):
    model = enabled("gemma3")
    cache = kvpack.KVCache(model, "fp16@sliding=int8")
    _drive(model, cache, prompt=300, steps=40)
    cache.save(tmp_path / "c.kvpack")
    loaded = kvpack.KVCache.load(tmp_path / "c.kvpack", model)
    assert loaded.layers[0].dropped == cache.layers[0].dropped > 0
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = model(ids, past_key_values=cache).logits
        b = model(ids, past_key_values=loaded).logits
    assert torch.equal(a, b)


def test_cropping_a_sliding_layer_once_it_dropped_tokens_is_refused(enabled):
    """A cut would leave the next query without the window before it; before the window fills a crop works."""
    model = enabled("gemma3")
    cache = kvpack.KVCache(model, "fp16@sliding=int8")
    _drive(model, cache, prompt=150, steps=0)
    cache.crop(-10)
    assert cache.get_seq_length() == 140 and cache.layers[0].length == 140
    _drive_more(model, cache, 100)
    assert cache.layers[0].dropped > 0
    with pytest.raises(ValueError, match="dropped its first"):
        cache.crop(-1)
    assert cache.get_seq_length() == 240  # nothing cut in any layer


def test_without_kvpack_attention_a_compressed_sliding_layer_still_holds_only_its_window():
    """The model's own attention reads the dequantized layer: zeros where it dropped tokens, which its mask never reads."""
    model = _wide("gemma3")
    reference = DynamicCache(config=model.config)
    expected = _drive(model, reference, prompt=300, steps=3)
    cache = kvpack.KVCache(model, "fp16@sliding=fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dequantizing path warns once
        got = _drive(model, cache, prompt=300, steps=3)
    layer = cache.layers[0]
    # the prompt's forward dropped all but the window; three steps later three more tokens wait for the next drop
    assert layer.length == 303 and layer.length - layer.dropped == reference.layers[0].keys.shape[2] + 3 == WIDE + 2
    assert torch.allclose(got, expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("turboquant:k3v2@sliding=nope", "unknown method 'nope'"),
        ("turboquant:k3v2@sliding=shard", "tiers, prompt codecs"),
        ("turboquant:k3v2@sliding=int8@seed=1@sliding=int8", "each at most once"),
        ("turboquant:k3v2+ropemean@fisher=32@sliding=int8", "@sliding=exact"),
    ],
)
def test_sliding_option_refusals_name_the_fix(name, match):
    with pytest.raises(ValueError, match=match):
        kvpack.get_method(name)


def test_sliding_layers_draw_from_the_methods_seed():
    method = kvpack.get_method("turboquant:k3v2@sliding=turboquant:k4v4+ropemean@seed=5")
    assert method.name == "turboquant:k3v2@sliding=turboquant:k4v4+ropemean@seed=5"
    side = method.sliding_method()
    assert side.key.options["seed"] == side.value.options["seed"] == 5
    assert side.sink_tokens == 0 and side.anchors == 0
    assert kvpack.get_method("turboquant:k3v2@sliding=exact").sliding_method() is None


@pytest.mark.parametrize(("name", "windows"), [
    (kvpack.DEFAULT_METHOD, "int8_rotated"), ("turboquant:k3v2", "int8_rotated"), ("shard", "int8_rotated"),
    ("tiered:1024:shard", "int8_rotated"), ("turboquant:k3v2@sliding=int8", "int8"),
    ("fp16", None),  # lossless: its windows stay as exact as its other layers
    (f"{kvpack.DEFAULT_METHOD}@fisher=32", None),  # reads every prompt token's K/V after the prefill
    ("turboquant:k3v2@sliding=exact", None), ("turboquant:k3v2@sliding=turboquant:k4v4", "turboquant"),
])
def test_sliding_windows_are_coded_in_rotated_int8_unless_the_method_cannot_use_them(name, windows, enabled):
    """By default ("auto") a sliding-window layer holds rotated int8 rows; exact windows where the method is lossless, where it
    reads the whole prompt after the prefill, or where asked for. The layers built on a Gemma-3 model follow."""
    method = kvpack.get_method(name)
    side = method.sliding_method()
    assert (side and side.key.codec) == windows
    assert name.endswith("@sliding=exact") or "@sliding=auto" not in method.name  # the default adds no suffix
    cache = kvpack.KVCache(enabled("gemma3"), method)
    first = cache.layers[0]
    if windows is None:
        assert isinstance(first, DynamicSlidingWindowLayer)
    else:
        assert isinstance(first, KVPackLayer) and first.sliding_window == WIDE and first.method.key.codec == windows


def test_a_seed_draws_the_windows_when_only_they_draw_at_random(enabled):
    """Plain int8 draws nothing at random, its TurboQuant (or rotated int8) windows do: `@seed=N` must reach them (and `compare --draws` run
    them N times), each seed a different rotation of the windows' codes, the same seed the same logits."""
    from kvpack.cache.serialize import method_from_json, method_to_json
    from kvpack.cli import expand_draws

    name = "int8@sliding=turboquant:k4v4+ropemean"
    method = kvpack.get_method(f"{name}@seed=3")
    assert method.name == f"{name}@seed=3" and method.sliding_seed == 3
    side = method.sliding_method()
    assert side.key.options["seed"] == side.value.options["seed"] == 3
    assert method_from_json(method_to_json(method)) == method
    assert expand_draws([name], 3) == [f"{name}@seed={s}" for s in range(3)]
    for plain in ("int8", "int8@sliding=int8", "int8@sliding=exact"):  # its default windows keep one fixed rotation
        with pytest.raises(ValueError, match="draws nothing at random"):
            kvpack.get_method(f"{plain}@seed=3")
    assert kvpack.get_method("int8@sliding=int8:rotated@seed=3").sliding_method().key.options["seed"] == 3
    assert kvpack.get_method("turboquant:k3v2@seed=3").sliding_method().key.options["seed"] == 3  # "auto" follows the codecs
    assert method.with_sliding("exact").sliding_seed is None
    with pytest.raises(ValueError, match="sliding_seed must be None or a non-negative integer"):
        dataclasses.replace(method, sliding_seed=-1)
    model = enabled("mistral")  # every layer slides: only the windows' codecs act
    runs = {seed: _drive(model, kvpack.KVCache(model, f"{name}@seed={seed}"), prompt=300, steps=4) for seed in (3, 4)}
    again = _drive(model, kvpack.KVCache(model, f"{name}@seed=3"), prompt=300, steps=4)
    assert torch.equal(again, runs[3])
    assert not torch.allclose(runs[3], runs[4], atol=1e-5)


def test_left_padded_rows_of_a_compressed_sliding_layer_follow_dynamic_cache(enabled):
    """Pads sit in the sink region until the window passes them; each row reads what DynamicCache gives it."""
    model = enabled("gemma3")
    ids = torch.randint(1, 64, (2, 260), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # row 1: 37 pads on the left
    expected, got = [], []
    for cache, out in ((DynamicCache(config=model.config), expected), (kvpack.KVCache(model, "fp16@sliding=fp16"), got)):
        m = mask
        with torch.no_grad():
            logits = model(ids, attention_mask=m, past_key_values=cache).logits[:, -1:]
            out.append(logits)
            for _ in range(120):
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
                logits = model(logits.argmax(-1), attention_mask=m, past_key_values=cache).logits[:, -1:]
                out.append(logits)
        if isinstance(cache, kvpack.KVCache):
            assert cache.layers[0].dropped > 0 and cache.layers[0].sink_k.shape[2] == 0
    assert torch.allclose(torch.cat(got, 1), torch.cat(expected, 1), atol=2e-3, rtol=0)
