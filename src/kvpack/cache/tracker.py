"""Quality tracking and adaptive tier boundaries (ADR-004; issue 13 item 4).

`QualityTracker` watches the one moment a cache still holds a block's original K/V next to its
compressed form: when `KVPackLayer.flush` has just encoded the block out of the exact window. On a
seeded fraction of those flushes it decodes what the cache now stores for the block and measures the
attention-output error the codec round trip causes (`attention_error`), with a running mean per tier
and per layer; `kvpack.metrics.collect` and the Prometheus exporter report them.

`AdaptiveThresholds` moves the boundary of the first older tier (`MethodConfig.tiers[0].after`, the
age where tokens leave the stream codecs) toward a target error: up while the observed error is above
target, down while it is below, by a noisy bisection over multiples of the block size. `Thresholds`
are what it learned; `save_thresholds` / `load_thresholds` keep them per model as JSON, and
`apply_boundary` moves a live cache's boundary (blocks already demoted stay where they are).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import tempfile
import threading
import warnings
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..codecs.base import slice_packed
from ..registry import CodecSpec, MethodConfig
from . import anchors
from .layer import KVPackLayer

if TYPE_CHECKING:
    from .kvcache import KVCache


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


class _Running:
    """Count, mean and max of a stream of errors."""

    def __init__(self):
        self.count, self.mean, self.max = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.mean += (x - self.mean) / self.count
        self.max = max(self.max, x)


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
        self._tiers: dict[str, _Running] = {}
        self._layers: dict[int, _Running] = {}
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
            kc, vc = (copy.deepcopy(layer._codec(f"tier{level}", side)) for side in ("key", "value"))
            n = k.shape[2] // math.lcm(kc.token_multiple, vc.token_multiple) * math.lcm(kc.token_multiple, vc.token_multiple)
            if not n:
                break
            k, v, k_hat, v_hat, pos = k[:, :, :n], v[:, :, :n], k_hat[:, :, :n], v_hat[:, :, :n], pos[..., :n]
            k_hat, v_hat = kc.decode(kc.encode(k_hat, pos), pos), vc.decode(vc.encode(v_hat, pos), pos)
            out.append(Sample(layer.layer_idx, f"tier{level}", start, n, attention_error(probe, k, v, k_hat, v_hat)))
        return out

    def _record(self, sample: Sample) -> None:
        with self._lock:
            self._tiers.setdefault(sample.tier, _Running()).add(sample.error)
            self._layers.setdefault(sample.layer, _Running()).add(sample.error)
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


# -- adaptive boundary -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """Learned tier boundary of one model: `boundary` is `tiers[0].after` in tokens, for `target_error`."""

    boundary: int
    target_error: float
    block_size: int
    samples: int = 0
    converged: bool = False
    archive_bits: tuple[int, int] | None = None  # (key, value) bits of the archive, when an AdaptiveArchive chose them

    def __post_init__(self):
        if isinstance(self.archive_bits, list):  # read back from JSON
            object.__setattr__(self, "archive_bits", tuple(self.archive_bits))
        bits = self.archive_bits
        if bits is not None and not (isinstance(bits, tuple) and len(bits) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bits)):
            raise ValueError(f"archive_bits must be None or (key bits, value bits), two positive ints, got {bits!r}")
        for name in ("boundary", "block_size", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "samples" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'samples' else 1}, got {value!r}")
        if self.boundary % self.block_size:
            raise ValueError(f"boundary must be a multiple of block_size {self.block_size}, got {self.boundary}")
        _check_target(self.target_error)
        if not isinstance(self.converged, bool):
            raise ValueError(f"converged must be a bool, got {self.converged!r}")


def _check_target(target: float) -> None:
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target < math.inf:
        raise ValueError(f"target_error must be a positive finite number (a relative error, e.g. 0.05), got {target!r}")


@dataclass(frozen=True)
class AdaptiveConfig:
    """target_error: the relative attention error aimed at. block_size: boundary step in tokens.
    min_after / max_after: the boundary's range (multiples of block_size; min_after at least window + block).
    min_samples: samples at a boundary before an early decision. max_samples: then the mean decides alone.
    z: standard errors the mean must clear the target by for an early decision (>= 0)."""

    target_error: float
    block_size: int = 64
    min_after: int = 128
    max_after: int = 4096
    # Measured on a synthetic error curve with 10% noise and the target midway between two grid points
    # (tests/test_tracker.py): 1000/1000 seeds end at the right boundary, the last move by sample 68 (95th
    # percentile); z 2.0 / max 16 got 994/1000, and at 20% noise these defaults get 877/1000.
    min_samples: int = 8
    max_samples: int = 20
    z: float = 2.5

    def __post_init__(self):
        _check_target(self.target_error)
        for name in ("block_size", "min_after", "max_after", "min_samples", "max_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_after % self.block_size or self.max_after % self.block_size or self.min_after > self.max_after:
            raise ValueError(
                f"min_after ({self.min_after}) and max_after ({self.max_after}) must be multiples of block_size "
                f"({self.block_size}) with min_after <= max_after"
            )
        if self.min_samples > self.max_samples:
            raise ValueError(f"min_samples ({self.min_samples}) must be <= max_samples ({self.max_samples})")
        if isinstance(self.z, bool) or not isinstance(self.z, int | float) or not 0 <= self.z < math.inf:
            raise ValueError(f"z must be a finite number >= 0, got {self.z!r}")

    @classmethod
    def for_method(cls, method: MethodConfig, target_error: float, max_after: int | None = None, **options) -> AdaptiveConfig:
        """The range `method` allows its first older tier: window + block up to the next tier's boundary − block."""
        if not method.tiers:
            raise ValueError(f"method {method.name!r} has no older tier (MethodConfig.tiers is empty): there is no boundary to adapt")
        block = method.block_size
        limit = method.tiers[1].after - block if len(method.tiers) > 1 else 4096
        top = min(max_after or limit, limit) // block * block
        return cls(target_error, block, method.window + block, top, **options)


