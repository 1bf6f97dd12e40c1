"""`auto:<target>`: per-layer codecs in MethodConfig, the byte-optimal allocator against brute force, profiles that
round-trip and refuse a damaged file or another model, and a calibration checked against real prefills."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

import kvpack
from kvpack import auto
from kvpack.cli import main
from kvpack.codecs.turboquant import TurboQuantCodec
from kvpack.eval.generate import cache_kwargs, forward
from kvpack.models import tiny_random_model
from kvpack.registry import CodecSpec, LayerCodecs, MethodConfig, get_method, list_methods
from kvpack.serve import blocks
from kvpack.text import token_stream

TQ2 = CodecSpec("turboquant", {"bits": 2, "center": True})
INT8 = CodecSpec("int8")
SMALL = auto.CalibrationConfig(prefix=160, tokens=48, mode="probe")  # past sinks + window + a block; seconds on the tiny model


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_random_model(seed=0)
    return model, tokenizer


@pytest.fixture(scope="module")
def profile(tiny):
    return auto.calibrate(*tiny, SMALL, progress=False)


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_PROFILE_DIR", str(tmp_path))
    return tmp_path


# -- per-layer codecs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layers, match", [((), "non-empty"), ([1], "non-empty tuple"), ((-1,), "non-negative"), ((True,), "non-negative"), ((1.0,), "non-negative")]
)
def test_layer_codecs_refuse_bad_layers(layers, match):
    with pytest.raises(ValueError, match=match):
        LayerCodecs(layers, TQ2, TQ2)


def test_layer_codecs_refuse_a_layer_listed_twice_and_non_specs():
    with pytest.raises(ValueError, match=r"layers \[1, 3\] more than once"):
        MethodConfig("m", INT8, INT8, layer_codecs=(LayerCodecs((0, 1, 3), TQ2, TQ2), LayerCodecs((3, 1), INT8, TQ2)))
    with pytest.raises(TypeError, match="LayerCodecs.value must be a CodecSpec"):
        LayerCodecs((0,), TQ2, "int8")
    with pytest.raises(TypeError, match="tuple of LayerCodecs"):
        MethodConfig("m", INT8, INT8, layer_codecs=[LayerCodecs((0,), TQ2, TQ2)])


def test_for_layer_replaces_key_and_value_of_listed_layers_only():
    method = MethodConfig("m", INT8, INT8, window=32, layer_codecs=(LayerCodecs((1, 4), TQ2, INT8),))
    assert method.for_layer(4) == MethodConfig("m", TQ2, INT8, window=32)
    assert method.for_layer(0) == MethodConfig("m", INT8, INT8, window=32)
    plain = get_method("int8")
    assert plain.for_layer(3) is plain


@torch.no_grad()
def test_cache_runs_each_layer_with_its_own_codecs(tiny):
    """Layer 1's keys read back exactly as an independent TurboQuant codec (layer 1's seed) encodes the same tokens."""
    model, _ = tiny
    method = MethodConfig("m", INT8, INT8, layer_codecs=(LayerCodecs((1,), TQ2, INT8),))
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = kvpack.KVCache(model, method)
    exact = kvpack.KVCache(model, "fp16")
    model(ids, past_key_values=cache)
    model(ids, past_key_values=exact)
    assert [type(layer._codecs["stream_key"]).__name__ for layer in cache.layers] == ["Int8Codec", "TurboQuantCodec"]
    seg = cache.layers[1].segments[0]
    middle = exact.layers[1].keys[:, :, seg.start : seg.start + seg.length]  # fp16 codec: the exact tokens
    codec = TurboQuantCodec(TQ2.config, 64, 2, layer_idx=1)
    assert torch.equal(cache.layers[1].keys[:, :, seg.start : seg.start + seg.length], codec.decode(codec.encode(middle)).to(middle.dtype))
    assert cache.layers[1].segments[0].key_run.nbytes() < cache.layers[0].segments[0].key_run.nbytes()  # 2-bit codes + norms < int8


def test_block_files_code_each_layer_with_its_own_codecs():
    k, v = torch.randn(2, 2, 100, 2, 64, generator=torch.Generator().manual_seed(0))  # (layers, tokens, kv_heads, head_dim)
    method = MethodConfig("m", INT8, INT8, layer_codecs=(LayerCodecs((1,), TQ2, INT8),))
    tensors, metadata = blocks.encode_kv(k, v, method)
    keys, _ = blocks.decode_kv(tensors, metadata, method)
    head, middle, _ = json.loads(metadata["split"])
    part = k[1, head : head + middle].permute(1, 0, 2).unsqueeze(0)  # (1, kv_heads, middle, head_dim)
    codec = TurboQuantCodec(TQ2.config, 64, 2, layer_idx=1)
    codec.fit(part)
    assert torch.equal(keys[1, head : head + middle], codec.decode(codec.encode(part))[0].permute(1, 0, 2))
    with pytest.raises(blocks.BlockMismatch):
        blocks.decode_kv(tensors, metadata, MethodConfig("m", INT8, INT8))


# -- allocation ----------------------------------------------------------------------------------------------------
def _brute_force(costs, losses, budget):
    """(cost, loss) of the cheapest allocation within the budget (ties: least loss), or None."""
    best = None
    for picks in itertools.product(*(range(len(row)) for row in costs)):
        cost = sum(costs[i][j] for i, j in enumerate(picks))
        loss = 0.0
        for i, j in enumerate(picks):
            loss += losses[i][j]
        if loss <= budget and (best is None or (cost, loss) < best):
            best = (cost, loss)
    return best


def _table(rng: random.Random, items: int, realistic: bool):
    if realistic:  # 2/3/4-bit TurboQuant block bytes, KL falling about 4x per bit
        costs = [[2304, 3328, 4352] for _ in range(items)]
        losses = [[s, s / rng.uniform(3, 5), s / rng.uniform(10, 20)] for s in (rng.lognormvariate(-6, 1.5) for _ in range(items))]
    else:
        costs = [[rng.randrange(0, 60) for _ in range(3)] for _ in range(items)]
        losses = [[rng.random() for _ in range(3)] for _ in range(items)]
    return costs, losses


@pytest.mark.parametrize("seed", range(12))
def test_allocation_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    costs, losses = _table(rng, 6, realistic=seed % 2 == 0)
    floor, ceiling = sum(min(r) for r in losses), sum(max(r) for r in losses)
    for budget in [floor * 0.99, floor, *(rng.uniform(floor, ceiling) for _ in range(6)), ceiling]:
        picks = auto.allocate(costs, losses, budget)
        expected = _brute_force(costs, losses, budget)
        if expected is None:
            assert picks is None
            continue
        loss = 0.0
        for i, j in enumerate(picks):
            loss += losses[i][j]
        assert (sum(costs[i][j] for i, j in enumerate(picks)), loss) == expected


def test_allocation_refuses_fractional_costs():
    with pytest.raises(ValueError, match="non-negative integers"):
        auto.allocate([[1.5, 2]], [[0.1, 0.0]], 1.0)


def _synthetic_profile(layers: int = 8, seed: int = 0) -> dict:
    rng = random.Random(seed)
    records = []
    for layer, side in itertools.product(range(layers), auto.SIDES):
        s = rng.lognormvariate(-7, 1.5)
        records += [{"layer": layer, "side": side, "bits": b, "kl": s * 4.0 ** (2 - b)} for b in auto.BITS]
    codecs = {side: {str(b): {"codec": spec.codec, "options": spec.options} for b in auto.BITS for spec in [auto.codec_spec(side, b)]} for side in auto.SIDES}
    return {
        "format": auto.PROFILE_FORMAT, "version": auto.PROFILE_VERSION, "layers": list(range(layers)), "bits": list(auto.BITS),
        "head_dim": 64, "kv_heads": 2, "codecs": codecs, "block_bytes": {side: {"2": 2304, "3": 3328, "4": 4352, "8": 8448} for side in auto.SIDES},
        "sensitivity": records, "fingerprint": {},
    }


def test_looser_targets_never_cost_more_bytes_and_stay_within_budget():
    profile = _synthetic_profile()
    floor = sum(r["kl"] for r in profile["sensitivity"] if r["bits"] == max(auto.BITS))
    previous = math.inf
    for target in [math.expm1(floor) * f for f in (1.01, 1.2, 1.5, 2, 3, 5, 8, 16, 64)] + [0.5]:
        info = auto.summary(auto.method_from_profile(profile, target), profile)
        assert info["predicted_kl"] <= math.log1p(target) and info["compressed_bytes_per_token"] <= previous
        previous = info["compressed_bytes_per_token"]
    assert info["mean_bits"] == 2.0  # 50%: everything at the narrowest width


def test_method_from_profile_mixes_widths_and_an_impossible_target_says_the_floor():
    profile = _synthetic_profile()
    method = auto.method_from_profile(profile, 0.01)
    widths = {(layer, side): auto.spec_bits(getattr(method.for_layer(layer), side)) for layer in range(8) for side in auto.SIDES}
    assert len(set(widths.values())) > 1 and method.name == "auto:1%"
    assert method.for_layer(5).key == auto.codec_spec("key", widths[(5, "key")])  # the fixed methods' codecs
    with pytest.raises(ValueError, match=r"int8 on every layer is predicted at .* use a looser target or the fp16 method$"):
        auto.method_from_profile(profile, 1e-6)
    old = profile | {"bits": [2, 3, 4], "sensitivity": [r for r in profile["sensitivity"] if r["bits"] != 8]}  # before the int8 rung
    assert auto.spec_bits(auto.method_from_profile(old, 0.5).for_layer(0).key) == 2
    with pytest.raises(ValueError, match=r"4 bits on every layer is predicted at .*, or recalibrate to measure the int8 rung"):
        auto.method_from_profile(old, 1e-6)


def test_a_wider_code_is_never_charged_less_kl():
    profile = _synthetic_profile()
    row = [r for r in profile["sensitivity"] if (r["layer"], r["side"]) == (3, "key")]
    row[1]["kl"] = 10 * row[0]["kl"]  # 3 bits measured worse than 2 (a heavy token)
    assert auto.sensitivities(profile)[(3, "key")] == [row[1]["kl"], row[1]["kl"], row[2]["kl"], row[3]["kl"]]
    for target in (0.005, 0.01, 0.02):
        bits = auto.spec_bits(auto.method_from_profile(profile, target).for_layer(3).key)
        info = auto.summary(auto.method_from_profile(profile, target), profile)
        assert info["predicted_kl"] <= math.log1p(target) and (bits != 2 or row[1]["kl"] <= math.log1p(target))


@pytest.mark.parametrize("arg, value", [("1%", 0.01), ("0.5%", 0.005), ("2%", 0.02), ("4%", 0.04), (" 1.5% ", 0.015)])
def test_targets_parse(arg, value):
    assert auto.parse_target(arg) == pytest.approx(value)


@pytest.mark.parametrize("arg", ["1", "abc", "0%", "-1%", "1%%", "", "101%", "1 %", "0.01"])
def test_bad_targets_name_the_form(arg):
    with pytest.raises(ValueError, match=r"auto:<number>%"):
        auto.parse_target(arg)


def test_auto_needs_the_model_and_is_not_in_the_test_matrix():
    with pytest.raises(ValueError, match=r"needs the model: pass it to kvpack.KVCache\(model, 'auto:1%'\)"):
        get_method("auto:1%")
    with pytest.raises(ValueError, match=r"auto:<number>%"):
        get_method("auto:fast")
    assert not any(m.startswith("auto") for m in list_methods())


# -- profiles -------------------------------------------------------------------------------------------------------
def test_calibration_table_is_finite_non_negative_and_counts_real_bytes(profile, tiny):
    kl = {(r["layer"], r["side"], r["bits"]): r["kl"] for r in profile["sensitivity"]}
    assert len(kl) == 2 * 2 * len(auto.BITS) and all(math.isfinite(v) and v >= 0 for v in kl.values())
    mean = {b: sum(v for (_, _, bits), v in kl.items() if bits == b) / 4 for b in auto.BITS}
    assert mean[2] >= mean[3] >= mean[4] >= mean[8]
    # 64 tokens x 2 kv heads x (fp16 norm + 64 coordinates at b bits); int8: an fp16 scale + 64 int8 codes
    assert profile["block_bytes"] == {side: {str(b): 64 * 2 * (2 + 64 * b // 8) for b in auto.BITS} for side in auto.SIDES}
    assert profile["fingerprint"] == auto.fingerprint(tiny[0]) and profile["calibration"]["text"] == "pydoc"


@torch.no_grad()
def test_calibration_kl_is_what_real_prefills_give(profile, tiny):
    """The shortcut (one prefill, its K/V stored by every probe cache) against a prefill through each probe cache."""
    model, tokenizer = tiny
    ids = token_stream(tokenizer, "pydoc", SMALL.prefix + SMALL.tokens + 1)

    def logp(method):
        cache = kvpack.KVCache(model, method)
        forward(model, ids[: SMALL.prefix], cache)
        return F.log_softmax(forward(model, ids[SMALL.prefix : -1], cache, last_only=False)[0].double(), -1)

    ref = logp(auto._probe(None))
    for record in profile["sensitivity"]:
        if record["side"] == "value" and record["bits"] in (2, 4, 8):  # the tiny random model reads its values, not keys
            probe = logp(auto._probe(record["layer"], "value", auto.codec_spec("value", record["bits"])))
            kl = F.kl_div(probe, ref, log_target=True, reduction="none").sum(-1).mean().item()
            assert kl == pytest.approx(record["kl"], rel=1e-6)


def test_profile_round_trips_and_kvcache_resolves_auto(tiny, profile, profiles):
    model, _ = tiny
    path = auto.save_profile(profile, auto.profile_path(model))
    assert path.parent == profiles and auto.load_profile(model) == json.loads(json.dumps(profile))
    cache = kvpack.KVCache(model, "auto:2%")
    assert cache.method == auto.method_from_profile(profile, 0.02)
    assert [layer.method for layer in cache.layers] == [cache.method.for_layer(i) for i in range(2)]


def test_missing_profile_names_the_command(profiles):
    model, _ = tiny_random_model(seed=0)
    model.config._name_or_path = "/somewhere/smollm2-135m"
    with pytest.raises(ValueError, match=rf"no calibration profile for this model at {profiles}/smollm2-135m.json; .*: kvpack calibrate --model smollm2-135m$"):
        kvpack.KVCache(model, "auto:1%")
    model.config._name_or_path = "/models/my-llama"
    with pytest.raises(ValueError, match="kvpack calibrate --model /models/my-llama$"):
        auto.auto_method(model, "auto:1%")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda text, p: text[: len(text) // 2], "not a readable kvpack calibration profile"),
        (lambda text, p: json.dumps({**p, "format": "x"}), "not a kvpack calibration profile"),
        (lambda text, p: json.dumps({**p, "version": 99}), "profile version 99"),
        (lambda text, p: json.dumps({**p, "sensitivity": p["sensitivity"][1:]}), "damaged calibration profile"),
        (lambda text, p: text.replace('"kl": ', '"kl": NaN, "was": ', 1), "damaged calibration profile"),
        (lambda text, p: json.dumps({**p, "block_bytes": {}}), "damaged calibration profile"),
        (lambda text, p: json.dumps({**p, "bits": p["bits"][::-1]}), r"damaged calibration profile \(ValueError: bits \[8, 4, 3, 2\] are not distinct"),
    ],
    ids=["truncated", "format", "version", "missing-probe", "nan-kl", "no-bytes", "unordered-bits"],
)
def test_damaged_profile_is_refused_naming_the_file(tiny, profile, tmp_path, damage, match):
    path = auto.save_profile(profile, tmp_path / "p.json")
    path.write_text(damage(path.read_text(), profile))
    with pytest.raises(auto.ProfileError, match=rf"{path}.*{match}.*make it again with"):
        auto.auto_method(tiny[0], "auto:1%", profile=path)


def test_profile_of_another_model_is_refused(tiny, profile, tmp_path):
    path = auto.save_profile(profile, tmp_path / "p.json")
    other, _ = tiny_random_model(seed=1)  # same architecture, other weights
    with pytest.raises(auto.ProfileError, match=rf"{path} was calibrated for another model \(it differs in: weights\)"):
        auto.auto_method(other, "auto:1%", profile=path)
    assert auto.auto_method(tiny_random_model(seed=0, dtype=torch.bfloat16)[0], "auto:1%", profile=path).layer_codecs  # same weights


def test_kvpack_attention_state_survives_calibration(tiny):
    model, tokenizer = tiny
    kvpack.enable(model)
    try:
        auto.calibrate(model, tokenizer, auto.CalibrationConfig(prefix=128, tokens=8, bits=(4,)), progress=False)
        assert model.config._attn_implementation == "kvpack"
    finally:
        kvpack.disable(model)
    assert model.config._attn_implementation != "kvpack"


# -- command line -------------------------------------------------------------------------------------------------------
def test_cli_lists_auto_and_checks_targets_before_loading(capsys):
    assert main(["methods"]) == 0
    assert "auto:<target>" in capsys.readouterr().out
    assert main(["compare", "--methods", "auto:lots", "--model", "tiny-random"]) == 2
    assert "auto:<number>%" in capsys.readouterr().err
    assert main(["calibrate", "--out", "profile.txt"]) == 2
    assert "--out profile.txt: unsupported file type '.txt'" in capsys.readouterr().err


def test_cli_compare_without_a_profile_names_the_command(profiles, capsys):
    assert main(["eval", "--method", "auto:1%", "--model", "tiny-random", "--no-needle"]) == 2
    assert "no calibration profile for this model" in capsys.readouterr().err


def test_cli_calibrate_writes_the_profile_auto_reads(profiles, capsys):
    assert main(["calibrate", "--model", "tiny-random", "--prefix", "128", "--tokens", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "auto:1%" in out and len(list(profiles.glob("*.json"))) == 1
    model = tiny_random_model(seed=0)[0]
    plain = kvpack.KVCache(model, "auto:4%").method
    assert plain.name == "auto:4%"
    anchored = kvpack.KVCache(model, "auto:4%@anchors=1%").method  # the profile's widths, with anchors
    assert anchored.name == "auto:4%@anchors=1%" and anchored.anchors == 0.01 and anchored.layer_codecs == plain.layer_codecs


def test_profile_summary_ranks_the_layers_that_carry_the_loss(tmp_path):
    """kvpack.bench.profile_plot on a hand-written profile: shares computed by hand (0.3 of 0.5 nats is layer 4's keys)."""
    from kvpack.bench import profile_plot

    recs = [{"layer": layer, "side": side, "bits": b, "kl": kl / (4 if b == 3 else 1)}
            for layer, side, kl in [(4, "key", 0.3), (9, "key", 0.1), (4, "value", 0.05), (9, "value", 0.05)] for b in (2, 3)]
    profile = {"model": "hand", "layers": [4, 9], "bits": [2, 3], "sensitivity": recs, "calibration": {"prefix": 8, "text": "pydoc"}}
    d = profile_plot.describe(profile, bits=2, top=2)
    assert d["total_kl"] == pytest.approx(0.5)
    assert d["key_share"] == pytest.approx(0.8)
    assert [(t["layer"], t["side"]) for t in d["top"]] == [(4, "key"), (9, "key")]
    assert d["top"][0]["share"] == pytest.approx(0.6)
    assert profile_plot.describe(profile, bits=3)["total_kl"] == pytest.approx(0.125)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert profile_plot.main([str(path), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="measured \\[2, 3\\] bits, not 4"):
        profile_plot.main([str(path), "--bits", "4"])


def test_bench_merge_keeps_an_earlier_run_only_when_its_protocol_and_baseline_match(tmp_path):
    """Peers run later sit beside an earlier auto run only if that run's config and uncompressed perplexity agree."""
    from argparse import Namespace

    from kvpack.bench import auto as bench

    config = {"model": "m", "context": 2048, "ppl_tokens": 2048, "chunk": 256, "text": "news", "dtype": "float32"}
    rows = [{"method": "dynamic", "ppl": 30.0}, {"method": "auto:1%", "ppl": 30.1}, {"method": "turboquant:k3v2", "ppl": 30.5}]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"config": config, "rows": rows}))
    args = Namespace(**config)
    merged = bench.merge(str(path), args, 30.0)
    assert [r["method"] for r in merged] == ["auto:1%", "turboquant:k3v2"]
    assert all(r["merged_from"] == str(path) for r in merged)
    with pytest.raises(SystemExit, match="uncompressed perplexity 30.000000 differs from this run's 30.100000"):
        bench.merge(str(path), args, 30.1)
    with pytest.raises(SystemExit, match="differs in context, text"):
        bench.merge(str(path), Namespace(**(config | {"context": 8192, "text": "pydoc"})), 30.0)
    assert [bench._group(m) for m in ("auto:2%", "turboquant:k4v4", "kivi:2", "hf-quanto:4")] == ["auto", "fixed", "peer", "peer"]


