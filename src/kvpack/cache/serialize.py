"""Save a compressed cache to disk and load it back, bit for bit: safetensors only, so loading executes no code.

A file is one safetensors file. Its tensors are the cache's own (sinks, windows, every segment's
packed fields, every codec's fitted `state_dict()`), named `layers.<i>.<part>`; its string metadata
holds JSON: the format version, the kvpack version, the method (rebuilt from its fields), a model
fingerprint (architecture fields, rotary hashes), the dtype, the token count (and ids when given),
the layout that says what each tensor is, and two sha256 digests (header, tensor payload).

`compress=True` stores every tensor as a zstd frame of its bytes in the smallest of three byte orders
(`_layout`: as in memory, by byte plane, or by channel and byte plane), still as safetensors uint8
tensors, with the order named in the header.
Writes are atomic (temporary file in the same directory, fsync, `os.replace`); a file that is
truncated, corrupted, from another format version or for another model is refused with a
`CacheFileError` (a ValueError) that names the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from transformers.cache_utils import DynamicSlidingWindowLayer

from .._optional import MissingDependency, install_line
from ..codecs.base import Packed
from ..codecs.rows import RowsCodec
from ..registry import AUTO_SLIDING, CODECS, EXACT_SLIDING, CodecSpec, LayerCodecs, MethodConfig, Tier, get_method
from ..support import VERSION, atomic_write, jsonable, model_fingerprint
from ..support import fingerprint as config_fingerprint
from .anchors import AnchorSet
from .layer import KVPackLayer, Segment

if TYPE_CHECKING:
    from .kvcache import KVCache

__all__ = ["FORMAT_VERSION", "CacheFileError", "MissingCacheFileError", "load_cache", "read_header", "save_cache"]

FORMAT = "kvpack-cache"
FORMAT_VERSION = 1
# zstd level of `compress=True`. On a 2K-token Shard cache of SmolLM2 (docs/guide/storage.md) levels 3 / 10 / 19 gave
# 6.10 / 6.10 / 6.07 MB (from 6.94) in 0.5 / 1.1 / 6.9 s of compression: 3 is as small, and fast.
ZSTD_LEVEL = 3
# Bytes of whole channel streams per zstd block in the "channels" layout: each block gets its own Huffman table.
# Same cache: blocks of >= 1 / 4 / 16 KB gave 6.15 / 6.10 / 6.19 MB (fewer tables vs. tables fitted to fewer channels).
MIN_BLOCK = 4096
LAYOUTS = ("raw", "planes", "channels")

# Text-config fields that decide the shape and meaning of cached K/V; a file saved for one value refuses another.
_DTYPES = {n: getattr(torch, n) for n in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")}
_PACKED_CLASS = re.compile(r"(kvpack(?:\.\w+)+):(\w+(?:\.\w+)*)")
# KVPackLayer attributes a file restores (saved or rebuilt from the method and model); tests compare this
# with a filled layer's attributes, so a new attribute fails there until serialization handles it.
# `fit_queries` (prompt queries awaiting the first fit) and `tier_queries` (the latest queries, for an older tier's next
# fit) are not saved: a loaded layer collects them again.
# A memory `budget` is not saved (pass one to the loaded cache); a cache with `evicted` tokens is refused.
# `prompt_target` (the method's prompt byte target, shared by the layers) is rebuilt by KVCache from the method.
# `_first_position` (a segment's first RoPE position, cached for the decode kernels) is rebuilt on first use.
# A `placement` other than the default is not saved: pass it to the loaded cache again, as a budget.
# `_max_entry` (the largest entry the method's codecs store, `Codec.max_entry`) is rebuilt on the first update.
# `sliding_window` is rebuilt by KVCache from the model's config; `dropped` (a sliding layer's tokens gone) is saved.
LAYER_ATTRIBUTES = frozenset({
    "method", "layer_idx", "model_config", "rope", "length", "updates", "sink_k", "sink_v", "win_k", "win_v", "segments",
    "pos_offset", "pad", "pad_max", "_codecs", "pending_attention", "is_initialized", "dtype", "device", "batch", "kv_heads",
    "head_dim", "v_head_dim", "exact_dtype", "keys", "values", "fit_queries", "evicted", "budget", "_first_position",
    "fit_scaling", "anchors", "anchor_credit", "prompt_target", "placement", "_max_entry", "tier_fit", "tier_queries",
    "dropped", "sliding_window",
})


# The cache class a file is loaded into. The file format sits below `KVCache` in the layers (the cache calls it to save and
# load), so the class registers itself here when it is defined instead of this module importing it.
_CACHE_TYPES: list[type] = []


def register_cache_type(cls: type) -> type:
    """Make `cls` (built as `cls(model, method, allow_untested=True)`) the class `load_cache` rebuilds and `save_cache` takes."""
    _CACHE_TYPES.insert(0, cls)
    return cls


class CacheFileError(ValueError):
    """A cache file that cannot be loaded; the message names the problem and the fix."""


class MissingCacheFileError(CacheFileError, FileNotFoundError):
    """No file at the path (also a FileNotFoundError)."""


# -- save ----------------------------------------------------------------------------------------------
def save_cache(cache: KVCache, path: str | os.PathLike, *, token_ids: torch.Tensor | None = None, compress: bool = False) -> dict:
    """Write `cache` to `path` atomically; returns {"path", "bytes_on_disk", "bytes_in_memory", "seconds", "compressed", "tokens"}.

    token_ids: the ids the cache holds, `(tokens,)` or `(batch, tokens)`, stored in the header (see `read_header`).
    compress: entropy-code the tensors with zstd (`pip install "kvpack[store]"`); loading detects it.
    """
    start = time.perf_counter()
    if not isinstance(cache, tuple(_CACHE_TYPES)):
        raise TypeError(f"save_cache saves a kvpack.KVCache, got {type(cache).__name__}")
    evicted = max((layer.evicted_tokens for layer in cache.compressed_layers()), default=0)
    if evicted:
        raise ValueError(
            f"this cache evicted {evicted} tokens to stay within its memory budget, and a saved cache holds every token: "
            "call cache.rematerialize(model) first (with room for them: cache.set_budget(None) lifts the limit)"
        )
    zstd = _zstd("save_cache(..., compress=True)") if compress else None
    tokens = cache.get_seq_length()
    tensors, layout = collect(cache)
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "kvpack_version": VERSION,
        "method": json.dumps(method_to_json(cache.method)),
        "fingerprint": json.dumps(fingerprint(cache)),
        "dtype": json.dumps(next((entry["dtype"] for entry in layout if entry.get("dtype")), None)),
        "tokens": str(tokens),
        "layout": json.dumps(layout),
    }
    if token_ids is not None:
        meta["token_ids"] = json.dumps(_check_token_ids(token_ids, tokens))
    if zstd is not None:
        tensors, streams = _compress(tensors, zstd)
        meta["compression"] = json.dumps(streams)
    meta["payload_sha256"] = _payload_digest(tensors)
    meta["header_sha256"] = _header_digest(meta)
    data = save(tensors, meta)
    atomic_write(Path(path), data)
    return {
        "path": str(path), "bytes_on_disk": len(data), "bytes_in_memory": cache.memory_report()["total_bytes"],
        "seconds": time.perf_counter() - start, "compressed": compress, "tokens": tokens,
    }


def collect(cache: KVCache) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """What a file stores: every tensor of the cache (CPU copies, named `layers.<i>.<part>`) and the per-layer layout."""
    tensors: dict[str, torch.Tensor] = {}
    layout = [_save_layer(layer, f"layers.{i}", tensors) for i, layer in enumerate(cache.layers)]
    return {name: _cpu_copy(t) for name, t in tensors.items()}, layout


def _save_layer(layer, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    if isinstance(layer, KVPackLayer):
        return _save_kvpack_layer(layer, prefix, tensors)
    if isinstance(layer, DynamicSlidingWindowLayer):
        return _save_sliding_layer(layer, prefix, tensors)
    raise ValueError(f"cannot save a {type(layer).__name__} layer: kvpack saves KVPackLayer and DynamicSlidingWindowLayer layers")


def _save_kvpack_layer(layer: KVPackLayer, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    if not layer.is_initialized:
        return {"type": "kvpack", "initialized": False}
    if layer.pending_attention:
        raise ValueError(
            f"layer {layer.layer_idx} is between its cache update and kvpack attention (mid-forward): save the cache "
            "between forward passes (e.g. after model.generate returns)"
        )
    entry: dict[str, Any] = {
        "type": "kvpack", "initialized": True, "length": layer.length, "updates": layer.updates, "batch": layer.batch,
        "kv_heads": layer.kv_heads, "head_dim": layer.head_dim, "v_head_dim": layer.v_head_dim,
        "dtype": _dtype_name(layer.dtype), "exact_dtype": _dtype_name(layer.exact_dtype), "optional": [], "codecs": {}, "segments": [],
    }
    for part in ("sink_k", "sink_v", "win_k", "win_v"):
        tensors[f"{prefix}.{part}"] = getattr(layer, part)
    for part in ("pos_offset", "pad"):  # (batch,) long or None
        value = getattr(layer, part, None)
        if value is not None:
            tensors[f"{prefix}.{part}"] = value
            entry["optional"].append(part)
    for name, codec in layer._codecs.items():
        state = codec.state_dict()
        entry["codecs"][name] = {"codec": codec.name, "state": sorted(state), **({"rows": codec.rows} if isinstance(codec, RowsCodec) else {})}
        if "@" in name:  # retired (layer.retire_codecs): the method no longer names its spec, so the file does
            entry["codecs"][name]["spec"] = _spec_json(_codec_spec(codec))
        tensors.update({f"{prefix}.codecs.{name}.{key}": t for key, t in state.items()})
    names = {id(codec): name for name, codec in layer._codecs.items()}
    for j, seg in enumerate(layer.segments):
        entry["segments"].append({
            "kind": seg.kind, "start": seg.start, "key_codec": names[id(seg.key_codec)], "value_codec": names[id(seg.value_codec)],
            "keys": _save_packed(seg.keys, f"{prefix}.segments.{j}.keys", tensors),
            "values": _save_packed(seg.values, f"{prefix}.segments.{j}.values", tensors),
        })
    if layer.anchors is not None:  # the exact rows and their indices; loading gathers their codes from the segment again
        for part in ("index", "k", "v"):
            tensors[f"{prefix}.anchors.{part}"] = getattr(layer.anchors, part)
        entry["anchors"] = layer.anchors.count
    if layer.anchor_credit:
        entry["anchor_credit"] = layer.anchor_credit  # the next flush's share of an anchor, so a loaded cache chooses as the saved one would
    if layer.tier_fit:
        entry["tier_fit"] = {kind: list(errors) for kind, errors in layer.tier_fit.items()}  # a tier's refit reference
    if layer.dropped:
        entry["dropped"] = layer.dropped
    return entry


def _save_sliding_layer(layer: DynamicSlidingWindowLayer, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    entry = {"type": "sliding", "initialized": bool(layer.is_initialized), "sliding_window": layer.sliding_window}
    if layer.is_initialized:
        tensors[f"{prefix}.keys"], tensors[f"{prefix}.values"] = layer.keys, layer.values
        entry |= {"cumulative_length": layer.cumulative_length, "record_past": bool(layer.record_past), "dtype": _dtype_name(layer.keys.dtype)}
    return entry


def _save_packed(packed: Packed, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Tensor fields to `tensors`; the class and the scalar fields (num_tokens, ...) to the returned layout entry."""
    cls = type(packed)
    fields: dict[str, Any] = {}
    names: list[str] = []
    for f in dataclasses.fields(packed):
        value = getattr(packed, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}.{f.name}"] = value
            names.append(f.name)
        elif value is None or type(value) in (int, float, str, bool):
            fields[f.name] = value
        else:
            raise ValueError(f"cannot save field {f.name!r} of {cls.__qualname__}: a {type(value).__name__} is not a tensor, int, float, str or bool")
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields, "tensors": names}