class AdaptiveThresholds:
    """Moves the boundary toward the smallest one whose error is at most the target (noisy bisection).

    Boundaries are the grid min_after, min_after + block, ..., max_after. Samples accumulate at the
    current boundary until their mean clears the target by `z` standard errors (after `min_samples`)
    or `max_samples` arrive; then that boundary is known "above target" (move up) or "at or below"
    (move down), and the next boundary bisects the bracket still open. It converges when the bracket
    closes: the boundary is then the lowest known at or below target, or `max_after` if none is.
    The error must fall as the boundary rises (more tokens in the precise tier). Once converged it
    keeps watching: a boundary confidently above target again (the text got harder) reopens the bracket
    upward; it never probes downward by itself (call `reset` to search again).
    """

    def __init__(self, config: AdaptiveConfig, initial: int | None = None):
        self.config = config
        self.grid = list(range(config.min_after, config.max_after + 1, config.block_size))
        self._lo, self._hi = -1, len(self.grid)  # largest index known above target, smallest known at or below
        self._top = len(self.grid) - 1  # highest index that can differ from a higher one (see `limit`)
        self._index = self._nearest(initial if initial is not None else config.min_after)
        self.samples = 0
        self._stats = _Running()
        self._m2 = 0.0

    @classmethod
    def resume(cls, config: AdaptiveConfig, thresholds: Thresholds) -> AdaptiveThresholds:
        """Start from saved thresholds: at their boundary, converged if they were."""
        if thresholds.block_size != config.block_size or not math.isclose(thresholds.target_error, config.target_error):
            raise ValueError(
                f"saved thresholds were learned for block_size {thresholds.block_size} and target {thresholds.target_error}, "
                f"not {config.block_size} and {config.target_error}"
            )
        new = cls(config, thresholds.boundary)
        new.samples = thresholds.samples
        if thresholds.converged:
            new._lo, new._hi = new._index - 1, new._index
        return new

    @property
    def boundary(self) -> int:
        """The current boundary in tokens (a grid point)."""
        return self.grid[self._index]

    @property
    def converged(self) -> bool:
        """The bracket closed: the boundary below this one is known above target (or this is min/max_after)."""
        return self._upper - self._lo <= 1

    @property
    def _upper(self) -> int:
        """The bracket's upper end: the smallest index known at or below target, or one past the top."""
        return min(self._hi, self._top + 1)

    def limit(self, tokens: int) -> int:
        """Tell the search how many tokens the cache holds; returns the boundary to use.

        A boundary at or past the context archives nothing, so all such boundaries measure the same: the
        first of them is the top of the search until the context grows past it (then the search may go on
        upward). Without this, a search early in a conversation wanders over boundaries it cannot tell apart."""
        self._top = next((i for i, b in enumerate(self.grid) if b >= tokens), len(self.grid) - 1)
        if self._index > self._top:
            self._index = self._top  # the same archive, so the samples so far still count
        return self.boundary

    def observe(self, error: float) -> int:
        """Add one error sample measured at the current boundary; returns the boundary to use next."""
        if not isinstance(error, int | float) or not math.isfinite(error) or error < 0:
            raise ValueError(f"error must be a finite number >= 0, got {error!r}")
        self.samples += 1
        delta = error - self._stats.mean
        self._stats.add(error)
        self._m2 += delta * (error - self._stats.mean)
        verdict = self._verdict()
        if verdict is not None:
            self._decide(verdict)
        return self.boundary

    def _verdict(self) -> bool | None:
        """True: above target, False: at or below, None: not sure yet."""
        n, mean, target = self._stats.count, self._stats.mean, self.config.target_error
        margin = self.config.z * math.sqrt(self._m2 / (n - 1) / n) if n > 1 else math.inf
        if n >= self.config.min_samples and abs(mean - target) > margin:
            return mean > target
        if n >= self.config.max_samples:
            # Searching, the mean decides; converged, only a confident excess moves the boundary, else keep watching.
            return False if self.converged else mean > target
        return None

    def _decide(self, above: bool) -> None:
        self._stats, self._m2 = _Running(), 0.0
        if self.converged:
            if not above:
                return
            self._lo, self._hi = self._index, len(self.grid)  # the target no longer holds here: search upward again
        elif above:
            self._lo = self._index
        else:
            self._hi = self._index
        upper = self._upper
        self._index = (self._lo + upper) // 2 if upper - self._lo > 1 else min(upper, self._top)

    def _nearest(self, boundary: int) -> int:
        return min(range(len(self.grid)), key=lambda i: abs(self.grid[i] - boundary))

    @property
    def exhausted(self) -> bool:
        """Converged with no boundary at or below target: even `max_after` (or, in a shorter context, archiving
        nothing) misses it."""
        return self.converged and self._lo >= self._top

    @property
    def slack(self) -> bool:
        """Converged at `min_after` with the target met: the tiers could hold fewer bytes."""
        return self.converged and self._hi == 0

    def reset(self) -> None:
        """Forget what was learned and search again from the current boundary."""
        self._lo, self._hi = -1, len(self.grid)
        self._stats, self._m2 = _Running(), 0.0

    def thresholds(self) -> Thresholds:
        """What to persist: the current boundary and how it was learned."""
        return Thresholds(self.boundary, self.config.target_error, self.config.block_size, self.samples, self.converged)


