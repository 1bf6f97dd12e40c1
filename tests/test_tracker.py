"""The quality tracker (errors checked against attention recomputed here over independently decoded blocks),
the adaptive boundary (converging on a synthetic error curve whose right boundary is known), thresholds
files, and moving a live cache's boundary."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack.cache import KVPackLayer
from kvpack.cache.tracker import (
    AdaptiveArchive,
    AdaptiveConfig,
    AdaptiveThresholds,
    QualityTracker,
    Thresholds,
    ThresholdsFileError,
    adapt,
    apply_archive_bits,
    apply_boundary,
    load_or_default,
    load_thresholds,
    part_masses,
    save_thresholds,
)
from kvpack.codecs.base import slice_packed
from kvpack.codecs.kivi import KiviCodec, KiviConfig
from kvpack.registry import get_method

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=4096)


class _Cfg:
    _attn_implementation = "sdpa"


def _layer(method, tracker: QualityTracker | None) -> KVPackLayer:
    layer = KVPackLayer(get_method(method), 0, _Cfg())
    layer.tracker = tracker
    return layer


def _feed(layer: KVPackLayer, tokens: int, chunk: int, g: torch.Generator, d: int = 64) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Update `layer` with `tokens` random tokens, `chunk` at a time; returns all K, V and how many updates encoded tokens."""
    ks, vs, encoding_updates = [], [], 0
    for _ in range(tokens // chunk):
        before = sum(seg.length for seg in layer.segments)
        ks.append(torch.randn(1, 2, chunk, d, generator=g))
        vs.append(torch.randn(1, 2, chunk, d, generator=g))
        layer.update(ks[-1], vs[-1])
        encoding_updates += sum(seg.length for seg in layer.segments) > before
    return torch.cat(ks, 2), torch.cat(vs, 2), encoding_updates


def _tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)).eval()


# -- tracker ----------------------------------------------------------------------------------------
def test_error_equals_attention_recomputed_over_the_independently_decoded_block():
    tracker = QualityTracker(1.0, probes=4)
    layer = _layer("kivi:2", tracker)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    layer.update(k, v)
    # 4 sinks; KIVI's 32-token key groups leave 224 of the 232 overflowing tokens encoded: [4, 228).
    (sample,) = tracker.samples
    assert (sample.layer, sample.tier, sample.start, sample.tokens) == (0, "stream", 4, 224)
    x_k, x_v = k[:, :, 4:228].half().float(), v[:, :, 4:228].half().float()  # the window stores fp16
    kc, vc = KiviCodec(KiviConfig(bits=2, axis="channel"), 64, 2), KiviCodec(KiviConfig(bits=2, axis="token"), 64, 2)
    probe = k[:, :, -4:].half().float()  # the newest keys: the last 4 tokens, still in the window
    exact = F.scaled_dot_product_attention(probe, x_k, x_v)
    approx = F.scaled_dot_product_attention(probe, kc.decode(kc.encode(x_k)), vc.decode(vc.encode(x_v)))
    assert sample.error == pytest.approx(float((exact - approx).norm() / exact.norm()), rel=1e-5)


def test_lossless_codec_measures_zero_and_every_encoding_flush_is_sampled():
    tracker = QualityTracker(1.0)
    layer = _layer("fp16", tracker)  # fp16 has no window: the probes fall back to the block's own keys
    _, _, encoding_updates = _feed(layer, 640, 8, torch.Generator().manual_seed(1))
    assert encoding_updates == 10 == tracker.flushes  # 64-token blocks out of 640 tokens
    assert len(tracker.samples) == 10 and all(s.error == 0.0 for s in tracker.samples)