# -- load ----------------------------------------------------------------------------------------------
def load_cache(path: str | os.PathLike, model) -> KVCache:
    """The `KVCache` saved at `path`, for `model` (the same architecture and dtype it was saved from), on the model's device.

    Raises `CacheFileError` (a ValueError) for a missing, truncated, corrupted, other-version or other-model file.
    """
    path = Path(path)
    data = _read(path)
    tensors, meta = _parse(data, path)
    _check_digests(meta, tensors, path)
    try:
        if "compression" in meta:
            tensors = _decompress(tensors, _json(meta, "compression", path), path)
        _check_model(meta, model, path)
        return _rebuild(meta, tensors, model, path)
    except CacheFileError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError) as err:
        # The checksums held, so the header was written (or re-signed) with contents no save produces: a clear refusal
        # rather than whichever check of the rebuild tripped first.
        raise CacheFileError(_corrupted_message(path, f"its header describes no cache kvpack can rebuild: {type(err).__name__}: {err}")) from err


def _rebuild(meta: dict[str, str], tensors: dict[str, torch.Tensor], model, path: Path) -> KVCache:
    method = method_from_json(_json(meta, "method", path))
    if not _CACHE_TYPES:
        raise RuntimeError("load_cache: no cache class is registered; import kvpack (kvpack.cache registers KVCache)")
    cache = _CACHE_TYPES[0](model, method, allow_untested=True)  # the file's model type was accepted when it was saved
    layout = _json(meta, "layout", path)
    if not isinstance(layout, list) or len(layout) != len(cache.layers):
        raise CacheFileError(f"{path} holds {len(layout) if isinstance(layout, list) else 'no'} layers but the model has {len(cache.layers)}")
    device = getattr(model, "device", torch.device("cpu"))
    for i, (layer, entry) in enumerate(zip(cache.layers, layout, strict=True)):
        _restore_layer(layer, entry, _Tensors(tensors, f"layers.{i}", device, path), path)
    return cache


