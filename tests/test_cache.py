"""The drop-in cache: exactness of lossless methods against DynamicCache, generation features,
compressed-domain attention against a plain-softmax reference, and memory accounting."""

from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import kvpack
from kvpack.attention import segmented_attention
from kvpack.cache import KVPackLayer
from kvpack.registry import get_method, list_methods

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=4096)


def _tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, num_key_value_heads=1, **SMALL)).eval()
    cfg = Gemma3TextConfig(num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=32, sliding_window_pattern=3, **SMALL)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def tiny(request):
    model = _tiny(request.param)
    yield model
    kvpack.disable(model)


def _generate(model, ids, cache, enabled: bool, **kwargs):
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        return model.generate(ids, past_key_values=cache, max_new_tokens=kwargs.pop("max_new_tokens", 64), **kwargs)
    finally:
        kvpack.disable(model)


@pytest.mark.parametrize("method", ["fp16", "int8"])
@pytest.mark.parametrize("enabled", [False, True])
def test_lossless_methods_reproduce_dynamic_cache_greedy(tiny, method, enabled):
    ids = torch.randint(0, 128, (1, 260), generator=torch.Generator().manual_seed(1))
    ref = tiny.generate(ids, past_key_values=DynamicCache(config=tiny.config), max_new_tokens=64, do_sample=False)
    out = _generate(tiny, ids, kvpack.KVCache(tiny, method), enabled, do_sample=False)
    assert torch.equal(out, ref)


def test_decoding_without_enable_says_once_how_to_compute_on_the_compressed_cache(monkeypatch):
    """Without kvpack.enable each step widens the compressed segments to float: one RuntimeWarning names the fix;
    under enable (or before anything is compressed) there is none."""
    from kvpack.cache import layer as layer_module

    model = _tiny("llama")
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(9))
    monkeypatch.setattr(layer_module, "_DEQUANTIZE_WARNED", threading.Event())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _generate(model, ids, kvpack.KVCache(model, "int8"), True, max_new_tokens=4, do_sample=False)
        assert not [w for w in seen if "kvpack.enable" in str(w.message)]
        _generate(model, ids[:, :20], kvpack.KVCache(model, "int8"), False, max_new_tokens=4, do_sample=False)
        assert not [w for w in seen if "kvpack.enable" in str(w.message)]  # 24 tokens: nothing compressed yet
        _generate(model, ids, kvpack.KVCache(model, "int8"), False, max_new_tokens=8, do_sample=False)
        _generate(model, ids, kvpack.KVCache(model, "int8"), False, max_new_tokens=8, do_sample=False)
    hits = [w for w in seen if "kvpack.enable(model)" in str(w.message)]
    assert len(hits) == 1 and hits[0].category is RuntimeWarning and "dequantizes" in str(hits[0].message)


def test_left_padded_batch_matches_dynamic_cache(tiny):
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :37], mask[1, :37] = 0, 0  # row 1 is left padded
    ref = tiny.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=tiny.config), max_new_tokens=32, do_sample=False)
    out = _generate(tiny, ids, kvpack.KVCache(tiny, "fp16"), True, attention_mask=mask, max_new_tokens=32, do_sample=False)
    assert torch.equal(out, ref)


def test_beam_search_matches_dynamic_cache(tiny):
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(3))
    ref = tiny.generate(ids, past_key_values=DynamicCache(config=tiny.config), max_new_tokens=24, num_beams=3, do_sample=False)
    out = _generate(tiny, ids, kvpack.KVCache(tiny, "fp16"), True, max_new_tokens=24, num_beams=3, do_sample=False)
    assert torch.equal(out, ref)


