"""Widths per kv head: each group of a layer's kv heads stored by its own codec (`auto`'s per-head allocation).

A layer's kv heads do not matter alike: in SmolLM2's layer 18 one of three heads carries 99% of what its
2-bit keys cost (docs/notes/auto.md, "Widths per kv head"). `HeadsCodec` holds a partition of the kv heads into
groups, each with an inner codec (`fp16`, `int8` or `turboquant` at some width) built for that group's head
count, and delegates everything to them head group by head group. Attention heads are independent, so
scores and weighted sums split along heads exactly: no partial softmax crosses a group, and the fused
kernels (`kvpack.kernels.heads`) run each group's inner kernel on its query heads when the key and value
codecs share one partition (as `auto` builds them).

Packed layout: every group's inner tensors ride in numbered slots (`s0`, `s1`, ...) of one `HeadsPacked`,
in group order and each inner dataclass's field order, so tokens stay at dim 2 of every tensor and the
cache's block runs, crop, anchors, batch selection and files treat it as any other codec's block.
The codec knows which slot is which (`HeadsCodec.layout`), so a block carries nothing but tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import heads as _kernel  # noqa: F401  (registers the ("heads", "heads") entry `kernel_kind` names)
from ..primitives.validation import check_query
from .base import Codec, Packed, group_query
from .spec import CodecSpec

INNER = ("fp16", "int8", "turboquant")  # codecs a group may use: per-token, no fit on queries, no scalar packed fields
SLOTS = 32  # tensor slots of a HeadsPacked: 16 groups of two-tensor codecs (int8, turboquant without QJL)


@dataclass(frozen=True)
class HeadsConfig:
    """heads: per kv head, the index of its group in `codecs` (e.g. [0, 1, 0]: heads 0 and 2 share codec 0).
    codecs: per group, {"codec": one of INNER, "options": that codec's options}; every group holds a head.

    Plain lists and dicts, so a method naming this codec round-trips through JSON (saved caches, profiles)."""

    heads: Sequence[int] = ()
    codecs: Sequence[dict] = ()

    def __post_init__(self):
        if not self.codecs or not isinstance(self.codecs, list | tuple):
            raise ValueError(f"codecs must be a non-empty list of {{'codec', 'options'}} dicts, one per head group, got {self.codecs!r}")
        for entry in self.codecs:
            if not isinstance(entry, dict) or set(entry) - {"codec", "options"} or entry.get("codec") not in INNER:
                raise ValueError(f"each head group's codec must be {{'codec': one of {INNER}, 'options': {{...}}}}, got {entry!r}")
            CodecSpec(entry["codec"], dict(entry.get("options", {})))  # validates the options
        groups = len(self.codecs)
        if not isinstance(self.heads, list | tuple) or not self.heads or any(isinstance(h, bool) or not isinstance(h, int) for h in self.heads):
            raise ValueError(f"heads must be a non-empty list of group indices, one per kv head, got {self.heads!r}")
        if set(self.heads) != set(range(groups)):
            raise ValueError(f"heads {list(self.heads)} must use every group index in 0..{groups - 1} and no other")
        if 2 * groups > SLOTS:
            raise ValueError(f"at most {SLOTS // 2} head groups, got {groups}")

    def specs(self) -> list:
        """Each group's `CodecSpec`."""
        return [CodecSpec(e["codec"], dict(e.get("options", {}))) for e in self.codecs]


HeadsPacked = dataclasses.make_dataclass(
    "HeadsPacked",
    [(f"s{i}", torch.Tensor | None, dataclasses.field(default=None)) for i in range(SLOTS)],
    bases=(Packed,),
    namespace={"__doc__": "Head groups' inner tensors in slots s0..: each `(batch, group heads, tokens, n)` (`HeadsCodec.layout`).",
               "__module__": __name__},
)


class HeadsCodec(Codec):
    """Groups of kv heads, each stored by its own codec. x: `(batch, kv_heads, tokens, head_dim)`."""

    config_class = HeadsConfig

    name = "heads"
    kernel_kind = "heads"  # the kernel table splits it into its groups (kvpack.kernels.heads)

    def __init__(self, config: HeadsConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        if len(config.heads) != kv_heads:
            raise ValueError(f"a heads codec for {len(config.heads)} kv heads cannot store a layer of {kv_heads}")
        self.index = [[h for h, g in enumerate(config.heads) if g == i] for i in range(len(config.codecs))]  # kv heads per group
        self.inner = [spec.build(head_dim, len(idx), layer_idx) for spec, idx in zip(config.specs(), self.index, strict=True)]
        self.uses_positions = self.needs_positions(config)  # per instance, as the groups' codecs decide
        self._layout: list[tuple[type[Packed], list[str]]] | None = None
        self._index_t: dict[torch.device, list[torch.Tensor]] = {}

    @property
    def partition(self) -> tuple[tuple[int, ...], ...]:
        """The kv heads of each group, in group order."""
        return tuple(tuple(idx) for idx in self.index)

    def heads_of(self, group: int, device: torch.device) -> torch.Tensor:
        """`(group heads,)` long index of group `group`'s kv heads, on `device` (cached)."""
        if device not in self._index_t:
            self._index_t[device] = [torch.tensor(idx, dtype=torch.long, device=device) for idx in self.index]
        return self._index_t[device][group]

    # -- packing --------------------------------------------------------------------------------
    def layout(self) -> list[tuple[type[Packed], list[str]]]:
        """Each group's inner packed class and the tensor fields it fills, in slot order (from one small encode,
        so a codec that has encoded nothing yet, e.g. one rebuilt to read a file, reads slots the same way)."""
        if self._layout is None:
            gen = torch.Generator().manual_seed(0)
            layout = []
            for codec in self.inner:
                x = torch.randn(1, codec.kv_heads, codec.token_multiple, self.head_dim, generator=gen)
                part = codec.encode(x, torch.zeros(1, x.shape[2], dtype=torch.long) if codec.uses_positions else None)
                layout.append((type(part), [f.name for f in dataclasses.fields(part) if isinstance(getattr(part, f.name), torch.Tensor)]))
            if sum(len(names) for _, names in layout) > SLOTS:
                raise ValueError(f"these head groups' codecs hold {sum(len(n) for _, n in layout)} tensors per block; a heads block has {SLOTS} slots")
            self._layout = layout
        return self._layout

    def split(self, packed: Packed) -> list[Packed]:
        """The inner packed block of each group, as views of `packed`'s slots (no copy)."""
        out, slot = [], 0
        for cls, names in self.layout():
            out.append(cls(packed.num_tokens, **{n: getattr(packed, f"s{slot + i}") for i, n in enumerate(names)}))
            slot += len(names)
        return out

    def join(self, parts: list[Packed]) -> Packed:
        """One `HeadsPacked` of the groups' inner blocks (their tensors in slot order)."""
        slots = [getattr(part, n) for part, (_, names) in zip(parts, self.layout(), strict=True) for n in names]
        return HeadsPacked(parts[0].num_tokens, **{f"s{i}": t for i, t in enumerate(slots)})

    # -- codec interface ------------------------------------------------------------------------
    def _pick(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """`x (b, kv_heads, ...)` -> `(b, group heads, ...)`."""
        return x.index_select(1, self.heads_of(group, x.device))

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        self._check(x)
        for g, codec in enumerate(self.inner):
            codec.fit(self._pick(x, g), positions)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> HeadsPacked:
        self._check(x)
        return self.join([codec.encode(self._pick(x, g), positions) for g, codec in enumerate(self.inner)])

    def decode(self, packed: Packed, positions: torch.Tensor | None = None) -> torch.Tensor:
        parts = self.split(packed)
        first = self.inner[0].decode(parts[0], positions)
        out = first.new_empty(first.shape[0], self.kv_heads, *first.shape[2:])
        for g, (codec, part) in enumerate(zip(self.inner, parts, strict=True)):
            out.index_copy_(1, self.heads_of(g, out.device), first if g == 0 else codec.decode(part, positions))
        return out

    def scores(self, query: torch.Tensor, packed: Packed, query_positions=None, key_positions=None) -> torch.Tensor:
        """`query (b, q_heads, q_len, d)` -> `(b, q_heads, q_len, tokens)`: each group's codec on its query heads."""
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query, self.kv_heads)  # (b, kv, group * q_len, d): a kv head's query heads are contiguous
        out = None
        for g, (codec, part) in enumerate(zip(self.inner, self.split(packed), strict=True)):
            qg = self._pick(q, g)
            s = codec.scores(qg.reshape(qg.shape[0], -1, query.shape[2], qg.shape[-1]), part, query_positions, key_positions)
            s = s.reshape(*qg.shape[:3], -1)  # (b, group heads, rows, tokens)
            out = s.new_empty(q.shape[0], self.kv_heads, q.shape[2], s.shape[-1]) if out is None else out
            out.index_copy_(1, self.heads_of(g, s.device), s)
        return out.reshape(*query.shape[:3], -1)

    def weighted_sum(self, probs: torch.Tensor, packed: Packed) -> torch.Tensor:
        """`probs (b, q_heads, q_len, tokens)` @ V -> `(b, q_heads, q_len, head_dim)`, group by group."""
        p = group_query(probs, self.kv_heads)  # (b, kv, rows, tokens)
        out = None
        for g, (codec, part) in enumerate(zip(self.inner, self.split(packed), strict=True)):
            pg = self._pick(p, g)
            o = codec.weighted_sum(pg.reshape(pg.shape[0], -1, probs.shape[2], pg.shape[-1]), part).reshape(*pg.shape[:3], -1)
            out = o.new_empty(p.shape[0], self.kv_heads, p.shape[2], o.shape[-1]) if out is None else out
            out.index_copy_(1, self.heads_of(g, o.device), o)
        return out.reshape(*probs.shape[:3], -1)

    # -- state ----------------------------------------------------------------------------------
    @classmethod
    def needs_positions(cls, config: HeadsConfig) -> bool:
        return any(spec.uses_positions for spec in config.specs())

    def set_rope(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        for codec in self.inner:
            codec.set_rope(inv_freq, attention_scaling)

    @property
    def learns(self) -> bool:
        return any(codec.learns for codec in self.inner)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each group's fitted state, its keys prefixed `g<i>.`."""
        return {f"g{g}.{k}": v for g, codec in enumerate(self.inner) for k, v in codec.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        groups: list[dict[str, Any]] = [{} for _ in self.inner]
        for key, value in state.items():
            g, dot, rest = key.partition(".")
            if not dot or not g.startswith("g") or not g[1:].isdigit() or int(g[1:]) >= len(groups):
                raise ValueError(f"codec 'heads' state keys are g<group>.<key> for groups 0..{len(groups) - 1}, got {key!r}")
            groups[int(g[1:])][rest] = value
        for codec, part in zip(self.inner, groups, strict=True):
            codec.load_state_dict(part)

    def state_nbytes(self) -> int:
        return sum(codec.state_nbytes() for codec in self.inner)
