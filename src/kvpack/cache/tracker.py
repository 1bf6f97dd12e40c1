"""Quality tracking: the attention error a cache's codecs cause, measured on the blocks it stores.

`QualityTracker` watches the one moment a cache still holds a block's original K/V next to its
compressed form: when `KVPackLayer.flush` has just encoded the block out of the exact window. On a
seeded fraction of those flushes it decodes what the cache now stores for the block and measures the
attention-output error the codec round trip causes (`attention_error`), with a running mean per tier
and per layer; `kvpack.metrics.collect` and the Prometheus exporter report them.

The controllers that act on these measurements (the adaptive tier boundary and archive widths) are in
`kvpack.cache.adaptive`; their names are also importable from here.
"""

from __future__ import annotations

import copy
import math
import random
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..codecs.base import slice_packed
from . import anchors
from .adaptive import (
    FORMAT,
    VERSION,
    AdaptiveArchive,
    AdaptiveConfig,
    AdaptiveThresholds,
    Running,
    Thresholds,
    ThresholdsFileError,
    adapt,
    apply_archive_bits,
    apply_boundary,
    load_or_default,
    load_thresholds,
    save_thresholds,
)
from .layer import KVPackLayer

__all__ = [
    "FORMAT", "VERSION", "AdaptiveArchive", "AdaptiveConfig", "AdaptiveThresholds", "DecodeEstimate", "LayerQuality", "QualityTracker",
    "Sample", "Thresholds", "ThresholdsFileError", "TierQuality", "TrackerConfig", "adapt", "apply_archive_bits", "apply_boundary",
    "attention_error", "load_or_default", "load_thresholds", "part_masses", "save_thresholds",
]

if TYPE_CHECKING:
    pass


def attention_error(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor) -> float:
    """Relative L2 error of `softmax(q·Kᵀ/√d)·V` when K, V are replaced by their reconstructions.

    query: (batch, kv_heads, probes, d); k, k_hat: (batch, kv_heads, tokens, d); v, v_hat: (batch,
    kv_heads, tokens, d_v). Computed in float32 over all rows: ‖O − Ô‖ / ‖O‖.
    """
    q = query.float()
    scale = q.shape[-1] ** -0.5
    out = torch.softmax(q @ k.float().transpose(-1, -2) * scale, -1) @ v.float()
    approx = torch.softmax(q @ k_hat.float().transpose(-1, -2) * scale, -1) @ v_hat.float()
    return float((out - approx).norm() / out.norm().clamp_min(torch.finfo(torch.float32).tiny))


@dataclass(frozen=True)
class TrackerConfig:
    """fraction: share of flushes measured, in (0, 1]. seed: the sampling stream (the same seed and the same
    flushes sample the same blocks). probes: pseudo-queries per sample, >= 1. history: recent samples kept, >= 1."""

    fraction: float = 0.1
    seed: int = 0
    probes: int = 4
    history: int = 4096

    def __post_init__(self):
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float) or not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be a number in (0, 1], got {self.fraction!r}")
        for name in ("seed", "probes", "history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'seed' else 1}, got {value!r}")


@dataclass(frozen=True)
class Sample:
    """One measured block: tokens [start, start + tokens) of layer `layer`, stored in `tier`."""

    layer: int
    tier: str
    start: int
    tokens: int
    error: float


@dataclass(frozen=True)
class TierQuality:
    """Sampled attention-output error of one tier (a segment kind: "prefill", "stream", "tier1", ...)."""

    tier: str
    samples: int
    mean_error: float
    max_error: float


@dataclass(frozen=True)
class LayerQuality:
    """Sampled attention-output error of one layer, all tiers together."""

    layer: int
    samples: int
    mean_error: float
    max_error: float


@dataclass(frozen=True)
class DecodeEstimate:
    """One probed decode step of one layer: where its attention went, and the output error that implies.

    masses: the share of the step's attention probability on each part of the layer ("sink", "window",
    and each segment kind: "prefill", "stream", "tier1", ...), averaged over batch rows, kv heads and
    query rows; they sum to 1. error: sum over parts of mass x the part's tracked mean error (exact parts
    0; a tier without samples yet is left out). boundary: `tiers[0].after` when it was measured (None
    without tiers). The estimate rises with the attention that lands in lossy tiers, so it falls as the
    boundary rises: the signal `AdaptiveThresholds` needs (`adapt`)."""

    layer: int
    masses: dict[str, float]
    error: float
    boundary: int | None
    complete: bool = True  # every lossy part with attention mass had tracked samples (else its error counted as 0)