def test_sampling_follows_the_seeded_stream_at_the_configured_fraction():
    method = get_method("int8").with_options(window=8, block_size=8)
    picked = {}
    for seed in (3, 3, 4):
        tracker = QualityTracker(0.25, seed=seed)
        layer = KVPackLayer(method, 0, _Cfg())
        layer.tracker = tracker
        _feed(layer, 8 * 201, 8, torch.Generator().manual_seed(0))
        picked.setdefault(seed, []).append([s.start for s in tracker.samples])
        # Flush i (from 0) is sampled when the i-th draw of random.Random(seed) is below the fraction.
        rng = random.Random(seed)
        draws = [rng.random() < 0.25 for _ in range(tracker.flushes)]
        assert len(tracker.samples) == sum(draws)
        assert abs(sum(draws) - 0.25 * tracker.flushes) <= 4 * math.sqrt(tracker.flushes * 0.25 * 0.75)
    assert picked[3][0] == picked[3][1] != picked[4][0]


def test_tiers_and_layers_keep_running_means_and_fewer_bits_err_more():
    model, tracker = _tiny(), QualityTracker(1.0)
    cache = kvpack.KVCache(model, "tiered:512", tracker=tracker)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 1500), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
    tiers = {t.tier: t for t in tracker.tiers()}
    assert set(tiers) == {"tier1", "stream"}  # the long prompt's old part went straight to the archive
    for name, stat in tiers.items():
        errors = [s.error for s in tracker.samples if s.tier == name]
        # per layer: stream 1 (its block); tier1 2 (the block encoded straight into it, and the stream block's demotion ahead)
        assert stat.samples == len(errors) == (4 if name == "tier1" else 2) and stat.mean_error == pytest.approx(sum(errors) / len(errors))
        assert stat.max_error == max(errors)
    assert tiers["tier1"].mean_error > tiers["stream"].mean_error  # KIVI 2-bit archive vs 4-bit warm
    assert [layer.layer for layer in tracker.layers()] == [0, 1]


def test_demotions_are_sampled_ahead_and_match_the_block_once_demoted():
    tracker = QualityTracker(1.0)
    layer = _layer("tiered:512", tracker)
    g = torch.Generator().manual_seed(2)
    k0, v0 = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    layer.update(k0, v0)
    k1, v1, encoding_updates = _feed(layer, 900, 1, g)
    k, v = torch.cat([k0, k1], 2).half().float(), torch.cat([v0, v1], 2).half().float()  # the window holds fp16
    assert len(tracker.samples) == 2 * tracker.flushes == 2 * (encoding_updates + 1)  # each stream block, and its demotion ahead
    archive = next(seg for seg in layer.segments if seg.kind == "tier1")
    checked = 0
    for s in tracker.samples:
        if s.tier != "tier1" or s.start + s.tokens > archive.start + archive.length:
            continue  # not demoted yet
        # Recomputed here from the block as the archive now holds it, with the probes of its flush: the newest 4
        # window keys right after it (the prompt's flush ends at token 300; each block's leaves a 64-token window).
        lo, hi = s.start - archive.start, s.start - archive.start + s.tokens
        pos = layer.positions(s.start, s.tokens)
        k_hat = archive.key_codec.decode(slice_packed(archive.keys, lo, hi), pos)
        v_hat = archive.value_codec.decode(slice_packed(archive.values, lo, hi), pos)
        end = 300 if s.start == 4 else s.start + s.tokens + 64
        probe = k[:, :, end - 4 : end]
        exact = F.scaled_dot_product_attention(probe, k[:, :, s.start : s.start + s.tokens], v[:, :, s.start : s.start + s.tokens])
        approx = F.scaled_dot_product_attention(probe, k_hat, v_hat)
        assert s.error == pytest.approx(float((exact - approx).norm() / exact.norm()), rel=1e-4)
        checked += 1
    assert checked >= 5


def test_tracking_leaves_the_cache_unchanged():
    ids = torch.randint(0, 128, (1, 700), generator=torch.Generator().manual_seed(3))
    model = _tiny()
    caches = [kvpack.KVCache(model, "tiered:512"), kvpack.KVCache(model, "tiered:512", tracker=QualityTracker(1.0))]
    with torch.no_grad():
        for cache in caches:
            model(ids, past_key_values=cache)
    for plain, tracked in zip(caches[0].layers, caches[1].layers, strict=True):
        for a, b in zip(plain.dequantized(), tracked.dequantized(), strict=True):
            assert torch.equal(a, b)


