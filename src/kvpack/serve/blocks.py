"""KV blocks of a served prefix <-> safetensors files through a kvpack method; no serving framework here.

A block is the K and V of some consecutive prompt tokens for every layer, `keys, values: (layers,
tokens, kv_heads, head_dim)`, starting at token position `start`. It is stored as it would sit in a
`KVCache` after prefill: tokens at positions below the method's `sink_tokens` exact (in its
`exact_dtype`), the rest through the method's prefill codecs (the stream codecs when it has none),
and a tail shorter than the codecs' token multiple (KIVI's channel groups) exact. There is no recent
window: a stored prefix is always followed by more tokens. Each layer gets fresh codecs, fitted on
this block (TurboQuant's mean and channel scales, VQ codebooks), whose fitted state goes into the
file, so a file decodes on its own. A codec that reads token positions (keys stored without RoPE, or centered on a
mean RoPE turns, as the default's `+ropemean` keys) is given the block's positions and each layer's rotary embedding
(`ropes`, as `kvpack.support.rope_per_layer` reads them); the file records their digests, and a reader with other
rotary parameters is refused.

Files are safetensors (tensors plus string metadata, no pickle), written to a temporary name and
moved into place with `os.replace`, so a reader sees a whole file or none, and concurrent writers of one
key each leave a whole file. Each file (one chunk) carries a sha256 over its metadata and tensor bytes
(`CHECKSUM`). Reading checks the format, the method (name and codec options) and any expected shape,
then the checksum, and refuses a mismatch or a damaged, truncated or half-written file with
`BlockMismatch` rather than decoding it. `evict` keeps a directory of chunks within a size limit, least
recently used first, and removes temporaries that crashed writers left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import struct
import time
import typing
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from ..codecs.base import Codec, Packed, slice_packed
from ..registry import EXACT_DTYPES, CodecSpec, MethodConfig, get_method
from ..support import Rope, rope_digest

FORMAT = "kvpack-blocks/1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHAPE_FIELDS = ("layers", "tokens", "kv_heads", "head_dim", "start")
CHECKSUM = "sha256"  # metadata key: sha256 over the other metadata entries and every tensor's name, dtype, shape and bytes
STALE_TEMPORARY_SECONDS = 3600  # a writer's temporary older than this belongs to a writer that died; `evict` removes it


class BlockMismatch(ValueError):
    """A block file that is not what the reader expects: other format, method or shape."""


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, salt: str = "") -> list[str]:
    """One key per whole chunk of `chunk_tokens` tokens: sha256 of `salt` and every token up to the chunk's end.

    Chained, as vLLM's prefix-cache block hashes are: chunk i's key names the whole prefix
    `token_ids[:(i + 1) * chunk_tokens]`, so equal keys mean equal prefixes (and equal positions).
    `salt` separates what must not be shared (model, method, dtype). A trailing partial chunk gets no key.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    digest = hashlib.sha256(salt.encode() + b"\0")
    keys = []
    for i in range(len(token_ids) // chunk_tokens):
        chunk = token_ids[i * chunk_tokens : (i + 1) * chunk_tokens]
        digest.update(struct.pack(f"<{chunk_tokens}q", *(int(t) for t in chunk)))
        keys.append(digest.copy().hexdigest())
    return keys


def method_fingerprint(method: MethodConfig) -> str:
    """What decides the bytes of a block: codec names and options, sinks, exact dtype (canonical JSON)."""

    def spec(s: CodecSpec | None) -> list | None:
        return None if s is None else [s.codec, {k: s.options[k] for k in sorted(s.options)}]

    fields = {
        "key": spec(method.key),
        "value": spec(method.value),
        "prefill_key": spec(method.prefill_key),
        "prefill_value": spec(method.prefill_value),
        "sink_tokens": method.sink_tokens,
        "exact_dtype": method.exact_dtype,
    }
    if method.layer_codecs:  # only when set, so files written before per-layer codecs existed still match
        fields["layer_codecs"] = [[list(e.layers), spec(e.key), spec(e.value)] for e in method.layer_codecs]
    return json.dumps(
        fields,
        sort_keys=True,
    )


def _specs(method: MethodConfig) -> tuple[CodecSpec, CodecSpec]:
    """The codecs a stored prefix goes through: the prefill codecs, else the stream codecs."""
    return method.prefill_key or method.key, method.prefill_value or method.value


def _build(spec: CodecSpec, head_dim: int, kv_heads: int, layer: int, ropes: Sequence[Rope | None] | None) -> Codec:
    codec = spec.build(head_dim, kv_heads, layer)
    if codec.uses_positions:
        rope = ropes[layer] if ropes is not None and layer < len(ropes) else None
        if rope is None:
            raise ValueError(
                f"codec {spec.codec!r} reads token positions and the model's rotary embedding (keys stored without RoPE, or "
                f"centered on a mean turned by it), and layer {layer} was given none: pass ropes=kvpack.support.rope_per_layer"
                "(model, layer_kinds) (one (inv_freq, attention_scaling) per layer), or store the blocks with a method that "
                "reads no positions, such as 'int8' or 'turboquant:k3v2'"
            )
        codec.set_rope(*rope)
    return codec


def _positions(start: int, head: int, middle: int) -> torch.Tensor:
    """`(1, middle)` RoPE positions of a block's compressed tokens."""
    return torch.arange(start + head, start + head + middle)[None]


def _rope_digests(codecs: Sequence[Sequence[Codec]], ropes: Sequence[Rope | None] | None) -> str | None:
    """JSON list of each layer's rotary digest when some codec reads positions (what its codes depend on), else None."""
    if not any(c.uses_positions for pair in codecs for c in pair):
        return None
    return json.dumps([rope_digest(r) for r in ropes or ()])


def _packed_class(codec: Codec) -> type[Packed]:
    """The packed dataclass `codec.encode` returns, read from its annotation (to rebuild one from a file)."""
    cls = typing.get_type_hints(type(codec).encode).get("return")
    if not (isinstance(cls, type) and issubclass(cls, Packed)):
        raise TypeError(f"{type(codec).__name__}.encode must be annotated with its Packed subclass, got {cls!r}")
    return cls


def _split(tokens: int, start: int, method: MethodConfig, multiple: int) -> tuple[int, int, int]:
    """(exact head, compressed, exact tail) token counts of a block of `tokens` starting at `start`."""
    head = min(max(method.sink_tokens - start, 0), tokens)
    middle = (tokens - head) // multiple * multiple
    return head, middle, tokens - head - middle


def _check_state_saved(spec: CodecSpec, codec: Codec, packed: Packed, head_dim: int, kv_heads: int, layer: int,
                       ropes: Sequence[Rope | None] | None, positions: torch.Tensor) -> None:
    """Refuse a codec whose `state_dict` leaves out fitted state that `decode` reads: its file would decode wrong.

    Fitted state (means, scales, bases, codebooks) is per head or channel, so the first token (or token group) shows it.
    """
    fresh = _build(spec, head_dim, kv_heads, layer, ropes)
    fresh.load_state_dict(codec.state_dict())
    probe, pos = slice_packed(packed, 0, codec.token_multiple), positions[:, : codec.token_multiple]
    if not torch.equal(fresh.decode(probe, pos), codec.decode(probe, pos)):
        raise NotImplementedError(
            f"codec {spec.codec!r} with options {spec.options} fits state on the data that its state_dict() does not return, "
            "so a stored block could not be decoded; it needs state_dict/load_state_dict for that state"
        )


def encode_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    method: str | MethodConfig,
    start: int = 0,
    extra: Mapping[str, str] | None = None,
    ropes: Sequence[Rope | None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`keys, values: (layers, tokens, kv_heads, head_dim)` at positions `start...` -> (tensors, metadata) for safetensors.

    `extra`: string metadata stored alongside (e.g. the model), checked by `decode_kv(expect=...)`. `ropes`: each layer's
    `(inv_freq, attention_scaling)`, needed only by codecs that read positions (the default's `+ropemean` keys).
    """
    method = get_method(method)
    if method.fisher_tail:  # its widths are a cache's, placed by running the model over that cache's own prompt
        raise ValueError(
            f"method {method.name!r} places key widths per prompt by running the model ('@fisher'), which stored blocks "
            "cannot: they hold one width per layer for every prompt. Store with the method without '@fisher', or with "
            "the method a placed cache holds (cache.method, its widths fixed)"
        )
    if keys.ndim != 4 or keys.shape != values.shape:
        raise ValueError(
            f"keys and values must both be (layers, tokens, kv_heads, head_dim), got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.dtype not in DTYPES.values() or values.dtype != keys.dtype:
        raise ValueError(f"keys and values must share one of {sorted(DTYPES)}, got {keys.dtype} and {values.dtype}")
    if start < 0 or keys.shape[1] < 1:
        raise ValueError(f"need start >= 0 and at least one token, got start {start} and {keys.shape[1]} tokens")
    layers, tokens, kv_heads, head_dim = keys.shape
    tensors: dict[str, torch.Tensor] = {}
    exact_dtype = EXACT_DTYPES[method.exact_dtype] or keys.dtype
    specs = [_specs(method.for_layer(layer)) for layer in range(layers)]  # (key, value) per layer (MethodConfig.layer_codecs)
    codecs = [tuple(_build(spec, head_dim, kv_heads, layer, ropes) for spec in pair) for layer, pair in enumerate(specs)]
    # One split for every layer (the file's "split"): whole groups of every layer's codecs.
    head, middle, tail = _split(tokens, start, method, math.lcm(*(c.token_multiple for pair in codecs for c in pair))) if layers else (0, 0, 0)
    positions = _positions(start, head, middle)
    for layer in range(layers) if middle else ():
        (kspec, vspec), (kc, vc) = specs[layer], codecs[layer]
        for side, codec, spec, x in (("k", kc, kspec, keys[layer]), ("v", vc, vspec, values[layer])):
            part = x[head : head + middle].permute(1, 0, 2).unsqueeze(0)  # (1, kv_heads, middle, head_dim): a codec's layout
            codec.fit(part, positions)
            packed = codec.encode(part, positions)
            _check_state_saved(spec, codec, packed, head_dim, kv_heads, layer, ropes, positions)
            for f in dataclasses.fields(packed):
                value = getattr(packed, f.name)
                if isinstance(value, torch.Tensor):
                    tensors[f"L{layer}.{side}.{f.name}"] = value.clone(
                        memory_format=torch.contiguous_format
                    )  # safetensors refuses shared storage
            for name, state in codec.state_dict().items():
                tensors[f"L{layer}.{side}.state.{name}"] = state.detach().cpu().contiguous()
    for side, x in (("k", keys), ("v", values)):
        for name, part in (("head", x[:, :head]), ("tail", x[:, head + middle :])):
            if part.shape[1]:
                if exact_dtype == torch.float16 and part.abs().amax() > torch.finfo(torch.float16).max:
                    raise ValueError(
                        f"{side} values exceed the float16 range of the method's exact tokens; "
                        "use a method with exact_dtype='bfloat16' or 'native' (MethodConfig.with_options)"
                    )
                tensors[f"{name}.{side}"] = part.to(exact_dtype).contiguous()
    metadata = {
        "format": FORMAT,
        "method": method.name,
        "method_spec": method_fingerprint(method),
        "layers": str(layers),
        "tokens": str(tokens),
        "kv_heads": str(kv_heads),
        "head_dim": str(head_dim),
        "start": str(start),
        "dtype": str(keys.dtype).removeprefix("torch."),
        "split": json.dumps([head, middle, tail]),
    }
    digests = _rope_digests(codecs, ropes) if middle else None
    if digests is not None:
        metadata["rope"] = digests
    for k, v in (extra or {}).items():
        if k in metadata:
            raise ValueError(f"extra metadata key {k!r} is reserved")
        metadata[k] = str(v)
    return tensors, metadata


def check_metadata(metadata: Mapping[str, str], method: str | MethodConfig, expect: Mapping[str, object] | None = None) -> None:
    """Raise `BlockMismatch` unless `metadata` is this format, this method, and matches every `expect` entry."""
    method = get_method(method)
    if metadata.get("format") != FORMAT:
        raise BlockMismatch(f"not a {FORMAT} file (format {metadata.get('format')!r})")
    if metadata.get("method") != method.name or metadata.get("method_spec") != method_fingerprint(method):
        raise BlockMismatch(
            f"block was written with method {metadata.get('method')!r} ({metadata.get('method_spec')}), reader uses {method.name!r}"
        )
    for key, want in (expect or {}).items():
        if metadata.get(key) != str(want):
            raise BlockMismatch(f"block has {key}={metadata.get(key)!r}, expected {want!r}")


def decode_kv(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    method: str | MethodConfig,
    expect: Mapping[str, object] | None = None,
    ropes: Sequence[Rope | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `encode_kv`: (keys, values) `(layers, tokens, kv_heads, head_dim)` in the dtype they were stored from.

    `expect`: metadata values the block must have (e.g. `{"layers": 30, "head_dim": 64, "model": ...}`);
    any mismatch, or another method, raises `BlockMismatch`; so do rotary parameters (`ropes`) other than the writer's,
    for codecs that read positions.
    """
    method = get_method(method)
    check_metadata(metadata, method, expect)
    layers, tokens, kv_heads, head_dim = (int(metadata[k]) for k in SHAPE_FIELDS[:4])
    head, middle, tail = json.loads(metadata["split"])
    if "rope" in metadata and (ropes is None or metadata["rope"] != json.dumps([rope_digest(r) for r in ropes])):
        raise BlockMismatch("block was written with other rotary parameters (inv_freq / attention scaling) than the reader's "
                            f"{'(none given: pass ropes=)' if ropes is None else ''}; its position-dependent codes would decode wrong")
    positions = _positions(int(metadata["start"]), head, middle)
    dtype = DTYPES[metadata["dtype"]]
    out = {}
    for side in ("k", "v"):
        parts = [tensors[f"head.{side}"].to(dtype)] if head else []
        if middle:
            rows = []
            for layer in range(layers):
                spec = _specs(method.for_layer(layer))[side == "v"]
                codec = _build(spec, head_dim, kv_heads, layer, ropes)
                prefix = f"L{layer}.{side}.state."
                codec.load_state_dict({k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)})
                cls = _packed_class(codec)
                declared = [f for f in dataclasses.fields(cls) if f.name != "num_tokens"]
                fields = {f.name: tensors.get(f"L{layer}.{side}.{f.name}") for f in declared}
                missing = [
                    f.name for f in declared if fields[f.name] is None and f.default is not None
                ]  # optional fields default to None
                if missing:
                    raise BlockMismatch(f"block lacks {side} field(s) {missing} of layer {layer}")
                x = codec.decode(cls(num_tokens=middle, **fields), positions)  # (1, kv_heads, middle, head_dim)
                rows.append(x[0].permute(1, 0, 2))
            parts.append(torch.stack(rows).to(dtype))
        if tail:
            parts.append(tensors[f"tail.{side}"].to(dtype))
        out[side] = torch.cat(parts, dim=1)
        if out[side].shape != (layers, tokens, kv_heads, head_dim):
            raise BlockMismatch(
                f"decoded {side} has shape {tuple(out[side].shape)}, metadata says {(layers, tokens, kv_heads, head_dim)}"
            )
    return out["k"], out["v"]


def checksum(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """sha256 over `metadata` (all but `CHECKSUM`, sorted) and every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256(json.dumps(sorted((k, v) for k, v in metadata.items() if k != CHECKSUM)).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_atomic(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """Write a safetensors file at `path` via a temporary file and `os.replace`; returns its size in bytes.

    The metadata gains `CHECKSUM`. Concurrent writers of one key each replace the file whole; a failure leaves no
    file (and no temporary).
    """
    path = Path(path)
    metadata = {**metadata, CHECKSUM: checksum(tensors, metadata)}
    data = safetensors.torch.save(dict(tensors), metadata=dict(metadata))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(data)


def save_kv(
    path: str | os.PathLike,
    keys: torch.Tensor,
    values: torch.Tensor,
    method: str | MethodConfig,
    start: int = 0,
    extra: Mapping[str, str] | None = None,
    ropes: Sequence[Rope | None] | None = None,
) -> int:
    """`encode_kv` then `write_atomic`; returns the bytes written."""
    tensors, metadata = encode_kv(keys, values, method, start, extra, ropes)
    return write_atomic(path, tensors, metadata)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a block file (its header only); `BlockMismatch` if it is no safetensors file."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except safetensors.SafetensorError as err:
        raise BlockMismatch(f"{path} is not a readable safetensors file: {err}") from err


def load_kv(
    path: str | os.PathLike,
    method: str | MethodConfig,
    expect: Mapping[str, object] | None = None,
    ropes: Sequence[Rope | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and decode a file written by `save_kv` (`ropes` as `decode_kv` takes them).

    `BlockMismatch` if it holds another method or shape, or its checksum does not match (a damaged, truncated or
    half-written file: recompute the chunk); a missing file raises `FileNotFoundError`. A file that loads has its
    modification time renewed, so `evict` removes the least recently used first.
    """
    # One read of the whole file, then its header and tensors from those bytes: `safetensors.safe_open` reads the
    # header and the tensor data through separate opens of the path, and a writer replacing the file in between gave
    # one file's metadata with another's tensors (9 of 4,507 reads beside two writers), a spurious checksum failure.
    with open(path, "rb") as f:
        data = f.read()
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size]) if len(data) >= 8 + size else None
        if not isinstance(header, dict):
            raise ValueError(f"a header of {size} bytes does not fit in a file of {len(data)}")
        metadata = dict(header.get("__metadata__") or {})
        check_metadata(metadata, method, expect)  # before decoding any tensor
        tensors = safetensors.torch.load(data)
    except BlockMismatch:
        raise
    except (ValueError, safetensors.SafetensorError) as err:  # a bad header or tensor table
        raise BlockMismatch(f"{path} is not a readable safetensors file: {err}") from err
    if metadata.get(CHECKSUM) != checksum(tensors, metadata):
        raise BlockMismatch(f"{path} is damaged (its {CHECKSUM} checksum does not match its contents): recompute the chunk")
    out = decode_kv(tensors, metadata, method, expect, ropes)
    with contextlib.suppress(OSError):  # another process may have evicted it meanwhile; the K/V are read
        os.utime(path)
    return out


def evict(directory: str | os.PathLike, max_bytes: int, pattern: str = "*.safetensors") -> list[Path]:
    """Remove the least recently used chunk files (`pattern`, oldest modification time first) until those left in
    `directory` take at most `max_bytes`, and writers' temporaries older than `STALE_TEMPORARY_SECONDS`; returns what
    was removed. Safe beside readers and writers: a reader of a removed file gets `FileNotFoundError` (a miss)."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    directory, removed = Path(directory), []
    now = time.time()
    for tmp in directory.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                tmp.unlink()
                removed.append(tmp)
    files = []
    for f in directory.glob(pattern):
        with contextlib.suppress(OSError):  # removed meanwhile
            st = f.stat()
            files.append((st.st_mtime, f.name, st.st_size, f))
    total = sum(size for _, _, size, _ in files)
    for _, _, size, f in sorted(files):
        if total <= max_bytes:
            break
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
            removed.append(f)
        total -= size
    return removed
