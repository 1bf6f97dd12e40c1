"""One model layer's compressed cache: `[sinks][compressed segments ...][recent window]`.

New tokens land in the exact window. Once attention has read them (or at once, without
`kvpack.enable`), tokens beyond the window are encoded by the method's codecs: the prompt leaves
exactly `window` exact tokens and its middle goes to the prefill codecs (Shard: PCA/VQ); later
tokens leave in whole blocks for the stream codecs, appended to one growing stream segment.
"""

from __future__ import annotations

import copy
import math
import threading
import warnings

import torch
from transformers.cache_utils import CacheLayerMixin

from ..codecs.base import FP16_MAX, ByteBudget, Codec, Packed, slice_packed
from ..codecs.rows import RowsCodec
from ..primitives.validation import abs_max, checks_values
from ..registry import EXACT_DTYPES, CodecSpec, MethodConfig
from .anchors import AnchorSet
from .blocks import BlockRun
from .budget import check_share
from .placement import Placement
from .policies import DEFAULT_PLACEMENT

# The layer whose update kvpack attention must read next, per thread: if the model's attention finds
# no layer tag on its keys (code between update and attention rebuilt the tensor), it can tell that
# attention would silently run over the new tokens only, and refuse.
PENDING = threading.local()

_DEQUANTIZE_WARNED = threading.Event()  # once per process: the advice is the same for every cache and layer


def _warn_dequantizing(layer_idx: int) -> None:
    """Say once that an update is widening compressed segments to float because kvpack attention is off."""
    if _DEQUANTIZE_WARNED.is_set():
        return
    _DEQUANTIZE_WARNED.set()
    warnings.warn(
        f"kvpack attention is not enabled for this model, so each forward dequantizes the compressed cache to float (layer "
        f"{layer_idx} first): the same numbers, but slower than an uncompressed cache. Call kvpack.enable(model) once "
        "before generate() to compute attention on the compressed segments.",
        RuntimeWarning,
        stacklevel=4,
    )


# Prompt queries kept for a codec fit that measures attention scores: 128 rows x all heads is a
# few hundred KB at most, and enough to rank a basis (docs/notes/shard.md).
FIT_QUERIES = 128
# Chunks `tier_queries` holds before they are folded into one: each decode step adds a one-row chunk, and walking
# 128 of them on every step cost ~70 us a layer (2 ms a step on SmolLM2's 30 layers).
TIER_QUERY_CHUNKS = 16
# A sliding-window layer drops the tokens that left its window once they are this share of the window (1/16: 32 of
# Gemma-3's 512) rather than every step: a drop swaps in a copy of the segment less its front (a snapshot may hold
# the old one), ~0.12 ms a layer a step, and the tokens held past the window until then are left out of every read
# (`hidden_front`), so the layer holds at most a 16th more than its window.
SLIDE_SLACK_DIVISOR = 16


def deepcopy_sharing(obj, memo: dict, *shared) -> object:
    """Deep copy of `obj` that keeps references to `shared` objects (the model's config, whose attention
    switch the copy must keep following) instead of cloning them."""
    for item in shared:
        memo[id(item)] = item
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    for key, value in obj.__dict__.items():
        setattr(new, key, copy.deepcopy(value, memo))
    return new