# -- the fisher calibration --------------------------------------------------------------------------------------
def test_fisher_diagonal_is_the_exact_fisher_of_the_scored_tokens():
    """The sign-and-sample estimator against the Fisher enumerated exactly: every token t and every vocabulary entry y,
    F_t = sum_y p_t(y) (d log p_t(y) / d cache)^2, summed over t (per cache position: over its head_dim elements)."""
    from transformers import DynamicCache

    model, tokenizer = tiny_random_model(seed=0)
    model = model.double()
    ids = token_stream(tokenizer, "pydoc", 24)
    prompt, scored = ids[:20], ids[20:]
    est = auto.fisher_diagonal(model, prompt, scored, draws=1500, seed=1)
    assert all(p.requires_grad for p in model.parameters())

    for p in model.parameters():
        p.requires_grad_(False)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[None], use_cache=True, **cache_kwargs(model, cache))
    leaves = []
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.detach().requires_grad_(True), layer.values.detach().requires_grad_(True)
        leaves += [layer.keys, layer.values]
    logp = torch.log_softmax(model(input_ids=scored[None], use_cache=True, **cache_kwargs(model, cache)).logits[0], -1)
    exact = [torch.zeros_like(x) for x in leaves]
    for t, y in itertools.product(range(len(scored)), range(logp.shape[1])):
        for e, g in zip(exact, torch.autograd.grad(logp[t, y], leaves, retain_graph=True), strict=True):
            e += logp[t, y].detach().exp() * g.square()
    for i, e in enumerate(exact):
        got = est[i // 2][i % 2].double()
        assert got.sum().item() == pytest.approx(e.sum().item(), rel=0.05)
        assert torch.allclose(got.sum(-1), e.sum(-1), rtol=0.15, atol=0.0)


@pytest.fixture(scope="module")
def fisher_profile(tiny):
    return auto.calibrate(*tiny, auto.CalibrationConfig(prefix=160, tokens=48, mode="fisher", draws=8), progress=False)


@torch.no_grad()
def test_fisher_profile_totals_are_real_prefills_and_shares_follow_the_fisher(fisher_profile, tiny):
    """Per (side, width): the layers' KL sums to the KL of a real prefill through a cache compressing that side of every
    layer at that width, split between the layers in proportion to their predictions: the Fisher's for values, for keys
    the Fisher's scaled per layer by its 2-bit key probe, itself a real prefill's KL."""
    model, tokenizer = tiny
    ids = token_stream(tokenizer, "pydoc", 160 + 48 + 1)

    def logp(method):
        cache = kvpack.KVCache(model, method)
        forward(model, ids[:160], cache)
        return F.log_softmax(forward(model, ids[160:-1], cache, last_only=False)[0].double(), -1)

    ref = logp(auto._probe(None))
    fp16 = CodecSpec("fp16")
    for side, bits in itertools.product(auto.SIDES, (2, 8)):
        spec = auto.codec_spec(side, bits)
        pair = (spec, fp16) if side == "key" else (fp16, spec)
        kl = F.kl_div(logp(MethodConfig("all", fp16, fp16, layer_codecs=(LayerCodecs((0, 1), *pair),))), ref, log_target=True, reduction="none")
        rows = [r for r in fisher_profile["sensitivity"] if r["side"] == side and r["bits"] == bits]
        assert sum(r["kl"] for r in rows) == pytest.approx(kl.sum(-1).mean().item(), rel=1e-6)
        assert rows[0]["kl"] * rows[1]["predicted"] == pytest.approx(rows[1]["kl"] * rows[0]["predicted"], rel=1e-9)
        if side == "value":
            assert [r["predicted"] for r in rows] == [r["fisher"] for r in rows]
    key2 = {r["layer"]: r for r in fisher_profile["sensitivity"] if r["side"] == "key" and r["bits"] == 2}
    key8 = {r["layer"]: r for r in fisher_profile["sensitivity"] if r["side"] == "key" and r["bits"] == 8}
    for layer in (0, 1):
        probe = logp(auto._probe(layer, "key", auto.codec_spec("key", 2)))
        assert key2[layer]["probe_kl"] == pytest.approx(F.kl_div(probe, ref, log_target=True, reduction="none").sum(-1).mean().item(), rel=1e-6)
        assert key2[layer]["predicted"] == pytest.approx(key2[layer]["probe_kl"], rel=1e-9)
        scale = key2[layer]["probe_kl"] / key2[layer]["fisher"]
        assert key8[layer]["predicted"] == pytest.approx(key8[layer]["fisher"] * scale, rel=1e-9)
    assert fisher_profile["calibration"]["mode"] == "fisher"
    auto.method_from_profile(fisher_profile, 0.04)  # the allocator reads it as it reads a probe profile


def test_fisher_calibration_leaves_the_weights_trainable_as_they_were(tiny):
    model, tokenizer = tiny
    flags = [p.requires_grad for p in model.parameters()]
    auto.fisher_diagonal(model, token_stream(tokenizer, "pydoc", 40)[:32], token_stream(tokenizer, "pydoc", 40)[32:], draws=1)
    assert [p.requires_grad for p in model.parameters()] == flags


@pytest.mark.parametrize("kwargs, match", [({"mode": "fast"}, r"mode must be one of \('probe', 'fisher'\)"), ({"draws": 0}, "draws must be a positive"),
                                           ({"draws": 1.5}, "draws must be a positive")])
def test_calibration_config_names_the_allowed_modes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        auto.CalibrationConfig(**kwargs)


def test_cli_calibrate_fisher_writes_a_profile_auto_reads(profiles, capsys):
    assert main(["calibrate", "--model", "tiny-random", "--prefix", "128", "--tokens", "8", "--mode", "fisher", "--draws", "2", "--quiet"]) == 0
    assert "Fisher diagonal from 2 backward passes" in capsys.readouterr().out
    assert kvpack.KVCache(tiny_random_model(seed=0)[0], "auto:4%").method.name == "auto:4%"