def test_track_attaches_detaches_and_survives_deepcopy():
    model, tracker = _tiny(), QualityTracker(1.0)
    cache = kvpack.KVCache(model, "int8")
    assert cache.track(tracker) is tracker and all(layer.tracker is tracker for layer in cache.layers)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 300)), past_key_values=cache)
    copied = copy.deepcopy(cache)
    assert copied.tracker is not tracker and copied.layers[0].tracker is copied.tracker
    assert copied.tracker.samples == tracker.samples
    cache.track(None)
    assert all("tracker" not in vars(layer) for layer in cache.layers)  # the layer's saved attributes are unchanged
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 200)), past_key_values=cache)
    assert len(tracker.samples) == 2  # one prompt flush per layer, nothing after detaching


def test_tracker_options_are_validated():
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        QualityTracker(0)
    with pytest.raises(ValueError, match="probes must be an int >= 1"):
        QualityTracker(0.5, probes=0)


# -- adaptive boundary ----------------------------------------------------------------------------------
def _error_at(boundary: int) -> float:
    """Synthetic expected error: falls as the boundary rises (more tokens stay in the precise tier)."""
    return 0.01 + 0.2 * math.exp(-boundary / 300)


def _run(controller: AdaptiveThresholds, samples: int, rng: random.Random, curve=_error_at, noise: float = 0.1) -> list[int]:
    return [controller.observe(max(0.0, curve(controller.boundary) * (1 + noise * rng.gauss(0, 1)))) for _ in range(samples)]


def test_boundary_converges_to_the_known_right_boundary_within_100_samples():
    config = AdaptiveConfig(0.0314, block_size=64, min_after=128, max_after=2048)
    # The right boundary: the smallest grid point whose expected error is at most the target. The target sits
    # midway between the errors at 640 (0.0337) and 704 (0.0291), so each side is 0.0023 = ~0.8 noise sd away.
    right = next(b for b in range(128, 2049, 64) if _error_at(b) <= 0.0314)
    assert right == 704
    for seed in range(50):
        controller = AdaptiveThresholds(config, initial=512)
        history = _run(controller, 300, random.Random(seed))
        assert history[99] == right and set(history[99:]) == {right}, seed  # there at sample 100, and stays
        assert controller.converged


def test_boundary_moves_up_when_above_target_and_down_when_below():
    config = AdaptiveConfig(0.05, block_size=64, min_after=128, max_after=1024)
    up, down = AdaptiveThresholds(config, 512), AdaptiveThresholds(config, 512)
    rng = random.Random(0)
    ups = _run(up, 100, rng, curve=lambda b: 0.08)  # above target at every boundary: as precise as allowed
    downs = _run(down, 100, rng, curve=lambda b: 0.02)  # below everywhere: as compressed as allowed
    assert ups == sorted(ups) and ups[-1] == 1024 and up.converged
    assert downs == sorted(downs, reverse=True) and downs[-1] == 128 and down.converged


def test_converged_boundary_moves_up_again_when_the_error_rises():
    config = AdaptiveConfig(0.0314, block_size=64, min_after=128, max_after=2048)
    controller = AdaptiveThresholds(config, 512)
    rng = random.Random(1)
    assert _run(controller, 100, rng)[-1] == 704

    def harder(b: int) -> float:  # the text got harder: 1.5x the error everywhere
        return 1.5 * _error_at(b)

    right = next(b for b in range(128, 2049, 64) if harder(b) <= 0.0314)
    assert _run(controller, 200, rng, curve=harder)[-1] == right > 704


