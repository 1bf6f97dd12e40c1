"""One codec per batch row: each row's fitted state learned from its own tokens.

A codec that learns from data (TurboQuant's channel mean and scale, KVQuant's per-channel levels, a subspace basis)
fits once, on the first block it sees. In a batch that block holds every row: one state pooled over prompts of
different texts, lengths and position ranges, which fits no row as well as a fit on that row alone does (a left-padded
row of a SmolLM2 batch lost 1.3-1.6x in KL to its run alone, docs/guide/reliability.md). `RowsCodec` gives each row
its own inner codec, built from the same spec, so a row is stored exactly as it would be in a batch of one: what a row
holds never depends on which other requests share its batch.

Packed layout: the inner codec's own packed class, rows concatenated along dim 0 (each inner codec encodes a batch of
one), so the cache's block runs, crop, anchors, batch selection and files treat it as the inner codec's block. Rows of
one block must agree in field shapes; per-token norms that one row widened past float16 (`storable`) promote the
block's field, which the torch paths read.

The cache wraps a codec only for a batch of more than one row and only when its `learns` is set; a codec whose fit
reads the prompt's queries or a byte allowance (Shard's prompt codecs) keeps one state for the batch, since the layer's
allowance is shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..kernels import rows as _kernel  # noqa: F401  (registers the ("rows", "rows") entry `kernel_kind` names)
from .base import Codec, Packed


def row(packed: Packed, i: int) -> Packed:
    """Row `i` of a block as a batch of one (views, no copy)."""
    return packed.map_tensors(lambda t: t[i : i + 1])


def join_rows(parts: Sequence[Packed]) -> Packed:
    """Blocks of one row each (one inner codec's class, equal token counts) -> one block of `len(parts)` rows."""
    first = parts[0]
    if len(parts) == 1:
        return first
    changes = {f.name: torch.cat([getattr(p, f.name) for p in parts], dim=0)
               for f in dataclasses.fields(first) if isinstance(getattr(first, f.name), torch.Tensor)}
    return dataclasses.replace(first, **changes)


def _row_of(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Row `i` of a `(batch, ...)` tensor (positions, queries), or None; a batch of one serves every row."""
    if t is None:
        return None
    return t if t.shape[0] == 1 else t[i : i + 1]


class RowsCodec(Codec):
    """Inner codecs, one per batch row, built from one spec. x: `(rows, kv_heads, tokens, head_dim)`.

    Reports its inner codec's `name`, `config`, `token_multiple` and positions use, so stats and files name the codec
    the method chose; `kernel_kind` is "rows" (the kernel table runs each row's inner entry, `kvpack.kernels.rows`)."""

    def __init__(self, inner: Sequence[Codec]):
        if not inner:
            raise ValueError("a rows codec needs one inner codec per batch row, got none")
        first = inner[0]
        if any(type(c) is not type(first) or c.config != first.config for c in inner):
            raise ValueError(f"a rows codec's inner codecs must share one class and config, got {sorted({type(c).__name__ for c in inner})}")
        super().__init__(first.config, first.head_dim, first.kv_heads, first.layer_idx)
        self.inner = list(inner)
        self.name = first.name
        self.config_class = type(first.config)
        self.uses_positions = first.uses_positions
        self.kernel_kind = None if first.kernel_kind is None else "rows"

    @property
    def token_multiple(self) -> int:
        return self.inner[0].token_multiple

    @property
    def rows(self) -> int:
        return len(self.inner)

    def _rows_of(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.rows:
            raise ValueError(f"this rows codec holds {self.rows} batch rows, got a batch of {x.shape[0]}")

    def remap(self, rows: Sequence[int]) -> None:
        """Follow a batch selection or repetition: new row `j` is old row `rows[j]` (inner codecs shared, not copied:
        their state is fixed once fitted)."""
        self.inner = [self.inner[i] for i in rows]

    # -- codec interface ------------------------------------------------------------------------
    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        self._rows_of(x)
        for i, codec in enumerate(self.inner):
            codec.fit(x[i : i + 1], _row_of(positions, i))

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Packed:
        self._rows_of(x)
        return join_rows([codec.encode(x[i : i + 1], _row_of(positions, i)) for i, codec in enumerate(self.inner)])

    def decode(self, packed: Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat([codec.decode(row(packed, i), _row_of(positions, i)) for i, codec in enumerate(self.inner)], dim=0)

    def scores(self, query: torch.Tensor, packed: Packed, query_positions=None, key_positions=None) -> torch.Tensor:
        """`query (rows, q_heads, q_len, d)` -> `(rows, q_heads, q_len, tokens)`, each row through its own codec."""
        self._rows_of(query)
        return torch.cat([codec.scores(query[i : i + 1], row(packed, i), _row_of(query_positions, i), _row_of(key_positions, i))
                          for i, codec in enumerate(self.inner)], dim=0)

    def weighted_sum(self, probs: torch.Tensor, packed: Packed) -> torch.Tensor:
        """`probs (rows, q_heads, q_len, tokens)` @ V -> `(rows, q_heads, q_len, head_dim)`, row by row."""
        self._rows_of(probs)
        return torch.cat([codec.weighted_sum(probs[i : i + 1], row(packed, i)) for i, codec in enumerate(self.inner)], dim=0)

    # -- state ----------------------------------------------------------------------------------
    @property
    def learns(self) -> bool:
        return self.inner[0].learns

    def set_rope(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        for codec in self.inner:
            codec.set_rope(inv_freq, attention_scaling)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each row's fitted state, its keys prefixed `r<i>.` (a row repeated by a batch selection is saved per row)."""
        return {f"r{i}.{k}": v for i, codec in enumerate(self.inner) for k, v in codec.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.inner]
        for key, value in state.items():
            r, dot, rest = key.partition(".")
            if not dot or not r.startswith("r") or not r[1:].isdigit() or int(r[1:]) >= len(parts):
                raise ValueError(f"codec {self.name!r} per-row state keys are r<row>.<key> for rows 0..{len(parts) - 1}, got {key!r}")
            parts[int(r[1:])][rest] = value
        for codec, part in zip(self.inner, parts, strict=True):
            codec.load_state_dict(part)

    def state_nbytes(self) -> int:
        seen = {id(c): c.state_nbytes() for c in self.inner}  # a repeated row's codec is held once
        return sum(seen.values())
