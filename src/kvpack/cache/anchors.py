"""Anchors: the few tokens the model attends to most, kept exact beside their codes.

Besides the first tokens (the sinks), a few tokens in the middle of a prompt draw much of the
attention, and an unlucky code on one of them is most of what one rotation draw loses and another
does not (docs/notes/decisions.md). At the prompt's flush the layer ranks its compressed tokens by the
attention its last queries paid them (`primitives.attention_mass`) and keeps the top
`MethodConfig.anchors` fraction in the exact dtype; each later flush does the same for its block with
the queries of the forward that flushes it (a chunk's, or a decode step's), so a long generation or a
chunked prompt keeps the same fraction of anchors over all of its tokens. A method with a prompt codec
(Shard) holds the prompt's anchors in the prompt's segment and later blocks' in the stream's: a layer's
`AnchorSet` has one `Anchors` per segment that holds some.

Their codes stay in the segment, so the segment's run, crop and save are unchanged. Attention reads
the exact anchors as one more part, and the segment's part leaves their codes out: the CPU kernels
and the torch paths mask those tokens' scores (`skip`). The device ops cannot mask, so there the
anchors' own codes (gathered once, a few bytes each) give a partial with a negative sign, which
cancels what the segment's kernel counted for them; it comes from the same kernel over the same
codes, so the cancellation holds to float32 rounding for any per-token codec.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..codecs.base import Codec, Packed, concat_packed, gather_packed
from ..primitives.attention_mass import most_attended, received_attention
from .placement import PlacementPolicy

KIND = "anchors"  # the exact anchors' part in a decode step's partials (the tracker counts it as exact)


@dataclasses.dataclass(frozen=True)
class Anchors:
    """Exact copies of some compressed tokens of one segment, and those tokens' codes.

    index: `(h,)` long, logical token indices, ascending. k, v: `(batch, kv_heads, h, d)` in the layer's exact
    dtype. keys, values: the tokens' codes, gathered from the segment (`h` tokens), read by the segment's
    codecs `key_codec` / `value_codec`. source_kind: that segment's kind (the tracker books the cancelling
    partial there).
    """

    index: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_codec: Codec
    value_codec: Codec
    keys: Packed
    values: Packed
    source_kind: str

    @classmethod
    def gather(cls, seg, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Anchors:
        """Anchors at logical `index (h,)` inside segment `seg`, with their exact rows `k`, `v` `(b, kv, h, d)`."""
        offset = index - seg.start
        if offset.numel() and (int(offset.min()) < 0 or int(offset.max()) >= seg.length):
            raise ValueError(f"anchors {index.tolist()} lie outside the segment of tokens [{seg.start}, {seg.start + seg.length})")
        return cls(index, k, v, seg.key_codec, seg.value_codec, gather_packed(seg.keys, offset), gather_packed(seg.values, offset), seg.kind)

    def extend(self, seg, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Anchors:
        """These anchors and tokens `index (h,)` of the same segment, all after them, with their exact rows `(b, kv, h, d)`."""
        if index.numel() and int(index[0]) <= int(self.index[-1]):
            raise ValueError(f"new anchors {index.tolist()} must follow the held ones (last {int(self.index[-1])})")
        more = Anchors.gather(seg, index, k, v)
        return dataclasses.replace(
            self, index=torch.cat([self.index, more.index]), k=torch.cat([self.k, more.k], 2), v=torch.cat([self.v, more.v], 2),
            keys=concat_packed([self.keys, more.keys]), values=concat_packed([self.values, more.values]),
        )

    @property
    def count(self) -> int:
        return int(self.index.numel())

    def skip_in(self, seg) -> torch.Tensor | None:
        """Offsets `(h,)` int64 of the anchors inside segment `seg` (the one that holds them), or None for another segment."""
        bounds = self.__dict__.get("_bounds")
        if bounds is None:  # python ints, once: a decode step asks every segment of every layer
            bounds = (int(self.index[0]), int(self.index[-1]))
            object.__setattr__(self, "_bounds", bounds)
        if not seg.start <= bounds[0] or bounds[1] >= seg.start + seg.length:
            return None
        memo = self.__dict__.get("_skip")
        if memo is None or memo[0] != seg.start:
            memo = (seg.start, (self.index - seg.start).contiguous())
            object.__setattr__(self, "_skip", memo)
        return memo[1]

    def keep(self, mask: torch.Tensor) -> Anchors | None:
        """The anchors where `mask (h,)` bool is True, or None if none is left (a new object: rollback snapshots hold this one)."""
        if bool(mask.all()):
            return self
        if not bool(mask.any()):
            return None
        rows = mask.nonzero().flatten()
        return dataclasses.replace(
            self, index=self.index[rows], k=self.k.index_select(2, rows.to(self.k.device)), v=self.v.index_select(2, rows.to(self.v.device)),
            keys=gather_packed(self.keys, rows), values=gather_packed(self.values, rows),
        )

    def truncate(self, keep: int) -> Anchors | None:
        """Those among the first `keep` logical tokens (crop)."""
        return self.keep(self.index < keep)

    def without(self, start: int, stop: int) -> Anchors | None:
        """All but those in tokens [start, stop) (their codes were evicted)."""
        return self.keep((self.index < start) | (self.index >= stop))

    def map(self, fn) -> Anchors:
        """`fn` on every batch-leading tensor (batch reorder/select, device moves); the indices are shared by all rows."""
        return dataclasses.replace(self, k=fn(self.k), v=fn(self.v), keys=self.keys.map_tensors(fn), values=self.values.map_tensors(fn))

    def nbytes(self) -> int:
        """Bytes held: exact rows, gathered codes and the index."""
        tensors = (self.index, self.k, self.v)
        return sum(t.numel() * t.element_size() for t in tensors) + self.keys.nbytes() + self.values.nbytes()

    def overwrite(self, full: torch.Tensor, side: str) -> torch.Tensor:
        """`full (b, kv, length, d)`, a layer's decoded keys or values, with the anchors' exact rows written in (in place)."""
        exact = self.k if side == "key" else self.v
        full[:, :, self.index.to(full.device)] = exact.to(full.dtype)
        return full


@dataclasses.dataclass(frozen=True)
class AnchorSet:
    """A layer's anchors over one or more segments: one `Anchors` per segment that holds some, in token order.

    A method with a prompt codec (Shard) holds the prompt's anchors in the prompt's segment and later blocks' in the
    stream's; every other method has one part. Reading it as one exact part (`index`, `k`, `v`) and leaving each
    segment's own anchors out of that segment (`skip_in`) is what attention does with it.
    """

    parts: tuple[Anchors, ...]

    @classmethod
    def of(cls, seg, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AnchorSet:
        return cls((Anchors.gather(seg, index, k, v),))

    @classmethod
    def gather(cls, segments, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AnchorSet:
        """Anchors at ascending logical `index (h,)`, each inside one of `segments`; ValueError when one lies in none."""
        parts, done = [], 0
        for seg in segments:
            inside = int(((index >= seg.start) & (index < seg.start + seg.length)).sum())
            if inside:
                rows = slice(done, done + inside)
                parts.append(Anchors.gather(seg, index[rows], k[:, :, rows], v[:, :, rows]))
                done += inside
        if done != index.numel():
            raise ValueError(f"anchors {index.tolist()} are not ascending tokens of the compressed segments")
        return cls(tuple(parts))

    def add(self, seg, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AnchorSet:
        """These anchors and tokens `index (h,)` of segment `seg`, after all of them: the last part grows, or `seg` starts one."""
        last = self.parts[-1]
        if last.skip_in(seg) is not None:
            return AnchorSet((*self.parts[:-1], last.extend(seg, index, k, v)))
        return AnchorSet((*self.parts, Anchors.gather(seg, index, k, v)))

    @functools.cached_property
    def index(self) -> torch.Tensor:
        return self.parts[0].index if len(self.parts) == 1 else torch.cat([p.index for p in self.parts])

    @functools.cached_property
    def k(self) -> torch.Tensor:
        return self.parts[0].k if len(self.parts) == 1 else torch.cat([p.k for p in self.parts], 2)

    @functools.cached_property
    def v(self) -> torch.Tensor:
        return self.parts[0].v if len(self.parts) == 1 else torch.cat([p.v for p in self.parts], 2)

    @property
    def count(self) -> int:
        return sum(p.count for p in self.parts)

    def part_in(self, seg) -> Anchors | None:
        """The anchors segment `seg` holds, or None."""
        return next((p for p in self.parts if p.skip_in(seg) is not None), None)

    def skip_in(self, seg) -> torch.Tensor | None:
        """Offsets `(h,)` int64 of the anchors inside segment `seg`, or None when it holds none."""
        part = self.part_in(seg)
        return None if part is None else part.skip_in(seg)

    def _each(self, fn) -> AnchorSet | None:
        parts = tuple(q for q in (fn(p) for p in self.parts) if q is not None)
        return AnchorSet(parts) if parts else None

    def truncate(self, keep: int) -> AnchorSet | None:
        """Those among the first `keep` logical tokens (crop)."""
        return self._each(lambda p: p.truncate(keep))

    def without(self, start: int, stop: int) -> AnchorSet | None:
        """All but those in tokens [start, stop) (their codes were evicted)."""
        return self._each(lambda p: p.without(start, stop))

    def map(self, fn) -> AnchorSet:
        """`fn` on every batch-leading tensor of every part."""
        return AnchorSet(tuple(p.map(fn) for p in self.parts))

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def overwrite(self, full: torch.Tensor, side: str) -> torch.Tensor:
        """`full (b, kv, length, d)` with every part's exact rows written in (in place)."""
        for p in self.parts:
            full = p.overwrite(full, side)
        return full


