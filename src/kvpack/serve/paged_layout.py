"""Where a paged KV cache keeps each token's K and V, learned from the cache's own writer.

A serving engine's paged cache holds, per (block, kv head), a plane of `2 * block_size * head_dim`
elements, but the order inside the plane belongs to its attention kernel: vLLM's CPU backend keeps K
transposed (`head_dim x block_size`, for its vectorized q·K) and V by token, and its AMX path tiles
both. Reading the plane as `[block_size, head_dim]` rows would hand a codec channels as if they were
tokens: lossless methods round-trip (the same wrong order is written back), lossy ones quantize the
wrong groups. So instead of assuming an order, `probe_layout` writes tokens whose values spell their
own (slot, channel) with the engine's writer, reads where each one landed, and keeps the offsets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Probe values are base-64 digits of the slot and channel indices: every digit (0..63) and the
# fillers (-1, -2) are exact in bfloat16 and float16, whatever the block size or head size.
_BASE = 64

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (key, value, kv) -> None, in place


@dataclass(frozen=True)
class PlaneLayout:
    """Flat offsets `key, value: (block_size, head_dim)` int64 of every (slot, channel) in one (block, head) plane."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def content_split(cls, block_size: int, head_dim: int) -> PlaneLayout:
        """Rows of `2 * head_dim` per slot, K then V along the content axis (FlashAttention's reading)."""
        rows = torch.arange(block_size)[:, None] * 2 * head_dim + torch.arange(head_dim)[None]
        return cls(rows, rows + head_dim)

    def _index(self, kv: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, side: str):
        planes = kv.view(kv.shape[0], kv.shape[1], -1)  # (blocks, kv_heads, 2 * block_size * head_dim)
        pos = getattr(self, side).to(kv.device)[off]  # (tokens, head_dim)
        heads = torch.arange(kv.shape[1], device=kv.device)
        return planes, (blk[:, None, None], heads[None, :, None], pos[:, None, :])

    def gather(self, kv: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `(tokens, kv_heads, head_dim)` (copies) of the tokens at block `blk`, slot `off` `(tokens,)` of `kv`."""
        out = []
        for side in ("key", "value"):
            planes, index = self._index(kv, blk, off, side)
            out.append(planes[index])
        return out[0], out[1]

    def scatter(self, kv: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V `(tokens, kv_heads, head_dim)` into `kv` at block `blk`, slot `off`, in place."""
        for side, x in (("key", k), ("value", v)):
            planes, index = self._index(kv, blk, off, side)
            planes[index] = x.to(kv.dtype)


def probe_layout(write: Writer, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PlaneLayout:
    """The plane offsets the engine's `write(key, value, kv)` uses.

    `write` stores `key, value: (block_size, kv_heads, head_dim)` into slots 0..block_size-1 of
    `kv: (1, kv_heads, block_size, 2 * head_dim)` as the engine's attention backend does. Raises
    NotImplementedError when the writer does not place every (slot, channel) of each side at exactly
    one offset, the same in every head (e.g. a quantized cache).
    """
    shape = (block_size, kv_heads, head_dim)
    slot = torch.arange(block_size)[:, None, None].expand(shape)
    chan = torch.arange(head_dim)[None, None, :].expand(shape)
    found = {}
    for side in ("key", "value"):
        digits = []
        for index in (slot, slot // _BASE, chan, chan // _BASE):
            kv = torch.full((1, kv_heads, block_size, 2 * head_dim), -2.0, dtype=dtype)
            probe, other = (index % _BASE).to(dtype), torch.full(shape, -1.0, dtype=dtype)
            write(*((probe, other) if side == "key" else (other, probe)), kv)
            digits.append(kv.view(kv_heads, -1).float())
        found[side] = _offsets(digits, block_size, head_dim)
    return PlaneLayout(found["key"], found["value"])


def _offsets(digits: list[torch.Tensor], block_size: int, head_dim: int) -> torch.Tensor:
    """`(block_size, head_dim)` offsets from the four probes' planes `(kv_heads, plane)` (slot lo/hi, channel lo/hi)."""
    written = digits[0] >= 0
    ident = ((digits[0] + _BASE * digits[1]) * head_dim + digits[2] + _BASE * digits[3]).long()
    per_head = []
    for h in range(written.shape[0]):
        where = written[h].nonzero().flatten()
        ids = ident[h, where]
        if len(where) != block_size * head_dim or not torch.equal(ids.sort().values, torch.arange(block_size * head_dim)):
            raise NotImplementedError(
                "the paged KV cache's writer does not store each (slot, channel) once per head (a quantized or "
                "unknown cache layout); KVPackConnector cannot read it"
            )
        pos = torch.empty(block_size * head_dim, dtype=torch.long)
        pos[ids] = where
        per_head.append(pos)
    if any(not torch.equal(p, per_head[0]) for p in per_head[1:]):
        raise NotImplementedError("the paged KV cache orders heads differently from one another; KVPackConnector cannot read it")
    return per_head[0].view(block_size, head_dim)
