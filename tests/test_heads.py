"""Widths per kv head (`HeadsCodec`): each group of heads reads back exactly as its own codec alone would store it, the
compressed-domain attention paths (torch, CPU kernels, custom ops) equal attention over the dequantized cache, blocks
survive crop, anchors, files and block storage, and `auto` allocates per head no worse than per layer."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kvpack
from kvpack import allocator, auto
from kvpack.cache.layer import KVPackLayer
from kvpack.codecs.heads import HeadsCodec, HeadsConfig
from kvpack.codecs.int8 import Int8Codec, Int8Config
from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig
from kvpack.registry import CodecSpec, LayerCodecs, MethodConfig
from kvpack.serve import blocks

TQ3 = {"codec": "turboquant", "options": {"bits": 3, "center": True}}
TQ2 = {"codec": "turboquant", "options": {"bits": 2, "center": True}}
INT8 = {"codec": "int8", "options": {}}


def _spec(heads, codecs) -> CodecSpec:
    return CodecSpec("heads", {"heads": list(heads), "codecs": list(codecs)})


def _method(heads=(0, 1, 0), keys=(TQ3, INT8), values=(TQ2, TQ3), **kwargs) -> MethodConfig:
    """Heads 0 and 2 share group 0 (3-bit keys, 2-bit values), head 1 is group 1 (int8 keys, 3-bit values)."""
    return MethodConfig("heads-test", _spec(heads, keys), _spec(heads, values), **kwargs)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"heads": [0, 1], "codecs": [TQ3]}, r"every group index in 0..0"),
        ({"heads": [0, 0], "codecs": [TQ3, INT8]}, r"every group index in 0..1"),
        ({"heads": [], "codecs": [TQ3]}, "non-empty list of group indices"),
        ({"heads": [0], "codecs": []}, "non-empty list"),
        ({"heads": [0], "codecs": [{"codec": "pca", "options": {}}]}, r"one of \('fp16', 'int8', 'turboquant'\)"),
        ({"heads": [0], "codecs": [{"codec": "turboquant", "options": {"bits": 9}}]}, "codec 'turboquant'"),
        ({"heads": [True], "codecs": [TQ3]}, "group indices"),
    ],
)
def test_config_refuses_bad_partitions_and_codecs(options, match):
    with pytest.raises(ValueError, match=match):
        CodecSpec("heads", options)


def test_a_codec_for_other_head_counts_is_refused():
    with pytest.raises(ValueError, match="for 3 kv heads cannot store a layer of 2"):
        _spec([0, 1, 0], [TQ3, INT8]).build(64, 2)


def test_each_group_reads_back_as_its_own_codec_alone():
    """The independent reference: a TurboQuant codec fitted on heads 0 and 2 alone and an int8 codec on head 1."""
    x = torch.randn(2, 3, 130, 64, generator=torch.Generator().manual_seed(0))
    codec = _spec([0, 1, 0], [TQ3, INT8]).build(64, 3, layer_idx=5)
    codec.fit(x)
    out = codec.decode(codec.encode(x))
    tq = TurboQuantCodec(TurboQuantConfig(bits=3, center=True), 64, 2, layer_idx=5)
    tq.fit(x[:, [0, 2]])
    i8 = Int8Codec(Int8Config(), 64, 1)
    assert torch.equal(out[:, [0, 2]], tq.decode(tq.encode(x[:, [0, 2]])))
    assert torch.equal(out[:, [1]], i8.decode(i8.encode(x[:, [1]])))


@pytest.mark.parametrize("gqa", [1, 3])
def test_scores_and_weighted_sum_equal_products_with_the_decoded_heads(gqa):
    gen = torch.Generator().manual_seed(gqa)
    x = torch.randn(2, 3, 90, 64, generator=gen)
    codec = _spec([1, 0, 1], [TQ2, INT8]).build(64, 3)
    codec.fit(x)
    packed = codec.encode(x)
    k = codec.decode(packed).repeat_interleave(gqa, 1)  # (b, q_heads, t, d): query head h reads kv head h // gqa
    q = torch.randn(2, 3 * gqa, 5, 64, generator=gen)
    torch.testing.assert_close(codec.scores(q, packed), q @ k.mT, atol=1e-4, rtol=1e-4)
    p = torch.softmax(torch.randn(2, 3 * gqa, 5, 90, generator=gen), -1)
    torch.testing.assert_close(codec.weighted_sum(p, packed), p @ k, atol=1e-5, rtol=1e-4)


def test_state_round_trips_and_bytes_are_the_groups():
    x = torch.randn(1, 3, 70, 64, generator=torch.Generator().manual_seed(1))
    spec = _spec([0, 1, 0], [TQ3, INT8])
    codec = spec.build(64, 3)
    codec.fit(x)
    packed = codec.encode(x)
    fresh = spec.build(64, 3)
    fresh.load_state_dict(codec.state_dict())
    assert torch.equal(fresh.decode(packed), codec.decode(packed))
    assert sorted(codec.state_dict()) == ["g0.mean"]
    # Hand count: 2 heads x 70 tokens x (24 code bytes + a 2-byte norm) + 1 head x 70 x (64 int8 + a 2-byte scale).
    assert packed.nbytes() == 2 * 70 * 26 + 70 * 66
    with pytest.raises(ValueError, match="g<group>.<key>"):
        fresh.load_state_dict({"mean": torch.zeros(3, 64)})


class _Cfg:
    _attn_implementation = "kvpack"


def _layer(method: MethodConfig, n: int = 4 + 64 * 4 + 29, gqa: int = 3, seed: int = 0):
    """A layer of 3 kv heads holding an `n`-token prompt and one decoded token, and a decode query."""
    gen = torch.Generator().manual_seed(seed)
    b, hk, d = 2, 3, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(method, 0, _Cfg(), (inv_freq, 1.0))
    layer.update(torch.randn(b, hk, n, d, generator=gen), torch.randn(b, hk, n, d, generator=gen))
    layer.flush()
    layer.update(torch.randn(b, hk, 1, d, generator=gen), torch.randn(b, hk, 1, d, generator=gen))
    return layer, torch.randn(b, hk * gqa, 1, d, generator=gen)


def _reference(layer: KVPackLayer, q: torch.Tensor) -> torch.Tensor:
    k, v = layer.dequantized()
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5, -1) @ v


@pytest.mark.parametrize("anchors", [0.0, 0.02])
def test_every_attention_path_equals_attention_over_the_dequantized_cache(monkeypatch, anchors):
    """torch scores, the CPU kernels (each group through its own fused kernel) and the custom ops (torch references,
    Triton under its interpreter), with and without anchors (exact copies of some coded tokens, left out of the codes)."""
    from kvpack import attention, kernels
    from kvpack.attention import segmented_attention
    from kvpack.codecs.base import group_query
    from kvpack.kernels import ops, table

    layer, q = _layer(_method(values=(TQ2, INT8), anchors=anchors))  # pairs (tq, tq) and (int8, int8): each group has a kernel
    codec = layer.segments[0].key_codec if layer.segments else None  # a batch's rows each hold their own heads codec
    assert codec is not None and all(isinstance(c, HeadsCodec) for c in getattr(codec, "inner", [codec])) and codec.rows == q.shape[0]
    scale = q.shape[-1] ** -0.5
    ref = _reference(layer, q)
    torch.testing.assert_close(segmented_attention(layer, q, None, scale), ref, atol=2e-4, rtol=1e-3)
    g = group_query(q, 3)
    if kernels.available():
        torch.testing.assert_close(attention.fused_decode(layer, q, scale), ref, atol=2e-4, rtol=1e-3)
        assert all(table.segment_partial(g, seg, scale, attention._first_position(layer, seg)) is not None for seg in layer.segments)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for backend in ["torch", *(["triton"] if ops.triton_available() else [])]:
        monkeypatch.setattr(ops, "_override", ops.Backend(backend))
        out = attention.fused_decode(layer, q, scale)
        atol = 1e-3 if backend == "triton" else 2e-4  # Triton's q.k takes fp16 operands (docs/guide/gpu.md)
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-3, msg=lambda m, backend=backend: f"{backend}: {m}")
        assert all(table.segment_partial(g, seg, scale, attention._first_position(layer, seg)) is not None for seg in layer.segments)


def test_key_and_value_partitions_that_differ_fall_back_to_the_codecs():
    from kvpack import attention, kernels
    from kvpack.codecs.base import group_query
    from kvpack.kernels import table

    method = MethodConfig("m", _spec([0, 1, 0], [TQ3, INT8]), _spec([0, 0, 1], [TQ2, TQ3]))
    layer, q = _layer(method)
    seg = layer.segments[0]
    assert table.segment_partial(group_query(q, 3), seg, 0.125, attention._first_position(layer, seg)) is None
    if kernels.available():
        torch.testing.assert_close(attention.fused_decode(layer, q, 0.125), _reference(layer, q), atol=2e-4, rtol=1e-3)


def test_crop_keeps_the_heads_codes_of_the_kept_tokens():
    layer, _ = _layer(_method())
    keys, _ = layer.dequantized()
    layer.crop(200 - layer.length)
    kept, _ = layer.dequantized()
    assert torch.equal(kept, keys[:, :, :200])


@torch.no_grad()
def test_a_cache_with_head_groups_generates_saves_and_loads(tmp_path):
    """Through a real (tiny) model: generate with kvpack attention, save, load, and the loaded cache reads the same."""
    from kvpack.cache.serialize import load_cache, save_cache
    from kvpack.models import tiny_random_model

    model, _ = tiny_random_model(seed=0)
    heads = model.config.num_key_value_heads
    assert heads >= 2
    split = [h % 2 for h in range(heads)]
    method = MethodConfig("m", CodecSpec("turboquant", {"bits": 4}), CodecSpec("turboquant", {"bits": 4}),
                          layer_codecs=(LayerCodecs((1,), _spec(split, [TQ3, INT8]), _spec(split, [TQ2, TQ3])),))
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    kvpack.enable(model)
    try:
        cache = kvpack.KVCache(model, method)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    finally:
        kvpack.disable(model)
    assert out.shape[1] == 208 and isinstance(cache.layers[1].segments[0].key_codec, HeadsCodec)
    save_cache(cache, tmp_path / "c.kvpack")
    loaded = load_cache(tmp_path / "c.kvpack", model)
    for a, b in zip(cache.layers[1].dequantized(), loaded.layers[1].dequantized(), strict=True):
        assert torch.equal(a, b)


def test_block_files_store_head_groups():
    k, v = torch.randn(2, 2, 100, 3, 64, generator=torch.Generator().manual_seed(0))  # (layers, tokens, kv_heads, head_dim)
    method = _method()
    tensors, metadata = blocks.encode_kv(k, v, method)
    keys, _ = blocks.decode_kv(tensors, metadata, method)
    head, middle, _ = json.loads(metadata["split"])
    part = k[1, head : head + middle].permute(1, 0, 2).unsqueeze(0)
    codec = method.key.build(64, 3, layer_idx=1)
    codec.fit(part)
    assert torch.equal(keys[1, head : head + middle], codec.decode(codec.encode(part))[0].permute(1, 0, 2))


# -- auto per head -------------------------------------------------------------------------------------------------
def _profile(heads: int = 3, layers: int = 6, seed: int = 0) -> dict:
    """A synthetic profile whose layers' KL is split unevenly over their heads, as SmolLM2's is (one head of a layer
    carrying most of it)."""
    gen = torch.Generator().manual_seed(seed)
    bits = list(auto.BITS)
    records = []
    for layer in range(layers):
        for side in auto.SIDES:
            scale = float(torch.rand((), generator=gen)) * (0.01 if side == "key" else 0.002)
            shares = torch.softmax(3 * torch.randn(heads, generator=gen), 0).double()
            shares = (shares / shares.sum()).tolist()
            for b in bits:
                records.append({"layer": layer, "side": side, "bits": b, "kl": scale * 4.0 ** (2 - b), "head_shares": shares})
    codecs = {side: {str(b): {"codec": auto.codec_spec(side, b).codec, "options": auto.codec_spec(side, b).options} for b in bits} for side in auto.SIDES}
    block = {side: {str(b): auto.block_bytes(auto.codec_spec(side, b), 64, heads) for b in bits} for side in auto.SIDES}
    return {"layers": list(range(layers)), "bits": bits, "kv_heads": heads, "head_dim": 64, "codecs": codecs, "block_bytes": block,
            "block_tokens": auto.BLOCK, "sensitivity": records}


@pytest.mark.parametrize("target", [0.005, 0.01, 0.02, 0.04])
def test_per_head_widths_never_cost_more_bytes_than_per_layer_and_stay_within_budget(target):
    """Per-head choices include every per-layer choice (all heads alike), so the exact knapsack can only do better."""
    profile = _profile()
    per_head = auto.method_from_profile(profile, target, grain="head")
    per_layer = auto.method_from_profile(profile, target, grain="layer")
    head, layer = auto.summary(per_head, profile), auto.summary(per_layer, profile)
    assert head["compressed_bytes_per_token"] <= layer["compressed_bytes_per_token"]
    assert head["predicted_kl"] <= math.log1p(target) + 1e-12
    assert per_head.name == auto.target_name(target, "head") and layer["mixed_head_cells"] == 0
    assert all(e.key.codec != "heads" for e in per_layer.layer_codecs)


def test_a_head_carrying_a_layers_loss_gets_the_bits():
    """Layer 0's keys: head 2 carries 98% of their KL; per head it keeps int8 where per layer every head pays for it."""
    profile = _profile(layers=2)
    for r in profile["sensitivity"]:
        if (r["layer"], r["side"]) == (0, "key"):
            r["kl"], r["head_shares"] = 0.02 * 4.0 ** (2 - r["bits"]) + (0.003 if r["bits"] < 8 else 0.0), [0.01, 0.01, 0.98]
    method = auto.method_from_profile(profile, 0.01, grain="head")
    key = method.for_layer(0).key
    assert key.codec == "heads"
    bits = auto.head_bits(key, 3)
    assert bits[2] == max(bits) and bits[0] < bits[2]
    assert method.for_layer(0).value.options["heads"] == key.options["heads"]  # one partition for K and V
    codec = key.build(64, 3)
    assert [len(i) for i in codec.index] == [list(key.options["heads"]).count(g) for g in range(len(key.options["codecs"]))]