class AttentionAnchors(PlacementPolicy):
    """Keep exact the compressed tokens the latest queries attend to most (`MethodConfig.anchors` of them).

    The prompt keeps that fraction of its tokens (at least one); each later flush keeps the same fraction of its block,
    owed across blocks (the layer's `anchor_credit`, a fraction of a token carried over), so anchors cover the whole
    context, not only the prompt. No anchors when none is due or no queries were seen (no kvpack attention)."""

    def keep_exact(self, layer, start: int, n: int, first: bool) -> torch.Tensor | None:
        share = layer.method.anchors
        if not share or layer.fit_queries is None or layer.fit_scaling is None:
            return None
        if first:
            count = min(n, max(1, round(share * n)))
        else:
            layer.anchor_credit += share * n
            count = min(n, int(layer.anchor_credit))
            layer.anchor_credit -= count
            if not count:
                return None
        # Every exact token: the whole context at the prompt's flush; later, the sinks and the window, which holds
        # the block and the queries' own tokens (the compressed tokens' share of each query is left out of the
        # normalization, which shifts how much each query weighs, not the order of the tokens it reads).
        keys = torch.cat([layer.sink_k, layer.win_k], dim=2)
        rows = min(layer.fit_queries.shape[2], layer.win_k.shape[2] if not first else keys.shape[2])
        first_valid = layer.pad  # left padding sits in the sinks; its keys are never attended
        mass = received_attention(layer.fit_queries[:, :, -rows:], keys, layer.fit_scaling, first_valid)
        lo = start if first else layer.sink_k.shape[2]  # where the block sits among those keys
        return most_attended(mass[:, lo : lo + n], count).to(layer.win_k.device)