def check_new_states(k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> float | None:
    """Reject what a cache must not store, before anything is stored. Returns the largest |entry| of `k` and `v`
    where their values are read (`checks_values`), else None, for the float16 range check of the exact parts."""
    for name, t in (("key_states", k), ("value_states", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point (float16/bfloat16/float32 activations), got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, kv_heads, tokens, head_dim), got {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"key and value states disagree on (batch, kv_heads, tokens): {tuple(k.shape)} vs {tuple(v.shape)}")
    # NaN/Inf are refused here, once per update and layer (one pass over the new tokens only): always on CPU,
    # on an accelerator (a host sync per layer) only with KVPACK_DEBUG=1; see primitives/validation.py.
    if not checks_values(k):
        return None
    peaks = abs_max(k), abs_max(v)
    if not all(math.isfinite(p) for p in peaks):
        raise ValueError(
            f"layer {layer_idx}: the new key/value states contain NaN or Inf, so nothing was stored (the cache is unchanged). "
            "The model produced them: check its inputs and dtype (float16 activations can overflow; try bfloat16 or float32)."
        )
    return max(peaks)


class Segment:
    """Compressed tokens [start, start + length) of the logical sequence: one codec pair's block runs."""

    def __init__(self, kind: str, key_codec: Codec, value_codec: Codec, keys: Packed, values: Packed, start: int):
        self.kind = kind  # "prefill" | "stream" | "tier1", "tier2", ... (older tiers, see MethodConfig.tiers)
        self.key_codec, self.value_codec = key_codec, value_codec
        self.key_run, self.value_run = BlockRun(keys), BlockRun(values)
        self.start = start

    @property
    def keys(self) -> Packed:
        return self.key_run.view()

    @property
    def values(self) -> Packed:
        return self.value_run.view()

    @property
    def length(self) -> int:
        return self.key_run.length

    @property
    def token_multiple(self) -> int:
        return math.lcm(self.key_codec.token_multiple, self.value_codec.token_multiple)

    def append(self, keys: Packed, values: Packed) -> None:
        self.key_run.append(keys)
        self.value_run.append(values)

    def truncate(self, length: int) -> None:
        self.key_run.truncate(length)
        self.value_run.truncate(length)

    def tail(self, n: int) -> Segment:
        """A new segment of all but the first `n` tokens (they went to an older tier, or were evicted); this one is unchanged."""
        seg = copy.copy(self)
        seg.key_run, seg.value_run = self.key_run.tail(n), self.value_run.tail(n)
        seg.start = self.start + n
        return seg

    def map(self, fn) -> None:
        self.key_run.map(fn)
        self.value_run.map(fn)

    def compact(self) -> int:
        """Free both runs' spare capacity; returns the bytes freed."""
        return self.key_run.compact() + self.value_run.compact()

    def nbytes(self) -> int:
        return self.key_run.nbytes() + self.value_run.nbytes()


class KVPackLayer(CacheLayerMixin):
    """A transformers cache layer holding segments; see the module docstring."""

    is_sliding = False
    is_croppable = True
    tracker = None  # a kvpack.cache.tracker.QualityTracker, set by KVCache.track; told of every flushed block
    budget = None  # a kvpack.cache.budget.LayerShare, set by KVCache.set_budget: bytes this layer may hold after a forward
    prompt_target = None  # a kvpack.cache.budget.PromptTarget, set by KVCache for a method with a prompt_ratio
    hold_prompt = False  # True from a `fisher_tail` cache's start until its prompt's widths are placed: flush keeps all
    # A sliding-window layer's window (set by KVCache for `MethodConfig.sliding`): every token no later query can reach
    # (older than the newest `sliding_window - 1`) is dropped after a forward, a few at a time (`SLIDE_SLACK_DIVISOR`;
    # attention leaves out the ones still held, `hidden_front`). Without kvpack's attention the model's
    # own attention reads `dequantized()`, whose dropped positions are zeros its sliding-window mask never attends.
    sliding_window: int | None = None
    # Where blocks go, when they move, what stays exact and what a budget evicts (kvpack.cache.placement); KVCache sets
    # another for `KVCache(..., placement=...)`.
    placement: Placement = DEFAULT_PLACEMENT

    def __init__(self, method: MethodConfig, layer_idx: int, model_config=None, rope: tuple[torch.Tensor, float] | None = None):
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.model_config = model_config
        self.rope = rope
        self._reset_state()

    def _reset_state(self) -> None:
        self.length = 0
        self.sink_k = self.sink_v = None
        self.win_k = self.win_v = None
        self.segments: list[Segment] = []
        self.pos_offset: torch.Tensor | None = None  # (batch,) position of logical token 0
        # (batch,) left-padding tokens of each row (from the attention mask), or None: pads never
        # leave the exact sink region, so fits, statistics and sinks see real tokens only.
        self.pad: torch.Tensor | None = None
        self.pad_max = 0
        self.updates = 0
        self._codecs: dict[str, Codec] = {}
        self.pending_attention = False  # set by update, cleared when kvpack attention reads the layer
        # The last prompt queries kvpack attention saw, kept until the prompt's codecs are fitted
        # (codecs with `fits_on_queries`, e.g. Shard's PCA choosing its rank by score error).
        self.fit_queries: torch.Tensor | None = None
        self.fit_scaling: float | None = None  # the attention scale those queries were read with
        # The last `FIT_QUERIES` query rows of any forward, as the chunks they came in (never written in place, so a
        # snapshot stays valid), kept only for a method whose older tiers fit on queries: an archive codec fitted
        # long after the prompt ranks its basis by the queries reading the cache then (`store`).
        self.tier_queries: tuple[torch.Tensor, ...] = ()
        self.anchors: AnchorSet | None = None  # compressed tokens kept exact beside their codes (MethodConfig.anchors)
        self.anchor_credit = 0.0  # anchors owed to the blocks flushed since the prompt (a fraction of a token carries over)
        # (start, tokens, segment kind) of compressed tokens evicted to keep a memory budget (kvpack.cache.budget)
        self.evicted: tuple[tuple[int, int, str], ...] = ()
        # Logical tokens [0, dropped) a sliding-window layer no longer holds (they left its window); every later one is held.
        self.dropped = 0
        # segment kind -> (key, value) relative squared error of its current codecs on the first run they coded after
        # their fit: the reference a tier's refit compares later runs with (kvpack.cache.tiers); replaced, never mutated
        self.tier_fit: dict[str, tuple[float, float]] = {}
        self.is_initialized = False

    @property
    def sink_target(self) -> int:
        """Exact leading tokens: the method's sinks after the longest row's left padding."""
        return self.method.sink_tokens + self.pad_max

    def set_padding(self, pad: torch.Tensor | None) -> None:
        """Left-padding lengths `pad: (batch,)` of the rows, from the attention mask of the first forward.

        The exact sink region grows to cover every row's padding plus its own first sink tokens, so no
        pad token reaches a codec (fits, channel statistics, KIVI groups) and each row keeps its real sinks.
        Positions of logical tokens shift by each row's padding, as the model's own `position_ids` do.
        """
        if self.length:
            raise RuntimeError(f"layer {self.layer_idx} already holds tokens; padding is set before the first update")
        has_pad = pad is not None and bool((pad > 0).any())
        self.pad = pad.to(torch.long) if has_pad else None
        self.pad_max = int(pad.max()) if has_pad else 0
        self.pos_offset = -self.pad if has_pad else None

    def snapshot(self) -> dict:
        """What `restore` needs to undo the next update and its flush: references and offsets, no tensor copies.

        Updates never write in place into what a snapshot references: sinks and window are rebuilt by
        `torch.cat`, block runs only write past their live length, and codecs are created (and fitted)
        when first used, so dropping the ones created since restores the fitted state.
        """
        state = dict(vars(self))
        state["segments"] = list(self.segments)
        state["_codecs"] = dict(self._codecs)
        state["_runs"] = [(run, run.length, list(run.blocks)) for seg in self.segments for run in (seg.key_run, seg.value_run)]
        return state

    def restore(self, state: dict) -> None:
        """Return to a `snapshot`: the tokens, segments and fitted codecs it saw, bit for bit."""
        state = dict(state)
        for run, length, blocks in state.pop("_runs"):
            run.length, run.blocks = length, blocks
        vars(self).clear()
        vars(self).update(state)

    def __deepcopy__(self, memo: dict) -> KVPackLayer:
        return deepcopy_sharing(self, memo, self.model_config)

    # -- transformers layer API ----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.kv_heads, _, self.head_dim = key_states.shape
        self.v_head_dim = value_states.shape[-1]
        self.exact_dtype = EXACT_DTYPES[self.method.exact_dtype] or self.dtype
        empty_k = key_states[:, :, :0].to(self.exact_dtype)
        empty_v = value_states[:, :, :0].to(self.exact_dtype)
        self.sink_k, self.sink_v, self.win_k, self.win_v = empty_k, empty_v, empty_k, empty_v
        self.is_initialized = True

    # transformers' layer API exposes `keys`/`values`; a kvpack layer holds no such tensors, so reading
    # them decodes every segment (costly, for inspection; kvpack attention reads the segments directly).
    @property
    def keys(self) -> torch.Tensor | None:
        """All cached keys `(batch, kv_heads, length, head_dim)`, dequantized in the model dtype: decodes every segment."""
        return self._dequantized("key") if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """All cached values `(batch, kv_heads, length, v_head_dim)`, dequantized: decodes every segment."""
        return self._dequantized("value") if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment("values", value)

    def _refuse_assignment(self, name: str, value) -> None:
        if value is not None:  # transformers' CacheLayerMixin.__init__ assigns None
            raise AttributeError(f"KVPackLayer.{name} is a read-only dequantized view; use update(), crop() or reset() to change the cache")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens; return dequantized K/V, or handles when kvpack attention is enabled.

        Everything is checked before anything is stored: a rejected update leaves the layer as it was.
        """
        peak = check_new_states(key_states, value_states, self.layer_idx)
        if self.budget is not None:
            self._check_budget(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_new(key_states, value_states)
        if self.pending_attention:
            raise RuntimeError(
                f"kvpack attention never read layer {self.layer_idx}'s previous update: the model ran another attention "
                "implementation while this cache expected kvpack's (was kvpack.disable() or set_attn_implementation called "
                "mid-generation?). Use a fresh cache, and keep kvpack.enable(model) on for its whole life."
            )
        if self.exact_dtype == torch.float16 and key_states.dtype != torch.float16:
            self._check_fits_fp16(peak)
        self._check_codecs_hold(peak)
        key_states, value_states = key_states.to(self.exact_dtype), value_states.to(self.exact_dtype)
        # By length, not by the sinks held: a sliding layer drops its sinks once they leave the window, for good.
        n_sink = min(max(self.sink_target - self.length, 0), key_states.shape[2])
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :n_sink]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :n_sink]], dim=2)
        self.win_k = torch.cat([self.win_k, key_states[:, :, n_sink:]], dim=2)
        self.win_v = torch.cat([self.win_v, value_states[:, :, n_sink:]], dim=2)
        self.length += key_states.shape[2]
        self.updates += 1
        if self._attention_enabled():
            key_states._kvpack_layer = self  # the registered attention reads segments from here
            self.pending_attention = True
            PENDING.layer = self
            return key_states, value_states
        if self.segments:
            _warn_dequantizing(self.layer_idx)
        keys, values = self.dequantized()
        self.flush()
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._reset_state()

    def offload(self) -> None:
        """Move the layer's tensors to the CPU (transformers' cache offloading)."""
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        """Move an offloaded layer back to its device ahead of use."""
        if self.is_initialized and self.sink_k.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices, dtype=torch.long)  # a tuple (0, 2) selects rows, as DynamicLayer reads it
        self._map_batch(lambda t: t.index_select(0, indices.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens, as `DynamicLayer.crop` does (all of them if more are asked).

        Compressed tokens before the cut stay bit-identical: block runs are truncated, never decoded
        and re-encoded. Only a codec whose blocks cannot be cut at any token (KIVI's per-channel key
        groups) decodes the kept part of the cut group back into the exact window.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative count of tokens to remove (transformers 5 semantics), got {tokens_to_remove}; "
                f"to keep the first N tokens call crop(N - cache.get_seq_length())"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.truncate(max(self.length + tokens_to_remove, 0))

    def truncate(self, keep: int) -> None:
        """Keep the first `keep` logical tokens."""
        if keep >= self.length:
            return
        if keep == 0:
            self._reset_state()
            return
        if self.dropped:
            # The next query after a cut to `keep` reaches back to keep - window + 1, before what the layer still holds.
            raise ValueError(
                f"layer {self.layer_idx} is a sliding-window layer that dropped its first {self.dropped} tokens as they left its "
                f"window, so cropping it to {keep} tokens would leave the next query without the window before it (as "
                "transformers' own sliding layers refuse once full); crop before the window fills, or use a method with "
                "'@sliding=exact'"
            )
        win_start = self.length - self.win_k.shape[2]
        if keep >= win_start:
            self.win_k, self.win_v = self.win_k[:, :, : keep - win_start], self.win_v[:, :, : keep - win_start]
        else:
            self.win_k, self.win_v = self.win_k[:, :, :0], self.win_v[:, :, :0]
            while self.segments and self.segments[-1].start >= keep:
                self.segments.pop()
            if self.segments and self.segments[-1].start + self.segments[-1].length > keep:
                self._cut_last_segment(keep - self.segments[-1].start)
            n_sink = min(keep, self.sink_k.shape[2])
            self.sink_k, self.sink_v = self.sink_k[:, :, :n_sink], self.sink_v[:, :, :n_sink]
            self.evicted = tuple((s, min(n, keep - s), kind) for s, n, kind in self.evicted if s < keep)
        if self.anchors is not None:
            self.anchors = self.anchors.truncate(keep)
        self.length = keep

    def _cut_last_segment(self, cut: int) -> None:
        """Keep the first `cut` tokens of the last segment: whole groups stay packed, a partial group's kept tokens move to the window."""
        seg = self.segments[-1]
        aligned = cut // seg.token_multiple * seg.token_multiple
        if aligned < cut:
            stop = min(aligned + seg.token_multiple, seg.length)
            pos = self.positions(seg.start + aligned, stop - aligned)
            k = seg.key_codec.decode(slice_packed(seg.keys, aligned, stop), pos)[:, :, : cut - aligned]
            v = seg.value_codec.decode(slice_packed(seg.values, aligned, stop), pos)[:, :, : cut - aligned]
            self.win_k, self.win_v = k.to(self.exact_dtype), v.to(self.exact_dtype)
        if aligned:
            seg.truncate(aligned)
        else:
            self.segments.pop()

    # -- compression ---------------------------------------------------------------------------
    def observe_queries(self, query: torch.Tensor, scaling: float | None = None) -> None:
        """Keep the last `FIT_QUERIES` real query rows `(batch, q_heads, m, d)` seen while nothing is fitted yet,
        for codecs that fit on queries and to choose anchors (`scaling`: the attention scale they are read with).

        Rows accumulate over forwards, so a short prompt followed by decode steps still fits on many queries.
        Once the prompt is compressed, only anchors read queries: this forward's rows, held until its flush
        chooses the anchors among the tokens it compresses (a decode step's one row; a chunk's many).
        A method whose older tiers fit on queries also keeps the latest rows of every forward (`tier_queries`).
        """
        real = query.shape[2] - (self.pad_max if self.updates == 1 else 0)  # left padding leads the first forward
        if real > 0 and self._tiers_fit_on_queries():
            # A copy, not a view: a view of a long prompt's last rows would keep its whole query tensor alive.
            chunks = [*self.tier_queries, query[:, :, -min(real, FIT_QUERIES) :].detach().to(torch.float32, copy=True)]
            held = sum(chunk.shape[2] for chunk in chunks)
            while held - chunks[0].shape[2] >= FIT_QUERIES:  # drop the oldest chunks the latest rows do not need
                held -= chunks.pop(0).shape[2]
            if len(chunks) > TIER_QUERY_CHUNKS:  # decode steps add one row each: fold them, so a step walks a few chunks
                chunks = [torch.cat(chunks, dim=2)[:, :, -FIT_QUERIES:]]
            self.tier_queries = tuple(chunks)
        if self.segments:
            # A decode step that flushes nothing skips this (no per-step copy).
            if self.method.anchors and self.win_k.shape[2] - self.method.window >= self.method.block_size:
                self.fit_scaling = scaling
                self.fit_queries = query[:, :, -FIT_QUERIES:].detach().float()
            return
        if not (self._fits_on_queries() or self.method.anchors):
            return
        self.fit_scaling = scaling
        rows = query[:, :, query.shape[2] - max(real, 0) :].detach().float()
        if self.fit_queries is not None:
            rows = torch.cat([self.fit_queries, rows], dim=2)
        self.fit_queries = rows[:, :, -FIT_QUERIES:] if rows.shape[2] else None

    def _tiers_fit_on_queries(self) -> bool:
        """Whether a codec of one of the method's older tiers uses queries in its fit."""
        return any(self.codec(f"tier{level}", side).fits_on_queries for level in range(1, len(self.method.tiers) + 1) for side in ("key", "value"))

    def _fits_on_queries(self) -> bool:
        """Whether a prompt codec of this method uses queries in its fit (only then are they kept)."""
        return self.method.prefill_key is not None and any(self.codec("prefill", side).fits_on_queries for side in ("key", "value"))

    def flush(self) -> None:
        """Compress what overflows the window (called after attention read it), then keep the memory budget."""
        self.pending_attention = False
        if self.hold_prompt:  # the prompt stays exact until the cache has placed its key widths (prompt_widths.place)
            return
        if self.sliding_window is not None:  # before encoding: what leaves the window is never coded
            self._slide()
        flushed = self._flush_blocks()
        if self.segments:  # after the prompt, a forward's queries serve only its own flush
            self.fit_queries = None
        self.placement.after_flush(self, flushed)  # every forward, flush or not: the window grows between flushes

    def _flush_blocks(self) -> bool:
        """The prompt, then whole blocks, from the window into compressed segments."""
        overflow = self.win_k.shape[2] - self.method.window
        first = self.updates == 1 and not self.segments
        prefill = first and self.method.prefill_key is not None
        kind = "prefill" if prefill else "stream"
        kc, vc = self.codec(kind, "key"), self.codec(kind, "value")
        # The prompt leaves exactly `window` exact tokens behind (up to the codecs' token multiple,
        # e.g. KIVI's per-channel groups); later tokens leave in whole blocks, so that appending to
        # a segment (a copy) happens once per block rather than once per decoded token.
        step = math.lcm(kc.token_multiple, vc.token_multiple) if first else self.method.block_size
        n = overflow // step * step
        if n <= 0 or (not self.segments and n < self.method.block_size):
            # The first encode fits data-dependent codecs (channel statistics, PCA, codebooks): it waits
            # for at least a block of tokens, since statistics of one or a few tokens are degenerate.
            return False
        k, v = self.win_k[:, :, :n], self.win_v[:, :, :n]
        start = self.length - self.win_k.shape[2]
        chosen = self.placement.keep_exact(self, start, n, first)
        sized = prefill and bool(self.method.prompt_ratio) and vc.fits_to_budget  # values fit to the prompt's byte target
        if prefill:
            positions = self.positions(start, n)
            kc.fit(k, positions, **({"queries": self.fit_queries} if kc.fits_on_queries else {}))
            allowance = {"byte_budget": self._value_allowance(kc, k, positions, 0 if chosen is None else len(chosen))} if sized else {}
            vc.fit(v, positions, **({"queries": self.fit_queries} if vc.fits_on_queries else {}), **allowance)
        done = 0
        for where, m in self.placement.route(self, kind, start, n):
            self.store(where, k[:, :, done : done + m], v[:, :, done : done + m], start + done)
            done += m
        if chosen is not None:
            self._add_anchors(start + chosen, k.index_select(2, chosen), v.index_select(2, chosen))
        self.fit_queries = None
        self.win_k, self.win_v = self.win_k[:, :, n:].contiguous(), self.win_v[:, :, n:].contiguous()
        if sized and self.prompt_target is not None:  # the kernel's copy of the key basis counted, as in the allowance
            self.prompt_target.record(self.layer_idx, self._fp16_bytes(), self.nbytes() + kc.state_nbytes(), vc.budget_met)
        if self.tracker is not None:  # the only moment the block's originals sit next to its encoding
            self.tracker.on_flush(self, k, v, start)
        return True

    def _slide(self) -> None:
        """Drop every token older than the newest `sliding_window - 1`: the next query (at position `length`) reaches
        back `sliding_window - 1` tokens and no further, as transformers' own sliding layer keeps. Sinks go first (a
        left-padded batch's pads sit there), then the oldest compressed tokens (a segment is cut only at its codecs'
        token multiple, so a few older tokens may stay; the attention mask hides them), then exact window rows."""
        keep_from = self.length - (self.sliding_window - 1)
        n_sink = self.sink_k.shape[2]
        if keep_from <= max(self.dropped, n_sink):
            return
        if not n_sink and self.segments:
            first = self.segments[0]
            slack = max(1, self.sliding_window // SLIDE_SLACK_DIVISOR)
            if keep_from - first.start < slack and keep_from < first.start + first.length:
                return  # the few tokens past the window stay, at the front of the first segment, until there are `slack`
        if n_sink:
            self.sink_k, self.sink_v = self.sink_k[:, :, :0], self.sink_v[:, :, :0]
        for seg in list(self.segments):
            if seg.start + seg.length <= keep_from:
                self.segments.remove(seg)
            elif seg.start < keep_from:
                cut = (keep_from - seg.start) // seg.token_multiple * seg.token_multiple
                if cut:
                    self.replace_front(seg, cut)
        win_start = self.length - self.win_k.shape[2]
        if keep_from > win_start:
            cut = keep_from - win_start
            self.win_k, self.win_v = self.win_k[:, :, cut:], self.win_v[:, :, cut:]
        first = self.segments[0].start if self.segments else self.length - self.win_k.shape[2]
        if self.anchors is not None:
            self.anchors = self.anchors.without(0, first)
        self.dropped = first

    def hidden_front(self, query_rows: int = 1) -> int:
        """Tokens at the front of the first segment that the last `query_rows` queries may not read: a sliding-window
        layer drops what left its window only every few steps (`SLIDE_SLACK_DIVISOR`), so until then the oldest held
        tokens lie outside the window of the newest query (at position `length - 1`, reading back `sliding_window - 1`).
        0 for a full-attention layer, or when every held token is in the window."""
        if self.sliding_window is None or not self.segments or self.sink_k.shape[2]:
            return 0
        first = self.segments[0]
        hidden = self.length - query_rows + 1 - self.sliding_window - first.start
        return min(max(hidden, 0), first.length)

    def _value_allowance(self, kc: Codec, k: torch.Tensor, positions: torch.Tensor, anchors: int) -> ByteBudget:
        """What the prompt's value codec may hold for this layer to end the prompt `prompt_ratio` times below fp16: the
        fp16 bytes of every token held over the ratio, plus what earlier layers left (`PromptTarget.carry`), less the
        sinks and the window left behind, the anchors' exact rows, the keys' codes (one encoded token's bytes times the
        count, `k (b, kv, n, d)` plus the anchors) and the key codec's state twice over, since the CPU kernel derives a
        copy of the basis on first use (`cpu_lut.int8_basis`), so the target holds while decoding too."""
        b, _, n, _ = k.shape
        exact = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.win_k[:, :, n:], self.win_v[:, :, n:]))
        anchor_rows = anchors * (b * self.kv_heads * (self.head_dim + self.v_head_dim) * self.win_k.element_size() + 8)
        step = kc.token_multiple
        keys = math.ceil(kc.encode(k[:, :, :step], positions[:, :step]).nbytes() * (n + anchors) / step)
        carry = self.prompt_target.carry(self.layer_idx) if self.prompt_target is not None else 0
        fixed = exact + 2 * kc.state_nbytes()
        return ByteBudget(int(self._fp16_bytes() / self.method.prompt_ratio) + carry - fixed - anchor_rows - keys, n + anchors, fixed, carry)

    def _fp16_bytes(self) -> int:
        """What this layer's tokens would take as fp16 K and V."""
        return self.batch * self.kv_heads * self.length * (self.head_dim + self.v_head_dim) * 2

    def _add_anchors(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep tokens `index (h,)` (just compressed, after every current anchor) exact, with rows `k`, `v` `(b, kv, h, d)`."""
        first, last = int(index[0]), int(index[-1])
        seg = next(seg for seg in self.segments if seg.start <= first < seg.start + seg.length)
        if last < seg.start + seg.length:
            self.anchors = AnchorSet.of(seg, index, k, v) if self.anchors is None else self.anchors.add(seg, index, k, v)
        else:  # the run went to more than one segment (an older tier and the stream): one part per segment
            held = self.anchors
            if held is not None:
                index, k, v = torch.cat([held.index, index]), torch.cat([held.k, k], 2), torch.cat([held.v, v], 2)
            self.anchors = AnchorSet.gather(self.segments, index, k, v)

    def store(self, kind: str, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Encode tokens [start, start + n) with `kind`'s codecs, appending to the segment that ends at `start`."""
        n = k.shape[2]
        if not n:
            return
        kc, vc = self.codec(kind, "key"), self.codec(kind, "value")
        fresh = self.holds_nothing(kc)
        positions = self.positions(start, n)
        if fresh and kind.startswith("tier") and self.tier_queries:
            # An older tier's codecs fit on their first run; one that ranks its basis by attention scores reads the
            # latest queries (without them it falls back to its data-only rule, e.g. the PCA keys' energy).
            queries = torch.cat(self.tier_queries, dim=2)[:, :, -FIT_QUERIES:]
            for codec, x in ((kc, k), (vc, v)):
                if codec.fits_on_queries:
                    codec.fit(x, positions, queries=queries)
        keys, values = kc.encode(k, positions), vc.encode(v, positions)
        prev = next((seg for seg in self.segments if seg.start + seg.length == start), None)
        if prev is not None and prev.key_codec is kc and prev.value_codec is vc:
            prev.append(keys, values)  # same codecs, contiguous tokens: one run, read by one kernel call
        else:
            at = next((i for i, seg in enumerate(self.segments) if seg.start >= start), len(self.segments))
            self.segments.insert(at, Segment(kind, kc, vc, keys, values, start))
        self.placement.stored(self, kind, k, v, start, fresh)

    def move_front(self, src: Segment, n: int, kind: str) -> None:
        """Re-encode `src`'s first `n` tokens with `kind`'s codecs (a block aging into an older tier): decoded, dropped
        from `src`, stored again. Anchors among them keep their exact rows; their codes are gathered from where the
        tokens now live, so each segment still leaves out exactly the anchors it holds."""
        start = src.start
        k, v = self.decode_front(src, n)
        self.replace_front(src, n)
        self.store(kind, k, v, start)
        held = self.anchors
        if held is not None and bool(((held.index >= start) & (held.index < start + n)).any()):
            self.anchors = AnchorSet.gather(self.segments, held.index, held.k, held.v)

    def holds_nothing(self, codec: Codec) -> bool:
        """Whether no segment is coded by `codec`: a codec that fits on its first encode has not fitted yet."""
        return not any(seg.key_codec is codec or seg.value_codec is codec for seg in self.segments)

    def decode_front(self, seg: Segment, n: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `(batch, kv_heads, n, d)` float of `seg`'s `n` tokens from its `first` on (its front by default)."""
        pos = self.positions(seg.start + first, n)
        keys, values = slice_packed(seg.keys, first, first + n), slice_packed(seg.values, first, first + n)
        return seg.key_codec.decode(keys, pos), seg.value_codec.decode(values, pos)

    def note_evicted(self, start: int, n: int, kind: str) -> None:
        """Record tokens [start, start + n) of segment kind `kind` as evicted (merged with a contiguous chunk of that kind);
        anchors among them go too (their codes no longer count, so nothing is left to cancel)."""
        if self.anchors is not None:
            self.anchors = self.anchors.without(start, start + n)
        chunks = list(self.evicted)
        if chunks and chunks[-1][0] + chunks[-1][1] == start and chunks[-1][2] == kind:
            chunks[-1] = (chunks[-1][0], chunks[-1][1] + n, kind)
        else:
            chunks.append((start, n, kind))
        self.evicted = tuple(chunks)  # a new tuple: a rollback snapshot keeps the old one

    @property
    def evicted_tokens(self) -> int:
        return sum(n for _, n, _ in self.evicted)

    def nbytes(self) -> int:
        """Every byte the layer holds (`memory()` summed)."""
        return sum(self.memory().values())

    def replace_front(self, seg: Segment, n: int) -> None:
        """Drop `seg`'s first `n` tokens by swapping in a shorter copy (or removing it), never by mutating it:
        the rollback snapshot of the running forward may hold `seg`."""
        i = self.segments.index(seg)
        if n < seg.length:
            self.segments[i] = seg.tail(n)
        else:
            del self.segments[i]

    def codec(self, kind: str, side: str) -> Codec:
        name = f"{kind}_{side}"
        if name not in self._codecs:
            self._codecs[name] = self.build_codec(self._spec(kind, side), side)
        return self._codecs[name]

    def build_codec(self, spec: CodecSpec, side: str, rows: int | None = None) -> Codec:
        """`spec`'s codec for this layer's `side`, given the model's rotary embedding when it reads positions. A codec
        that learns from data gets one instance per batch row (`RowsCodec`), so no row's state is pooled with other
        requests'; one whose fit reads the prompt's queries or a byte allowance keeps one state for the batch.
        rows: None decides from the layer's batch; a file's codec says what it was (its row count, or 0 for one codec)."""
        dim = self.head_dim if side == "key" else self.v_head_dim
        codec = spec.build(dim, self.kv_heads, self.layer_idx)
        if codec.uses_positions and self.rope is None:
            raise ValueError(f"codec {spec.codec!r} needs the model's rotary embedding, but layer {self.layer_idx} has none")
        if rows is None:
            rows = self.batch if self.batch > 1 and codec.learns and not (codec.fits_on_queries or codec.fits_to_budget) else 0
        if rows:
            codec = RowsCodec([codec, *(spec.build(dim, self.kv_heads, self.layer_idx) for _ in range(rows - 1))])
        if codec.uses_positions:
            codec.set_rope(*self.rope)
        return codec

    def retire_codecs(self, kind: str) -> None:
        """Keep `kind`'s codecs for the segments they encoded, under new names (`tier1@1_key`, ...), so the next
        block of `kind` builds fresh codecs from the method's current specs (e.g. after `apply_archive_bits`).
        A retired codec is never asked to encode again; the segments it wrote keep reading through it."""
        held = [f"{kind}_{side}" for side in ("key", "value") if f"{kind}_{side}" in self._codecs]
        if not held:
            return
        generation = 1 + sum(1 for name in self._codecs if name.startswith(f"{kind}@") and name.endswith("_key"))
        codecs = dict(self._codecs)  # a new dict: a rollback snapshot keeps the old one
        for name in held:
            side = name.rpartition("_")[2]
            codecs[f"{kind}@{generation}_{side}"] = codecs.pop(name)
        self._codecs = codecs
        self.tier_fit = {name: errors for name, errors in self.tier_fit.items() if name != kind}  # the next fit measures its own

    def _spec(self, kind: str, side: str) -> CodecSpec:
        # KVCache hands each layer its own config, but apply_boundary / apply_archive_bits set the cache's whole
        # method on every layer: resolving here keeps per-layer codecs (MethodConfig.layer_codecs) either way.
        m = self.method.for_layer(self.layer_idx)
        if kind.startswith("tier"):
            tier = m.tiers[int(kind[4:]) - 1]
            return tier.key if side == "key" else tier.value
        if kind == "prefill":
            return (m.prefill_key if side == "key" else m.prefill_value) or (m.key if side == "key" else m.value)
        return m.key if side == "key" else m.value

    # -- reading -------------------------------------------------------------------------------
    def positions(self, start: int, count: int) -> torch.Tensor:
        """RoPE positions `(batch, count)` of logical tokens [start, start + count)."""
        idx = torch.arange(start, start + count, device=self.device).unsqueeze(0).expand(self.batch, -1)
        return idx if self.pos_offset is None else idx + self.pos_offset.unsqueeze(1)

    def first_position(self, start: int) -> torch.Tensor:
        """`(batch,)` RoPE position of logical token `start`, kept while the row offsets and batch are unchanged:
        a RoPE-free codec's kernel reads it for its segment on every decode step. One entry per segment start: the
        tiers' segments read theirs in turn on each step, and a single entry would be rebuilt at every call."""
        held = getattr(self, "_first_position", None)
        if held is None or held[0] is not self.pos_offset or held[1] != self.batch or held[2] != self.device:
            held = self._first_position = (self.pos_offset, self.batch, self.device, {})
        starts = held[3]
        if start not in starts:
            if len(starts) >= 16:  # segments come and go as blocks move: keep the entries bounded
                starts.clear()
            starts[start] = self.positions(start, 1)[:, 0].contiguous()
        return starts[start]

    def set_positions(self, position_ids: torch.Tensor | None, q_len: int) -> None:
        """Learn each row's position offset (left padding) from the model's `position_ids`."""
        if position_ids is None or self.pos_offset is not None or self.pad is not None:
            return
        last = position_ids[:, -1].to(self.device)
        if last.numel() == 1 and self.batch > 1:
            last = last.expand(self.batch)
        self.pos_offset = last - (self.length - 1)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full K/V `(batch, kv_heads, length, head_dim)` in the model dtype (the no-enable path)."""
        return self._dequantized("key"), self._dequantized("value")

    def _dequantized(self, side: str) -> torch.Tensor:
        k = side == "key"
        parts = [self.sink_k if k else self.sink_v]
        if self.dropped:  # tokens a sliding layer dropped: zeros, which the model's sliding-window mask never reads
            held = self.win_k if k else self.win_v
            parts.append(held.new_zeros(held.shape[0], held.shape[1], self.dropped, held.shape[3]))
        for seg in self.segments:
            codec, packed = (seg.key_codec, seg.keys) if k else (seg.value_codec, seg.values)
            decoded = codec.decode(packed, self.positions(seg.start, seg.length))
            # Within its codec's error, a reconstruction of entries near float16's max may land just past it: saturate.
            parts.append(decoded.clamp(-FP16_MAX, FP16_MAX) if self.dtype == torch.float16 else decoded)
        parts.append(self.win_k if k else self.win_v)
        full = torch.cat([p.to(self.dtype) for p in parts], dim=2)
        return full if self.anchors is None else self.anchors.overwrite(full, side)

    # -- accounting ----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Real bytes held, per part."""
        def size(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        out = {"sink": size(self.sink_k, self.sink_v), "window": size(self.win_k, self.win_v)}
        for seg in self.segments:
            key = f"{seg.kind}:{seg.key_codec.name}/{seg.value_codec.name}"
            out[key] = out.get(key, 0) + seg.nbytes()
        if self.anchors is not None:
            out["anchors"] = self.anchors.nbytes()
        out["codec_state"] = sum(self.state_nbytes_by_kind().values())
        return out

    def state_nbytes_by_kind(self) -> dict[str, int]:
        """Fitted codec state bytes per segment kind ("stream", "tier1", ...): codecs are named `<kind>_<side>`, and a
        retired fit `<kind>@<generation>_<side>` (`retire_codecs`) still reads its segments, so it counts with its kind."""
        out: dict[str, int] = {}
        for name, codec in list(self._codecs.items()):  # a copy: the metrics exporter reads while a flush may add one
            kind = name.rpartition("_")[0].partition("@")[0]
            out[kind] = out.get(kind, 0) + codec.state_nbytes()
        return out

    # -- helpers -------------------------------------------------------------------------------
    def _attention_enabled(self) -> bool:
        return getattr(self.model_config, "_attn_implementation", None) == "kvpack"

    def _check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape[0] != self.batch or k.shape[1] != self.kv_heads or k.shape[3] != self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx} was initialized for batch {self.batch}, {self.kv_heads} kv heads, head_dim {self.head_dim}; "
                f"got {tuple(k.shape)}. Use a fresh cache (or cache.reset()) for a new batch."
            )

    def _check_budget(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self._attention_enabled():
            raise ValueError(
                f"layer {self.layer_idx}: a cache with a memory budget evicts old tokens, and only kvpack's attention reads a "
                "cache with a gap; call kvpack.enable(model) before using it (or build the cache without budget=)"
            )
        if not self.is_initialized:
            check_share(self, k, v)

    def _check_fits_fp16(self, peak: float | None) -> None:
        """Sinks and window are stored in fp16 by default: refuse values fp16 would turn into Inf. `peak`: the new
        states' largest |entry| (`check_new_states`), None where values are not read (an accelerator without DEBUG)."""
        if peak is not None and peak > torch.finfo(torch.float16).max:
            raise ValueError(
                f"layer {self.layer_idx}: key/value states exceed the float16 range (65504) of kvpack's exact sinks and window, "
                "so nothing was stored; build the method with exact_dtype='bfloat16' or 'native', e.g. "
                "kvpack.get_method(name).with_options(exact_dtype='bfloat16')"
            )

    def _check_codecs_hold(self, peak: float | None) -> None:
        """Refuse entries beyond what the method's codecs store as finite numbers (`Codec.max_entry`), now, while nothing
        is stored: the window hands them to a codec only when it flushes, when refusing would leave the cache stuck."""
        bound = self.__dict__.get("_max_entry")
        if bound is None:
            dim = max(self.head_dim, self.v_head_dim)
            bound = self._max_entry = min(s.codec_class.max_entry(s.config, dim) for s in self.method.specs())
        if peak is not None and peak > bound:
            raise ValueError(
                f"layer {self.layer_idx}: key/value states reach {peak:.3g}, beyond the {bound:.3g} that method "
                f"{self.method.name!r}'s codecs store as finite numbers, so nothing was stored (the cache is unchanged). "
                "Activations this large mean the model overflowed (attention would square them too): check its inputs and dtype"
            )

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.win_k, self.win_v = fn(self.win_k), fn(self.win_v)
        for seg in self.segments:
            seg.map(fn)
        if self.pos_offset is not None:
            self.pos_offset = fn(self.pos_offset)
        if self.pad is not None:
            self.pad = fn(self.pad)
        if self.fit_queries is not None:
            self.fit_queries = fn(self.fit_queries)
        self.tier_queries = tuple(fn(chunk) for chunk in self.tier_queries)
        if self.anchors is not None:
            self.anchors = self.anchors.map(fn)
        rows = None
        for codec in self._codecs.values():
            if isinstance(codec, RowsCodec):
                rows = fn(torch.arange(self.batch)).tolist() if rows is None else rows  # which old row each new row is
                codec.remap(rows)
        self.batch = self.sink_k.shape[0]