def test_sampling_matches_dynamic_cache_with_same_seed(tiny):
    ids = torch.randint(0, 128, (1, 140), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(11)
    ref = tiny.generate(ids, past_key_values=DynamicCache(config=tiny.config), max_new_tokens=32, do_sample=True, top_k=20)
    torch.manual_seed(11)
    out = _generate(tiny, ids, kvpack.KVCache(tiny, "fp16"), True, max_new_tokens=32, do_sample=True, top_k=20)
    assert torch.equal(out, ref)


def test_crop_then_continue_matches_uncropped_prefix():
    model = _tiny("llama")
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(5))
    kvpack.enable(model)
    try:
        cache = kvpack.KVCache(model, "fp16")
        model(ids, past_key_values=cache)
        cache.crop(-150)  # reaches past the window into compressed segments
        assert cache.get_seq_length() == 250
        logits = model(ids[:, 250:260], past_key_values=cache).logits
    finally:
        kvpack.disable(model)
    ref = model(ids[:, :260]).logits[:, 250:260]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)


def test_assisted_generation_crops_correctly():
    model = _tiny("llama")
    assistant = _tiny("llama")
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(6))
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    out = _generate(model, ids, kvpack.KVCache(model, "fp16"), True, assistant_model=assistant, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, ref)


def _reference_attention(layer: KVPackLayer, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """Plain softmax attention over the layer's dequantized K/V (an independent computation)."""
    k, v = layer.dequantized()
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    return torch.softmax(q.float() @ k.transpose(-1, -2) * scaling, dim=-1) @ v


class _Cfg:
    _attn_implementation = "kvpack"


def _one_decode_step(method: str, gqa: int, n: int, seed: int, b: int = 2, hk: int = 2, d: int = 64):
    """A layer holding an `n`-token prompt (flushed: sinks, compressed segments, window) plus one decoded
    token, and a decode query `(b, hk * gqa, 1, d)`."""
    torch.manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(get_method(method), 0, _Cfg(), (inv_freq, 1.0))
    layer.update(torch.randn(b, hk, n, d), torch.randn(b, hk, n, d))
    layer.flush()
    layer.update(torch.randn(b, hk, 1, d), torch.randn(b, hk, 1, d))
    return layer, torch.randn(b, hk * gqa, 1, d)


@pytest.mark.parametrize("method", list_methods())
@pytest.mark.parametrize("gqa", [1, 4, 7])
def test_compressed_attention_equals_reference_over_dequantized_cache(method, gqa):
    layer, q = _one_decode_step(method, gqa, 4 + 64 * 5 + 37, seed=gqa)
    d = q.shape[-1]
    out = segmented_attention(layer, q, None, d**-0.5)
    torch.testing.assert_close(out, _reference_attention(layer, q, d**-0.5), atol=2e-4, rtol=1e-3)
    assert layer.segments or method == "fp16"



@pytest.mark.parametrize("method", list_methods())
@pytest.mark.parametrize("gqa", [1, 4, 7])
def test_fused_decode_equals_reference_over_dequantized_cache(method, gqa):
    """The CPU decode path (one fused kernel per part where the codecs have one: TurboQuant, int8,
    Shard's PCA + VQ) against plain attention over the layer's dequantized K/V."""
    from kvpack import kernels
    from kvpack.attention import fused_decode

    if not kernels.available():
        pytest.skip("CPU kernels unavailable")
    layer, q = _one_decode_step(method, gqa, 4 + 64 * 5 + 37, seed=gqa)
    d = q.shape[-1]
    out = fused_decode(layer, q, d**-0.5)
    assert out is not None
    torch.testing.assert_close(out, _reference_attention(layer, q, d**-0.5), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("gqa,rope_scaling,method", [(1, 1.0, "turboquant:k3v2+ropemean"), (3, 1.25, "turboquant:k3v2+ropemean"),
                                                     (3, 1.0, "turboquant:k3v2+ropemean+tcq")])
def test_turning_mean_keys_decode_fused_and_through_ops_as_over_the_dequantized_cache(monkeypatch, gqa, rope_scaling, method):
    """`turboquant:k3v2+ropemean` on keys with a constant component before RoPE (so pairs turn and the kernel adds
    their per-token term): the CPU kernel, the custom ops (torch references; Triton under its interpreter) and plain
    attention over the dequantized cache agree, over the prompt's tokens and a later block at other positions. With
    `+tcq` the kernels read trellis windows (a `(2**L,)` table) on both sides."""
    from kvpack import attention, kernels
    from kvpack.codecs.base import group_query
    from kvpack.primitives.rope import apply_rope, rope_cos_sin

    torch.manual_seed(gqa)
    b, hk, d, n = 2, 2, 64, 4 + 64 * 5 + 37
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(get_method(method), 0, _Cfg(), (inv_freq, rope_scaling))
    offset = 4 * torch.randn(1, hk, 1, d)

    def keys(start, count):  # RoPE'd as the model does, its attention scaling included (YaRN-style models scale cos/sin)
        cos, sin = rope_cos_sin(torch.arange(start, start + count)[None].expand(b, -1), inv_freq, rope_scaling)
        return apply_rope(offset + torch.randn(b, hk, count, d), cos, sin)

    layer.update(keys(0, n), torch.randn(b, hk, n, d))
    layer.flush()
    coded = sum(seg.length for seg in layer.segments)
    for step in range(70):  # a block of decoded tokens leaves the window and is coded at its own positions
        layer.update(keys(n + step, 1), torch.randn(b, hk, 1, d))
        layer.flush()  # what kvpack attention does after reading each step
    assert sum(seg.length for seg in layer.segments) > coded and all(c._turning_state() is not None for seg in layer.segments for c in seg.key_codec.inner)  # one codec per batch row
    q = torch.randn(b, hk * gqa, 1, d)
    ref = _reference_attention(layer, q, d**-0.5)
    torch.testing.assert_close(segmented_attention(layer, q, None, d**-0.5), ref, atol=2e-4, rtol=1e-3)
    if kernels.available():
        torch.testing.assert_close(attention.fused_decode(layer, q, d**-0.5), ref, atol=2e-4, rtol=1e-3)
        from kvpack.kernels import table

        for seg in layer.segments:  # through the kernel, not the codec's torch scores
            assert table.segment_partial(group_query(q, hk), seg, d**-0.5, attention._first_position(layer, seg)) is not None
    from kvpack.kernels import ops, table

    backends = ["torch", *(["cpu"] if kernels.available() else []), *(["triton"] if ops.triton_available() else [])]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for backend in backends:  # the route a CUDA step takes: the op's kernel forms the turning term from its turn_* arguments
        monkeypatch.setattr(ops, "_override", ops.Backend(backend))
        out = attention.fused_decode(layer, q, d**-0.5)
        atol = 1e-3 if backend == "triton" else 2e-4  # Triton's q·k takes fp16 operands (docs/guide/gpu.md); keys 4x the unit scale
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-3, msg=lambda m, backend=backend: f"{backend}: {m}")
        for seg in layer.segments:
            assert table.segment_partial(group_query(q, hk), seg, d**-0.5, attention._first_position(layer, seg)) is not None


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("method", ["turboquant:k3v2", "int8", "shard:tq4", "shard:k3v2+e1", "kivi:2"])
def test_device_decode_path_through_custom_ops(monkeypatch, backend, method):
    """The route a CUDA decode step takes (the `kvpack::` ops: Triton kernels, run here on CPU tensors by
    Triton's interpreter, or the torch references) against attention over the dequantized cache."""
    from kvpack import attention
    from kvpack.codecs.base import group_query
    from kvpack.kernels import ops

    if backend == "triton" and not ops.triton_available():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_override", ops.Backend(backend))
    layer, q = _one_decode_step(method, 3, 4 + 64 * 3 + 21, seed=0)
    hk, d = layer.kv_heads, q.shape[-1]
    out = attention.fused_decode(layer, q, d**-0.5)
    # The ops read float16 norms and tables; the reference decodes to float32 (3e-4: 2.3e-4 seen on an output near 0).
    torch.testing.assert_close(out, _reference_attention(layer, q, d**-0.5), atol=3e-4, rtol=1e-3)
    from kvpack.kernels import table

    for seg in layer.segments:  # every segment went through an op, none through its codec's own scores / weighted_sum
        assert table.segment_partial(group_query(q, hk), seg, d**-0.5, attention._first_position(layer, seg)) is not None, seg.kind
    if backend == "triton":  # on CPU tensors, the Triton backend routes a decode step through the ops
        assert ops.implementation("tq_attention", q.device).__module__.endswith("triton_attention")
        torch.testing.assert_close(attention.fused_decode(layer, q, d**-0.5), out)

def test_shard_ops_path_after_the_cpu_kernel_dropped_the_float_basis(monkeypatch):
    """The CPU kernel's integer rebuild drops the PCA codec's float basis from its kernel state (memory_report
    counts what a codec holds); the op's other implementations (a GPU's, here its torch reference) run on the same layer
    afterwards rebuild it from its integer form and still match attention over the dequantized cache."""
    from kvpack import attention, kernels
    from kvpack.kernels import cpu_lut, ops

    if not (kernels.available() and cpu_lut.int8_rebuild()):
        pytest.skip("no CPU integer rebuild on this machine: the float basis is never dropped")
    layer, q = _one_decode_step("shard", 3, 4 + 64 * 5 + 37, seed=5)
    d = q.shape[-1]
    expected = _reference_attention(layer, q, d**-0.5)
    torch.testing.assert_close(attention.fused_decode(layer, q, d**-0.5), expected, atol=2e-4, rtol=1e-3)
    prompt = next(seg for seg in layer.segments if seg.key_codec.kernel_kind == "pca")
    assert prompt.key_codec.kernel_state()["basis_t"].numel() == 0
    monkeypatch.setattr(ops, "_override", ops.Backend("torch"))
    out = attention.fused_decode(layer, q, d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-3)


def test_memory_report_matches_hand_count():
    torch.manual_seed(0)
    b, hk, d = 1, 2, 64
    layer = KVPackLayer(get_method("int8"), 0, _Cfg())
    layer.update(torch.randn(b, hk, 300, d), torch.randn(b, hk, 300, d))
    layer.flush()
    # The prompt leaves 4 sinks and exactly the 64-token window: 296 -> 232 compressed.
    mem = layer.memory()
    assert mem["sink"] == 2 * b * hk * 4 * d * 2  # fp16 K and V (exact_dtype default)
    assert mem["window"] == 2 * b * hk * 64 * d * 2
    assert mem["stream:int8/int8"] == 2 * b * hk * 232 * (d + 2)  # int8 codes + fp16 scale per vector
    # Decoded tokens leave in whole 64-token blocks: 63 more stay exact, the 64th flushes a block.
    for step in range(64):
        layer.update(torch.randn(b, hk, 1, d), torch.randn(b, hk, 1, d))
        layer.flush()
        expect_window = 64 + step + 1 if step < 63 else 64
        assert layer.memory()["window"] == 2 * b * hk * expect_window * d * 2
    # The run grows into spare capacity (a 32nd of its tokens, at least a block), which is held memory.
    live = 2 * b * hk * 296 * (d + 2)
    held = layer.memory()["stream:int8/int8"]
    assert held == sum(t.numel() * t.element_size() for seg in layer.segments for run in (seg.key_run, seg.value_run) for t in run._bufs.values())
    assert live <= held <= live + 2 * b * hk * 64 * (d + 2)


@pytest.mark.parametrize("pad", [0, 100])
def test_shard_rank_comes_from_the_prompts_real_queries_under_kvpack_attention(monkeypatch, pad):
    """Under kvpack.enable the prompt's last real (unpadded) queries reach the PCA fit; without it key energy decides."""
    from kvpack.cache import layer as layer_module
    from kvpack.codecs.pca import PCAKeyCodec

    monkeypatch.setattr(layer_module, "FIT_QUERIES", 1000)  # keep every real row, to see that pads are left out
    seen, fit = [], PCAKeyCodec.fit
    monkeypatch.setattr(PCAKeyCodec, "fit", lambda self, x, positions=None, queries=None: seen.append(queries) or fit(self, x, positions, queries))
    model = _tiny("llama")
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    for enabled in (True, False):
        seen.clear()
        cache = kvpack.KVCache(model, "shard")
        (kvpack.enable if enabled else kvpack.disable)(model)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
        kvpack.disable(model)
        codec = cache.layers[0]._codecs["prefill_key"]
        assert codec.rank_source == ("queries" if enabled else "energy")
        assert all(layer.fit_queries is None for layer in cache.layers)
        if enabled:
            assert [q.shape for q in seen] == [(2, 4, 300 - pad, 16)] * 2  # batch, q heads, real rows, head_dim
        else:
            assert seen == [None, None]
    # A method whose codecs fit without queries keeps none, even before its first fit.
    cache = kvpack.KVCache(model, "turboquant:k3v2")
    kvpack.enable(model)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache)
    kvpack.disable(model)
    assert not cache.layers[0].segments and cache.layers[0].fit_queries is None


