"""KVQuant: pre-RoPE per-channel non-uniform keys, per-token non-uniform values, dense-and-sparse outliers.

Hooper et al., "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache Quantization"
(arXiv:2401.18079). What is kept from the paper:
- keys are quantized per channel *before* RoPE (§3.1, §3.2): the codec undoes RoPE with the model's
  `inv_freq` / `attention_scaling`, where outlier channels sit still instead of being mixed between
  the two coordinates of a rotating pair;
- non-uniform codebooks (nuqX, §3.3) fitted to the data by 1-D k-means: one per (kv head, channel)
  for keys, one per kv head over per-token-normalized values. The paper weights k-means by Fisher
  information from an offline calibration set, which needs gradients; here it is plain MSE, fitted on
  the first block the codec encodes (the prompt), as Shard fits its PCA;
- per-vector dense-and-sparse quantization (§3.4): the entries farthest outside a per-channel
  threshold (keys; the `outlier_fraction / 2` and `1 - outlier_fraction / 2` quantiles of the channel,
  fitted in `fit`) or the largest magnitudes of the token (values, thresholds "online" per token) are
  kept exactly (fp16) in a sparse side tensor. The paper stores a variable number in CSR/CSC form;
  here every token keeps the same count `k`, so each packed tensor keeps tokens at dim 2 and blocks
  concatenate like every other codec's;
- attention sinks (§3.5, first token in fp16): the cache's exact sinks already do this.

Layout per token and kv head (d channels, b bits, k = `outliers_per_token`):
    keys:   ceil(d*b/8) B codes + k B uint8 channel indices + 2k B fp16 values
    values: the same + 2 B fp16 centre + 2 B fp16 radius of the token's inlier range
d = 64, k = 1: keys 19 / 27 / 35 B and values 23 / 31 / 39 B at 2 / 3 / 4 bits, vs 128 B in fp16.

Attention reads the codes block by block (at most `_CHUNK_ELEMENTS` decoded floats at a time): a codebook
gather and the outlier scatter rebuild one chunk, keys get RoPE back at their positions, one matmul.
The paper's kernels do the same (dequantize, apply RoPE on the fly). The RoPE relative-position
identity (pca.py) would avoid re-rotating keys, but each key is a full d-dim vector here, so the
identity costs `rows * d` products per key token against trig tables of `(q_len, tokens, d/2)`,
while re-rotating costs `3 d` per key token plus the same matmul: re-RoPE per chunk is cheaper and
keeps the float temporary to one chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..primitives.packing import pack_bits, unpack_bits
from ..primitives.rope import apply_rope, undo_rope
from ..primitives.scalar_codebook import lloyd_1d, nearest_level, sorted_quantiles
from ..primitives.validation import check_query
from .base import CHUNK_ELEMENTS, FP16_MAX, Codec, Packed, check_state, chunked_scores, chunked_sum, group_query, ungroup
from .rope_keys import UnRopedKeys

BITS = (2, 3, 4)
_CHUNK_ELEMENTS = CHUNK_ELEMENTS  # largest temporary of `scores` / `weighted_sum`: the shared bound, a knob tests shrink
_TINY = 1e-6  # smallest channel / token radius: a constant channel or token has no range to normalize


@dataclass(frozen=True)
class KVQuantConfig:
    """bits: 2 | 3 | 4 bits per dense code. outlier_fraction: share of each vector kept exactly,
    in [0, 0.1] (paper: 0.01); a token keeps `max(1, round(outlier_fraction * head_dim))` entries
    (0 when the fraction is 0), i.e. 1 of 64 or 128 channels at the default 1%."""

    bits: int = 4
    outlier_fraction: float = 0.01

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.outlier_fraction, bool) or not isinstance(self.outlier_fraction, int | float):
            raise ValueError(f"outlier_fraction must be a number in [0, 0.1], got {self.outlier_fraction!r}")
        if not 0.0 <= self.outlier_fraction <= 0.1:
            raise ValueError(f"outlier_fraction must be in [0, 0.1], got {self.outlier_fraction}")

    def outliers_per_token(self, head_dim: int) -> int:
        return 0 if self.outlier_fraction == 0 else max(1, round(self.outlier_fraction * head_dim))


@dataclass
class KVQuantPacked(Packed):
    codes: torch.Tensor  # (batch, kv_heads, tokens, ceil(d * bits / 8)) uint8, bit-packed along channels
    outlier_index: torch.Tensor  # (batch, kv_heads, tokens, k) uint8 channel of each exact entry
    outlier_value: torch.Tensor  # (batch, kv_heads, tokens, k) float16 its value (un-RoPEd for keys)
    center: torch.Tensor | None = None  # values only: (batch, kv_heads, tokens, 1) float16 midpoint of the inlier range
    radius: torch.Tensor | None = None  # values only: (batch, kv_heads, tokens, 1) float16 half-width of that range


class _KVQuantBase(Codec):
    """What keys and values share: outlier bookkeeping, codebook lookup, chunked reading."""

    config_class = KVQuantConfig

    @classmethod
    def max_entry(cls, config: KVQuantConfig, head_dim: int) -> float:
        # Outlier values, codebooks and thresholds are float16 in the entries' own scale, and un-RoPEd keys mix RoPE pairs
        # (a pair's entries of m turn into up to sqrt(2)·m): half of float16's range keeps them finite.
        return FP16_MAX / 2

    def __init__(self, config: KVQuantConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        self.levels = 1 << config.bits
        self.k = config.outliers_per_token(head_dim)
        if self.k and head_dim > 256:
            raise ValueError(f"outlier channel indices are uint8: head_dim must be <= 256 with outliers, got {head_dim}")
        self.codebook: torch.Tensor | None = None  # float16, keys (kv_heads, d, L), values (kv_heads, 1, L)

    @property
    def fitted(self) -> bool:
        return self.codebook is not None

    def _pack(self, codes: torch.Tensor, x: torch.Tensor, index: torch.Tensor, **extra) -> KVQuantPacked:
        """codes `(b, h, t, d)` long, outlier `index (b, h, t, k)` into the exact values of `x`."""
        value = x.gather(-1, index).half()
        return KVQuantPacked(x.shape[2], pack_bits(codes.to(torch.uint8), self.config.bits), index.to(torch.uint8), value, **extra)

    def _lookup(self, packed: KVQuantPacked, book: torch.Tensor) -> torch.Tensor:
        """Codebook entries `(b, h, t, d)` float32; `book (kv_heads, d | 1, L)` (per channel or per head)."""
        codes = unpack_bits(packed.codes, self.config.bits, self.head_dim).long()
        b, h, _, d = codes.shape
        # A gather along the level axis of the (broadcast) table: 2x faster on CPU than flat advanced indexing.
        table = self._on("codebook", book, codes.device).float().transpose(1, 2).unsqueeze(0).expand(b, h, self.levels, d)
        return torch.gather(table, 2, codes)

    @staticmethod
    def _restore_outliers(dense: torch.Tensor, packed: KVQuantPacked) -> torch.Tensor:
        return dense.scatter_(-1, packed.outlier_index.long(), packed.outlier_value.float())



class KVQuantKeyCodec(UnRopedKeys, _KVQuantBase):
    """Keys: RoPE undone, per-(kv head, channel) codebooks and outlier thresholds fitted on the first block."""

    name = "kvquant-key"
    uses_positions = True

    def __init__(self, config: KVQuantConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        if head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head_dim, got {head_dim}")
        # Until `set_rope`, keys are taken as RoPE-free: zero frequencies make RoPE the identity.
        self._init_rope()
        self.center: torch.Tensor | None = None  # (kv_heads, d) float16 midpoint of each channel's thresholds
        self.radius: torch.Tensor | None = None  # (kv_heads, d) float16 half the distance between them


    def _unroped(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        self._check(x)
        return undo_rope(x.float(), *self._cos_sin(positions, x.shape[0], x.shape[2], x.device))

    @staticmethod
    def _by_channel(x0: torch.Tensor) -> torch.Tensor:
        """`(b, h, t, d)` -> `(h * d, b * t)`: one row of samples per (kv head, channel)."""
        return x0.permute(1, 3, 0, 2).reshape(x0.shape[1] * x0.shape[3], -1)

    def _outlier_index(self, x0: torch.Tensor) -> torch.Tensor:
        """The `k` channels of each token farthest outside their channel's thresholds `(b, h, t, k)` long."""
        center, radius = self._on("center", self.center, x0.device).float(), self._on("radius", self.radius, x0.device).float()
        excess = (x0 - center[None, :, None]).abs() / radius[None, :, None]
        return excess.topk(self.k, dim=-1).indices

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Thresholds and per-channel codebooks from keys `x (batch, kv_heads, tokens, head_dim)` (RoPE'd)."""
        x0 = self._unroped(x, positions)
        samples = self._by_channel(x0)  # (h * d, N)
        f = self.config.outlier_fraction
        lo, hi = sorted_quantiles(samples, torch.tensor([f / 2, 1 - f / 2])).unbind(-1)
        shape = (self.kv_heads, self.head_dim)
        self.center = ((lo + hi) / 2).view(shape).half()
        self.radius = ((hi - lo) / 2).clamp_min(_TINY).view(shape).half()
        keep = torch.ones_like(x0).scatter_(-1, self._outlier_index(x0), 0.0)  # exact entries do not shape the codebook
        init = sorted_quantiles(samples, (torch.arange(self.levels) + 0.5) / self.levels)
        levels = lloyd_1d(samples, init, self._by_channel(keep))
        self.codebook = levels.view(*shape, self.levels).half()

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> KVQuantPacked:
        if not self.fitted:
            self.fit(x, positions)
        x0 = self._unroped(x, positions)
        b, h, t, d = x0.shape
        book = self._on("codebook", self.codebook, x0.device).float().view(h * d, self.levels)
        codes = nearest_level(self._by_channel(x0), book).view(h, d, b, t).permute(2, 0, 3, 1)
        return self._pack(codes, x0, self._outlier_index(x0))

    def decode_unroped(self, packed: KVQuantPacked) -> torch.Tensor:
        """Keys without RoPE `(b, h, t, d)` float32: codebook entries with the exact outliers put back."""
        return self._restore_outliers(self._lookup(packed, self.codebook), packed)

    def decode(self, packed: KVQuantPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        keys = self.decode_unroped(packed)
        return apply_rope(keys, *self._cos_sin(positions, keys.shape[0], keys.shape[2], keys.device))

    def scores(
        self,
        query: torch.Tensor,
        packed: KVQuantPacked,
        query_positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """<q, RoPE(k)> `(batch, q_heads, q_len, tokens)`: the query arrives RoPE'd, keys get RoPE per chunk."""
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)

        def part(block: KVQuantPacked, start: int, stop: int) -> torch.Tensor:
            pos = key_positions if key_positions is None or block is packed else key_positions[:, start:stop]
            return q @ self.decode(block, pos).mT

        return ungroup(chunked_scores(part, packed, q, self._width(q.shape[2]), limit=_CHUNK_ELEMENTS), query.shape[1])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-channel `codebook (kv_heads, d, 2^bits)`, outlier threshold `center` / `radius (kv_heads, d)`, all fp16."""
        return {} if not self.fitted else {"codebook": self.codebook, "center": self.center, "radius": self.radius}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        shape = (self.kv_heads, self.head_dim)
        expected = {"codebook": ((*shape, self.levels), torch.float16), "center": (shape, torch.float16), "radius": (shape, torch.float16)}
        check_state(self.name, state, expected)
        self.codebook, self.center, self.radius = state.get("codebook"), state.get("center"), state.get("radius")


class KVQuantValueCodec(_KVQuantBase):
    """Values: per-token range after the `k` largest magnitudes, a per-kv-head codebook on [-1, 1]."""

    name = "kvquant-value"

    def _normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x (b, h, t, d)` -> (outlier index `(b, h, t, k)`, fp16 centre and radius `(b, h, t, 1)`, x on [-1, 1])."""
        index = x.abs().topk(self.k, dim=-1).indices
        out = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, index, True)
        lo = x.masked_fill(out, math.inf).amin(-1, keepdim=True)
        hi = x.masked_fill(out, -math.inf).amax(-1, keepdim=True)
        # Normalize against the stored fp16 centre and radius, so decode reproduces what encode assumed.
        center, radius = ((lo + hi) / 2).half(), ((hi - lo) / 2).half()
        z = (x - center.float()) / radius.float().clamp_min(_TINY)
        return index, center, radius, z

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """One codebook per kv head on [-1, 1] from the values' normalized inlier entries (plain MSE k-means).

        The ends are not pinned at ±1: at 2 bits, keeping every token's min and max exact costs half the
        levels, 1.6x the squared error of free levels on Gaussian vectors of 64 channels.
        """
        self._check(x)
        x = x.float()
        index, _, _, z = self._normalize(x)
        keep = torch.ones_like(x).scatter_(-1, index, 0.0)
        samples, weights = (t.transpose(0, 1).reshape(self.kv_heads, -1) for t in (z, keep))
        init = torch.linspace(-1.0, 1.0, self.levels, device=x.device).expand(self.kv_heads, -1)
        self.codebook = lloyd_1d(samples, init, weights).half().unsqueeze(1)  # (kv_heads, 1, L)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> KVQuantPacked:
        if not self.fitted:
            self.fit(x)
        self._check(x)
        x = x.float()
        index, center, radius, z = self._normalize(x)
        b, h, t, d = x.shape
        book = self._on("codebook", self.codebook, x.device).float().squeeze(1)  # (kv_heads, L)
        codes = nearest_level(z.transpose(0, 1).reshape(h, -1), book).view(h, b, t, d).transpose(0, 1)
        return self._pack(codes, x, index, center=center, radius=radius)

    def decode(self, packed: KVQuantPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        dense = packed.center.float() + packed.radius.float() * self._lookup(packed, self.codebook)
        return self._restore_outliers(dense, packed)

    def weighted_sum(self, probs: torch.Tensor, packed: KVQuantPacked) -> torch.Tensor:
        """`probs (batch, q_heads, q_len, tokens)` @ V, decoding one chunk of tokens at a time."""
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        out = chunked_sum(lambda pc, block: pc @ self.decode(block), p, packed, self._width(p.shape[2]), limit=_CHUNK_ELEMENTS)
        return ungroup(out, probs.shape[1])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The per-kv-head `codebook (kv_heads, 1, 2^bits)` fp16; centres and radii are per token, in the packed blocks."""
        return {} if not self.fitted else {"codebook": self.codebook}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        check_state(self.name, state, {"codebook": ((self.kv_heads, 1, self.levels), torch.float16)})
        self.codebook = state.get("codebook")

