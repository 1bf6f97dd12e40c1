"""Cache metrics as Python objects, and a Prometheus exporter for them (ADR-004).

`collect(cache)` reads what a `KVCache` holds right now: per tier its token positions, the bytes its
tensors hold (`KVPackLayer.memory`, the same count as `KVCache.memory_report`) and the ratio against
an fp16 cache of the same tokens, plus the quality tracker's running errors when the cache has one.
`serve(port, cache)` starts an HTTP endpoint (`prometheus_client`, the `serve` extra) whose every
scrape calls `collect`. Tiers: "sinks", "hot" (the exact window), each compressed segment kind
("prefill", "stream", "tier1", ...) and "sliding_window" (transformers' own sliding layers).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._optional import MissingDependency, install_line
from .cache import anchors
from .cache.kvcache import KVCache
from .cache.layer import KVPackLayer
from .cache.tracker import LayerQuality, TierQuality

FP16_BYTES = 2


@dataclass(frozen=True)
class TierMetrics:
    """One tier, summed over layers. tokens: positions the tier holds in each layer (every compressed layer
    holds the same split, as they see the same updates). bytes: held by its tensors, spare block capacity
    included. fp16_bytes: the same tokens as fp16 K and V. ratio_vs_fp16: fp16_bytes / bytes. state_bytes: the
    fitted state of the codecs that coded the tier (PCA bases, codebooks; earlier fits that still read their
    segments included), which `CacheMetrics.total_bytes` counts once for the whole cache."""

    tier: str
    tokens: int
    bytes: int
    fp16_bytes: int
    ratio_vs_fp16: float
    state_bytes: int = 0

    @property
    def ratio_with_state(self) -> float:
        """fp16_bytes / (bytes + state_bytes): what the tier costs per token with its codecs' fitted state."""
        held = self.bytes + self.state_bytes
        return self.fp16_bytes / held if held else math.nan


@dataclass(frozen=True)
class QualityMetrics:
    """The tracker's running attention-output errors (`kvpack.cache.tracker.QualityTracker`)."""

    fraction: float
    flushes: int
    tiers: tuple[TierQuality, ...]
    layers: tuple[LayerQuality, ...]


@dataclass(frozen=True)
class BudgetMetrics:
    """A cache's `MemoryBudget` and every move it made (`KVCache.budget_events`). moves / moved_tokens: per action
    ("demote", "evict", "rematerialize"), the events and the token positions they moved, summed over layers.
    evicted_tokens: positions out of attention now (the most over layers; 0 after `rematerialize`)."""

    max_bytes: int
    moves: dict[str, int]
    moved_tokens: dict[str, int]
    evicted_tokens: int


@dataclass(frozen=True)
class CacheMetrics:
    """A cache's memory by tier and its quality. total_bytes: the tiers plus fitted codec state (bases,
    codebooks), = `KVCache.memory_report()["total_bytes"]`. ratio: fp16 bytes / total_bytes.
    quality: None when the cache has no tracker. budget: None when it has no `MemoryBudget`."""

    method: str
    tiers: tuple[TierMetrics, ...]
    total_tokens: int
    total_bytes: int
    codec_state_bytes: int
    fp16_bytes: int
    ratio: float
    quality: QualityMetrics | None
    budget: BudgetMetrics | None = None

    def tier(self, name: str) -> TierMetrics:
        """The tier called `name`; KeyError lists the tiers present."""
        for t in self.tiers:
            if t.tier == name:
                return t
        raise KeyError(f"no tier {name!r} in this cache; tiers: {[t.tier for t in self.tiers]}")


class _Tally:
    """Per tier: max tokens over layers, summed bytes and fp16 bytes."""

    def __init__(self):
        self.rows: dict[str, list[int]] = {}
        self.state: dict[str, int] = {}

    def add(self, tier: str, tokens: int, nbytes: int, fp16: int) -> None:
        row = self.rows.setdefault(tier, [0, 0, 0])
        row[0], row[1], row[2] = max(row[0], tokens), row[1] + nbytes, row[2] + fp16

    def add_state(self, layer: KVPackLayer) -> None:
        for kind, nbytes in layer.state_nbytes_by_kind().items():
            self.state[kind] = self.state.get(kind, 0) + nbytes

    def tiers(self) -> tuple[TierMetrics, ...]:
        return tuple(TierMetrics(name, t, b, f, f / b if b else math.nan, self.state.get(name, 0)) for name, (t, b, f) in self.rows.items())