def part_masses(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Share of attention probability per part `(parts,)`, from online-softmax partials (m, l, o) with m, l
    `(batch, kv, rows, 1)`: part i holds l_i e^(m_i - M) of the total, averaged over batch, heads and rows."""
    m = torch.cat([p[0] for p in parts], dim=-1).float()  # (b, kv, rows, parts)
    w = torch.cat([p[1] for p in parts], dim=-1).float() * torch.exp(m - m.amax(-1, keepdim=True))
    return (w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)).mean(dim=(0, 1, 2))


class QualityTracker:
    """Measures codec fidelity on a seeded fraction of a cache's flushes; see the module docstring.

    Probe queries. kvpack's cache layer never sees the model's queries (they go to attention, not to
    `update`), so the probes are the keys of the newest tokens the layer holds (the last `probes` of the
    exact window after the flush). They stand at the positions the next queries will have, so with RoPE
    they meet the block at the relative distances real queries do, and they are not in the block: the
    block's own keys as queries would score themselves highest (q·k = ‖k‖²) and measure mostly one
    token each. Only a method without a window (nothing newer is held) falls back to the block's own
    last keys. Attention is over the block alone: the error isolates this block's codec, not the mix.

    Older tiers are sampled twice over: when tokens are encoded into them straight from the window (a long
    prompt), and, for every sampled block of a younger tier, by replaying the demotions still ahead of it
    at flush time (`_demotions`), since at the demotion itself the originals are gone. Samples are not
    undone when a failed forward is rolled back.
    """

    def __init__(self, fraction: float = 0.1, *, seed: int = 0, probes: int = 4, history: int = 4096):
        self.config = TrackerConfig(fraction, seed, probes, history)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # the exporter reads from its own thread while generation writes
        self.flushes = 0
        self._tiers: dict[str, Running] = {}
        self._layers: dict[int, Running] = {}
        self._recent: deque[Sample] = deque(maxlen=history)
        self.decode_steps = 0
        self._decode_rng = random.Random(seed + 1)  # its own stream: probing decode steps never shifts which flushes are sampled
        self._estimates: deque[DecodeEstimate] = deque(maxlen=history)
        self._drained = 0  # estimates handed out by `drain_estimates`, counted over the tracker's life
        self._produced = 0

    def on_flush(self, layer: KVPackLayer, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Called by `KVPackLayer.flush` once it has encoded tokens [start, start + n) and trimmed its window.

        k, v: the block's original states `(batch, kv_heads, n, head_dim)` in the window's dtype.
        """
        with self._lock:
            self.flushes += 1
            if self._rng.random() >= self.config.fraction:
                return
        probe = self._probe(layer, k)
        for sample in self._measure(layer, k, v, start, probe):
            self._record(sample)

    def on_decode(self, layer: KVPackLayer, kinds: list[str], parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Called by kvpack's fused decode step with the layer's partials, one per part named in `kinds`.

        On a seeded `fraction` of steps it records a `DecodeEstimate`: the attention mass per part, read from
        the partials the step computed anyway (no extra attention pass), times each tier's tracked error."""
        with self._lock:
            self.decode_steps += 1
            if self._decode_rng.random() >= self.config.fraction:
                return
            errors = {t: r.mean for t, r in self._tiers.items()}
        masses: dict[str, float] = {}
        for kind, mass in zip(kinds, part_masses(parts).tolist(), strict=True):
            masses[kind] = masses.get(kind, 0.0) + mass
        error = sum(mass * errors.get(kind, 0.0) for kind, mass in masses.items())
        complete = all(kind in errors or kind in ("sink", "window", anchors.KIND) or mass == 0 for kind, mass in masses.items())
        boundary = layer.method.tiers[0].after if layer.method.tiers else None
        with self._lock:
            self._estimates.append(DecodeEstimate(layer.layer_idx, masses, error, boundary, complete))
            self._produced += 1

    def drain_estimates(self) -> list[DecodeEstimate]:
        """The decode estimates recorded since the last call (at most `history` of them), oldest first."""
        with self._lock:
            new = min(self._produced - self._drained, len(self._estimates))
            self._drained = self._produced
            return list(self._estimates)[len(self._estimates) - new :] if new else []

    @property
    def estimates(self) -> tuple[DecodeEstimate, ...]:
        """The most recent decode estimates (at most `history`), oldest first."""
        with self._lock:
            return tuple(self._estimates)

    def forget(self, tier: str) -> None:
        """Drop `tier`'s running statistics (its codecs changed, e.g. `apply_archive_bits`): estimates leave it
        out, marked incomplete, until new samples arrive."""
        with self._lock:
            self._tiers.pop(tier, None)

    def _probe(self, layer: KVPackLayer, k: torch.Tensor) -> torch.Tensor:
        """Pseudo-queries `(batch, kv_heads, probes, d)`: the newest window keys, else the block's last keys."""
        source = layer.win_k if layer.win_k.shape[2] else k
        return source[:, :, -self.config.probes :]

    def _measure(self, layer: KVPackLayer, k: torch.Tensor, v: torch.Tensor, start: int, probe: torch.Tensor) -> list[Sample]:
        """One sample per segment that holds part of the block (a long prompt can span an archive tier and the stream)."""
        stop, out = start + k.shape[2], []
        for seg in layer.segments:
            lo, hi = max(start, seg.start), min(stop, seg.start + seg.length)
            if lo >= hi:
                continue
            # The block was encoded on its own, so it starts at a packing boundary of its segment: slicing is exact.
            pos = layer.positions(lo, hi - lo)
            k_hat = seg.key_codec.decode(slice_packed(seg.keys, lo - seg.start, hi - seg.start), pos)
            v_hat = seg.value_codec.decode(slice_packed(seg.values, lo - seg.start, hi - seg.start), pos)
            k0, v0 = k[:, :, lo - start : hi - start], v[:, :, lo - start : hi - start]
            out.append(Sample(layer.layer_idx, seg.kind, lo, hi - lo, attention_error(probe, k0, v0, k_hat, v_hat)))
            out.extend(self._demotions(layer, seg.kind, (k0, v0), (k_hat, v_hat), probe, lo, pos))
        return out

    def _demotions(self, layer: KVPackLayer, kind: str, original: tuple, stored: tuple, probe: torch.Tensor, start: int, pos) -> list[Sample]:
        """What the block will hold after each demotion still ahead of it, measured now, while its originals exist.

        A demotion decodes the younger tier and re-encodes (`KVPackLayer._demote`), so the chain is replayed on
        the stored reconstruction with deep copies of the older tiers' codecs (a copy of a codec that has not
        fitted yet fits on this block and is dropped: the cache's own codecs are untouched). Without these
        samples a tier reached only by demotion (every decoded token of a chat) would have no error at all, and
        the decode estimate would fall as the boundary falls."""
        tiers = len(layer.method.tiers)
        first = 1 if kind == "stream" else int(kind[4:]) + 1 if kind.startswith("tier") else tiers + 1
        (k, v), (k_hat, v_hat), out = original, stored, []
        for level in range(first, tiers + 1):
            kc, vc = (copy.deepcopy(layer.codec(f"tier{level}", side)) for side in ("key", "value"))
            n = k.shape[2] // math.lcm(kc.token_multiple, vc.token_multiple) * math.lcm(kc.token_multiple, vc.token_multiple)
            if not n:
                break
            k, v, k_hat, v_hat, pos = k[:, :, :n], v[:, :, :n], k_hat[:, :, :n], v_hat[:, :, :n], pos[..., :n]
            k_hat, v_hat = kc.decode(kc.encode(k_hat, pos), pos), vc.decode(vc.encode(v_hat, pos), pos)
            out.append(Sample(layer.layer_idx, f"tier{level}", start, n, attention_error(probe, k, v, k_hat, v_hat)))
        return out

    def _record(self, sample: Sample) -> None:
        with self._lock:
            self._tiers.setdefault(sample.tier, Running()).add(sample.error)
            self._layers.setdefault(sample.layer, Running()).add(sample.error)
            self._recent.append(sample)

    def tiers(self) -> tuple[TierQuality, ...]:
        """Running error per tier, in order of first sample."""
        with self._lock:
            return tuple(TierQuality(t, r.count, r.mean, r.max) for t, r in self._tiers.items())

    def layers(self) -> tuple[LayerQuality, ...]:
        """Running error per layer, by layer index."""
        with self._lock:
            return tuple(LayerQuality(i, r.count, r.mean, r.max) for i, r in sorted(self._layers.items()))

    @property
    def samples(self) -> tuple[Sample, ...]:
        """The most recent samples (at most `history`), oldest first."""
        with self._lock:
            return tuple(self._recent)

    def __deepcopy__(self, memo: dict) -> QualityTracker:
        # A copied cache gets its own tracker with the same history; a lock cannot be copied, so it is new.
        new = QualityTracker.__new__(QualityTracker)
        with self._lock:
            state = {key: val for key, val in vars(self).items() if key != "_lock"}
            vars(new).update(copy.deepcopy(state, memo))
        new._lock = threading.Lock()
        return new
