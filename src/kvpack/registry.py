"""One registry from method names to cache configurations: the CLI, tests and benchmarks read it.

A method names the K codec, the V codec, optional codecs for the prefill middle (Shard), the
sink and window sizes and the compression block size. Codecs resolve lazily by import path, so
a codec file is only imported when a method using it is built; building it also builds the
codec's config, so a bad option fails there. A method builder registers itself with `@method`,
naming its canonical variants, which `list_methods()` returns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .codecs.spec import CODECS, CodecSpec, load_class

__all__ = [
    "CODECS", "DEFAULT_GRAIN", "DEFAULT_METHOD", "EXACT_DTYPES", "GRAINS", "CodecSpec", "LayerCodecs", "MethodConfig", "Tier",
    "apply_suffixes", "get_method", "list_methods", "method", "parse_auto", "parse_target", "split_suffixes", "target_name",
]

EXACT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "native": None}


@dataclass(frozen=True)
class Tier:
    """An older tier (ADR-004): compressed tokens more than `after` tokens behind the newest one are held by
    these codecs instead of the stream codecs, moved there in whole blocks as they age.

    For codecs fitted on data (Shard's PCA keys and VQ values, KVQuant's codebooks), which fit on their first encode:
    fit_tokens: a fresh fit of this tier's codecs waits until at least this many tokens are past the boundary and takes
        them in one run, so the fit sees more than one block (0: fit on whatever arrives first).
    refit: every run stored after a fit has its reconstruction error measured (per side, relative squared error,
        read back from its codes); a run whose error is more than `refit` above the first run's after the fit (0.25:
        25% worse) ends the fit: its codecs keep the segments they coded, and the next tokens past the boundary wait
        for a fresh fit on `fit_tokens` of their own (0: never refit).
    """

    key: CodecSpec
    value: CodecSpec
    after: int
    fit_tokens: int = 0
    refit: float = 0.0

    def __post_init__(self):
        for attr in ("key", "value"):
            if not isinstance(getattr(self, attr), CodecSpec):
                raise TypeError(f"Tier.{attr} must be a CodecSpec, got {type(getattr(self, attr)).__name__}")
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 1:
            raise ValueError(f"Tier.after must be a positive int (tokens behind the newest), got {self.after!r}")
        if isinstance(self.fit_tokens, bool) or not isinstance(self.fit_tokens, int) or self.fit_tokens < 0:
            raise ValueError(f"Tier.fit_tokens must be a non-negative int (tokens a fresh fit waits for; 0: no wait), got {self.fit_tokens!r}")
        if isinstance(self.refit, bool) or not isinstance(self.refit, int | float) or not 0 <= self.refit < math.inf:
            raise ValueError(f"Tier.refit must be a finite number >= 0 (relative error rise that ends a fit; 0: never), got {self.refit!r}")
        if self.refit and not self.fit_tokens:
            raise ValueError("Tier.refit needs fit_tokens > 0: a refit must wait for enough tokens to fit on, "
                             f"e.g. Tier(..., fit_tokens=1024, refit={self.refit!r})")


@dataclass(frozen=True)
class LayerCodecs:
    """Stream codecs for some layers of a method, replacing its `key` / `value` there (mixed widths per layer).

    layers: model layer indices (as `cache.layers` counts them; sliding-window layers keep their own cache and
    ignore an entry). A method with no prefill codecs also codes these layers' prompts with them.
    """

    layers: tuple[int, ...]
    key: CodecSpec
    value: CodecSpec

    def __post_init__(self):
        for attr in ("key", "value"):
            if not isinstance(getattr(self, attr), CodecSpec):
                raise TypeError(f"LayerCodecs.{attr} must be a CodecSpec, got {type(getattr(self, attr)).__name__}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ValueError(f"LayerCodecs.layers must be a non-empty tuple of layer indices, got {self.layers!r}")
        bad = [i for i in self.layers if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"LayerCodecs.layers must be non-negative ints (layer indices), got {bad!r} in {self.layers!r}")


EXACT_SLIDING = "exact"  # `MethodConfig.sliding`: sliding-window layers keep transformers' own window, uncompressed
AUTO_SLIDING = "auto"  # `MethodConfig.sliding`'s default: `AUTO_SLIDING_METHOD` rows, or "exact" where those cannot serve
# What "auto" codes a sliding window with: per-token int8 rows after a seeded Hadamard rotation. Plain int8 rows cost
# Gemma-3 nothing measurable at 2K but a third of a point at 8K (its one 256-wide kv head's outlier channels set each
# token's scale); rotated, the same bytes read as the exact fp32 window does (docs/guide/methods.md, "Sliding-window layers").
AUTO_SLIDING_METHOD = "int8:rotated"
SLIDING_EXAMPLES = "'int8:rotated', 'int8', 'turboquant:k4v4+ropemean'"


@dataclass(frozen=True)
class MethodConfig:
    """Everything a cache needs to know about one compression method.

    key / value: codecs for tokens leaving the window during decode (the stream).
    prefill_key / prefill_value: codecs for the prefill middle; None means the stream codecs.
    sink_tokens: leading tokens kept uncompressed (attention sinks).
    window: recent tokens kept uncompressed; the prompt leaves exactly `window`, later tokens leave
        it in whole blocks of `block_size`.
    exact_dtype: storage of sinks and window: float16 (the seeds' layout) | bfloat16 | native
        (the model's own dtype: bit-exact, but 2x the bytes for an fp32 model).
    tiers: older tiers (ADR-004), see `Tier`.
    layer_codecs: per-layer `key` / `value` overrides (`LayerCodecs`, each layer listed at most once);
        `for_layer(idx)` is the config a layer runs (`auto:<target>` allocates bits this way, kvpack/auto.py).
    anchors: fraction of the compressed tokens also kept exact, beside their codes: of the prompt, those its last
        queries attend to most; of each later block, those the queries of the forward that flushes it attend to
        most (kvpack/cache/anchors.py; name suffix `@anchors=0.5%`). 0 keeps none.
    prompt_ratio: a byte target for the prompt: each layer holds at least this many times fewer bytes than fp16
        once the prompt is encoded, every tensor counted. The prompt's value codec (one with `fits_to_budget`,
        Shard's VQ) sizes itself to the bytes the keys, sinks, window and anchors leave (`shard:10x`). 0: none.
    fisher_tail: key widths per layer placed by the prompt itself (name suffix `@fisher=N`): after the prefill, the
        prompt's last N tokens are run again with gradients w.r.t. the earlier tokens' cached K/V, and the keys of the
        layers that signal ranks most sensitive get a fourth bit, paid for by the keys of the least sensitive at two,
        so the bytes stay the method's (kvpack/cache/prompt_widths.py). Needs 3-bit TurboQuant keys. 0: off.
    sliding: what a sliding-window layer (Gemma-3's local layers, Mistral-style configs) holds: "auto" (the default)
        is "int8:rotated" (`AUTO_SLIDING_METHOD`), or "exact" for a lossless method or one with `fisher_tail`
        (`resolved_sliding`); "exact" (name suffix `@sliding=exact`) keeps transformers' bounded window in the model's
        dtype; a registered method name (e.g. "int8", "turboquant:k4v4+ropemean"; name suffix `@sliding=int8`)
        compresses the window with that method's codecs, without sinks or anchors, and drops every token once it
        leaves the window (`sliding_method`); such a layer cannot be cropped once it has dropped tokens (as
        transformers' own sliding layers refuse once full).
    sliding_seed: the draw of the sliding-window layers' codecs (set by `@seed=N`); None takes the seed of this method's
        own codecs, or the sliding method's default when they draw nothing (`int8@sliding=turboquant:k4v4@seed=N` draws
        only its windows' rotations).
    """

    name: str
    key: CodecSpec
    value: CodecSpec
    prefill_key: CodecSpec | None = None
    prefill_value: CodecSpec | None = None
    sink_tokens: int = 4
    window: int = 64
    block_size: int = 64
    exact_dtype: str = "float16"
    tiers: tuple[Tier, ...] = ()
    layer_codecs: tuple[LayerCodecs, ...] = ()
    anchors: float = 0.0
    prompt_ratio: float = 0.0
    fisher_tail: int = 0
    sliding: str = AUTO_SLIDING
    sliding_seed: int | None = None

    def __post_init__(self):
        for attr in ("key", "value", "prefill_key", "prefill_value"):
            spec = getattr(self, attr)
            if not isinstance(spec, CodecSpec) and not (spec is None and attr.startswith("prefill")):
                raise TypeError(f"{attr} must be a CodecSpec (e.g. CodecSpec('int8')), got {type(spec).__name__}")
        for attr in ("sink_tokens", "window", "block_size"):
            if isinstance(getattr(self, attr), bool) or not isinstance(getattr(self, attr), int):
                raise TypeError(f"{attr} must be an int, got {getattr(self, attr)!r}")
        if self.exact_dtype not in EXACT_DTYPES:
            raise ValueError(f"exact_dtype must be one of {sorted(EXACT_DTYPES)}, got {self.exact_dtype!r}")
        for attr in ("sink_tokens", "window"):
            if getattr(self, attr) < 0:
                raise ValueError(f"{attr} must be >= 0, got {getattr(self, attr)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self._check_tiers()
        self._check_layer_codecs()
        self._check_anchors()
        self._check_prompt_ratio()
        self._check_fisher_tail()
        self._check_sliding()

    def _check_sliding(self) -> None:
        if not isinstance(self.sliding, str):
            raise TypeError(f"sliding must be a str ('{AUTO_SLIDING}', '{EXACT_SLIDING}' or a method name), got {type(self.sliding).__name__}")
        seed = self.sliding_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"sliding_seed must be None or a non-negative integer, got {seed!r}")
        if self.resolved_sliding == EXACT_SLIDING:
            if seed is not None:
                raise ValueError(f"sliding_seed draws the codecs of compressed sliding-window layers; with exact windows "
                                 f"there are none, so leave it None (e.g. '{DEFAULT_METHOD}{SLIDING_SUFFIX}turboquant:k4v4')")
            return
        if self.sliding == AUTO_SLIDING:
            return
        allowed = (f"'{AUTO_SLIDING}' (the default), '{EXACT_SLIDING}' (transformers' window, uncompressed) or a method without "
                   f"suffixes, tiers or prompt codecs, e.g. {SLIDING_EXAMPLES}")
        if "@" in self.sliding:
            raise ValueError(f"sliding must be {allowed}; got {self.sliding!r}")
        try:
            base = get_method(self.sliding)
        except ValueError as err:
            raise ValueError(f"sliding must be {allowed}; got {self.sliding!r} ({err})") from None
        if base.tiers or base.prefill_key is not None or base.prefill_value is not None or base.layer_codecs or base.prompt_ratio:
            raise ValueError(f"sliding must be {allowed}; {self.sliding!r} has tiers, prompt codecs or per-layer widths, which a "
                             "window of recent tokens has no use for")
        if self.fisher_tail:
            raise ValueError(f"method {self.name!r}: '{FISHER_SUFFIX}' reads every prompt token's cached K/V after the prefill, and a "
                             f"compressed sliding layer drops them as they leave its window; use '{SLIDING_SUFFIX}{EXACT_SLIDING}' with it")

    @property
    def resolved_sliding(self) -> str:
        """What `sliding` comes to: itself, or for "auto" `AUTO_SLIDING_METHOD`, except "exact" for a lossless method (its
        windows stay as exact as its other layers) and for `fisher_tail` (which reads every prompt token's K/V after the
        prefill, where a coded window has dropped them)."""
        if self.sliding != AUTO_SLIDING:
            return self.sliding
        return EXACT_SLIDING if self.lossless or self.fisher_tail else AUTO_SLIDING_METHOD

    def sliding_method(self) -> MethodConfig | None:
        """The config a compressed sliding-window layer runs, or None when its windows are exact (`resolved_sliding`): the
        named method with no sinks and no anchors (a token leaves the window for good, so neither would be read for
        long), this method's exact dtype, and its codecs drawn from this method's seed (one `@seed=N` draws every layer)."""
        sliding = self.resolved_sliding
        if sliding == EXACT_SLIDING:
            return None
        base = get_method(sliding)
        seed = self.sliding_seed
        if seed is None:
            seed = next((s.options["seed"] for s in self.specs() if "seed" in s.options), None)
        if seed is not None and any(_has_seed(s) for s in base.specs()):
            base = base.with_seed(seed)
        return replace(base, sink_tokens=0, anchors=0.0, exact_dtype=self.exact_dtype)

    def _check_fisher_tail(self) -> None:
        tail = self.fisher_tail
        if isinstance(tail, bool) or not isinstance(tail, int) or not (tail == 0 or MIN_FISHER_TAIL <= tail <= MAX_FISHER_TAIL):
            raise ValueError(f"fisher_tail must be 0 (off) or a token count from {MIN_FISHER_TAIL} to {MAX_FISHER_TAIL} "
                             f"(e.g. '{DEFAULT_METHOD}{FISHER_SUFFIX}32'), got {tail!r}")
        if not tail:
            return
        key = self.key
        plain = key.codec == "turboquant" and key.options.get("bits") == 3 and not key.options.get("qjl") and not key.options.get("trellis")
        if not plain or self.layer_codecs or self.tiers or self.prefill_key is not None:
            raise ValueError(f"method {self.name!r}: '{FISHER_SUFFIX}' moves a key bit between layers, so it takes a method whose keys "
                             "are 3-bit TurboQuant codes everywhere (no '+qjl', '+tcq', per-layer widths, tiers or prompt codecs), "
                             f"e.g. '{DEFAULT_METHOD}{FISHER_SUFFIX}32'")

    def _check_prompt_ratio(self) -> None:
        ratio = self.prompt_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not (ratio == 0 or 1 < ratio <= MAX_PROMPT_RATIO):
            raise ValueError(f"prompt_ratio must be 0 (no byte target) or a number above 1 and at most {MAX_PROMPT_RATIO} (e.g. 10 for 10x), got {ratio!r}")
        if ratio and (self.prefill_value is None or not self.prefill_value.codec_class.fits_to_budget):
            fitting = sorted(name for name, path in CODECS.items() if load_class(path).fits_to_budget)
            raise ValueError(f"method {self.name!r}: a prompt byte target needs a prompt value codec that sizes itself to a "
                             f"byte budget ({fitting}), e.g. 'shard:10x'; got {self.prefill_value and self.prefill_value.codec!r}")

    def _check_anchors(self) -> None:
        if isinstance(self.anchors, bool) or not isinstance(self.anchors, int | float) or not 0 <= self.anchors <= MAX_ANCHORS:
            raise ValueError(f"anchors must be a fraction of the prompt's tokens from 0 to {MAX_ANCHORS} (e.g. 0.005), got {self.anchors!r}")

    def _check_layer_codecs(self) -> None:
        if not isinstance(self.layer_codecs, tuple) or not all(isinstance(e, LayerCodecs) for e in self.layer_codecs):
            raise TypeError(f"layer_codecs must be a tuple of LayerCodecs, got {self.layer_codecs!r}")
        listed = [i for entry in self.layer_codecs for i in entry.layers]
        twice = sorted({i for i in listed if listed.count(i) > 1})
        if twice:
            raise ValueError(f"layer_codecs lists layers {twice} more than once; each layer takes one key/value pair")

    def for_layer(self, idx: int) -> MethodConfig:
        """The config layer `idx` runs: `key` / `value` from its `layer_codecs` entry (if any), no overrides left."""
        if not self.layer_codecs:
            return self
        entry = next((e for e in self.layer_codecs if idx in e.layers), None)
        codecs = {"key": entry.key, "value": entry.value} if entry is not None else {}
        return replace(self, layer_codecs=(), **codecs)

    def _check_tiers(self) -> None:
        if not isinstance(self.tiers, tuple) or not all(isinstance(t, Tier) for t in self.tiers):
            raise TypeError(f"tiers must be a tuple of Tier, got {self.tiers!r}")
        last = self.window + self.block_size
        for tier in self.tiers:
            if tier.after < last or tier.after % self.block_size:
                raise ValueError(
                    f"tier boundaries must be multiples of block_size ({self.block_size}), increasing, and at least "
                    f"window + block_size ({self.window + self.block_size}); got {[t.after for t in self.tiers]}"
                )
            last = tier.after + self.block_size

    @property
    def lossless(self) -> bool:
        overrides = [spec for entry in self.layer_codecs for spec in (entry.key, entry.value)]
        return all(spec.codec == "fp16" for spec in (self.key, self.value, *overrides)) and self.prefill_key is None

    def with_options(self, **changes: Any) -> MethodConfig:
        return replace(self, **changes)

    def specs(self) -> list[CodecSpec]:
        """Every codec spec the method names: stream, prompt, tiers and per-layer overrides."""
        tiers = [spec for tier in self.tiers for spec in (tier.key, tier.value)]
        layers = [spec for entry in self.layer_codecs for spec in (entry.key, entry.value)]
        return [s for s in (self.key, self.value, self.prefill_key, self.prefill_value, *tiers, *layers) if s is not None]

    def with_seed(self, seed: int) -> MethodConfig:
        """Another draw of this method: every codec that draws at random (rotations, sketches, k-means starts)
        seeded from base `seed` instead of its default, named `name@seed=N`. At 3 bits one draw moves a
        perplexity delta by up to ~1.7 points (docs/guide/evaluation.md, "One draw of the rotation")."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        # Windows named with `@sliding=` draw with the method; "auto" ones follow the method's own codecs' seed where
        # they draw, and keep their fixed default draw under a method that draws nothing (plain `int8` on any model).
        sliding = self.resolved_sliding
        windows = self.sliding != AUTO_SLIDING and sliding != EXACT_SLIDING and any(_has_seed(s) for s in get_method(sliding).specs())
        if not windows and not any(_has_seed(s) for s in self.specs()):
            raise ValueError(f"method {self.name!r} draws nothing at random (none of its codecs takes a seed), so '@seed=' would not change it")
        tiers = tuple(replace(t, key=_seeded(t.key, seed), value=_seeded(t.value, seed)) for t in self.tiers)
        layers = tuple(replace(e, key=_seeded(e.key, seed), value=_seeded(e.value, seed)) for e in self.layer_codecs)
        return replace(self, name=f"{self.name}{SEED_SUFFIX}{seed}", key=_seeded(self.key, seed), value=_seeded(self.value, seed),
                       prefill_key=_seeded(self.prefill_key, seed), prefill_value=_seeded(self.prefill_value, seed), tiers=tiers, layer_codecs=layers,
                       sliding_seed=seed if windows else None)

    def with_window(self, tokens: int) -> MethodConfig:
        """This method with an exact recent window of `tokens` (the prompt leaves that many; later tokens leave in
        blocks of `block_size`), named `name@window=N`."""
        changed = replace(self, window=tokens)  # validates
        return replace(changed, name=f"{self.name}{WINDOW_SUFFIX}{tokens}")

    def with_fisher(self, tail: int) -> MethodConfig:
        """This method with key widths per layer placed by the prompt's own Fisher signal over its last `tail` tokens
        (`fisher_tail`), named `name@fisher=N`."""
        changed = replace(self, fisher_tail=tail)  # validates
        return replace(changed, name=f"{self.name}{FISHER_SUFFIX}{tail}")

    def with_sliding(self, method: str) -> MethodConfig:
        """This method with its sliding-window layers held as `method` names ("exact", "int8", "auto", ...; `sliding`),
        named `name@sliding=METHOD`."""
        # A window seed drawn earlier stays with compressed windows; exact windows draw nothing.
        changed = replace(self, sliding=method, sliding_seed=None if method == EXACT_SLIDING else self.sliding_seed)  # validates
        return replace(changed, name=f"{self.name}{SLIDING_SUFFIX}{method}")

    def with_anchors(self, fraction: float) -> MethodConfig:
        """This method with `fraction` of its compressed tokens also kept exact (the most attended ones),
        named `name@anchors=P%`. Half a percent (about ten tokens of 2K) cut turboquant:k3v2's perplexity loss by
        40-60% on SmolLM2 and Gemma-3 at 2K for 2.8% more bytes (docs/notes/decisions.md)."""
        changed = replace(self, anchors=fraction)  # validates
        return replace(changed, name=f"{self.name}{ANCHORS_SUFFIX}{_percent(fraction)}")


SEED_SUFFIX = "@seed="  # `turboquant:k3v2@seed=1`: the method's codecs drawn from another seed (`MethodConfig.with_seed`)
ANCHORS_SUFFIX = "@anchors="  # `turboquant:k3v2@anchors=0.5%`: the most-attended compressed tokens kept exact (`with_anchors`)
WINDOW_SUFFIX = "@window="  # `turboquant:k3v2@window=32`: the exact recent window's size in tokens (`with_window`)
FISHER_SUFFIX = "@fisher="  # `...@fisher=32`: key widths per layer placed by the prompt's last 32 tokens (`with_fisher`)
SLIDING_SUFFIX = "@sliding="  # `...@sliding=int8`: sliding-window layers compressed with int8 rows (`with_sliding`)
SUFFIXES = ("anchors", "window", "fisher", "sliding", "seed")  # the order a name carries them in
MIN_FISHER_TAIL, MAX_FISHER_TAIL = 16, 4096
MAX_ANCHORS = 0.25
MAX_PROMPT_RATIO = 64  # 64x: below one bit per fp16 element is past any codec kvpack has


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.4g}%"


def _parse_fraction(text: str, method: str) -> float:
    """`"0.5%"` or `"0.005"` -> 0.005."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_ANCHORS:
        raise ValueError(f"{method!r}: '{ANCHORS_SUFFIX}' takes a fraction of the prompt's tokens from 0 to {_percent(MAX_ANCHORS)}, e.g. '{DEFAULT_METHOD}{ANCHORS_SUFFIX}0.5%'")
    return value


def split_suffixes(method: str) -> tuple[str, dict[str, Any]]:
    """`"name[:args]@anchors=P%@window=N@fisher=N@seed=S"` (suffixes in any order, each at most once) -> (`"name[:args]"`,
    {"anchors": f, "window": N, "fisher": N, "seed": S})."""
    base, *parts = method.split("@")
    found: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in SUFFIXES or key in found:
            raise ValueError(
                f"{method!r}: a method name takes the suffixes '{ANCHORS_SUFFIX}P%', '{WINDOW_SUFFIX}N', '{FISHER_SUFFIX}N', "
                f"'{SLIDING_SUFFIX}METHOD' and '{SEED_SUFFIX}N', "
                f"each at most once, got '@{part}'"
            )
        if key in ("seed", "window", "fisher") and not value.isdigit():
            raise ValueError(f"{method!r}: '@{key}=' takes a non-negative integer, e.g. 'turboquant:k3v2@{key}=1'")
        found[key] = _parse_fraction(value, method) if key == "anchors" else value if key == "sliding" else int(value)
    return base, found


def apply_suffixes(config: MethodConfig, suffixes: dict[str, Any]) -> MethodConfig:
    """`config` with the options `split_suffixes` read, named in `SUFFIXES` order (`name@anchors=P%@window=N@seed=S`)."""
    for key in SUFFIXES:
        if key in suffixes:
            config = getattr(config, f"with_{key}")(suffixes[key])  # with_anchors, with_window, with_fisher, with_seed
    return config


def _has_seed(spec: CodecSpec | None) -> bool:
    return spec is not None and any(f.name == "seed" for f in fields(spec.config))


def _seeded(spec: CodecSpec | None, seed: int) -> CodecSpec | None:
    """`spec` with its config's `seed` set to `seed`; a codec without one (or no codec) as it is."""
    return CodecSpec(spec.codec, {**spec.options, "seed": seed}) if _has_seed(spec) else spec


METHODS: dict[str, Callable[[str], MethodConfig]] = {}
_CANONICAL: list[str] = []  # list_methods(), in registration order


def method(name: str, *variants: str) -> Callable[[Callable[[str], MethodConfig]], Callable[[str], MethodConfig]]:
    """Register a builder `fn(arg) -> MethodConfig` for `"name"` / `"name:arg"`, with its canonical variants.

    `variants` are the args listed by `list_methods()` (the CLI and the test matrix); none, or an empty one, lists
    `name` alone.
    """

    def register(builder: Callable[[str], MethodConfig]) -> Callable[[str], MethodConfig]:
        METHODS[name] = builder
        _CANONICAL.extend([f"{name}:{v}" if v else name for v in variants] or [name])
        return builder

    return register


def _no_options(name: str, arg: str) -> None:
    if arg:
        raise ValueError(f"method {name!r} takes no options, got {name}:{arg}; use {name!r}")


@method("fp16")
def _fp16(arg: str) -> MethodConfig:
    _no_options("fp16", arg)
    spec = CodecSpec("fp16")
    return MethodConfig("fp16", spec, spec, sink_tokens=0, window=0)


@method("int8", "", "rotated")
def _int8(arg: str) -> MethodConfig:
    """`int8`: per-token int8 rows; `int8:rotated`: the same bytes after a seeded randomized Hadamard rotation, which
    spreads a token's outlier channels before its absmax scale is taken (`codecs/int8_rotated.py`)."""
    if arg not in ("", "rotated"):
        raise ValueError(f"int8 takes no option or 'rotated' (int8, int8:rotated), got int8:{arg}")
    spec = CodecSpec("int8_rotated" if arg else "int8")
    return MethodConfig(f"int8:{arg}" if arg else "int8", spec, spec)


@method("turboquant", "k4v4", "k3v3", "k3v2", "k3v3+qjl", "k3v2+ropemean", "k3v2+ropemean+match")
def _turboquant(arg: str) -> MethodConfig:
    match = re.fullmatch(r"k([1-4])v([1-4])(\+qjl)?(\+ropemean)?(\+tcq[kv]?)?(\+(unbiased|match)([kv]?))?", arg or "k3v2")
    if not match or (match[3] and (match[5] or match[6])):
        raise ValueError(f"turboquant takes 'kXvY' with X, Y in 1..4, then optionally '+qjl', '+ropemean', '+tcq' (or '+tcqk', "
                         f"'+tcqv': keys or values only; not with '+qjl') and '+match' or '+unbiased' (with k or v: one side; not "
                         f"with '+qjl'), in that order (e.g. turboquant:k3v3, turboquant:k3v2+ropemean+match), got {arg!r}")
    kb, vb, qjl = int(match[1]), int(match[2]), bool(match[3])
    # kvpack normalizes before TurboQuant (see TurboQuantConfig): keys are centered and divided by
    # RMS^0.5 per channel (Qwen2's outlier channels; full RMS scaling cost SmolLM2 +1.7% at 3 bits,
    # alpha 0.5 +0.7%), values are centered only. '+ropemean' centers keys on their mean taken before RoPE, rotated
    # back to each token's position (TurboQuantConfig.rope_center): RoPE turns a constant key component into one that
    # turns with position, which a post-RoPE mean cannot remove (docs/notes/decisions.md).
    # '+tcq' codes both sides with a bitshift trellis (TurboQuantConfig.trellis) of L = the first multiple of the width
    # >= 8 state bits (256-4096 states): below the scalar optimum at 0.05-0.2 more bits per value (docs/guide/methods.md).
    # '+tcqk' / '+tcqv' code one side so. '+match' stores each vector's scalar so that its reconstruction is as long as
    # the input, '+unbiased' so that its component along the input is the input (TurboQuantConfig.norm; '+matchk',
    # '+matchv', '+unbiasedk', '+unbiasedv': one side).
    sides = {"+tcq": "kv", "+tcqk": "k", "+tcqv": "v"}.get(match[5] or "", "")

    def tcq(side: str, b: int) -> dict:
        return {"trellis": -(-8 // b) * b} if side in sides else {}

    def norm(side: str) -> dict:
        return {"norm": match[7]} if match[7] and side in (match[8] or "kv") else {}

    key = CodecSpec("turboquant", {"bits": kb, "qjl": qjl, "center": True, "channel_scale": 0.5, **({"rope_center": True} if match[4] else {}),
                                   **tcq("k", kb), **norm("k")})
    return MethodConfig(f"turboquant:{arg or 'k3v2'}", key, CodecSpec("turboquant", {"bits": vb, "center": True, **tcq("v", vb), **norm("v")}))


@method("polarquant-int4")
def _polarquant(arg: str) -> MethodConfig:
    _no_options("polarquant-int4", arg)
    spec = CodecSpec("polarquant-int4")
    return MethodConfig("polarquant-int4", spec, spec)


@method("qjl")
def _qjl(arg: str) -> MethodConfig:
    try:
        ratio = float(arg) if arg else 2.0
    except ValueError:
        ratio = float("nan")
    if not 0 < ratio < math.inf:
        raise ValueError(f"qjl takes a sketch ratio, sign bits per key coordinate, a positive number (e.g. qjl:2, qjl:4), got {arg!r}")
    ratio = int(ratio) if ratio.is_integer() else ratio
    return MethodConfig(f"qjl:{ratio}" if arg else "qjl", CodecSpec("qjl", {"sketch_ratio": ratio}), CodecSpec("kivi", {"bits": 4, "axis": "token"}))


@method("kivi", "4", "2")
def _kivi(arg: str) -> MethodConfig:
    if arg not in ("2", "4"):
        raise ValueError(f"kivi takes 2 or 4 bits (kivi:2, kivi:4), got {arg!r}")
    bits = int(arg)
    return MethodConfig(f"kivi:{bits}", CodecSpec("kivi", {"bits": bits, "axis": "channel"}), CodecSpec("kivi", {"bits": bits, "axis": "token"}))


SHARD_CODEBOOKS = (16, 32, 64, 128, 256)  # `shard:vqN`: entries of the value codebook (log2 N bits per 4 channels)
SHARD_SCORE_ERRORS = ("0.5", "1", "2", "3", "5")  # `shard:eN`: the key rank keeps the prompt's score error within N%


@method("shard")
def _shard(arg: str) -> MethodConfig:
    """`shard[:STREAM][+vqN][+eN][+Rx]`: STREAM the codec of tokens after the prompt (int8 by default; k3v2 the default's
    TurboQuant pair), vqN the value codebook's entries
    (256 by default: 2 bits per value; `vq64`, 1.5 bits), eN the key rank: the smallest
    that keeps the relative score error of the prompt's queries within N% (3 by default; `e1` holds Gemma-3's few
    global layers within +1%, docs/notes/shard.md), Rx a byte target: each layer's value codebook is the largest (up to
    vqN's) that keeps the layer R times smaller than fp16 once the prompt is encoded (`shard:10x`)."""
    # k3v2: the default's TurboQuant pair, so tokens generated after the prompt stay at >= 5x too; k4v2 its 4-bit keys.
    tq, tq4 = get_method("turboquant:k3v2"), get_method("turboquant:k4v2")
    stream = {"": (CodecSpec("int8"),) * 2, "int8": (CodecSpec("int8"),) * 2, "tq4": (CodecSpec("turboquant", {"bits": 4}),) * 2,
              "fp16": (CodecSpec("fp16"),) * 2, "k3v2": (tq.key, tq.value), "k4v2": (tq4.key, tq4.value)}
    parts = [p for p in arg.split("+") if p] if arg else []
    books = [p for p in parts if p.startswith("vq")]
    errors = [p for p in parts if p.startswith("e")]
    ratios = [p for p in parts if p.endswith("x") and p[:1].isdigit()]
    streams = [p for p in parts if not p.startswith(("vq", "e")) and p not in ratios]
    if len(books) > 1 or len(streams) > 1 or len(errors) > 1 or len(ratios) > 1 or any(p not in stream for p in streams):
        raise ValueError(f"shard takes a decode-stream codec in {sorted(k for k in stream if k)}, a value codebook vqN "
                         f"(N in {SHARD_CODEBOOKS}), a key score error eN (N in {SHARD_SCORE_ERRORS}) and/or a byte target Rx "
                         f"(e.g. 10x), each at most once, joined by + (e.g. shard:tq4, shard:k3v2, shard:vq64, shard:e1, shard:10x, "
                         f"shard:k3v2+e1), got {arg!r}")
    ratio = _parse_ratio(ratios[0]) if ratios else 0.0
    if errors and errors[0][1:] not in SHARD_SCORE_ERRORS:
        raise ValueError(f"shard's key score error eN takes N in {SHARD_SCORE_ERRORS} (percent), got {errors[0]!r}")
    error = errors[0][1:] if errors and errors[0][1:] != "3" else None
    options = {"token_norm": True}
    if books:
        size = books[0][2:]
        if not size.isdigit() or int(size) not in SHARD_CODEBOOKS:
            raise ValueError(f"shard's value codebook vqN takes N in {SHARD_CODEBOOKS}, got {books[0]!r}")
        if int(size) != 256:
            options["codebook_size"] = int(size)
    stream_key, stream_value = stream[streams[0] if streams else ""]
    # Per-token RMS on values (2 B per token and head): at an 8K prefix on SmolLM2 the blog's VQ alone
    # cost +3.0% perplexity (values only lossy), with the RMS -0.1%.
    value = CodecSpec("vq", options)
    tokens = [t for t in (streams[0] if streams and streams[0] else "", f"vq{options['codebook_size']}" if "codebook_size" in options else "",
                          f"e{error}" if error else "", f"{ratio:g}x" if ratio else "") if t]
    key = CodecSpec("pca", {"score_error": float(error) / 100} if error else {})
    return MethodConfig("shard" + (":" + "+".join(tokens) if tokens else ""), stream_key, stream_value, prefill_key=key, prefill_value=value,
                        prompt_ratio=ratio)


def _parse_ratio(text: str) -> float:
    """`"10x"` -> 10.0 (a byte target, `MethodConfig.prompt_ratio`)."""
    try:
        ratio = float(text[:-1])
    except ValueError:
        ratio = float("nan")
    if not 1 < ratio <= MAX_PROMPT_RATIO:
        raise ValueError(f"shard's byte target Rx takes R above 1 and at most {MAX_PROMPT_RATIO} (times fewer bytes than fp16), "
                         f"e.g. shard:10x, got {text!r}")
    return ratio


@method("kvquant", "4", "3", "2")
def _kvquant(arg: str) -> MethodConfig:
    if arg not in ("2", "3", "4"):
        raise ValueError(f"kvquant takes 2, 3 or 4 bits (kvquant:4, kvquant:3, kvquant:2), got {arg!r}")
    # No prefill codecs: the prompt and later blocks share one fitted codec pair, which fits itself on
    # its first encode (the prompt's middle), so decoded tokens are coded with codebooks from the prompt.
    opts = {"bits": int(arg)}
    return MethodConfig(f"kvquant:{arg}", CodecSpec("kvquant-key", opts), CodecSpec("kvquant-value", opts))


@method("subspace", "2")
def _subspace(arg: str) -> MethodConfig:
    if arg not in ("2", "3", "4"):
        raise ValueError(f"subspace takes 2, 3 or 4 bits per component (e.g. subspace:2), got {arg!r}")
    spec = CodecSpec("subspace", {"bits": int(arg)})  # one fitted codec pair for prompt and stream, as kvquant
    return MethodConfig(f"subspace:{arg}", spec, spec)


@method("tiered", "512", "512:tq", "1024:shard")
def _tiered(arg: str) -> MethodConfig:
    """ADR-004's three tiers: the exact window (hot), KIVI 4-bit (warm), KIVI 2-bit beyond `after` tokens (archive).

    `tiered:<after>:tq` uses kvpack's TurboQuant codecs instead: k4v4 warm, the default's k3v2 archive.
    `tiered:<after>:shard`: a 4-bit TurboQuant warm tier (`k4v4+ropemean`, the default's window and anchors), and an
    archive of Shard's codecs (un-RoPEd PCA keys, VQ values at 1.5 bits) fitted on the archive's own tokens,
    ARCHIVE_FIT_TOKENS at a time, and fitted again when they drift; the keys' rank keeps the score error of the latest
    queries within 3% (Shard's prompt rule; the keys' energy 0.90 where kvpack attention is off and no query is seen).
    `tiered:budget[:tq|:shard]`: no age boundary; blocks go to the archive, oldest first, only when a `MemoryBudget`
    needs their bytes (`KVCache(model, method, budget=...)`), so at any peak bytes it archives no block that a fixed
    boundary with that peak keeps warm (tests/test_budget.py; measured in docs/guide/tiers.md).
    """
    boundary, _, family = (arg or "512").partition(":")
    try:
        after = BUDGET_ONLY if boundary == "budget" else int(boundary)
    except ValueError:
        after = -1
    if after < 128 or after % 64 or family not in ("", "tq", "shard"):
        raise ValueError(
            f"tiered takes the archive boundary in tokens, a multiple of 64 from 128, or 'budget' (archive only what a "
            f"MemoryBudget needs), then optionally ':tq' for TurboQuant tiers or ':shard' for a Shard archive (e.g. "
            f"tiered:512, tiered:512:tq, tiered:1024:shard, tiered:budget:shard), got {arg!r}"
        )
    name = f"tiered:{'budget' if after == BUDGET_ONLY else after}" + (f":{family}" if family else "")
    if family == "tq":
        warm, archive = _turboquant("k4v4"), _turboquant("k3v2")
        return MethodConfig(name, warm.key, warm.value, tiers=(Tier(archive.key, archive.value, after),))
    if family == "shard":  # the default's window and anchors, 4-bit warm codecs, a fitted archive
        archive = Tier(CodecSpec("pca", {"bits": ARCHIVE_KEY_BITS}), CodecSpec("vq", {"token_norm": True, "codebook_size": ARCHIVE_CODEBOOK}), after,
                       fit_tokens=ARCHIVE_FIT_TOKENS, refit=ARCHIVE_REFIT)
        warm = _turboquant("k4v4+ropemean")
        return get_method(DEFAULT_METHOD).with_options(name=name, key=warm.key, value=warm.value, tiers=(archive,))
    warm = (CodecSpec("kivi", {"bits": 4, "axis": "channel"}), CodecSpec("kivi", {"bits": 4, "axis": "token"}))
    archive = Tier(CodecSpec("kivi", {"bits": 2, "axis": "channel"}), CodecSpec("kivi", {"bits": 2, "axis": "token"}), after)
    return MethodConfig(name, *warm, tiers=(archive,))


# `tiered:budget`'s boundary: an age no context reaches (2^30 tokens), so only a MemoryBudget moves blocks to the archive.
BUDGET_ONLY = 1 << 30


# `tiered:<after>:shard`'s archive: PCA keys at 4 bits per kept component on average (the rank by the latest queries'
# score error: at the keys' energy 0.90 Qwen2.5 lost +4.7% at 8K, by score error -2.7%), 64 value codewords per 4 channels
# (1.5 bits per value), a fit on at least 1,024 tokens, a new fit once a run's error is 50% above the first run's after
# the fit. Its warm tier is 4-bit because the archive codes what the warm tier decodes: with the default's 3/2-bit warm
# codecs the same archive lost a point more (SmolLM2, 8K: docs/guide/tiers.md).
ARCHIVE_KEY_BITS = 4
ARCHIVE_CODEBOOK = 64
ARCHIVE_FIT_TOKENS = 1024
ARCHIVE_REFIT = 0.5


# -- auto:<target>: the name's grammar (the allocation itself is kvpack.allocator's) -------------------------
_TARGET = re.compile(r"(\d+(?:\.\d*)?|\.\d+)%")


def parse_target(arg: str) -> float:
    """'1%' -> 0.01: the allowed perplexity increase over the uncompressed cache, a fraction in (0, 1]."""
    match = _TARGET.fullmatch(arg.strip()) if isinstance(arg, str) else None
    value = float(match[1]) / 100 if match else math.nan
    if not 0 < value <= 1:
        raise ValueError(f"auto takes a perplexity target in percent, above 0 and at most 100 (auto:<number>%, e.g. auto:0.5%, auto:1%, auto:2%), got {arg!r}")
    return value


# What one width covers: a (layer, side) (`auto:1%/layer`) or a (layer, side, kv head) (`auto:1%/head`, when the profile
# splits its KL over heads: `has_head_shares`); `auto:1%` is DEFAULT_GRAIN.
GRAINS = ("layer", "head")
DEFAULT_GRAIN = "layer"


def parse_auto(arg: str) -> tuple[float, str]:
    """'1%' -> (0.01, DEFAULT_GRAIN); '1%/head' -> (0.01, "head"): the target and the grain widths are allocated at."""
    target, slash, grain = arg.partition("/") if isinstance(arg, str) else (arg, "", "")
    if slash and grain not in GRAINS:
        raise ValueError(f"auto takes auto:<target>%, auto:<target>%/layer (one width per layer and K/V) or auto:<target>%/head "
                         f"(one per kv head), got auto:{arg}")
    return parse_target(target), grain or DEFAULT_GRAIN


def target_name(target: float, grain: str = DEFAULT_GRAIN) -> str:
    return f"auto:{100 * target:g}%" + ("" if grain == DEFAULT_GRAIN else f"/{grain}")


def _auto(arg: str) -> MethodConfig:
    parse_auto(arg)  # a malformed target fails with the form it takes
    raise ValueError(
        f"auto:{arg} allocates bits from the model's calibration profile, so it needs the model: pass it to "
        f"kvpack.KVCache(model, 'auto:{arg}'), or build the config with kvpack.auto.auto_method(model, 'auto:{arg}')"
    )


# Registered by hand, not with `@method`: list_methods() is the test matrix, and it has no calibration profile.
METHODS["auto"] = _auto


@method("int4")
def _int4(arg: str) -> MethodConfig:
    _no_options("int4", arg)
    spec = CodecSpec("int4")
    return MethodConfig("int4", spec, spec)


# The default: TurboQuant 3-bit keys and 2-bit values, keys centered on their un-RoPEd mean turned to each token's
# position on the RoPE pairs where that gains (`+ropemean`: a QKV bias or massive channel, constant before RoPE, turns
# with position after it), each vector's stored scalar making its reconstruction as long as the input (`+match`:
# Lloyd-Max centroids fall short of it, so every score and every averaged value came out ~D too small), the 0.5%
# most-attended compressed tokens kept exact (anchors), and a 32-token exact window. `+match` costs no byte and no
# decode work; at 2K over three rotation draws it cut next-token KL by 31-38% on all three models, every draw lower,
# and the perplexity loss from +1.45% to +0.78% (SmolLM2) and +1.13% to +0.77% (Gemma-3) at 5.12x / 2.51x
# (docs/notes/decisions.md, "Choosing the default").
DEFAULT_METHOD = "turboquant:k3v2+ropemean+match@anchors=0.5%@window=32"


def get_method(method: str | MethodConfig) -> MethodConfig:
    """Resolve `"name"` or `"name:args"` (e.g. `"turboquant:k3v3"`, `"kivi:2"`), optionally with `"@seed=N"`
    (`MethodConfig.with_seed`) and `"@anchors=P%"` (`MethodConfig.with_anchors`), to a MethodConfig."""
    if isinstance(method, MethodConfig):
        return method
    if not isinstance(method, str):
        raise TypeError(f"method must be a name (e.g. {DEFAULT_METHOD!r}) or a MethodConfig, got {type(method).__name__}")
    base, suffixes = split_suffixes(method)
    if suffixes:
        return apply_suffixes(get_method(base), suffixes)
    name, _, arg = method.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(list_methods())}")
    return METHODS[name](arg)


def list_methods() -> list[str]:
    """Canonical method names, for the CLI and the test matrix: every registered method's listed variants."""
    return list(_CANONICAL)