def _layer_tiers(layer: KVPackLayer) -> Iterator[tuple[str, int, int]]:
    """(tier, tokens, bytes) of one compressed layer: sinks and window from `layer.memory()`, segments by kind."""
    mem = layer.memory()
    yield "sinks", layer.sink_k.shape[2], mem["sink"]
    rows: dict[str, tuple[int, int]] = {}
    # One pass over one copy of the list: the exporter reads while the generating thread may be flushing.
    for seg in list(layer.segments):
        tokens, nbytes = rows.get(seg.kind, (0, 0))
        rows[seg.kind] = (tokens + seg.length, nbytes + seg.nbytes())
    for kind, (tokens, nbytes) in rows.items():
        yield kind, tokens, nbytes
    held = layer.anchors  # read once: the exporter may run while the generating thread crops
    if held is not None:  # exact copies of tokens a segment above already counts
        yield anchors.KIND, held.count, held.nbytes()
    yield "hot", layer.win_k.shape[2], mem["window"]


def _sliding(layer) -> tuple[int, int, int]:
    """(tokens, bytes, fp16 bytes) of a transformers sliding-window layer."""
    k, v = layer.keys, layer.values
    return k.shape[2], k.numel() * k.element_size() + v.numel() * v.element_size(), (k.numel() + v.numel()) * FP16_BYTES


def _budget(cache: KVCache) -> BudgetMetrics | None:
    budget = cache.budget
    if budget is None:
        return None
    moves: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for event in list(cache.budget_events):  # a copy: the generating thread may append while the exporter reads
        moves[event.action] = moves.get(event.action, 0) + 1
        tokens[event.action] = tokens.get(event.action, 0) + event.tokens
    evicted = max((layer.evicted_tokens for layer in cache.compressed_layers()), default=0)
    return BudgetMetrics(budget.max_bytes, moves, tokens, evicted)


def _quality(cache: KVCache) -> QualityMetrics | None:
    tracker = getattr(cache, "tracker", None)
    if tracker is None:
        return None
    return QualityMetrics(tracker.config.fraction, tracker.flushes, tracker.tiers(), tracker.layers())


def collect(cache: KVCache) -> CacheMetrics:
    """Memory per tier and quality of `cache`, read from the tensors it holds now.

    fp16 reference per compressed layer: batch × kv_heads × tokens × (head_dim + v_head_dim) × 2 bytes
    (K and V in fp16); sliding layers: their held K/V elements × 2 bytes.
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"collect reads a kvpack.KVCache, got {type(cache).__name__}")
    tally, state = _Tally(), 0
    for layer in cache.layers:
        if isinstance(layer, KVPackLayer):
            if not layer.is_initialized:
                continue
            per_token = layer.batch * layer.kv_heads * (layer.head_dim + layer.v_head_dim) * FP16_BYTES
            for tier, tokens, nbytes in _layer_tiers(layer):
                tally.add(tier, tokens, nbytes, 0 if tier == anchors.KIND else tokens * per_token)  # anchors: no tokens of their own
            state += layer.memory()["codec_state"]
            tally.add_state(layer)
        elif getattr(layer, "is_initialized", False):
            tokens, nbytes, fp16 = _sliding(layer)
            tally.add("sliding_window", tokens, nbytes, fp16)
    tiers = tally.tiers()
    total, fp16 = sum(t.bytes for t in tiers) + state, sum(t.fp16_bytes for t in tiers)
    ratio = fp16 / total if total else math.nan
    return CacheMetrics(cache.method.name, tiers, cache.get_seq_length(), total, state, fp16, ratio, _quality(cache), _budget(cache))


# -- Prometheus --------------------------------------------------------------------------------------
Source = KVCache | Callable[[], "KVCache | Iterable[KVCache] | None"]


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as err:
        raise MissingDependency(
            f"kvpack.metrics.serve needs the optional package 'prometheus_client', which is not installed; install it with: {install_line('serve')}"
        ) from err
    return prometheus_client


def _caches(sources: tuple[Source, ...]) -> list[KVCache]:
    """The caches to report at this scrape: each source as is, or what its callable returns now."""
    out: list[KVCache] = []
    for source in sources:
        got = source() if callable(source) else source
        if got is None:
            continue
        out.extend([got] if isinstance(got, KVCache) else list(got))
    return out


class _Collector:
    """A prometheus_client collector: `collect` runs on every scrape, so the numbers are the cache's current ones."""

    def __init__(self, sources: tuple[Source, ...]):
        self.sources = sources

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = {
            name: GaugeMetricFamily(f"kvpack_cache_{name}", doc, labels=labels)
            for name, doc, labels in _GAUGES
        }
        quality = {
            "error": GaugeMetricFamily("kvpack_quality_relative_error", "Mean sampled attention-output relative error", labels=["cache", "tier"]),
            "max": GaugeMetricFamily("kvpack_quality_max_relative_error", "Largest sampled attention-output relative error", labels=["cache", "tier"]),
            "samples": CounterMetricFamily("kvpack_quality_samples", "Blocks measured by the quality tracker", labels=["cache", "tier"]),
            "layer": GaugeMetricFamily("kvpack_quality_layer_relative_error", "Mean sampled relative error per layer", labels=["cache", "layer"]),
            "flushes": CounterMetricFamily("kvpack_quality_flushes", "Block flushes the quality tracker saw (sampled or not)", labels=["cache"]),
        }
        budget = {
            "max_bytes": GaugeMetricFamily("kvpack_budget_max_bytes", "The cache's MemoryBudget in bytes", labels=["cache"]),
            "moves": CounterMetricFamily("kvpack_budget_moves", "Budget moves per action (demote, evict, rematerialize), over layers", labels=["cache", "action"]),
            "tokens": CounterMetricFamily("kvpack_budget_moved_tokens", "Token positions moved per action, summed over layers", labels=["cache", "action"]),
            "evicted": GaugeMetricFamily("kvpack_budget_evicted_tokens", "Token positions out of attention now (most over layers)", labels=["cache"]),
        }
        for i, cache in enumerate(_caches(self.sources)):
            m = collect(cache)
            _add_cache(g, quality, str(i), m)
            if m.budget is not None:
                _add_budget(budget, str(i), m.budget)
        yield from g.values()
        yield from quality.values()
        yield from budget.values()