def apply_boundary(cache: KVCache, boundary: int) -> MethodConfig:
    """Set the first older tier's boundary of a live cache (every compressed layer) to `boundary` tokens.

    Only blocks not yet demoted are affected: a higher boundary leaves archived blocks in the archive
    (demotion is one way) and stops demoting until tokens age past it; a lower one demotes the warm
    blocks now past it at the next flush. Returns the new method; validated as any MethodConfig.
    """
    method = cache.method
    if not method.tiers:
        raise ValueError(f"method {method.name!r} has no older tier (MethodConfig.tiers is empty): there is no boundary to set")
    new = method.with_options(tiers=(replace(method.tiers[0], after=boundary), *method.tiers[1:]))
    cache.method = new
    for layer in cache.layers:
        if isinstance(layer, KVPackLayer):
            layer.method = new
    return new


def apply_archive_bits(cache: KVCache, key_bits: int, value_bits: int) -> MethodConfig:
    """Set the bit widths of a live cache's archive (its method's last tier) for blocks demoted from now on.

    Blocks already in the archive keep their codes and their codecs (`KVPackLayer.retire_codecs`); the next
    block demoted builds codecs from the new specs. The tracker forgets the tier's error, which changes with
    the bits. Returns the new method; bits a codec does not offer raise its ValueError (e.g. KIVI: 2 | 4)."""
    method = cache.method
    if not method.tiers:
        raise ValueError(f"method {method.name!r} has no older tier (MethodConfig.tiers is empty): there are no archive bits to set")
    tier, kind = method.tiers[-1], f"tier{len(method.tiers)}"
    key, value = (CodecSpec(spec.codec, {**spec.options, "bits": bits}) for spec, bits in ((tier.key, key_bits), (tier.value, value_bits)))
    if (key, value) == (tier.key, tier.value):
        return method
    new = method.with_options(tiers=(*method.tiers[:-1], replace(tier, key=key, value=value)))
    cache.method = new
    for layer in cache.layers:
        if isinstance(layer, KVPackLayer):
            layer.method = new
            layer.retire_codecs(kind)
    if cache.tracker is not None:
        cache.tracker.forget(kind)
    return new