def test_profiles_without_head_shares_allocate_per_layer_and_bad_shares_are_refused(tmp_path):
    profile = _profile()
    for r in profile["sensitivity"]:
        del r["head_shares"]
    assert not auto.has_head_shares(profile)
    method = auto.method_from_profile(profile, 0.01, grain="head")
    assert all(e.key.codec != "heads" and e.value.codec != "heads" for e in method.layer_codecs)
    bad = _profile()
    bad["sensitivity"][0]["head_shares"] = [0.5, 0.6, -0.1]
    bad |= {"format": auto.PROFILE_FORMAT, "version": auto.PROFILE_VERSION, "fingerprint": {}}
    with pytest.raises(auto.ProfileError, match="damaged"):
        allocator._check_profile(bad, tmp_path / "p.json", "kvpack calibrate")


@pytest.mark.parametrize("arg, parsed", [("1%", (0.01, auto.DEFAULT_GRAIN)), ("1%/layer", (0.01, "layer")), ("0.5%/head", (0.005, "head"))])
def test_auto_names_parse_their_grain(arg, parsed):
    assert auto.parse_auto(arg) == parsed
    assert auto.parse_auto(auto.target_name(*parsed).removeprefix("auto:")) == parsed


@pytest.mark.parametrize("arg", ["1%/heads", "1%/layers", "1%/", "1/layer"])
def test_bad_grains_name_the_forms(arg):
    with pytest.raises(ValueError, match=r"auto:<(target|number)>%"):
        auto.parse_auto(arg)


