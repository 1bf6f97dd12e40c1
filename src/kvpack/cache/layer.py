"""One model layer's compressed cache: `[sinks][compressed segments ...][recent window]`.

New tokens land in the exact window. Once attention has read them (or at once, without
`kvpack.enable`), tokens beyond the window are encoded by the method's codecs: the prompt leaves
exactly `window` exact tokens and its middle goes to the prefill codecs (Shard: PCA/VQ); later
tokens leave in whole blocks for the stream codecs, appended to one growing stream segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from ..codecs.base import Codec, Packed, concat_packed
from ..registry import EXACT_DTYPES, CodecSpec, MethodConfig


@dataclass
class Segment:
    """Compressed tokens [start, start + length) of the logical sequence."""

    kind: str  # "prefill" | "stream"
    key_codec: Codec
    value_codec: Codec
    keys: Packed
    values: Packed
    start: int

    @property
    def length(self) -> int:
        return self.keys.num_tokens

    def map(self, fn) -> None:
        self.keys = self.keys.map_tensors(fn)
        self.values = self.values.map_tensors(fn)


class KVPackLayer(CacheLayerMixin):
    """A transformers cache layer holding segments; see the module docstring."""

    is_sliding = False
    is_croppable = True

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
        self.updates = 0
        self._codecs: dict[str, Codec] = {}
        self.is_initialized = False

    # -- transformers layer API ----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.kv_heads, _, self.head_dim = key_states.shape
        self.v_head_dim = value_states.shape[-1]
        self.exact_dtype = EXACT_DTYPES[self.method.exact_dtype] or self.dtype
        empty_k = key_states[:, :, :0].to(self.exact_dtype)
        empty_v = value_states[:, :, :0].to(self.exact_dtype)
        self.sink_k, self.sink_v, self.win_k, self.win_v = empty_k, empty_v, empty_k, empty_v
        self.keys, self.values = empty_k, empty_v  # transformers' generic helpers read these
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens; return dequantized K/V, or handles when kvpack attention is enabled."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_new(key_states, value_states)
        key_states, value_states = key_states.to(self.exact_dtype), value_states.to(self.exact_dtype)
        n_sink = min(max(self.method.sink_tokens - self.sink_k.shape[2], 0), key_states.shape[2])
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :n_sink]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :n_sink]], dim=2)
        self.win_k = torch.cat([self.win_k, key_states[:, :, n_sink:]], dim=2)
        self.win_v = torch.cat([self.win_v, value_states[:, :, n_sink:]], dim=2)
        self.length += key_states.shape[2]
        self.updates += 1
        if self._attention_enabled():
            key_states._kvpack_layer = self  # the registered attention reads segments from here
            return key_states, value_states
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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers 5 passes a negative count).

        Tokens inside compressed segments are decoded back into the window first, so any codec
        can be cropped at any token.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        remove = min(-tokens_to_remove, self.length - self.sink_k.shape[2] if self.is_initialized else 0)
        while remove > self.win_k.shape[2] and self.segments:
            self._reopen_last_segment()
        if remove:
            self.win_k, self.win_v = self.win_k[:, :, :-remove], self.win_v[:, :, :-remove]
            self.length -= remove

    # -- compression ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Compress what overflows the window (called after attention read it): the prompt, then whole blocks."""
        overflow = self.win_k.shape[2] - self.method.window
        first = self.updates == 1 and not self.segments
        prefill = first and self.method.prefill_key is not None
        kind = "prefill" if prefill else "stream"
        kc, vc = self._codec(kind, "key"), self._codec(kind, "value")
        # The prompt leaves exactly `window` exact tokens behind (up to the codecs' token multiple,
        # e.g. KIVI's per-channel groups); later tokens leave in whole blocks, so that appending to
        # a segment (a copy) happens once per block rather than once per decoded token.
        step = math.lcm(kc.token_multiple, vc.token_multiple) if first else self.method.block_size
        n = overflow // step * step
        if n <= 0:
            return
        k, v = self.win_k[:, :, :n], self.win_v[:, :, :n]
        start = self.length - self.win_k.shape[2]
        positions = self.positions(start, n)
        if prefill:
            kc.fit(k, positions)
            vc.fit(v, positions)
        seg = Segment(kind, kc, vc, kc.encode(k, positions), vc.encode(v, positions), start)
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == kind == "stream" and last.start + last.length == start:
            last.keys = concat_packed([last.keys, seg.keys])
            last.values = concat_packed([last.values, seg.values])
        else:
            self.segments.append(seg)
        self.win_k, self.win_v = self.win_k[:, :, n:].contiguous(), self.win_v[:, :, n:].contiguous()

    def _codec(self, kind: str, side: str) -> Codec:
        name = f"{kind}_{side}"
        if name not in self._codecs:
            spec = self._spec(kind, side)
            dim = self.head_dim if side == "key" else self.v_head_dim
            codec = spec.build(dim, self.kv_heads, self.layer_idx)
            if codec.uses_positions:
                if self.rope is None:
                    raise ValueError(f"codec {spec.codec!r} needs the model's rotary embedding, but layer {self.layer_idx} has none")
                codec.set_rope(*self.rope)
            self._codecs[name] = codec
        return self._codecs[name]

    def _spec(self, kind: str, side: str) -> CodecSpec:
        m = self.method
        if kind == "prefill":
            return (m.prefill_key if side == "key" else m.prefill_value) or (m.key if side == "key" else m.value)
        return m.key if side == "key" else m.value

    def _reopen_last_segment(self) -> None:
        seg = self.segments.pop()
        pos = self.positions(seg.start, seg.length)
        k = seg.key_codec.decode(seg.keys, pos).to(self.exact_dtype)
        v = seg.value_codec.decode(seg.values, pos).to(self.exact_dtype)
        self.win_k = torch.cat([k, self.win_k], dim=2)
        self.win_v = torch.cat([v, self.win_v], dim=2)

    # -- reading -------------------------------------------------------------------------------
    def positions(self, start: int, count: int) -> torch.Tensor:
        """RoPE positions `(batch, count)` of logical tokens [start, start + count)."""
        idx = torch.arange(start, start + count, device=self.device).unsqueeze(0).expand(self.batch, -1)
        return idx if self.pos_offset is None else idx + self.pos_offset.unsqueeze(1)

    def set_positions(self, position_ids: torch.Tensor | None, q_len: int) -> None:
        """Learn each row's position offset (left padding) from the model's `position_ids`."""
        if position_ids is None or self.pos_offset is not None:
            return
        last = position_ids[:, -1].to(self.device)
        if last.numel() == 1 and self.batch > 1:
            last = last.expand(self.batch)
        self.pos_offset = last - (self.length - 1)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full K/V `(batch, kv_heads, length, head_dim)` in the model dtype (the no-enable path)."""
        ks, vs = [self.sink_k], [self.sink_v]
        for seg in self.segments:
            pos = self.positions(seg.start, seg.length)
            ks.append(seg.key_codec.decode(seg.keys, pos).to(self.dtype))
            vs.append(seg.value_codec.decode(seg.values, pos).to(self.dtype))
        ks.append(self.win_k)
        vs.append(self.win_v)
        return torch.cat([k.to(self.dtype) for k in ks], dim=2), torch.cat([v.to(self.dtype) for v in vs], dim=2)

    # -- accounting ----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Real bytes held, per part."""
        def size(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        out = {"sink": size(self.sink_k, self.sink_v), "window": size(self.win_k, self.win_v)}
        for seg in self.segments:
            key = f"{seg.kind}:{seg.key_codec.name}/{seg.value_codec.name}"
            out[key] = out.get(key, 0) + seg.keys.nbytes() + seg.values.nbytes()
        out["codec_state"] = sum(c.state_nbytes() for c in self._codecs.values())
        return out

    # -- helpers -------------------------------------------------------------------------------
    def _attention_enabled(self) -> bool:
        return getattr(self.model_config, "_attn_implementation", None) == "kvpack"

    def _check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"key/value states must be (batch, kv_heads, tokens, head_dim) with matching leading dims, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[0] != self.batch or k.shape[1] != self.kv_heads or k.shape[3] != self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx} was initialized for batch {self.batch}, {self.kv_heads} kv heads, head_dim {self.head_dim}; "
                f"got {tuple(k.shape)}. Use a fresh cache (or cache.reset()) for a new batch."
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
        self.batch = self.sink_k.shape[0]