def test_prompt_flush_respects_codec_token_multiple():
    b, hk, d = 1, 2, 64
    layer = KVPackLayer(get_method("kivi:2"), 0, _Cfg())
    layer.update(torch.randn(b, hk, 300, d), torch.randn(b, hk, 300, d))
    layer.flush()
    # KIVI keys quantize per channel over 32-token groups: 232 overflowing tokens -> 224 compressed.
    assert layer.win_k.shape[2] == 300 - 4 - 224
    assert sum(seg.length for seg in layer.segments) == 224


def test_cache_memory_report_ratio_is_real():
    model = _tiny("llama")
    cache = kvpack.KVCache(model, "int8")
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 1000)), past_key_values=cache)
    rep = cache.memory_report()
    held = sum(sum(layer.memory().values()) for layer in cache.layers)
    assert rep["total_bytes"] == held
    assert rep["fp16_bytes"] == 2 * 1000 * 2 * 16 * 2 * 2  # layers * tokens * kv_heads * head_dim * (K+V) * 2 bytes
    # Per layer: 4 fp16 sinks, 932 int8 tokens (head_dim 16 + fp16 scale), a 64-token fp16 window; K and V, 2 kv heads.
    per_layer = 2 * 2 * (4 * 16 * 2 + 932 * (16 + 2) + 64 * 16 * 2)
    assert rep["total_bytes"] == 2 * per_layer