def test_adaptive_config_is_validated_and_derived_from_the_method():
    with pytest.raises(ValueError, match="target_error must be a positive finite number"):
        AdaptiveConfig(0.0)
    with pytest.raises(ValueError, match="multiples of block_size"):
        AdaptiveConfig(0.05, block_size=64, min_after=100)
    with pytest.raises(ValueError, match="min_samples"):
        AdaptiveConfig(0.05, min_samples=30, max_samples=20)
    config = AdaptiveConfig.for_method(get_method("tiered:512"), 0.05, max_after=1000)
    assert (config.min_after, config.max_after, config.block_size) == (128, 960, 64)  # window 64 + block 64
    with pytest.raises(ValueError, match="no older tier"):
        AdaptiveConfig.for_method(get_method("kivi:4"), 0.05)
    with pytest.raises(ValueError, match="finite number >= 0"):
        AdaptiveThresholds(config).observe(float("nan"))


# -- thresholds files -----------------------------------------------------------------------------------
def test_thresholds_round_trip_and_resume(tmp_path):
    path = tmp_path / "smollm2.json"
    saved = Thresholds(boundary=704, target_error=0.0314, block_size=64, samples=61, converged=True)
    save_thresholds(path, "HuggingFaceTB/SmolLM2-135M", saved)
    on_disk = json.loads(path.read_text())
    assert on_disk["model_id"] == "HuggingFaceTB/SmolLM2-135M" and on_disk["thresholds"]["boundary"] == 704
    loaded = load_thresholds(path, "HuggingFaceTB/SmolLM2-135M")
    assert loaded == saved
    resumed = AdaptiveThresholds.resume(AdaptiveConfig(0.0314, max_after=2048), loaded)
    assert resumed.boundary == 704 and resumed.converged and resumed.thresholds() == saved


def test_thresholds_file_problems_name_the_path(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(FileNotFoundError, match=f"{path}: no thresholds file"):
        load_thresholds(path, "m")
    path.write_text('{"format": "kvpack-thresholds", "vers')
    with pytest.raises(ThresholdsFileError, match=f"{path}: corrupted thresholds file: not JSON"):
        load_thresholds(path, "m")
    save_thresholds(path, "other/model", Thresholds(512, 0.05, 64))
    with pytest.raises(ThresholdsFileError, match=f"{path}: thresholds saved for model 'other/model', not 'm'"):
        load_thresholds(path, "m")
    data = json.loads(path.read_text())
    data["thresholds"]["boundary"] = 500  # not a multiple of the block
    path.write_text(json.dumps(data))
    with pytest.raises(ThresholdsFileError, match="corrupted thresholds file: boundary must be a multiple"):
        load_thresholds(path, "other/model")
    default = Thresholds(512, 0.05, 64)
    with pytest.warns(RuntimeWarning, match=f"{path}: corrupted .* using the default thresholds"):
        assert load_or_default(path, "other/model", default) == default
    with pytest.warns(RuntimeWarning, match="no thresholds file"):
        assert load_or_default(tmp_path / "missing.json", "m", default) == default


# -- a live cache ---------------------------------------------------------------------------------------
def _step(cache: kvpack.KVCache, g: torch.Generator, tokens: int = 1) -> None:
    for idx in range(len(cache.layers)):
        cache.update(torch.randn(1, 2, tokens, 16, generator=g), torch.randn(1, 2, tokens, 16, generator=g), idx)


def test_apply_boundary_moves_only_blocks_not_yet_demoted():
    config = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)
    cache, g = kvpack.KVCache(config, "tiered:512"), torch.Generator().manual_seed(4)
    _step(cache, g, 300)
    for _ in range(700):
        _step(cache, g)
    layer = cache.layers[0]
    archived = (layer.segments[0].start, layer.segments[0].length)
    assert layer.segments[0].kind == "tier1" and archived[0] + archived[1] <= 1000 - 512
    apply_boundary(cache, 768)
    assert cache.method.tiers[0].after == 768 and all(x.method is cache.method for x in cache.layers)
    for _ in range(100):  # tokens 1000..1099: nothing older than 768 lies beyond the archive's end (>= 1000 - 512 - 96)
        _step(cache, g)
    assert (layer.segments[0].start, layer.segments[0].length) == archived  # archived blocks stay, none are added
    apply_boundary(cache, 256)
    for _ in range(64):  # the next block flush demotes every warm block past 256
        _step(cache, g)
    archive = layer.segments[0]
    assert archive.start + archive.length <= layer.length - 256 < archive.start + archive.length + 64 + 32
    with pytest.raises(ValueError, match="multiples of block_size"):
        apply_boundary(cache, 300)
    with pytest.raises(ValueError, match="no older tier"):
        apply_boundary(kvpack.KVCache(config, "kivi:4"), 256)