_GAUGES = (
    ("bytes", "Bytes held by the tier's tensors, summed over layers", ["cache", "tier"]),
    ("tokens", "Token positions the tier holds (per layer)", ["cache", "tier"]),
    ("fp16_bytes", "Bytes the tier's tokens would take as fp16 K and V", ["cache", "tier"]),
    ("tier_compression_ratio", "fp16 bytes / held bytes, per tier", ["cache", "tier"]),
    ("total_bytes", "Bytes held by the cache: tiers and fitted codec state", ["cache"]),
    ("codec_state_bytes", "Bytes of fitted codec state (bases, codebooks)", ["cache"]),
    ("total_tokens", "Tokens in the cache", ["cache"]),
    ("compression_ratio", "fp16 bytes / total bytes", ["cache"]),
    ("info", "The cache's method (value 1)", ["cache", "method"]),
)


def _add_cache(g: dict, quality: dict, label: str, m: CacheMetrics) -> None:
    for t in m.tiers:
        for name, value in (("bytes", t.bytes), ("tokens", t.tokens), ("fp16_bytes", t.fp16_bytes), ("tier_compression_ratio", t.ratio_vs_fp16)):
            g[name].add_metric([label, t.tier], value)
    for name, value in (("total_bytes", m.total_bytes), ("codec_state_bytes", m.codec_state_bytes), ("total_tokens", m.total_tokens), ("compression_ratio", m.ratio)):
        g[name].add_metric([label], value)
    g["info"].add_metric([label, m.method], 1)
    if m.quality is None:
        return
    quality["flushes"].add_metric([label], m.quality.flushes)
    for q in m.quality.tiers:
        quality["error"].add_metric([label, q.tier], q.mean_error)
        quality["max"].add_metric([label, q.tier], q.max_error)
        quality["samples"].add_metric([label, q.tier], q.samples)
    for q in m.quality.layers:
        quality["layer"].add_metric([label, str(q.layer)], q.mean_error)


def _add_budget(families: dict, label: str, b: BudgetMetrics) -> None:
    families["max_bytes"].add_metric([label], b.max_bytes)
    families["evicted"].add_metric([label], b.evicted_tokens)
    for action in ("demote", "evict", "rematerialize"):  # every action, 0 included: a rate needs the series from the start
        families["moves"].add_metric([label, action], b.moves.get(action, 0))
        families["tokens"].add_metric([label, action], b.moved_tokens.get(action, 0))


class MetricsServer:
    """A running exporter: `url` to scrape, `close()` (or `with`) to stop it and free the port."""

    def __init__(self, server, thread: threading.Thread):
        self._server, self._thread = server, thread
        self.addr, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(port: int, *sources: Source, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve `collect` of each source as Prometheus metrics on `http://addr:port/metrics`, from a daemon thread.

    sources: `KVCache`s, or callables returning a cache, an iterable of caches or None (caches made
    later, e.g. one per request); the `cache` label is the position in that list. port 0 picks a free
    port (read it from `.port`). Needs `prometheus_client` (`pip install "kvpack[serve]"`).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
    for source in sources:
        if not isinstance(source, KVCache) and not callable(source):
            raise TypeError(f"serve takes KVCache objects or callables returning them, got {type(source).__name__}")
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(sources))
    server, thread = prom.start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread)