def read_header(path: str | os.PathLike) -> dict:
    """The header of a cache file without its tensors: format_version, kvpack_version, method, fingerprint, dtype,
    tokens, token_ids (a long tensor or None) and compressed. The header digest is checked; the payload's is by `load_cache`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
    except FileNotFoundError:
        raise MissingCacheFileError(_missing_message(path)) from None
    meta = _metadata(head + header, path)
    _check_format(meta, path)
    if meta.get("header_sha256") != _header_digest(meta):
        raise CacheFileError(_corrupted_message(path, "its header checksum does not match"))
    ids = json.loads(meta["token_ids"]) if "token_ids" in meta else None
    return {
        "format_version": int(meta["format_version"]), "kvpack_version": meta["kvpack_version"], "method": _json(meta, "method", path),
        "fingerprint": _json(meta, "fingerprint", path), "dtype": _json(meta, "dtype", path), "tokens": int(meta["tokens"]),
        "token_ids": None if ids is None else torch.tensor(ids, dtype=torch.long), "compressed": "compression" in meta,
    }


class _Tensors:
    """The loaded tensors of one layer, fetched by part name and moved to the model's device."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str, device, path: Path):
        self.tensors, self.prefix, self.device, self.path = tensors, prefix, device, path

    def get(self, name: str, device=None) -> torch.Tensor:
        key = f"{self.prefix}.{name}"
        if key not in self.tensors:
            raise CacheFileError(_corrupted_message(self.path, f"tensor {key!r} named by its layout is missing"))
        return self.tensors[key].to(device or self.device, copy=True)