# -- the live signal: attention mass per part times each tier's tracked error ---------------------------
def test_part_masses_equal_the_softmax_mass_over_each_parts_columns():
    from kvpack.kernels.reference import partial_from_scores as partial_reference

    g = torch.Generator().manual_seed(7)
    widths = [4, 100, 37, 64]
    scores = torch.randn(2, 3, 5, sum(widths), generator=g) * 3
    values = torch.randn(2, 3, sum(widths), 16, generator=g)
    cols = torch.split(torch.arange(sum(widths)), widths)
    parts = [partial_reference(scores[..., c], values[:, :, c]) for c in cols]
    reference = torch.stack([scores.softmax(-1)[..., c].sum(-1) for c in cols], -1).mean(dim=(0, 1, 2))
    assert torch.allclose(part_masses(parts), reference, atol=1e-6)


@torch.no_grad()
def _decode_estimates(boundary: int) -> list:
    model = _tiny()
    cache = kvpack.KVCache(model, f"tiered:{boundary}", tracker=QualityTracker(1.0))
    ids = torch.randint(0, 128, (1, 1200), generator=torch.Generator().manual_seed(8))
    kvpack.enable(model)
    try:
        model.generate(ids, past_key_values=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    finally:
        kvpack.disable(model)
    return cache.tracker.drain_estimates()


def test_decode_estimates_are_probability_masses_and_fall_as_the_boundary_rises():
    low, high = _decode_estimates(128), _decode_estimates(1024)
    assert len(low) == len(high) == 2 * 23  # every decode step of both layers (fraction 1.0; the prefill is no decode step)
    for est in low + high:
        assert math.isclose(sum(est.masses.values()), 1.0, rel_tol=1e-5) and est.error >= 0
    assert {"sink", "window", "tier1", "stream"} <= set(low[0].masses) and low[0].boundary == 128
    archive = lambda ests: sum(e.masses.get("tier1", 0.0) for e in ests) / len(ests)  # noqa: E731
    assert archive(low) > 3 * archive(high)  # 1,000 archived tokens against 100
    assert sum(e.error for e in low) / len(low) > sum(e.error for e in high) / len(high)


def test_adapt_feeds_the_controller_and_moves_the_live_cache():
    config = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)
    with pytest.raises(ValueError, match="QualityTracker"):
        adapt(kvpack.KVCache(config, "tiered:512"), AdaptiveThresholds(AdaptiveConfig(0.05)))
    model = _tiny()
    cache = kvpack.KVCache(model, "tiered:128", tracker=QualityTracker(1.0))
    controller = AdaptiveThresholds(AdaptiveConfig.for_method(cache.method, 1e-9, min_samples=2, max_samples=4), initial=128)
    ids = torch.randint(0, 128, (1, 700), generator=torch.Generator().manual_seed(9))
    kvpack.enable(model)
    try:
        with torch.no_grad():
            model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    finally:
        kvpack.disable(model)
    boundary = adapt(cache, controller)  # every estimate is above a target of 1e-9: the boundary moves up
    assert boundary > 128 and cache.method.tiers[0].after == boundary == controller.boundary
    assert adapt(cache, controller) == boundary  # nothing new recorded: nothing moves


