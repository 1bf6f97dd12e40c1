"""The codec interface: a block of vectors in, a packed dataclass of tensors out, and back.

A codec compresses `x: (batch, kv_heads, tokens, head_dim)`. Every tensor field of its packed
dataclass carries the token axis at dim 2, so blocks concatenate along tokens and the cache can
append to a segment without knowing the layout. Compressed-domain `scores`/`weighted_sum`
default to decode-then-matmul, so a new codec works before it is fast.

Torch attention paths read a segment in token chunks (`chunk_tokens`, `chunked_scores`,
`chunked_sum`), so the largest temporary they hold is bounded by `CHUNK_ELEMENTS`, never by the
segment's length; a segment of one chunk (every decode-time block) is passed whole, unsliced.
Codec state (rotations, codebooks, bases) stays where it was made and is copied to another device
once (`Codec._on`), not on every call.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch

from ..primitives.validation import check_finite, check_kv, check_query, checks_values

# Entries of the largest temporary a torch `scores` / `weighted_sum` holds (16 MiB of float32): a
# decode step over 32K tokens would otherwise rebuild K (or V) in float, 32K x heads x head_dim.
CHUNK_ELEMENTS = 1 << 22

FP16_MAX = torch.finfo(torch.float16).max
# The largest |entry| of keys/values any codec compresses. Codecs square and sum in float32 (norms, variances,
# k-means distances, over up to 1024 channels); below 1e16 per entry those sums stay finite (1e32 x 1024 < 3.4e38).
# A model's activations never come near it; beyond it a cache refuses the update before storing anything.
MAX_ENTRY = 1e16


def storable(x: torch.Tensor) -> torch.Tensor:
    """`x` (per-token norms or scales) in float16 when every entry fits, the layout the codecs' byte counts and
    fused kernels assume; else in float32 (2 more bytes each, for that block only). A key of 1e4 per entry at
    d = 64 has norm 8e4, which float16 would store as inf and decode to NaN. Checked where values are read
    (`checks_values`: CPU, or any device with KVPACK_DEBUG=1), since the check reads a maximum back to the host."""
    if not x.numel() or not checks_values(x) or float(x.abs().amax()) <= FP16_MAX:
        return x.half()
    return x.float()


@dataclasses.dataclass
class Packed:
    """Base of every codec's packed block. Subclasses add tensor fields with tokens at dim 2."""

    num_tokens: int

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in (getattr(self, f.name) for f in dataclasses.fields(self)) if isinstance(v, torch.Tensor)]

    def nbytes(self) -> int:
        """Real bytes held by this block's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map_tensors(self, fn) -> Packed:
        """A copy with `fn` applied to every tensor field (e.g. batch selection, device moves)."""
        changes = {f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **changes)


def concat_packed(blocks: list[Packed]) -> Packed:
    """Concatenate blocks of one codec along tokens (dim 2 of every tensor field)."""
    if len(blocks) == 1:
        return blocks[0]
    first = blocks[0]
    changes: dict[str, Any] = {"num_tokens": sum(b.num_tokens for b in blocks)}
    for f in dataclasses.fields(first):
        if isinstance(getattr(first, f.name), torch.Tensor):
            changes[f.name] = torch.cat([getattr(b, f.name) for b in blocks], dim=2)
    return dataclasses.replace(first, **changes)


def slice_packed(packed: Packed, start: int, stop: int) -> Packed:
    """Tokens [start, stop) of a packed block (for `crop`)."""
    changes: dict[str, Any] = {"num_tokens": stop - start}
    for f in dataclasses.fields(packed):
        value = getattr(packed, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value[:, :, start:stop]
    return dataclasses.replace(packed, **changes)


def gather_packed(packed: Packed, index: torch.Tensor) -> Packed:
    """Tokens `index (n,)` (long, any order) of a packed block of a per-token codec (`token_multiple == 1`), copied."""
    changes: dict[str, Any] = {"num_tokens": int(index.numel())}
    for f in dataclasses.fields(packed):
        value = getattr(packed, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.index_select(2, index.to(value.device))
    return dataclasses.replace(packed, **changes)


def check_state(
    name: str, state: dict[str, torch.Tensor], expected: dict[str, tuple[tuple[int | None, ...], torch.dtype]], together: bool = True
) -> None:
    """Refuse a `load_state_dict` input that is not what this codec's `fit` would have produced.

    expected: key -> (shape with None for a dimension fit chooses, e.g. PCA's rank; dtype).
    together: the keys are fitted together, so the state holds all of them or none (an unfitted codec).
    """
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ValueError(f"codec {name!r} has no fitted state {unknown}; its state keys are {sorted(expected)}")
    missing = sorted(set(expected) - set(state))
    if together and state and missing:
        raise ValueError(f"codec {name!r} state is incomplete: missing {missing} (fit sets {sorted(expected)} together)")
    for key, value in state.items():
        shape, dtype = expected[key]
        ok = isinstance(value, torch.Tensor) and value.dtype == dtype and value.dim() == len(shape)
        if not ok or any(want is not None and got != want for got, want in zip(value.shape, shape, strict=True)):
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"codec {name!r} state {key!r} must be a {dtype} tensor of shape {want}, got {got}")


def group_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(batch, q_heads, q_len, d)` -> `(batch, kv_heads, group * q_len, d)` without copying K/V.

    Query head h reads kv head h // group, the convention of transformers' `repeat_kv`.
    """
    b, hq, lq, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * lq, d)


