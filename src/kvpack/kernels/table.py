"""The kernel table: what computes a decode step's online-softmax partial over each part of a layer.

A one-token decode step (`attention.fused_decode`) walks a layer's parts once, downward: the exact rows (sinks,
window, anchors) and each compressed segment. A segment's entry is found by its codec pair's kernel kinds
`(key_codec.kernel_kind, value_codec.kernel_kind)`; the entry reads the segment's stored tensors, calls its
`torch.library` op (`ops.define`) through `ops.run`, and maps the result back to the model's value space. The op's
kernel for the query's device runs (C++ on CPU, Triton on CUDA, the pure-torch reference elsewhere or under
`KVPACK_BACKEND=torch`), so there is one path for every device. `ops.run` is the op itself under `torch.compile`;
in eager mode it calls the implementation the op's registered kernel would pick, without the dispatcher's round
trip (a decode step makes two of these calls per layer for the default). Every partial is `(m, l, o)` float32 over the kv head's grouped query rows:

    m, l (b, kv, rows, 1)   max score, Σ exp(s - m)
    o    (b, kv, rows, d_v)  Σ exp(s - m) · v, unnormalized

and the parts merge exactly by log-sum-exp (`merge`), as split-K flash decoding merges its splits.

A kernel family registers its entry where it is defined (`register(Kernel(...))` in `kernels/<family>.py`), and
the codec whose `kernel_kind` names it imports that file, so adding a kernel is one file beside its codec
(docs/guide/kernels.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import cpu_lut, ops, reference

Partial = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # m, l (b, kv, rows, 1); o (b, kv, rows, d_v)


@dataclass(frozen=True)
class Request:
    """What a segment's partial needs besides its codes.

    scale: the softmax scale. first_position: `() -> (b,)` int64 RoPE position of the segment's first token, for
    kernels whose keys are stored without RoPE or centered on a turning mean (called only by them), or None when
    unknown. skip: `(S,)` int64 ascending offsets of tokens to leave out (the segment's anchors, held exact in
    another part), or None."""

    scale: float
    first_position: Callable[[], torch.Tensor] | None = None
    skip: torch.Tensor | None = None


@dataclass(frozen=True)
class Kernel:
    """One family's entry: what it serves, and `partial(q, segment, request) -> Partial | None`.

    `q (b, kv, rows, d)` float32 is the query grouped by kv head (`codecs.base.group_query`); `segment` anything with
    `key_codec`, `value_codec`, `keys`, `values` (a cache segment, or one head group of one). `partial` returns None
    when this segment's codecs are configured outside what the kernel reads (the caller then uses the codecs' math).
    """

    kind: tuple[str, str]  # (key codec's kernel_kind, value codec's kernel_kind)
    partial: Callable[[torch.Tensor, Any, Request], Partial | None]
    op: str | None = None  # the `kvpack::` op it calls (None: a composite of other entries)
    devices: tuple[str, ...] = ("cpu", "cuda")  # where a fused kernel serves it (C++ / Triton); elsewhere the reference
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # query dtypes the fused kernels take (others: the reference)
    skip: bool = True  # leaves a segment's anchors out (`Request.skip`)
    positions: bool = False  # reads `Request.first_position` (RoPE re-applied, or a turning mean's term)
    head_dims: str = "any"  # the head dims its kernels take, in words
    # `rows(q, segment, request) -> Partial | None` over a batch whose rows hold their own codecs (`codecs.rows.RowsCodec`:
    # `segment.key_codec.inner`, one per row) in one call, or None: the rows entry then runs this entry row by row.
    rows: Callable[[torch.Tensor, Any, Request], Partial | None] | None = None

    def __post_init__(self):
        if len(self.kind) != 2 or not all(isinstance(k, str) and k for k in self.kind):
            raise ValueError(f"kind must be a (key kind, value kind) pair of names, got {self.kind!r}")
        if self.op is not None and not hasattr(torch.ops.kvpack, self.op):
            raise ValueError(f"op kvpack::{self.op} is not defined: define it (kernels.ops.define) before its table entry")


KERNELS: dict[tuple[str, str], Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Add `kernel` to the table under its kind (once)."""
    if kernel.kind in KERNELS:
        raise ValueError(f"a kernel for {kernel.kind} is already registered")
    KERNELS[kernel.kind] = kernel
    return kernel