# -- archive bits -----------------------------------------------------------------------------------------
def test_archive_bits_apply_to_new_blocks_and_the_old_ones_round_trip_through_a_file(tmp_path):
    from kvpack.cache.serialize import load_cache, save_cache
    from kvpack.models import tiny_random_model
    from test_serialize import _assert_same_state, _generate

    model, _ = tiny_random_model(seed=0)
    cache = kvpack.KVCache(model, "tiered:128:tq", tracker=QualityTracker(1.0))
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(4))
    seq, _ = _generate(model, ids, cache, 64)
    assert {s.tier for s in cache.tracker.samples} >= {"tier1"}
    with pytest.raises(ValueError, match="bits"):
        apply_archive_bits(cache, 9, 9)
    new = apply_archive_bits(cache, 4, 4)
    assert (new.tiers[0].key.options["bits"], new.tiers[0].value.options["bits"]) == (4, 4) and cache.method is new
    assert "tier1" not in {t.tier for t in cache.tracker.tiers()}  # its error changes with the bits: forgotten
    seq, _ = _generate(model, seq, cache, 128)  # two more blocks age past the boundary into 4-bit codecs
    layer = cache.compressed_layers()[0]
    archives = [seg for seg in layer.segments if seg.kind == "tier1"]
    assert [(seg.key_codec.config.bits, seg.value_codec.config.bits) for seg in archives] == [(3, 2), (4, 4)]
    assert archives[0].key_codec is layer._codecs["tier1@1_key"] and archives[1].key_codec is layer._codecs["tier1_key"]
    save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", model)
    _assert_same_state(cache, loaded)
    expected, _ = _generate(model, seq, cache, 8)
    assert torch.equal(_generate(model, seq, loaded, 8)[0], expected)


def _two_rung_curve(rung: int, boundary: int) -> float:
    """Synthetic error: rung 0 (fewest bits) is 3x as lossy as rung 1 at every boundary."""
    return (3.0 if rung == 0 else 1.0) * _error_at(boundary)


def _run_archive(archive: AdaptiveArchive, samples: int, rng: random.Random) -> list[tuple[int, int]]:
    path = []
    for _ in range(samples):
        archive.boundary.observe(max(0.0, _two_rung_curve(archive.rung, archive.boundary.boundary) * (1 + 0.1 * rng.gauss(0, 1))))
        archive.step()
        path.append((archive.rung, archive.boundary.boundary))
    return path


def test_archive_climbs_a_rung_when_no_boundary_meets_the_target_and_settles():
    config = AdaptiveConfig(0.0314, block_size=64, min_after=128, max_after=1024)
    # Rung 0 misses the target even at 1024 (3 x 0.0227); rung 1 meets it from 704 (as in the boundary test).
    assert _two_rung_curve(0, 1024) > 0.0314 and _two_rung_curve(1, 704) <= 0.0314 < _two_rung_curve(1, 640)
    for seed in range(20):
        archive = AdaptiveArchive(AdaptiveThresholds(config, 512), ((2, 2), (3, 3)), start=0)
        path = _run_archive(archive, 400, random.Random(seed))
        assert path[-1] == (1, 704) and archive.floor == 1, seed
        assert sum(a[0] != b[0] for a, b in zip(path[:-1], path[1:], strict=True)) == 1  # one climb, never back down


def test_archive_steps_down_while_the_target_holds_at_the_lowest_boundary():
    config = AdaptiveConfig(0.5, block_size=64, min_after=128, max_after=1024)  # loose: every rung meets it at 128 (rung 0: 0.42)
    assert _run_archive(AdaptiveArchive(AdaptiveThresholds(config, 512), ((2, 2), (3, 3)), start=1), 300, random.Random(0))[-1] == (1, 128)
    archive = AdaptiveArchive(AdaptiveThresholds(config, 512), ((2, 2), (3, 2), (3, 3)), start=2, step_down=True)
    path = _run_archive(archive, 300, random.Random(0))
    assert path[-1] == (0, 128)  # as few bytes as allowed (opt-in; by default the bits only climb)
    assert archive.thresholds().archive_bits == (2, 2)
    with pytest.raises(ValueError, match="rungs must be"):
        AdaptiveArchive(AdaptiveThresholds(config), (), 0)
    with pytest.raises(ValueError, match="start must index rungs"):
        AdaptiveArchive(AdaptiveThresholds(config), ((2, 2),), 1)