def ungroup(out: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Inverse of `group_query` on a result `(batch, kv_heads, group * q_len, n)`."""
    b, _, rows, n = out.shape
    return out.reshape(b, q_heads, rows * out.shape[1] // q_heads, n)


def chunk_tokens(like: torch.Tensor, width: int, multiple: int = 1, limit: int | None = None) -> int:
    """Tokens per chunk that keep a temporary of `width` entries per (batch row, kv head, token) within `limit`
    (default `CHUNK_ELEMENTS`); `like (batch, kv_heads, ·, ·)` gives the batch and heads. Rounded down to a
    multiple of `multiple` (blocks that slice only at token groups, e.g. KIVI's per-channel keys)."""
    step = (limit or CHUNK_ELEMENTS) // max(1, like.shape[0] * like.shape[1] * width)
    return max(multiple, step - step % multiple)


def chunked_scores(
    part: Callable[[Packed, int, int], torch.Tensor], packed: Packed, like: torch.Tensor, width: int, multiple: int = 1, limit: int | None = None
) -> torch.Tensor:
    """`(b, kv, rows, tokens)` from `part(block, start, stop) -> (b, kv, rows, stop - start)` over chunks of
    `chunk_tokens(like, width, multiple, limit)` tokens, written into one result (no pieces to concatenate);
    `like (b, kv, rows, ·)` gives its leading shape, dtype and device. One chunk is passed whole, unsliced."""
    tokens = packed.num_tokens
    if tokens * like.shape[0] * like.shape[1] * width <= (limit or CHUNK_ELEMENTS):  # one chunk: short blocks pay one product
        return part(packed, 0, tokens)
    step = chunk_tokens(like, width, multiple, limit)
    out = like.new_empty(*like.shape[:3], tokens)
    for start in range(0, tokens, step):
        stop = min(start + step, tokens)
        out[..., start:stop] = part(slice_packed(packed, start, stop), start, stop)
    return out


def chunked_sum(
    part: Callable[[torch.Tensor, Packed], torch.Tensor], probs: torch.Tensor, packed: Packed, width: int, multiple: int = 1, limit: int | None = None
) -> torch.Tensor:
    """Σ over chunks of `part(probs[..., chunk], block)`, a fresh `(b, kv, rows, n)` partial sum, with chunks as
    in `chunked_scores`; `probs (b, kv, rows, tokens)` is sliced only when there is more than one chunk."""
    tokens = packed.num_tokens
    if tokens * probs.shape[0] * probs.shape[1] * width <= (limit or CHUNK_ELEMENTS):
        return part(probs, packed)
    step = chunk_tokens(probs, width, multiple, limit)
    acc = part(probs[..., :step], slice_packed(packed, 0, step))
    for start in range(step, tokens, step):
        stop = min(start + step, tokens)
        acc += part(probs[..., start:stop], slice_packed(packed, start, stop))
    return acc


class ByteBudget(NamedTuple):
    """What a `fits_to_budget` codec may hold for `tokens` tokens: `allowed` bytes, after the rest of the layer took
    its part, of which `fixed` went to parts that do not grow with the prompt (exact sinks and window, codec state)
    and which includes `carry`, what other layers left (or owe). When nothing fits but `allowed - carry + fixed`
    would, the prompt is too short for the target, not the codec too large."""

    allowed: int
    tokens: int
    fixed: int = 0
    carry: int = 0


class Codec(ABC):
    """One compression scheme for one layer's keys or values.

    Subclasses set `name`, implement `encode`/`decode`, and may override `scores`/`weighted_sum`
    with compressed-domain versions and `fit` for data-dependent state.
    """

    name: ClassVar[str]
    # The form a fused attention kernel can read ("tq", "int8", ...; a key of the kernel table, kvpack.kernels.table), or None:
    # then attention goes through `scores` / `weighted_sum`.
    config_class: ClassVar[type]  # the frozen dataclass of its options (CodecSpec builds and validates it)
    kernel_kind: ClassVar[str | None] = None
    # Codecs that store keys without RoPE (Shard's PCA) or center them on a mean RoPE turns (TurboQuant's
    # `rope_center`) need token positions and the model's rotary frequencies; the cache passes positions and
    # calls `set_rope` when this is True (per instance where a config decides: `needs_positions`).
    uses_positions: ClassVar[bool] = False
    # Codecs whose `fit` can use a sample of the prompt's queries (`fit(x, positions, queries=...)`):
    # the cache passes the last prompt queries it saw under kvpack attention, None otherwise.
    fits_on_queries: ClassVar[bool] = False
    # Codecs whose `fit` can size themselves to a byte allowance (`fit(x, positions, byte_budget=ByteBudget(...))`,
    # Shard's VQ choosing its codebook): the cache passes what a method's `prompt_ratio` leaves them.
    fits_to_budget: ClassVar[bool] = False

    @classmethod
    def needs_positions(cls, config: Any) -> bool:
        """Whether a codec built from `config` reads token positions and the model's rotary embedding (`uses_positions`,
        known before building: a cache refuses a model whose rotary table it cannot read up front)."""
        return cls.uses_positions

    @classmethod
    def max_entry(cls, config: Any, head_dim: int) -> float:
        """The largest |entry| of keys/values a codec built from `config` stores as finite numbers: MAX_ENTRY where
        per-token norms and scales widen past float16 (`storable`); lower where float16 fields or fitted state hold
        the entries' own scale. A cache refuses new tokens beyond its codecs' bound before storing them: decode tokens
        reach a codec only when the window flushes them, dozens of steps later, when nothing can be refused."""
        return MAX_ENTRY

    @property
    def token_multiple(self) -> int:
        """Token counts `encode` accepts must be multiples of this (1: any count, per-token codecs)."""
        return 1

    def __init__(self, config: Any, head_dim: int, kv_heads: int, layer_idx: int = 0):
        self.config = config
        self.head_dim = head_dim
        self.kv_heads = kv_heads
        self.layer_idx = layer_idx

    # -- required ------------------------------------------------------------------------------
    @abstractmethod
    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Packed:
        """Compress `x: (batch, kv_heads, tokens, head_dim)`; `positions: (batch, tokens)` long."""

    @abstractmethod
    def decode(self, packed: Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        """float32 reconstruction `(batch, kv_heads, tokens, head_dim)` (RoPE re-applied if undone)."""

    # -- optional ------------------------------------------------------------------------------
    def set_rope(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        """Rotary parameters of this layer (`inv_freq: (head_dim // 2,)`), for `uses_positions` codecs."""
        return None

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Learn data-dependent state from `x: (batch, kv_heads, tokens, head_dim)`; default none."""
        return None

    @property
    def learns(self) -> bool:
        """Whether `fit` learns state from the data (a codec that overrides it, unless its config turns learning off):
        a cache gives each batch row its own such codec (`codecs.rows.RowsCodec`)."""
        return type(self).fit is not Codec.fit

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Fitted, data-dependent state (PCA bases, codebooks, channel statistics), for saving a cache.

        Only what `fit` (or a first encode) learned from data; state regenerated from the config and
        seed (rotations, sketches) is left out. Default: none.
        """
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned (tensors on any device; the codec moves them)."""
        if state:
            raise ValueError(f"codec {self.name!r} keeps no fitted state, got {sorted(state)}")

    def state_nbytes(self) -> int:
        """Bytes of tensors the codec itself holds (bases, codebooks, rotations), including derived
        forms cached for kernels (`_kernel_cache`): memory actually held, each tensor counted once."""
        seen: dict[int, int] = {}
        stack = list(vars(self).values())
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                seen[id(item)] = item.numel() * item.element_size()
            elif isinstance(item, (tuple, list)):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
        return sum(seen.values())

    def nbytes(self, packed: Packed) -> int:
        return packed.nbytes()

    def scores(
        self,
        query: torch.Tensor,
        packed: Packed,
        query_positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Raw inner products <q, k>: `query (batch, q_heads, q_len, d)` -> `(batch, q_heads, q_len, tokens)`.

        Positions `(batch, q_len)` / `(batch, tokens)` matter only to `uses_positions` codecs. Keys are
        decoded one chunk of tokens at a time.
        """
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)

        def part(block: Packed, start: int, stop: int) -> torch.Tensor:
            pos = key_positions if key_positions is None or block is packed else key_positions[:, start:stop]
            return q @ self.decode(block, pos).transpose(-1, -2)

        return ungroup(chunked_scores(part, packed, q, self._width(q.shape[2])), query.shape[1])

    def weighted_sum(self, probs: torch.Tensor, packed: Packed) -> torch.Tensor:
        """`probs (batch, q_heads, q_len, tokens)` @ V -> `(batch, q_heads, q_len, head_dim)`, V decoded by chunks."""
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        out = chunked_sum(lambda pc, block: pc @ self.decode(block), p, packed, self._width(p.shape[2]))
        return ungroup(out, probs.shape[1])

    # -- helpers -------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        """What `fit` / `encode` accept: structure always, NaN/Inf where `checks_values` (see validation.py)."""
        check_kv(x, self.head_dim)
        if x.shape[1] != self.kv_heads:
            raise ValueError(f"x has {x.shape[1]} kv heads but this codec was built for {self.kv_heads}")
        check_finite(x)

    def _width(self, rows: int) -> int:
        """Entries per (batch row, kv head, token) of the largest temporary in the torch `scores` /
        `weighted_sum` with `rows` grouped query rows: a decoded vector or a `(rows, tokens)` product."""
        return max(self.head_dim, rows)

    def _on(self, key: str, state: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Codec state `state` (named `key`) on `device`, copied there on first use and reused while `state` is
        still the codec's tensor: a decode step on an accelerator makes no host-to-device copies. A refit or
        `load_state_dict` assigns new tensors, which the identity check sees, so no copy goes stale."""
        if state.device == device:
            return state
        copies = self.__dict__.setdefault("_device_copies", {})
        hit = copies.get((key, device))
        if hit is None or hit[0] is not state:
            hit = copies[(key, device)] = (state, state.to(device))
        return hit[1]
