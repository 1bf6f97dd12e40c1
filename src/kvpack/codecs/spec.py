"""The codec table: a codec's name and its class, resolved lazily by import path so a codec file is imported only when a
method that uses it is built; `CodecSpec` is a name plus options, validated when it is made."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

from .base import Codec

# Name -> codec class by import path (one entry per codec); the class names its config dataclass (`Codec.config_class`).
CODECS: dict[str, str] = {
    "fp16": "kvpack.codecs.fp16:Fp16Codec",
    "int8": "kvpack.codecs.int8:Int8Codec",
    "int8_rotated": "kvpack.codecs.int8_rotated:RotatedInt8Codec",
    "int4": "kvpack.codecs.int4:Int4Codec",
    "turboquant": "kvpack.codecs.turboquant:TurboQuantCodec",
    "polarquant-int4": "kvpack.codecs.polarquant:PolarQuantCodec",
    "qjl": "kvpack.codecs.qjl:QJLCodec",
    "kivi": "kvpack.codecs.kivi:KiviCodec",
    "pca": "kvpack.codecs.pca:PCAKeyCodec",
    "vq": "kvpack.codecs.vq:VQValueCodec",
    "kvquant-key": "kvpack.codecs.kvquant:KVQuantKeyCodec",
    "kvquant-value": "kvpack.codecs.kvquant:KVQuantValueCodec",
    "subspace": "kvpack.codecs.subspace:SubspaceCodec",
    "heads": "kvpack.codecs.heads:HeadsCodec",
}


def load_class(path: str) -> Any:
    """The object at `"module:attr"`."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class CodecSpec:
    """A codec name and the keyword options of its config dataclass.

    The config is built here, once, so an unknown or invalid option fails when the spec (and so the
    method or cache) is made, not at the first flush mid-generate.
    """

    codec: str
    options: dict[str, Any] = field(default_factory=dict)
    _config: Any = field(init=False, repr=False, compare=False)  # set once in __post_init__

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; available: {sorted(CODECS)}")
        if not isinstance(self.options, dict):
            raise TypeError(f"options must be a dict of the codec config's fields, got {type(self.options).__name__}")
        config_class = self.codec_class.config_class
        allowed = [f.name for f in fields(config_class)]
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            raise ValueError(f"codec {self.codec!r} has no option {', '.join(map(repr, unknown))}; its options are {allowed or 'none'}")
        try:
            config = config_class(**self.options)
        except (TypeError, ValueError) as err:  # e.g. a string where a number goes
            raise ValueError(f"codec {self.codec!r}: {err}") from err
        object.__setattr__(self, "_config", config)

    @property
    def config(self) -> Any:
        """The codec's validated, frozen config dataclass."""
        return self._config

    @property
    def codec_class(self) -> type[Codec]:
        return load_class(CODECS[self.codec])

    @property
    def uses_positions(self) -> bool:
        """Whether this codec reads token positions and the model's rotary embedding (`Codec.needs_positions`)."""
        return self.codec_class.needs_positions(self.config)

    def build(self, head_dim: int, kv_heads: int, layer_idx: int = 0) -> Codec:
        return self.codec_class(self.config, head_dim, kv_heads, layer_idx)
