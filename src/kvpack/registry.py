"""One registry from method names to cache configurations: the CLI, tests and benchmarks read it.

A method names the K codec, the V codec, optional codecs for the prefill middle (Shard), the
sink and window sizes and the compression block size. Codecs resolve lazily by import path, so
a method file is only imported when it is used.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .codecs.base import Codec

CODECS: dict[str, str] = {
    "fp16": "kvpack.codecs.fp16:Fp16Codec",
    "int8": "kvpack.codecs.int8:Int8Codec",
    "turboquant": "kvpack.codecs.turboquant:TurboQuantCodec",
    "polarquant-int4": "kvpack.codecs.polarquant:PolarQuantCodec",
    "qjl": "kvpack.codecs.qjl:QJLCodec",
    "kivi": "kvpack.codecs.kivi:KiviCodec",
    "pca": "kvpack.codecs.pca:PCAKeyCodec",
    "vq": "kvpack.codecs.vq:VQValueCodec",
}

CONFIG_CLASSES: dict[str, str] = {
    "fp16": "kvpack.codecs.fp16:Fp16Config",
    "int8": "kvpack.codecs.int8:Int8Config",
    "turboquant": "kvpack.codecs.turboquant:TurboQuantConfig",
    "polarquant-int4": "kvpack.codecs.polarquant:PolarQuantConfig",
    "qjl": "kvpack.codecs.qjl:QJLConfig",
    "kivi": "kvpack.codecs.kivi:KiviConfig",
    "pca": "kvpack.codecs.pca:PCAConfig",
    "vq": "kvpack.codecs.vq:VQConfig",
}


EXACT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "native": None}


def _load(path: str) -> Any:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class CodecSpec:
    """A codec name and the keyword options of its config dataclass."""

    codec: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; available: {sorted(CODECS)}")

    def build(self, head_dim: int, kv_heads: int, layer_idx: int = 0) -> Codec:
        config = _load(CONFIG_CLASSES[self.codec])(**self.options)
        return _load(CODECS[self.codec])(config, head_dim, kv_heads, layer_idx)


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

    def __post_init__(self):
        if self.exact_dtype not in EXACT_DTYPES:
            raise ValueError(f"exact_dtype must be one of {sorted(EXACT_DTYPES)}, got {self.exact_dtype!r}")
        for attr in ("sink_tokens", "window"):
            if getattr(self, attr) < 0:
                raise ValueError(f"{attr} must be >= 0, got {getattr(self, attr)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def lossless(self) -> bool:
        return self.key.codec == self.value.codec == "fp16" and self.prefill_key is None

    def with_options(self, **changes: Any) -> MethodConfig:
        return replace(self, **changes)


def _fp16(_: str) -> MethodConfig:
    spec = CodecSpec("fp16")
    return MethodConfig("fp16", spec, spec, sink_tokens=0, window=0)


def _int8(_: str) -> MethodConfig:
    spec = CodecSpec("int8")
    return MethodConfig("int8", spec, spec)


def _turboquant(arg: str) -> MethodConfig:
    match = re.fullmatch(r"k([1-4])v([1-4])(\+qjl)?", arg or "k3v2")
    if not match:
        raise ValueError(f"turboquant takes 'kXvY' with X, Y in 1..4 and an optional '+qjl' (e.g. turboquant:k3v3), got {arg!r}")
    kb, vb, qjl = int(match[1]), int(match[2]), bool(match[3])
    # kvpack normalizes before TurboQuant (see TurboQuantConfig): keys are centered and divided by
    # RMS^0.5 per channel (Qwen2's outlier channels; full RMS scaling cost SmolLM2 +1.7% at 3 bits,
    # alpha 0.5 +0.7%), values are centered only.
    key = CodecSpec("turboquant", {"bits": kb, "qjl": qjl, "center": True, "channel_scale": 0.5})
    return MethodConfig(f"turboquant:{arg or 'k3v2'}", key, CodecSpec("turboquant", {"bits": vb, "center": True}))


def _polarquant(_: str) -> MethodConfig:
    spec = CodecSpec("polarquant-int4")
    return MethodConfig("polarquant-int4", spec, spec)


def _qjl(arg: str) -> MethodConfig:
    ratio = int(arg) if arg else 2
    return MethodConfig(f"qjl:{ratio}" if arg else "qjl", CodecSpec("qjl", {"sketch_ratio": ratio}), CodecSpec("kivi", {"bits": 4, "axis": "token"}))


def _kivi(arg: str) -> MethodConfig:
    if arg not in ("2", "4"):
        raise ValueError(f"kivi takes 2 or 4 bits (kivi:2, kivi:4), got {arg!r}")
    bits = int(arg)
    return MethodConfig(f"kivi:{bits}", CodecSpec("kivi", {"bits": bits, "axis": "channel"}), CodecSpec("kivi", {"bits": bits, "axis": "token"}))


def _shard(arg: str) -> MethodConfig:
    stream = {"": CodecSpec("int8"), "int8": CodecSpec("int8"), "tq4": CodecSpec("turboquant", {"bits": 4}), "fp16": CodecSpec("fp16")}
    if arg not in stream:
        raise ValueError(f"shard takes a decode-stream codec in {sorted(k for k in stream if k)} (e.g. shard:tq4), got {arg!r}")
    s = stream[arg]
    # Per-token RMS on values (2 B per token and head): at an 8K prefix on SmolLM2 the blog's VQ alone
    # cost +3.0% perplexity (values only lossy), with the RMS -0.1%.
    value = CodecSpec("vq", {"token_norm": True})
    return MethodConfig("shard" + (f":{arg}" if arg else ""), s, s, prefill_key=CodecSpec("pca"), prefill_value=value)


METHODS: dict[str, Callable[[str], MethodConfig]] = {
    "fp16": _fp16,
    "int8": _int8,
    "turboquant": _turboquant,
    "polarquant-int4": _polarquant,
    "qjl": _qjl,
    "kivi": _kivi,
    "shard": _shard,
}

DEFAULT_METHOD = "turboquant:k3v2"


def get_method(method: str | MethodConfig) -> MethodConfig:
    """Resolve `"name"` or `"name:args"` (e.g. `"turboquant:k3v3"`, `"kivi:2"`) to a MethodConfig."""
    if isinstance(method, MethodConfig):
        return method
    if not isinstance(method, str):
        raise ValueError(f"method must be a name or a MethodConfig, got {type(method).__name__}")
    name, _, arg = method.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {sorted(METHODS)} (e.g. 'turboquant:k3v3', 'kivi:2')")
    return METHODS[name](arg)


def list_methods() -> list[str]:
    """Canonical method names, for the CLI and the test matrix."""
    return ["fp16", "int8", "turboquant:k4v4", "turboquant:k3v3", "turboquant:k3v2", "turboquant:k3v3+qjl", "polarquant-int4", "qjl", "kivi:4", "kivi:2", "shard"]
