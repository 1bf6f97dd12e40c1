"""What every layer of kvpack may use, and which imports nothing of kvpack: the version, a model's text config, layer
kinds and RoPE parameters, its fingerprint, the name of the forward's cache argument, and atomic file writes.

Everything here reads a transformers model or config (or writes a file); nothing holds state. The cache, the
allocator, the saved-cache format and the calibration all read a model through these, so they agree on what a
model is (the same layer kinds, the same rotary parameters, the same fingerprint).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import os
import secrets
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

VERSION = "0.1.0"

Rope = tuple[torch.Tensor, float]  # (inv_freq (d/2,) float32, attention_scaling) of one layer

# Config fields a cache's K/V depend on (besides the weights): a saved cache or a profile is refused for a model whose
# fields differ.
FINGERPRINT_FIELDS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "sliding_window", "attention_chunk_size", "rope_theta", "rope_parameters", "rope_scaling",
    "partial_rotary_factor",
)


# -- a model's configuration -------------------------------------------------------------------------------
def text_config(model_or_config) -> tuple[Any, Any]:
    """(config, text config) of a transformers model or `PretrainedConfig` (the decoder's, for multimodal models)."""
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise ValueError(f"KVCache needs a transformers model or PretrainedConfig, got {type(model_or_config).__name__}")
    return config, config.get_text_config(decoder=True)


def layer_kinds(text) -> list[tuple[str, int | None]]:
    """(attention kind, window) of every layer, inferred as transformers' `DynamicCache(config=...)` does.

    `layer_types` when the config has it; otherwise a layer is "sliding_attention" when the config sets
    `sliding_window` (Mistral: every layer keeps only the window), "chunked_attention" when it sets
    `attention_chunk_size`, else "full_attention" (transformers 5.x `get_layer_types_and_kwargs`).
    """
    n_layers = text.num_hidden_layers
    window, chunk = getattr(text, "sliding_window", None), getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None else "full_attention"
        types = [kind] * n_layers
    return [(t, window if t == "sliding_attention" else chunk if t == "chunked_attention" else None) for t in types]


def head_dim(text) -> int:
    """Channels per attention head: the config's `head_dim`, else hidden size / heads."""
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


# -- rotary embeddings -------------------------------------------------------------------------------------
def rope_per_layer(model, kinds: list[tuple[str, int | None]]) -> list[Rope | None]:
    """(inv_freq, attention_scaling) of each layer, read from the model's rotary modules; None where there is none."""
    if model is None or not hasattr(model, "modules"):
        return [None] * len(kinds)
    emb = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
    if not emb:
        # Gemma3-style rotary modules keep one buffer per layer type.
        emb = [m for m in model.modules() if any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))]
    if not emb:
        return [None] * len(kinds)
    rotary = emb[0]
    out = []
    for layer_type, _ in kinds:
        inv = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv is None:
            inv = getattr(rotary, "inv_freq", None)
        scaling = getattr(rotary, f"{layer_type}_attention_scaling", getattr(rotary, "attention_scaling", 1.0))
        out.append(None if inv is None else (inv.detach().float().clone(), float(scaling)))
    return out


def rotary_from_config(text) -> torch.nn.Module | None:
    """The rotary-embedding module transformers builds for this (text) config's model type, wrapped for `rope_per_layer`;
    None when the model type has no single `*RotaryEmbedding` class or it cannot be built from the config."""
    name = MODEL_MAPPING_NAMES.get(getattr(text, "model_type", ""))
    model_class = getattr(transformers, name, None) if name else None
    if model_class is None:
        return None
    module = importlib.import_module(model_class.__module__)
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    if len(classes) != 1:
        return None
    try:
        return torch.nn.ModuleList([classes[0](config=text)])
    except (AttributeError, KeyError, TypeError, ValueError):  # a config this class cannot read: the caller names the fix
        return None


# -- fingerprints ------------------------------------------------------------------------------------------
def jsonable(value: Any) -> Any:
    """`value` as plain JSON types (enums by value, anything else by repr), for fingerprints and headers."""
    return json.loads(json.dumps(value, sort_keys=True, default=lambda v: v.value if isinstance(v, Enum) else repr(v)))


def fingerprint(config, ropes: list[Rope | None]) -> dict:
    """What a cache's K/V depend on besides the weights: model type, architecture fields and per-layer RoPE hashes."""
    _, text = text_config(config)
    fields = {f: jsonable(getattr(text, f, None)) for f in FINGERPRINT_FIELDS}
    fields["head_dim"] = fields["head_dim"] or text.hidden_size // text.num_attention_heads
    fields["layer_kinds"] = jsonable(layer_kinds(text))
    return {"model_type": getattr(text, "model_type", None), "config": fields, "rope": [rope_digest(r) for r in ropes]}


def model_fingerprint(model) -> dict:
    """`fingerprint` of a cache built for `model`, read from the model itself (its config and rotary modules, as KVCache reads them)."""
    _, text = text_config(model)
    kinds = layer_kinds(text)
    ropes = rope_per_layer(model, kinds)
    return fingerprint(model.config, [rope if kind == "full_attention" else None for rope, (kind, _) in zip(ropes, kinds, strict=True)])


def rope_digest(rope: Rope | None) -> str | None:
    """sha256 of one layer's inv_freq bytes and scaling; None for a layer without RoPE."""
    if rope is None:
        return None
    inv_freq, scaling = rope
    digest = hashlib.sha256(inv_freq.detach().float().cpu().contiguous().numpy().tobytes())
    digest.update(repr(float(scaling)).encode())
    return digest.hexdigest()


# -- the forward's cache argument --------------------------------------------------------------------------
@functools.cache
def _cache_name(forward_fn) -> str:
    return "cache" if "cache" in inspect.signature(forward_fn).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{name: cache} for `model`'s forward: `cache` where it takes it (transformers >= 5.2x, where `past_key_values`
    is deprecated and goes in 5.40), else `past_key_values` (earlier 5.x)."""
    return {_cache_name(type(model).forward): cache}


# -- files -------------------------------------------------------------------------------------------------
def atomic_write(path: Path, data: bytes) -> None:
    """`data` to a temporary file beside `path`, fsync, then `os.replace`: `path` is the old file or the whole new one."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"cannot save to {path}: the directory {path.parent} does not exist; create it first")
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    # os.open, not mkstemp: mode 0o666 minus the umask, as a plain open() would create (mkstemp makes 0o600 files).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write_bytes(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write_bytes(f, data: bytes) -> None:
    """The one write of an atomic save (a seam where tests make it fail midway)."""
    f.write(data)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); directories cannot be opened for fsync on Windows."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