def _restore_layer(layer, entry: dict, tensors: _Tensors, path: Path) -> None:
    kind = "kvpack" if isinstance(layer, KVPackLayer) else "sliding"
    if entry.get("type") != kind:
        raise CacheFileError(f"{path}: layer {tensors.prefix} was saved as a {entry.get('type')!r} layer but the model's is {kind!r}")
    if not entry["initialized"]:
        return
    if kind == "sliding":
        _restore_sliding_layer(layer, entry, tensors, path)
    else:
        _restore_kvpack_layer(layer, entry, tensors, path)


def _restore_sliding_layer(layer: DynamicSlidingWindowLayer, entry: dict, tensors: _Tensors, path: Path) -> None:
    if entry["sliding_window"] != layer.sliding_window:
        raise CacheFileError(f"{path}: {tensors.prefix} has sliding window {entry['sliding_window']}, the model's layer {layer.sliding_window}")
    keys, values = tensors.get("keys"), tensors.get("values")
    layer.lazy_initialization(keys, values)  # dtype, device and transformers' own bookkeeping
    layer.keys, layer.values = keys, values
    layer.cumulative_length, layer.record_past = int(entry["cumulative_length"]), bool(entry["record_past"])


def _restore_kvpack_layer(layer: KVPackLayer, entry: dict, tensors: _Tensors, path: Path) -> None:
    b, h, d, dv, dtype = entry["batch"], entry["kv_heads"], entry["head_dim"], entry["v_head_dim"], _dtype(entry["dtype"], path)
    # The layer's own initializer sets dtype, device, shapes and the exact dtype the method implies.
    layer.lazy_initialization(torch.empty(b, h, 0, d, dtype=dtype, device=tensors.device), torch.empty(b, h, 0, dv, dtype=dtype, device=tensors.device))
    if _dtype_name(layer.exact_dtype) != entry["exact_dtype"]:
        raise CacheFileError(f"{path}: {tensors.prefix} stores exact tokens as {entry['exact_dtype']} but its method implies {layer.exact_dtype}")
    optional = {part: tensors.get(part) for part in entry["optional"]}
    if "pad" in optional and hasattr(layer, "set_padding"):  # before any token: the layer derives its sink region from it
        layer.set_padding(optional["pad"])
    elif "pad" in optional:
        layer.pad = optional["pad"]
    layer.pos_offset = optional.get("pos_offset")
    for part, dim in (("sink_k", d), ("sink_v", dv), ("win_k", d), ("win_v", dv)):
        setattr(layer, part, _checked(tensors.get(part), (b, h, None, dim), layer.exact_dtype, f"{tensors.prefix}.{part}", path))
    for name, info in entry["codecs"].items():
        codec = _restore_codec(layer, name, info, path)
        if codec.name != info["codec"]:
            raise CacheFileError(f"{path}: {tensors.prefix} codec {name!r} was {info['codec']!r}, the method builds {codec.name!r}")
        state = {key: tensors.get(f"codecs.{name}.{key}", "cpu") for key in info["state"]}
        try:
            codec.load_state_dict(state)
        except ValueError as err:
            raise CacheFileError(_corrupted_message(path, f"{tensors.prefix} codec {name!r}: {err}")) from err
    for j, seg in enumerate(entry["segments"]):
        if seg["key_codec"] not in layer._codecs or seg["value_codec"] not in layer._codecs:
            raise CacheFileError(_corrupted_message(path, f"segment {j} of {tensors.prefix} names codecs the layout does not list"))
        kc, vc = layer._codecs[seg["key_codec"]], layer._codecs[seg["value_codec"]]
        keys = _load_packed(seg["keys"], tensors, f"segments.{j}.keys", b, path)
        values = _load_packed(seg["values"], tensors, f"segments.{j}.values", b, path)
        if keys.num_tokens != values.num_tokens:
            raise CacheFileError(_corrupted_message(path, f"segment {j} of {tensors.prefix} has {keys.num_tokens} key and {values.num_tokens} value tokens"))
        layer.segments.append(Segment(seg["kind"], kc, vc, keys, values, int(seg["start"])))
    layer.length, layer.updates = int(entry["length"]), int(entry["updates"])
    layer.dropped = int(entry.get("dropped", 0))
    if layer.dropped and (layer.sliding_window is None or not 0 < layer.dropped < layer.length or layer.sink_k.shape[2]):
        raise CacheFileError(_corrupted_message(path, f"{tensors.prefix}: it says {layer.dropped} tokens left a window, which only a "
                                                      "sliding-window layer without sinks and with later tokens held has"))
    _check_layer_layout(layer, tensors.prefix, path)
    if "anchors" in entry:
        layer.anchors = _load_anchors(layer, int(entry["anchors"]), tensors, path)
    layer.anchor_credit = float(entry.get("anchor_credit", 0.0))
    layer.tier_fit = {str(kind): (float(errors[0]), float(errors[1])) for kind, errors in entry.get("tier_fit", {}).items()}


