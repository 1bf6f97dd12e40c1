"""Metrics per tier against bytes counted here from the tensors each layer holds (and by hand from the
codec layouts), and the Prometheus endpoint scraped over HTTP and parsed with this file's own parser."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack._optional import MissingDependency
from kvpack.cache import KVPackLayer
from kvpack.codecs.kivi import KiviCodec, KiviConfig
from kvpack.metrics import collect, serve

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=4096)
KV_BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 2  # layers * kv_heads * head_dim * (K and V) * fp16 bytes, batch 1


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)).eval()


def _fill(model, cache, prompt: int, steps: int = 0) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, prompt), generator=g), past_key_values=cache)
        for _ in range(steps):
            model(torch.randint(0, 128, (1, 1), generator=g), past_key_values=cache)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _counted(cache) -> dict[str, tuple[int, int]]:
    """(tokens per layer, bytes over layers) per tier, from the tensors themselves (block buffers with their slack)."""
    out: dict[str, list[int]] = {}
    for layer in cache.layers:
        parts = [("sinks", layer.sink_k.shape[2], _nbytes([layer.sink_k, layer.sink_v])), ("hot", layer.win_k.shape[2], _nbytes([layer.win_k, layer.win_v]))]
        parts += [(seg.kind, seg.length, _nbytes([*seg.key_run._bufs.values(), *seg.value_run._bufs.values()])) for seg in layer.segments]
        for tier, tokens, nbytes in parts:
            row = out.setdefault(tier, [0, 0, 0])
            row[0] = tokens if row[2] == 0 else row[0]
            assert row[0] == tokens or row[2] == 0  # every compressed layer holds the same split
            row[1], row[2] = row[1] + nbytes, row[2] + 1
    return {tier: (t, b) for tier, (t, b, _) in out.items()}


def test_int8_tiers_match_a_hand_count():
    model = _llama()
    cache = kvpack.KVCache(model, "int8")
    _fill(model, cache, 1000)
    m = collect(cache)
    per_token = 2 * 2 * 2  # layers * kv_heads * (K and V)
    assert [t.tier for t in m.tiers] == ["sinks", "stream", "hot"]
    # 4 fp16 sinks, 932 int8 tokens (16 codes + an fp16 scale per vector), a 64-token fp16 window.
    assert (m.tier("sinks").tokens, m.tier("sinks").bytes) == (4, 4 * per_token * 16 * 2)
    assert (m.tier("stream").tokens, m.tier("stream").bytes) == (932, 932 * per_token * (16 + 2))
    assert (m.tier("hot").tokens, m.tier("hot").bytes) == (64, 64 * per_token * 16 * 2)
    assert m.tier("stream").ratio_vs_fp16 == pytest.approx(32 / 18) and m.tier("hot").ratio_vs_fp16 == 1.0
    assert m.fp16_bytes == 1000 * KV_BYTES_PER_TOKEN and m.total_tokens == 1000
    assert m.total_bytes == 1000 * KV_BYTES_PER_TOKEN - 932 * per_token * (32 - 18) and m.ratio == m.fp16_bytes / m.total_bytes
    assert m.quality is None and m.method == "int8"
    with pytest.raises(KeyError, match="tiers: \\['sinks', 'stream', 'hot'\\]"):
        m.tier("tier1")


def test_tiered_cache_bytes_are_the_bytes_its_tensors_hold():
    model = _llama()
    cache = kvpack.KVCache(model, "tiered:512")
    _fill(model, cache, 1000, steps=130)
    m = collect(cache)
    counted = _counted(cache)
    assert {t.tier for t in m.tiers} == set(counted) == {"sinks", "tier1", "stream", "hot"}
    for t in m.tiers:
        assert (t.tokens, t.bytes) == counted[t.tier], t.tier
        assert t.fp16_bytes == t.tokens * KV_BYTES_PER_TOKEN and t.ratio_vs_fp16 == t.fp16_bytes / t.bytes
    assert sum(t.tokens for t in m.tiers) == m.total_tokens == 1130
    assert m.codec_state_bytes == 0 and m.total_bytes == sum(b for _, b in counted.values())  # KIVI fits nothing


def test_archive_bytes_match_the_archive_codec_layout():
    model = _llama()
    cache = kvpack.KVCache(model, "tiered:512")
    _fill(model, cache, 2000)  # one encode per tier: no spare block capacity yet
    archive = collect(cache).tier("tier1")
    x = torch.randn(1, 2, archive.tokens, 16)
    per_layer = KiviCodec(KiviConfig(bits=2, axis="channel"), 16, 2).encode(x).nbytes()
    per_layer += KiviCodec(KiviConfig(bits=2, axis="token"), 16, 2).encode(x).nbytes()
    assert archive.bytes == 2 * per_layer


def test_fitted_codec_state_counts_toward_the_total():
    model = _llama()
    cache = kvpack.KVCache(model, "shard")
    _fill(model, cache, 600)
    m = collect(cache)
    state = sum(c.state_nbytes() for layer in cache.layers for c in layer._codecs.values())
    assert m.codec_state_bytes == state > 0  # the PCA basis and VQ codebooks
    assert m.total_bytes == sum(t.bytes for t in m.tiers) + state == cache.memory_report()["total_bytes"]


def test_archive_ratio_counts_its_tokens_bytes_and_fitted_state():
    """The oldest tier's own ratio, from `collect` and from `memory_report()["archive"]` (what `kvpack compare` prints),
    against the bytes counted here from the tensors and the state of the codecs named for that tier, a retired fit
    included: the fp16 bytes of its tokens over both."""
    model = _llama()
    cache = kvpack.KVCache(model, "tiered:1024:shard")
    _fill(model, cache, 2600)  # 1,500 tokens past the boundary: the archive fits on them
    layers = [layer for layer in cache.layers if isinstance(layer, KVPackLayer)]
    layers[0].retire_codecs("tier1")  # an earlier fit keeps reading its segment: its state still counts with the tier
    state = sum(c.state_nbytes() for layer in layers for name, c in layer._codecs.items() if name.split("_")[0].split("@")[0] == "tier1")
    assert state == sum(c.state_nbytes() for layer in layers for name, c in layer._codecs.items() if name.startswith("tier1")) > 0
    tokens, nbytes = _counted(cache)["tier1"]
    assert tokens >= 1024
    archive, report = collect(cache).tier("tier1"), cache.memory_report()["archive"]
    assert (archive.tokens, archive.bytes, archive.state_bytes) == (tokens, nbytes, state)
    assert archive.ratio_with_state == pytest.approx(tokens * KV_BYTES_PER_TOKEN / (nbytes + state))
    assert archive.ratio_with_state < archive.ratio_vs_fp16
    assert report == {"tier": "tier1", "tokens": tokens, "bytes": nbytes, "state_bytes": state, "fp16_bytes": tokens * KV_BYTES_PER_TOKEN,
                      "ratio": pytest.approx(archive.ratio_with_state)}
    assert sum(t.state_bytes for t in collect(cache).tiers) == collect(cache).codec_state_bytes
    assert "archive" not in kvpack.KVCache(model, "int8").memory_report()  # no tiers, no archive


def test_sliding_layers_are_their_own_tier():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=32, sliding_window_pattern=3, **SMALL)
    model = Gemma3ForCausalLM(cfg).eval()
    cache = kvpack.KVCache(model, "int8@sliding=exact")  # transformers' own windows (coded ones count as kvpack layers)
    _fill(model, cache, 300)
    sliding = [layer for layer in cache.layers if not isinstance(layer, KVPackLayer)]
    m = collect(cache)
    assert len(sliding) == 2 and m.tier("sliding_window").bytes == _nbytes([t for x in sliding for t in (x.keys, x.values)])
    assert m.tier("sliding_window").tokens == sliding[0].keys.shape[2]


def test_collect_refuses_other_caches():
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="kvpack.KVCache, got DynamicCache"):
        collect(DynamicCache())


# -- Prometheus ---------------------------------------------------------------------------------------
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Samples of a text exposition, {(name, labels): value}, parsed line by line."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, labels, value = LINE.match(line).groups()
        out[name, frozenset(LABEL.findall(labels or ""))] = float(value)
    return out


def _key(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


def test_endpoint_serves_the_bytes_counted_from_the_tensors():
    pytest.importorskip("prometheus_client")
    model, tracker = _llama(), kvpack.QualityTracker(1.0)
    cache = kvpack.KVCache(model, "tiered:512", tracker=tracker)
    _fill(model, cache, 1000, steps=70)
    counted = _counted(cache)
    with serve(0, cache) as server:
        assert server.port > 0 and server.addr == "127.0.0.1"
        got = _scrape(server.url)
    for tier, (tokens, nbytes) in counted.items():
        assert got[_key("kvpack_cache_bytes", cache="0", tier=tier)] == nbytes
        assert got[_key("kvpack_cache_tokens", cache="0", tier=tier)] == tokens
    total = sum(b for _, b in counted.values())
    assert got[_key("kvpack_cache_total_bytes", cache="0")] == total
    assert got[_key("kvpack_cache_total_tokens", cache="0")] == 1070
    assert got[_key("kvpack_cache_compression_ratio", cache="0")] == pytest.approx(1070 * KV_BYTES_PER_TOKEN / total)
    assert got[_key("kvpack_cache_info", cache="0", method="tiered:512")] == 1
    for tier in {s.tier for s in tracker.samples}:
        errors = [s.error for s in tracker.samples if s.tier == tier]
        assert got[_key("kvpack_quality_samples_total", cache="0", tier=tier)] == len(errors)
        assert got[_key("kvpack_quality_relative_error", cache="0", tier=tier)] == pytest.approx(sum(errors) / len(errors))
    assert _key("kvpack_quality_layer_relative_error", cache="0", layer="1") in got
    assert got[_key("kvpack_quality_flushes_total", cache="0")] == tracker.flushes > 2  # a prompt flush and a block per layer
    with pytest.raises(urllib.error.URLError):  # shut down: the port no longer answers
        urllib.request.urlopen(server.url, timeout=2)


def test_endpoint_reads_callable_sources_at_every_scrape():
    pytest.importorskip("prometheus_client")
    model, holder = _llama(), {"cache": None}
    with serve(0, lambda: holder["cache"]) as server:
        assert not any(name.startswith("kvpack_cache") for name, _ in _scrape(server.url))  # no cache yet
        holder["cache"] = kvpack.KVCache(model, "int8")
        for prompt in (300, 200):  # the second forward appends blocks and grows the run's spare capacity
            _fill(model, holder["cache"], prompt)
            got = _scrape(server.url)
            assert got[_key("kvpack_cache_bytes", cache="0", tier="stream")] == _counted(holder["cache"])["stream"][1]
        assert got[_key("kvpack_cache_total_tokens", cache="0")] == 500


def test_budget_moves_are_exported_as_the_layers_hold_them():
    pytest.importorskip("prometheus_client")
    model = _llama()
    kvpack.enable(model)
    try:
        unlimited = kvpack.KVCache(model, "tiered:2048")  # a boundary past the context: only the budget archives
        _fill(model, unlimited, 1000, steps=70)
        held = [layer.nbytes() for layer in unlimited.compressed_layers()]
        compressed = sum(seg.nbytes() for layer in unlimited.compressed_layers() for seg in layer.segments)
        budget = kvpack.MemoryBudget(int(sum(held) - 0.8 * compressed))  # past what 2-bit archiving alone frees
        cache = kvpack.KVCache(model, "tiered:2048", budget=budget)
        _fill(model, cache, 1000, steps=70)
        assert collect(unlimited).budget is None
        m = collect(cache).budget
        layers = cache.compressed_layers()
        archived = sum(seg.length for layer in layers for seg in layer.segments if seg.kind == "tier1")
        evicted = [layer.evicted_tokens for layer in layers]
        # the archive holds what was demoted, less what eviction then dropped from its front (it is the oldest)
        assert m.max_bytes == budget.max_bytes and m.moved_tokens["demote"] == archived + sum(evicted) > 0
        assert m.moved_tokens["evict"] == sum(evicted) > 0 and m.evicted_tokens == max(evicted)
        with serve(0, cache) as server:
            got = _scrape(server.url)
    finally:
        kvpack.disable(model)
    assert got[_key("kvpack_budget_max_bytes", cache="0")] == budget.max_bytes
    assert got[_key("kvpack_budget_moved_tokens_total", cache="0", action="demote")] == archived + sum(evicted)
    assert got[_key("kvpack_budget_moved_tokens_total", cache="0", action="evict")] == sum(evicted)
    assert got[_key("kvpack_budget_moves_total", cache="0", action="rematerialize")] == 0
    assert got[_key("kvpack_budget_moves_total", cache="0", action="demote")] == m.moves["demote"] >= len(layers)
    assert got[_key("kvpack_budget_evicted_tokens", cache="0")] == max(evicted)


def test_serve_without_prometheus_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what a failed import looks like
    with pytest.raises(MissingDependency, match=r'pip install "kvpack\[serve\]"'):
        serve(0)


def test_serve_validates_its_arguments():
    with pytest.raises(ValueError, match="port must be an int in 0..65535"):
        serve(70000)
    with pytest.raises(TypeError, match="KVCache objects or callables"):
        serve(0, "cache")


def test_core_and_collect_need_no_prometheus_client():
    script = textwrap.dedent(f"""
        import sys
        sys.modules["prometheus_client"] = None
        from transformers import LlamaConfig
        import kvpack
        cache = kvpack.KVCache(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **{SMALL!r}), "int8")
        assert kvpack.metrics.collect(cache).total_bytes == 0
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