def test_native_exact_dtype_keeps_model_precision():
    layer = KVPackLayer(get_method("int8").with_options(exact_dtype="native"), 0, _Cfg())
    k = torch.randn(1, 2, 10, 64)
    layer.update(k, k)
    assert layer.win_k.dtype == torch.float32 and torch.equal(layer.dequantized()[0], k)


def test_unsupported_model_type_names_it():
    cfg = LlamaConfig(num_hidden_layers=1, **SMALL)
    cfg.model_type = "mamba"
    with pytest.raises(ValueError, match="mamba"):
        kvpack.KVCache(cfg, "int8")


def test_unknown_method_lists_available():
    with pytest.raises(ValueError, match="available"):
        kvpack.KVCache(_tiny("llama"), "zip:9")


def test_wrong_batch_after_init_is_a_clear_error():
    layer = KVPackLayer(get_method("int8"), 0, None)
    layer.update(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64))
    with pytest.raises(ValueError, match="fresh cache"):
        layer.update(torch.randn(3, 2, 1, 64), torch.randn(3, 2, 1, 64))


def test_partial_merge_is_exact_softmax():
    from kvpack.attention import Partial

    s = torch.randn(2, 3, 4, 50)
    v = torch.randn(2, 3, 50, 8)
    p = Partial()
    for a, b in [(0, 20), (20, 21), (21, 50)]:
        p.add(s[..., a:b], lambda w, a=a, b=b: w @ v[:, :, a:b])
    torch.testing.assert_close(p.result(), torch.softmax(s, -1) @ v)
    assert math.isfinite(float(p.result().sum()))