def _load_anchors(layer: KVPackLayer, count: int, tensors: _Tensors, path: Path) -> AnchorSet:
    """The anchors' exact rows, checked, with their codes gathered again from the segments that hold them."""
    b, h = layer.batch, layer.kv_heads
    index = _checked(tensors.get("anchors.index"), (count,), torch.long, f"{tensors.prefix}.anchors.index", path)
    k = _checked(tensors.get("anchors.k"), (b, h, count, layer.head_dim), layer.exact_dtype, f"{tensors.prefix}.anchors.k", path)
    v = _checked(tensors.get("anchors.v"), (b, h, count, layer.v_head_dim), layer.exact_dtype, f"{tensors.prefix}.anchors.v", path)
    bad = f"{tensors.prefix}: its anchors {index.tolist()} are not ascending tokens of its compressed segments"
    if not count or not bool((index[1:] > index[:-1]).all()):
        raise CacheFileError(_corrupted_message(path, bad))
    try:
        return AnchorSet.gather(layer.segments, index, k, v)
    except ValueError:
        raise CacheFileError(_corrupted_message(path, bad)) from None


def _load_packed(entry: dict, tensors: _Tensors, prefix: str, batch: int, path: Path) -> Packed:
    cls = _packed_class(entry["class"])
    kwargs = dict(entry["fields"]) | {name: tensors.get(f"{prefix}.{name}") for name in entry["tensors"]}
    expected = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(kwargs) != expected:
        raise CacheFileError(_corrupted_message(path, f"{prefix} has fields {sorted(kwargs)}, {cls.__qualname__} takes {sorted(expected)}"))
    try:
        packed = cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise CacheFileError(_corrupted_message(path, f"{prefix} does not rebuild a {cls.__qualname__} ({err})")) from err
    for name in entry["tensors"]:
        t = getattr(packed, name)
        if t.dim() < 3 or t.shape[0] != batch or t.shape[2] != packed.num_tokens:
            raise CacheFileError(_corrupted_message(path, f"{prefix}.{name} has shape {tuple(t.shape)}, expected batch {batch} and {packed.num_tokens} tokens at dim 2"))
    return packed


def _packed_class(spec: str) -> type[Packed]:
    """The `Packed` dataclass named `module:qualname`, only from a kvpack module already imported (no import runs)."""
    match = _PACKED_CLASS.fullmatch(spec)
    module = sys.modules.get(match[1]) if match else None
    obj: Any = module
    for part in match[2].split(".") if module is not None else ():
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, Packed) and dataclasses.is_dataclass(obj)):
        raise CacheFileError(
            f"packed class {spec!r} is not a kvpack Packed dataclass of a loaded kvpack codec module; "
            "kvpack loads only its own codecs' blocks (was the file written by another program?)"
        )
    return obj