def test_head_config_round_trips_through_a_methods_json():
    from kvpack.cache.serialize import method_from_json, method_to_json

    method = _method()
    assert method_from_json(json.loads(json.dumps(method_to_json(method)))) == method
    assert isinstance(method.key.config, HeadsConfig)


def test_a_kv_head_the_model_never_reads_gets_no_share(monkeypatch):
    """Layer 0's kv head 1 made irrelevant (o_proj ignores the query heads that read it): the scored tokens' predictions
    do not depend on its keys or values, so the calibration gives it no share of any (layer 0, side, width), and the
    per-head allocation gives it the narrowest width there."""
    from kvpack.models import tiny_random_model

    model, tokenizer = tiny_random_model(seed=0)
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    group = heads // kv
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[:, group * d : 2 * group * d] = 0  # query heads of kv head 1
    profile = auto.calibrate(model, tokenizer, auto.CalibrationConfig(prefix=160, tokens=48, draws=2), progress=False)
    layer0 = [r for r in profile["sensitivity"] if r["layer"] == 0]
    assert layer0 and all(r["head_shares"][1] == 0 for r in layer0)
    assert any(r["head_shares"][1] > 0 for r in profile["sensitivity"] if r["layer"] == 1)
    method = auto.method_from_profile(profile, 0.01, grain="head")
    for side in auto.SIDES:
        assert auto.head_bits(getattr(method.for_layer(0), side), kv)[1] == min(profile["bits"])


@torch.no_grad()
def test_the_decode_benchmark_runs_auto_methods_from_their_configs():
    """`python -m kvpack.bench.decode --methods dynamic,auto:1%/head` resolves auto names from the profile once the model
    is loaded and passes the configs in; here the same with a calibrated tiny model's profile."""
    from kvpack.bench.decode import run_context
    from kvpack.models import tiny_random_model

    model, tokenizer = tiny_random_model(seed=0)
    profile = auto.calibrate(model, tokenizer, auto.CalibrationConfig(prefix=160, tokens=48, draws=2), progress=False)
    name = "auto:4%/head"
    kvpack.enable(model)
    try:
        ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
        rows = run_context(model, ids, ["dynamic", name], steps=2, warmup=0, log=lambda *_: None,
                           configs={name: auto.method_from_profile(profile, 0.04, "head")})
    finally:
        kvpack.disable(model)
    assert [r["method"] for r in rows] == ["dynamic", name] and rows[1]["kv_bytes"] < rows[0]["kv_bytes"]
