"""A run of one codec's packed blocks, held in capacity buffers with a block table.

Every tensor field of a codec's `Packed` keeps tokens at dim 2, so a run of blocks is one buffer per
field, `(batch, kv_heads, capacity, n)`, and the blocks are offsets into it (vLLM's paged-attention
idea, with one page per tier): appending a block writes into the spare capacity, the live tokens
are a zero-copy view `[:, :, :length]` that a kernel reads in one call however many blocks it
holds, and crop moves the end offset rather than re-concatenating anything.

Capacity grows geometrically (by a 32nd of the tokens, at least one block): appending costs O(1) copied
bytes per token amortized (each token is copied at most ~33 times over a run's life) while the slack stays
under a 32nd of the live tokens plus a block. The slack is memory really held, and `nbytes` counts it; the
copies are cheap beside the reads, since a decode step reads every live token of the run and a growth copies
them once every `length / 32` appended tokens (a 32K-token run: one copy per 1,000 steps, a 1,000th of
the step's reads each). A larger step (an eighth) would hold up to 12% of a long archive empty.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..codecs.base import Packed

GROWTH_DIVISOR = 32  # capacity = needed + needed // 32: at most ~3% slack (plus a block), ~33 copies per token over a run's life


def _fields(packed: Packed) -> list[str]:
    return [f.name for f in dataclasses.fields(packed) if isinstance(getattr(packed, f.name), torch.Tensor)]


class BlockRun:
    """Tokens of one codec's blocks, in order. `view()` is the live `Packed`; `blocks` their token offsets."""

    def __init__(self, first: Packed):
        self._template = first
        self._names = _fields(first)
        # The first block (usually the prompt) is held at its exact size: no slack until the run grows.
        self._bufs = {n: getattr(first, n) for n in self._names}
        self.length = first.num_tokens
        self.blocks = [0]  # token offset where each appended block starts

    @property
    def capacity(self) -> int:
        return next(iter(self._bufs.values())).shape[2] if self._bufs else self.length

    def view(self) -> Packed:
        """The live tokens as a `Packed` of views (no copy). Reused while the run's length, buffers and
        template are the same objects (a decode step reads each run's view a few times per layer; building
        one costs a dataclass copy and a slice per field)."""
        key = (self._template, *self._bufs.values())
        cached = self.__dict__.get("_view")
        if cached is not None and cached[1].num_tokens == self.length and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        changes = {n: b[:, :, : self.length] for n, b in self._bufs.items()}
        packed = dataclasses.replace(self._template, num_tokens=self.length, **changes)
        self._view = (key, packed)
        return packed

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_view"}  # copies and pickles rebuild their view

    def append(self, block: Packed) -> None:
        """Add `block`'s tokens after the live ones (a copy of the block only, amortized)."""
        n = block.num_tokens
        need = self.length + n
        if need > self.capacity:
            self._grow(need + max(n, need // GROWTH_DIVISOR))
        for name in self._names:
            part = getattr(block, name)
            if part.dtype != self._bufs[name].dtype:
                self._widen(name, part.dtype)
            self._bufs[name][:, :, self.length : need] = part
        self.blocks.append(self.length)
        self.length = need

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (crop): offsets move, the kept bytes are untouched."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a run of {self.length} tokens to {length}")
        self.length = length
        self.blocks = [b for b in self.blocks if b < length] or [0]

    def tail(self, n: int) -> BlockRun:
        """A new run of all but the first `n` tokens (demotion to an older tier, eviction), in buffers of its own
        sized to the live tokens, so the dropped bytes are freed once the caller drops this run. This run is
        left as it was: a snapshot that holds it (a forward's rollback journal) stays valid."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot drop {n} tokens from a run of {self.length}")
        run = copy.copy(self)
        run.__dict__.pop("_view", None)
        run._bufs = {name: buf[:, :, n : self.length].clone() for name, buf in self._bufs.items()}
        run.length = self.length - n
        run.blocks = [b - n for b in self.blocks if b >= n] or [0]
        run._template = run.view()
        return run

    def compact(self) -> int:
        """Free the spare capacity: the live tokens move into buffers of their size (new ones, so a snapshot holding
        the old buffers stays valid). Returns the bytes freed (0 when there was no slack)."""
        before = self.nbytes()
        if self.capacity == self.length:
            return 0
        self._bufs = {name: buf[:, :, : self.length].clone() for name, buf in self._bufs.items()}
        self.__dict__.pop("_view", None)
        self._template = self.view()  # the old template's fields would keep the old buffers alive
        return before - self.nbytes()

    def map(self, fn) -> None:
        """Apply `fn` to the live tokens of every field (batch reorder/select); slack is dropped."""
        self._bufs = {n: fn(b[:, :, : self.length]) for n, b in self._bufs.items()}
        self._template = self.view()

    def nbytes(self) -> int:
        """Bytes held, spare capacity included."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def _widen(self, name: str, dtype: torch.dtype) -> None:
        """Hold field `name` in the wider of its dtype and `dtype`: a block whose norms or scales passed float16's range
        arrives with float32 ones (`codecs.base.storable`), and writing them into a float16 buffer would store inf.
        A new buffer, so a snapshot holding the old one stays valid."""
        buf = self._bufs[name]
        wide = torch.promote_types(buf.dtype, dtype)
        if wide != buf.dtype:
            self._bufs[name] = buf.to(wide)

    def _grow(self, capacity: int) -> None:
        for name, buf in self._bufs.items():
            new = buf.new_empty((*buf.shape[:2], capacity, *buf.shape[3:]))
            new[:, :, : self.length] = buf[:, :, : self.length]
            self._bufs[name] = new
