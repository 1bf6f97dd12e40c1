"""Adaptive placement: controllers that move a live cache's tier boundary and archive widths toward a target error.

`AdaptiveThresholds` moves the boundary of the first older tier (`MethodConfig.tiers[0].after`, the
age where tokens leave the stream codecs) toward a target error: up while the observed error is above
target, down while it is below, by a noisy bisection over multiples of the block size. `AdaptiveArchive` moves the
archive's widths around it. `adapt(cache, controller)` feeds a controller the error estimates of the cache's
`QualityTracker` (kvpack.cache.tracker) and applies its moves (`apply_boundary`, `apply_archive_bits`): the age
tiers (kvpack.cache.tiers) read the boundaries from the layers' method, so blocks follow at the next flush.
`Thresholds` are what a controller learned; `save_thresholds` / `load_thresholds` keep them per model as JSON.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..registry import CodecSpec, MethodConfig

if TYPE_CHECKING:
    from .kvcache import KVCache


class Running:
    """Count, mean and max of a stream of errors."""

    def __init__(self):
        self.count, self.mean, self.max = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.mean += (x - self.mean) / self.count
        self.max = max(self.max, x)


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
        self._stats = Running()
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
        self._stats, self._m2 = Running(), 0.0
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
        self._stats, self._m2 = Running(), 0.0

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
    for layer in cache.compressed_layers():  # a compressed sliding layer runs its own method, without tiers
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
    for layer in cache.compressed_layers():  # a compressed sliding layer runs its own method, without tiers
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
    (measured on SmolLM2: +3.3% perplexity with it, docs/guide/tiers.md); use it where the context is stable.
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