def test_thresholds_keep_the_archive_bits(tmp_path):
    saved = Thresholds(704, 0.0314, 64, 61, True, archive_bits=(3, 2))
    save_thresholds(tmp_path / "t.json", "m", saved)
    assert load_thresholds(tmp_path / "t.json", "m") == saved
    with pytest.raises(ValueError, match="archive_bits must be None or"):
        Thresholds(704, 0.0314, 64, archive_bits=(3,))


def test_adaptive_bench_moves_the_boundary_on_a_model_and_records_its_path(tmp_path):
    from kvpack.bench import adaptive as bench

    out = tmp_path / "a.json"
    # A target far below any codec's error: the boundary climbs; then the archive climbs its rungs.
    assert bench.main(["--model", "tiny-random", "--method", "tiered:128:tq", "--context", "64", "--tokens", "256", "--targets", "1e-6",
                       "--fixed", "128", "--start", "128", "--rungs", "3x2,4x4", "--fraction", "1.0", "--threads", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    fixed, adaptive, with_bits = data["rows"]
    assert fixed["estimates"] > 0 and fixed["late_mean_error"] > 0  # one-token decode steps fed the tracker
    for row in (adaptive, with_bits):
        boundaries = [t[1] for t in row["trace"]]
        assert boundaries[0] >= 128 and boundaries == sorted(boundaries) and row["final_boundary"] > 128  # only up: every error is above 1e-6
    assert with_bits["trace"][0][4] == [3, 2] and all(t[4] in ([3, 2], [4, 4]) for t in with_bits["trace"])
    assert data["environment"]["command"].startswith("python -m kvpack.bench.adaptive")


def test_boundary_follows_a_growing_context_and_never_searches_past_it():
    # A conversation: the context grows while the controller learns. The archive holds the tokens older than the
    # boundary, so the error grows with the archived share; the right boundary is 70% of the context, rising with it.
    def curve(boundary: int, tokens: int) -> float:
        return 0.05 + 0.1 * max(0, tokens - boundary) / tokens

    config = AdaptiveConfig(0.08, block_size=64, min_after=128, max_after=4096)
    for seed in range(10):
        controller, rng = AdaptiveThresholds(config, 512), random.Random(seed)
        for step in range(6000):
            tokens = 200 + step // 3
            cap = next(b for b in controller.grid if b >= tokens)
            assert controller.limit(tokens) <= cap  # a boundary past the context archives nothing: never searched
            controller.observe(max(0.0, curve(controller.boundary, tokens) * (1 + 0.1 * rng.gauss(0, 1))))
        right = next(b for b in controller.grid if curve(b, tokens) <= 0.08)
        assert right - 128 <= controller.boundary <= right + 64, (seed, controller.boundary, right)


def test_archive_bits_move_only_once_attention_reaches_the_archive():
    model = _tiny()
    kvpack.enable(model)
    try:
        for prompt, moved in ((150, False), (700, True)):
            cache = kvpack.KVCache(model, "tiered:128:tq", tracker=QualityTracker(1.0))
            config = AdaptiveConfig.for_method(cache.method, 10.0, min_samples=2, max_samples=4)  # loose: every boundary is slack
            archive = AdaptiveArchive(AdaptiveThresholds(config, 128), ((2, 2), (3, 2)), start=1, step_down=True)
            ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(prompt))
            with torch.no_grad():
                model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
            has_archive = any(e.masses.get("tier1", 0.0) > 0 for e in cache.tracker.estimates)
            adapt(cache, archive)
            assert has_archive == moved and (archive.bits == (2, 2)) == moved, prompt  # 150 tokens: nothing archived yet
            assert (cache.method.tiers[0].key.options["bits"], cache.method.tiers[0].value.options["bits"]) == archive.bits
    finally:
        kvpack.disable(model)