class AdaptiveArchive:
    """The archive's bit widths as an outer loop around the boundary's `AdaptiveThresholds` (ADR-004: the hot
    boundary and the archive bits move toward the target).

    rungs: (key bits, value bits) of the archive, fewest bytes first; `start` indexes the rung in use. When the
    boundary search converges with every boundary above target (even `max_after` misses it), the archive
    climbs a rung and that rung becomes the floor. With `step_down=True`, when it converges at `min_after`
    with the target met, the archive steps down a rung (fewer bytes) unless that rung is below the floor, i.e.
    already failed. Each move restarts the boundary search. The floor only rises, so the rung settles after at
    most 2 x len(rungs) moves. Stepping down is off by default: in a growing conversation the target is met
    easily while the archive is small, and blocks archived coarsely then stay coarse when the context grows
    (measured on SmolLM2: +3.3% perplexity with it, docs/tiers.md); use it where the context is stable.
    """

    def __init__(self, boundary: AdaptiveThresholds, rungs: tuple[tuple[int, int], ...], start: int, step_down: bool = False):
        if not rungs or not all(isinstance(r, tuple) and len(r) == 2 and all(isinstance(b, int) and b > 0 for b in r) for r in rungs):
            raise ValueError(f"rungs must be (key bits, value bits) pairs of positive ints, fewest bytes first, got {rungs!r}")
        if not 0 <= start < len(rungs):
            raise ValueError(f"start must index rungs (0..{len(rungs) - 1}), got {start!r}")
        self.boundary, self.rungs, self.rung, self.floor, self.step_down = boundary, tuple(rungs), start, 0, step_down

    @property
    def bits(self) -> tuple[int, int]:
        return self.rungs[self.rung]

    def thresholds(self) -> Thresholds:
        """What to persist: the boundary controller's thresholds with the archive bits in use."""
        return replace(self.boundary.thresholds(), archive_bits=self.bits)

    def step(self) -> bool:
        """After the boundary controller's latest sample: move a rung if its converged state asks for it."""
        c = self.boundary
        if not c.converged:
            return False
        if c.exhausted and self.rung + 1 < len(self.rungs):
            self.rung += 1
            self.floor = self.rung
        elif self.step_down and c.slack and self.rung > self.floor:
            self.rung -= 1
        else:
            return False
        c.reset()
        return True