def _checked(t: torch.Tensor, shape: tuple, dtype: torch.dtype, name: str, path: Path) -> torch.Tensor:
    if t.dtype != dtype or t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape, strict=True)):
        raise CacheFileError(_corrupted_message(path, f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}"))
    return t


def _check_layer_layout(layer: KVPackLayer, prefix: str, path: Path) -> None:
    """[sinks or a sliding layer's dropped tokens][segments, contiguous][window] must cover exactly `length` tokens."""
    pos = layer.dropped or layer.sink_k.shape[2]
    for seg in layer.segments:
        if seg.start != pos:
            raise CacheFileError(_corrupted_message(path, f"{prefix}: a segment starts at token {seg.start}, expected {pos}"))
        pos += seg.length
    if pos + layer.win_k.shape[2] != layer.length or layer.sink_v.shape[2] != layer.sink_k.shape[2] or layer.win_v.shape[2] != layer.win_k.shape[2]:
        raise CacheFileError(_corrupted_message(path, f"{prefix}: sinks, segments and window do not add up to its {layer.length} tokens"))


def _codec_slot(name: str, path: Path) -> tuple[str, str]:
    kind, _, side = name.rpartition("_")
    tier, _, generation = kind.partition("@")
    ok = kind in ("prefill", "stream") or (tier.startswith("tier") and tier[4:].isdigit() and (not generation or generation.isdigit()))
    if not ok or side not in ("key", "value"):
        raise CacheFileError(_corrupted_message(path, f"unknown codec slot {name!r}"))
    return kind, side


def _codec_spec(codec) -> CodecSpec:
    """The registry spec that builds `codec` again: its registered name and every field of its config."""
    codec = codec.inner[0] if isinstance(codec, RowsCodec) else codec  # one per batch row: the spec builds each
    name = next(key for key, target in CODECS.items() if target == f"{type(codec).__module__}:{type(codec).__name__}")
    return CodecSpec(name, dataclasses.asdict(codec.config))


def _restore_codec(layer: KVPackLayer, name: str, info: dict, path: Path):
    """The layer's codec for slot `name`: built by the method, or for a retired slot from the spec the file keeps."""
    kind, side = _codec_slot(name, path)
    rows = info.get("rows", 0)  # one codec per batch row when it was saved so
    if isinstance(rows, bool) or not isinstance(rows, int) or rows not in (0, layer.batch):
        raise CacheFileError(_corrupted_message(path, f"codec {name!r} claims {rows!r} rows of a batch of {layer.batch}"))
    if "@" not in kind:
        spec = layer._spec(kind, side)
    else:
        try:
            spec = CodecSpec(info["spec"]["codec"], dict(info["spec"]["options"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CacheFileError(_corrupted_message(path, f"retired codec {name!r} has no valid spec: {err}")) from err
    codec = layer.build_codec(spec, side, rows)
    layer._codecs[name] = codec
    return codec


# -- method and model identity -----------------------------------------------------------------------
FIRST_AUTO_SLIDING_METHOD = "int8"  # what a sliding window held under "auto" in files that do not record it
def method_to_json(method: MethodConfig) -> dict:
    """Every field of `method` as JSON (codec specs as {"codec", "options"}); `method_from_json` rebuilds an equal config."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(method):
        value = getattr(method, f.name)
        if f.name == "tiers":
            value = [{"key": _spec_json(t.key), "value": _spec_json(t.value), "after": t.after, "fit_tokens": t.fit_tokens, "refit": t.refit}
                     for t in value]
        if f.name == "layer_codecs":
            value = [{"layers": list(e.layers), "key": _spec_json(e.key), "value": _spec_json(e.value)} for e in value]
        out[f.name] = _spec_json(value) if isinstance(value, CodecSpec) else value
    if method.sliding == AUTO_SLIDING:  # what "auto" stood for when saved: a later default must not re-read these rows
        out["sliding_auto"] = method.resolved_sliding
    out["registered"] = _registered(method)
    if method_from_json(out) != method:
        raise ValueError(f"method {method.name!r} cannot be saved: its options {out} do not rebuild the same MethodConfig from JSON")
    return out


def _spec_json(spec: CodecSpec) -> dict:
    return {"codec": spec.codec, "options": jsonable(spec.options)}


def method_from_json(data: dict) -> MethodConfig:
    names = {f.name for f in dataclasses.fields(MethodConfig)}
    kwargs = {k: CodecSpec(v["codec"], dict(v["options"])) if isinstance(v, dict) else v for k, v in data.items() if k in names}
    kwargs.setdefault("sliding", EXACT_SLIDING)  # a file from before sliding windows could be coded held them exact
    spec = lambda v: CodecSpec(v["codec"], dict(v["options"]))  # noqa: E731
    kwargs["tiers"] = tuple(Tier(spec(t["key"]), spec(t["value"]), int(t["after"]), int(t.get("fit_tokens", 0)), t.get("refit", 0.0))
                            for t in data.get("tiers", ()))
    kwargs["layer_codecs"] = tuple(LayerCodecs(tuple(e["layers"]), spec(e["key"]), spec(e["value"])) for e in data.get("layer_codecs", ()))
    method = MethodConfig(**kwargs)
    if method.sliding == AUTO_SLIDING:
        # "auto" names whatever the release codes windows with; the file says what it was then (a file from before it
        # said so held plain int8 rows, or exact windows where "auto" keeps them exact)
        held = data.get("sliding_auto") or (EXACT_SLIDING if method.resolved_sliding == EXACT_SLIDING else FIRST_AUTO_SLIDING_METHOD)
        if held != method.resolved_sliding:
            method = dataclasses.replace(method, sliding=held)
    return method


def _registered(method: MethodConfig) -> bool:
    """Whether `method.name` resolves through `get_method` to this very config (informative: loading uses the fields)."""
    try:
        return get_method(method.name) == method
    except ValueError:
        return False


def fingerprint(cache: KVCache) -> dict:
    """What a cache's K/V depend on besides the weights: model type, architecture fields and per-layer RoPE hashes."""
    # Full-attention layers' RoPE, as `model_fingerprint` digests it (a sliding layer's is the config's, checked with it).
    ropes = [layer.rope if isinstance(layer, KVPackLayer) and layer.sliding_window is None else None for layer in cache.layers]
    return config_fingerprint(cache.model_config, ropes)


def _check_model(meta: dict, model, path: Path) -> None:
    saved, now = _json(meta, "fingerprint", path), model_fingerprint(model)
    fix = "load it with the model it was saved from (or rebuild the cache for this model)"
    if saved["model_type"] != now["model_type"]:
        raise CacheFileError(f"{path} is a cache for a {saved['model_type']!r} model, not this {now['model_type']!r} model: {fix}")
    diffs = [f"{k}: file {saved['config'].get(k)!r}, model {now['config'].get(k)!r}" for k in now["config"] if saved["config"].get(k) != now["config"].get(k)]
    if diffs:
        raise CacheFileError(f"{path} is a cache for another model ({'; '.join(diffs)}): {fix}")
    dtype, model_dtype = _json(meta, "dtype", path), getattr(model, "dtype", None)
    if dtype is not None and model_dtype is not None and dtype != _dtype_name(model_dtype):
        raise CacheFileError(f"{path} holds a cache of a {dtype} model, this model runs {_dtype_name(model_dtype)}: load the model with dtype=torch.{dtype}")
    layers = [i for i, (a, b) in enumerate(zip(saved["rope"], now["rope"], strict=True)) if a is not None and a != b]
    if layers:  # checked after the dtype: a model cast to another dtype casts its inv_freq buffers too
        raise CacheFileError(f"{path} was saved with other rotary parameters (inv_freq / attention scaling of layers {layers}): {fix}")


# -- file format -----------------------------------------------------------------------------------------
def _payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(json.dumps([name, _dtype_name(t.dtype), list(t.shape)]).encode())
        digest.update(_byte_view(t).numpy().tobytes())
    return digest.hexdigest()


def _header_digest(meta: dict[str, str]) -> str:
    body = {k: v for k, v in meta.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MissingCacheFileError(_missing_message(path)) from None
    except IsADirectoryError:
        raise CacheFileError(f"{path} is a directory, not a cache file: pass the file that save_cache wrote") from None


def _parse(data: bytes, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    meta = _metadata(data, path)
    _check_format(meta, path)
    try:
        tensors = load(data)
    except SafetensorError as err:
        raise CacheFileError(_corrupted_message(path, f"safetensors cannot read it ({err})")) from err
    return tensors, meta


def _metadata(data: bytes, path: Path) -> dict[str, str]:
    """The safetensors `__metadata__` strings, read from the header without touching the tensors."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    try:
        if not 0 <= n <= len(data) - 8:
            raise ValueError(f"the header length {n} does not fit in the file's {len(data)} bytes")
        header = json.loads(data[8 : 8 + n])
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not a mapping")
    except (ValueError, AttributeError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CacheFileError(_corrupted_message(path, f"its safetensors header is unreadable ({err})")) from err
    return meta


def _check_format(meta: dict[str, str], path: Path) -> None:
    if meta.get("format") != FORMAT:
        raise CacheFileError(f"{path} is not a kvpack cache file (no kvpack header): pass a file written by kvpack's save_cache")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CacheFileError(
            f"{path} has cache format version {version} (written by kvpack {meta.get('kvpack_version')}); this kvpack "
            f"({VERSION}) reads version {FORMAT_VERSION}: load it with that kvpack version, or save the cache again"
        )


def _check_digests(meta: dict[str, str], tensors: dict[str, torch.Tensor], path: Path) -> None:
    if meta.get("header_sha256") != _header_digest(meta):
        raise CacheFileError(_corrupted_message(path, "its header checksum does not match"))
    if meta.get("payload_sha256") != _payload_digest(tensors):
        raise CacheFileError(_corrupted_message(path, "its tensor checksum does not match"))


def _json(meta: dict[str, str], key: str, path: Path) -> Any:
    try:
        return json.loads(meta[key])
    except (KeyError, ValueError) as err:
        raise CacheFileError(_corrupted_message(path, f"header field {key!r} is missing or unreadable")) from err


def _missing_message(path: Path) -> str:
    return f"no cache file at {path}: check the path, or save one first with save_cache(cache, path)"


def _corrupted_message(path: Path, what: str) -> str:
    return f"{path} is truncated or corrupted ({what}): it cannot be loaded; save the cache again (or copy the whole file again)"


# -- entropy-coded form --------------------------------------------------------------------------------
def _zstd(purpose: str):
    try:
        import zstandard
    except ImportError as err:
        raise MissingDependency(f"{purpose} needs the optional package 'zstandard', which is not installed; install it with: {install_line('store')}") from err
    return zstandard


def _grid(shape: list[int], size: int) -> tuple[int, int, int]:
    """(rows, channels, element bytes) of a tensor: channels = the last dimension, rows = (batch, head, token, ...)."""
    cols = shape[-1] if shape else 1
    return (_numel(shape) // cols if cols else 0), cols, size


def _layout(t: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """The bytes of `t` as uint8 chunks in one of LAYOUTS (each a permutation of the bytes):

    raw: as in memory (rows of a token's channels; keeps repeated token rows together for zstd's matches).
    planes: byte plane, then rows and channels (fp16's sign/exponent bytes apart from its noisy low bytes).
    channels: one chunk per (byte plane, channel) over all rows: the codes of one channel (or one byte column of
        bit-packed codes) across tokens, drawn from one distribution, for an entropy coder with a table per block.
    """
    rows, cols, size = _grid(list(t.shape), t.element_size())
    b = _byte_view(t).view(rows, cols, size)
    if layout == "raw":
        return [b.reshape(-1)]
    if layout == "planes":
        return [b.permute(2, 0, 1).reshape(-1)]
    return list(b.permute(2, 1, 0).reshape(size * cols, rows))


def _unlayout(data: torch.Tensor, dtype: torch.dtype, shape: list[int], layout: str) -> torch.Tensor:
    """Inverse of `_layout`: the concatenated chunks back to the tensor."""
    rows, cols, size = _grid(shape, torch.empty((), dtype=dtype).element_size())
    if layout == "raw":
        b = data.view(rows, cols, size)
    elif layout == "planes":
        b = data.view(size, rows, cols).permute(1, 2, 0)
    else:
        b = data.view(size, cols, rows).permute(2, 1, 0)
    return b.reshape(-1).view(dtype).reshape(shape)


def _frame(chunks: list[torch.Tensor], compressor, zstd) -> bytes:
    """One zstd frame of the chunks, a new block (with its own entropy tables) after every MIN_BLOCK bytes of whole chunks."""
    cobj = compressor.compressobj(size=sum(c.numel() for c in chunks))
    out, pending = [], 0
    for chunk in chunks:
        out.append(cobj.compress(chunk.numpy().tobytes()))
        pending += chunk.numel()
        if pending >= MIN_BLOCK and len(chunks) > 1:
            out.append(cobj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
            pending = 0
    out.append(cobj.flush())
    return b"".join(out)


def _compress(tensors: dict[str, torch.Tensor], zstd) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Every tensor as the smallest of its LAYOUTS' zstd frames (uint8), and what undoes each."""
    compressor = zstd.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    out, streams = {}, {}
    for name, t in tensors.items():
        frames = {layout: _frame(_layout(t, layout), compressor, zstd) for layout in LAYOUTS}
        layout = min(LAYOUTS, key=lambda k: len(frames[k]))
        out[name] = torch.frombuffer(bytearray(frames[layout]), dtype=torch.uint8)
        streams[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "layout": layout, "nbytes": t.numel() * t.element_size()}
    return out, streams


def _decompress(tensors: dict[str, torch.Tensor], streams: dict[str, dict], path: Path) -> dict[str, torch.Tensor]:
    zstd = _zstd(f"loading the compressed cache {path}")
    decompressor = zstd.ZstdDecompressor()
    out = {}
    for name, info in streams.items():
        if info.get("layout") not in LAYOUTS or name not in tensors:
            raise CacheFileError(_corrupted_message(path, f"stream {name!r} is missing or has an unknown layout {info.get('layout')!r}"))
        dtype = _dtype(info["dtype"], path)
        nbytes = _numel(info["shape"]) * torch.empty((), dtype=dtype).element_size()
        frame = tensors[name].numpy().tobytes()
        try:
            # The frame records its size (save writes it); a header claiming more is refused before any allocation.
            claimed = zstd.frame_content_size(frame)
        except zstd.ZstdError as err:
            raise CacheFileError(_corrupted_message(path, f"stream {name!r} is not a zstd frame ({err})")) from err
        if claimed != nbytes:
            raise CacheFileError(_corrupted_message(path, f"stream {name!r} holds {claimed} bytes but its header claims {nbytes}"))
        try:
            raw = decompressor.decompress(frame, max_output_size=nbytes)
        except zstd.ZstdError as err:
            raise CacheFileError(_corrupted_message(path, f"stream {name!r} does not decompress ({err})")) from err
        if len(raw) != nbytes:
            raise CacheFileError(_corrupted_message(path, f"stream {name!r} decompresses to {len(raw)} bytes, not {nbytes}"))
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = _unlayout(data, dtype, info["shape"], info["layout"])
    return out


# -- small helpers ---------------------------------------------------------------------------------------
def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy owning its storage (safetensors refuses views and shared storage)."""
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, path: Path) -> torch.dtype:
    if name not in _DTYPES:
        raise CacheFileError(_corrupted_message(path, f"unknown dtype {name!r}"))
    return _DTYPES[name]


def _check_token_ids(token_ids: torch.Tensor, tokens: int) -> list:
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype.is_floating_point or token_ids.dim() not in (1, 2):
        raise ValueError(f"token_ids must be an integer tensor of shape (tokens,) or (batch, tokens), got {token_ids!r:.80}")
    if token_ids.shape[-1] != tokens:
        raise ValueError(f"token_ids hold {token_ids.shape[-1]} tokens but the cache holds {tokens}: pass the ids the cache was filled with")
    return token_ids.tolist()