def lookup(key_codec, value_codec) -> Kernel | None:
    """The entry for a codec pair, or None (no fused kernel reads these codecs' blocks)."""
    key, value = key_codec.kernel_kind, value_codec.kernel_kind
    return None if key is None or value is None else KERNELS.get((key, value))


class SegmentData(NamedTuple):
    """What an entry reads of a segment: its codecs and its live `Packed` keys and values (resolved once per call:
    a cache segment builds its views on access)."""

    key_codec: Any
    value_codec: Any
    keys: Any
    values: Any


def segment_partial(q: torch.Tensor, seg, scale: float, first_position: Callable[[], torch.Tensor] | None = None,
                    skip: torch.Tensor | None = None) -> Partial | None:
    """One segment's partial through its entry (see `Request` for the arguments); None without one, or when the
    segment's per-token norms or scales are not float16 (the form every kernel reads)."""
    kernel = lookup(seg.key_codec, seg.value_codec)
    if kernel is None:
        return None
    data = seg if isinstance(seg, SegmentData) else SegmentData(seg.key_codec, seg.value_codec, seg.keys, seg.values)
    if not fp16_meta(data):
        return None
    return kernel.partial(q, data, Request(scale, first_position, skip))


def fp16_meta(seg) -> bool:
    """Whether a segment's per-token norms and scales are float16. A block whose norms passed float16's range keeps float32
    ones (`codecs.base.storable`); its segment then runs its codecs' torch paths, which read either."""
    for packed in (seg.keys, seg.values):
        for name in ("norm", "scale", "zero"):
            t = getattr(packed, name, None)
            if t is not None and t.dtype != torch.float16:
                return False
    return True


class ExactRows(NamedTuple):
    """Uncompressed rows (sinks, window, anchors) as a part: keys `(b, kv, t, d)`, values `(b, kv, t, d_v)`."""

    keys: torch.Tensor
    values: torch.Tensor


EXACT = ("exact", "exact")


def exact_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Partial:
    """The partial over exact rows, through the table's exact entry."""
    return KERNELS[EXACT].partial(q, ExactRows(k, v), Request(scale))


register(Kernel(EXACT, lambda q, rows, req: ops.run("exact_attention", q, rows.keys, rows.values, req.scale, None, 0.0, req.skip),
                op="exact_attention", devices=("cpu",), dtypes=(torch.float32,), head_dims="any (fp16 or fp32 rows in C++)"))


def merge(parts: list[Partial]) -> torch.Tensor:
    """Normalized attention `(b, kv, rows, d_v)` from the parts' partials: `Σ e^(m_i - M) o_i / Σ e^(m_i - M) l_i`,
    M = max m_i. One C++ call on CPU (instead of ~10 torch ops) when the C++ kernels run; torch ops otherwise."""
    if _cpp(parts[0][0]):
        return cpu_lut.merge_partials([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])
    return reference.merge_partials(parts)


def _cpp(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and ops.get_backend() in (ops.Backend.AUTO, ops.Backend.CPU) and cpu_lut.available()


def merge_with_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, parts: list[Partial]) -> torch.Tensor:
    """`merge([exact_partial(q, k, v, scale), *parts])`: the exact rows' partial and the merge of every part, as one
    `kvpack::exact_merge` op (one C++ call on CPU where two calls and their Python took ~30 us a layer; on CUDA one
    Triton launch where the torch ops took ~20)."""
    return ops.run("exact_merge", q, k, v, scale, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])