def adapt(cache: KVCache, controller: AdaptiveThresholds | AdaptiveArchive) -> int:
    """Feed `controller` the decode estimates the cache's tracker recorded since the last call, moving the
    cache's boundary (`apply_boundary`) whenever the controller does, and with an `AdaptiveArchive` its
    archive bits (`apply_archive_bits`); returns the boundary now in use.

    Call it between decode steps (e.g. every few tokens). Estimates measured at another boundary than the
    controller's current one (before a move took effect), or while a lossy tier had no samples yet, are skipped."""
    if cache.tracker is None:
        raise ValueError("adapt needs a QualityTracker on the cache: KVCache(model, method, tracker=kvpack.QualityTracker(0.1))")
    archive = controller if isinstance(controller, AdaptiveArchive) else None
    boundary = archive.boundary if archive else controller
    if cache.method.tiers[0].after != boundary.limit(cache.get_seq_length()):
        apply_boundary(cache, boundary.boundary)
    for estimate in cache.tracker.drain_estimates():
        if estimate.boundary != boundary.boundary or not estimate.complete:
            continue
        before = boundary.boundary
        if boundary.observe(estimate.error) != before:
            apply_boundary(cache, boundary.boundary)
        # Bits move only on estimates that saw attention on the archive: early in a conversation the archive is
        # empty, every boundary meets the target, and stepping down then would archive the next blocks too coarsely.
        if archive is not None and estimate.masses.get(f"tier{len(cache.method.tiers)}", 0.0) > 0 and archive.step():
            apply_archive_bits(cache, *archive.bits)
    return boundary.boundary


# -- persistence -----------------------------------------------------------------------------------
FORMAT = "kvpack-thresholds"
VERSION = 1


class ThresholdsFileError(ValueError):
    """A thresholds file that cannot be used: the message names the path and the problem."""


def save_thresholds(path: str | os.PathLike, model_id: str, thresholds: Thresholds) -> None:
    """Write `thresholds` for `model_id` to `path` as JSON (atomically: a crash leaves the old file)."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string (e.g. 'HuggingFaceTB/SmolLM2-135M'), got {model_id!r}")
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds must be a Thresholds, got {type(thresholds).__name__}")
    path = Path(path)
    data = {"format": FORMAT, "version": VERSION, "model_id": model_id, "thresholds": asdict(thresholds)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def load_thresholds(path: str | os.PathLike, model_id: str) -> Thresholds:
    """The thresholds saved for `model_id` at `path`.

    Raises FileNotFoundError for a missing file, ThresholdsFileError for a corrupted one or one saved for
    another model; both messages name the path.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no thresholds file (save_thresholds writes one after a calibration)") from None
    data = _parse(path, text)
    if data["model_id"] != model_id:
        raise ThresholdsFileError(f"{path}: thresholds saved for model {data['model_id']!r}, not {model_id!r}")
    try:
        return Thresholds(**data["thresholds"])
    except (TypeError, ValueError) as err:
        raise ThresholdsFileError(f"{path}: corrupted thresholds file: {err}") from err


def _parse(path: Path, text: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ThresholdsFileError(f"{path}: corrupted thresholds file: not JSON ({err})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ThresholdsFileError(f"{path}: corrupted thresholds file: not a {FORMAT!r} document")
    if data.get("version") != VERSION:
        raise ThresholdsFileError(f"{path}: thresholds format version {data.get('version')!r}, this kvpack reads {VERSION}")
    known = {f.name for f in fields(Thresholds)}
    if not isinstance(data.get("model_id"), str) or not isinstance(data.get("thresholds"), dict) or set(data["thresholds"]) - known:
        raise ThresholdsFileError(f"{path}: corrupted thresholds file: needs a 'model_id' string and 'thresholds' with keys {sorted(known)}")
    return data


def load_or_default(path: str | os.PathLike, model_id: str, default: Thresholds) -> Thresholds:
    """`load_thresholds`, or `default` with a warning naming the path and the problem when it cannot load."""
    try:
        return load_thresholds(path, model_id)
    except (OSError, ThresholdsFileError) as err:
        warnings.warn(f"{err}; using the default thresholds (boundary {default.boundary})", RuntimeWarning, stacklevel=2)
        return default