def test_decode_bench_fills_query_fitted_methods_through_a_real_forward():
    """bench.decode times Shard as a user gets it: its PCA rank chosen from the prompt's queries, not key energy."""
    from kvpack.bench.decode import fill_kvpack, prefill_dynamic

    model = _tiny("llama")
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(6))
    kvpack.enable(model)
    try:
        source, _ = prefill_dynamic(model, ids)
        for given, expect in ((ids, "queries"), (None, "energy")):
            cache, seconds = fill_kvpack(model, "shard", source, given)
            assert cache.get_seq_length() == 300 and seconds > 0
            assert cache.layers[0]._codecs["prefill_key"].rank_source == expect
    finally:
        kvpack.disable(model)


def test_a_forward_that_broke_off_mid_layer_does_not_poison_the_next_forward():
    """A layer left waiting for its attention (an exception between update and attention) must not make a later
    forward of the same model, with another cache, refuse its untagged attention."""
    from transformers import DynamicCache

    from kvpack.cache.layer import PENDING

    model = _tiny("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    stale = kvpack.KVCache(model, "int8")  # installs the model's forward hook
    kvpack.enable(model)
    try:
        stale.layers[0].lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
        stale.layers[0].pending_attention = True
        PENDING.layer = stale.layers[0]
        with torch.no_grad():
            out = model(ids, past_key_values=DynamicCache(config=model.config)).logits
    finally:
        kvpack.disable(model)
    assert torch.isfinite(out).all()


def test_seed_suffix_is_another_draw_of_the_same_method():
    """`name@seed=N` seeds every codec that draws at random (tiers and prompt codecs included) and leaves the rest: a
    cache holds other codes for the same tokens in the same bytes. Suffixes that cannot apply are clear errors."""
    base, other = get_method("tiered:512:tq"), get_method("tiered:512:tq@seed=4")
    assert other.name == "tiered:512:tq@seed=4"
    pairs = [(base.key, other.key), (base.value, other.value), *((t.key, u.key) for t, u in zip(base.tiers, other.tiers, strict=True))]
    assert all(b.codec == a.codec and b.options == {**a.options, "seed": 4} for a, b in pairs)
    shard, seeded = get_method("shard"), get_method("shard@seed=2")
    assert (seeded.key, seeded.prefill_key) == (shard.key, shard.prefill_key)  # int8 stream, PCA keys: nothing random
    assert seeded.prefill_value.options == {**shard.prefill_value.options, "seed": 2}
    model = _tiny("llama")
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(7))
    held = {}
    kvpack.enable(model)
    try:
        tq = "turboquant:k3v2@anchors=0.5%@window=32"  # TurboQuant's rotation is drawn (Shard's prompt keys are not)
        for name in (tq, f"{tq}@seed=1"):
            cache = kvpack.KVCache(model, name)
            with torch.no_grad():
                model(ids, past_key_values=cache)
            held[name] = (cache.memory_report()["total_bytes"], cache.layers[0].segments[0].keys.codes)
    finally:
        kvpack.disable(model)
    (bytes0, codes0), (bytes1, codes1) = held.values()
    assert bytes0 == bytes1 and codes0.shape == codes1.shape and not torch.equal(codes0, codes1)
    with pytest.raises(ValueError, match="draws nothing at random"):
        get_method("int8@seed=1")
    with pytest.raises(ValueError, match="non-negative integer"):
        kvpack.KVCache(model, "turboquant:k3v2@seed=-1")


def test_a_cache_from_the_config_reads_the_rotary_tables_the_model_holds(tiny):
    """Methods that read positions built from `model.config` alone: each compressed layer's (inv_freq, attention scaling)
    is the model's own rotary module's (Gemma-3's per-layer-type tables included), and with a scaled RoPE as well."""
    configs = [tiny]
    if isinstance(tiny, LlamaForCausalLM):
        torch.manual_seed(0)
        rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256}
        configs.append(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **{**SMALL, "rope_parameters": rope})).eval())
    for model in configs:
        pairs = zip(kvpack.KVCache(model.config, "turboquant:k3v2+ropemean").layers, kvpack.KVCache(model, "turboquant:k3v2+ropemean").layers, strict=True)
        compressed = [(a, b) for a, b in pairs if isinstance(a, KVPackLayer)]
        assert compressed and all(torch.equal(a.rope[0], b.rope[0]) and a.rope[1] == b.rope[1] for a, b in compressed)
    if len(configs) > 1:
        assert configs[1].model.rotary_emb.attention_scaling != 1.0  # YaRN scales cos/sin: the check above covered it
