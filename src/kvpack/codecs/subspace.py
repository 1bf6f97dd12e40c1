"""Subspace quantization (SQuat-style): a learned orthogonal basis per kv head, coefficients coded per subspace.

After SQuat (Wang et al., "SQuat: Subspace-orthogonal KV Cache Quantization", arXiv:2503.24358) and
ADR-004's archive tier: vectors `(batch, kv_heads, tokens, head_dim)` are coded in a basis learned
from the data rather than in the model's channels. SQuat itself builds a subspace from the prompt's
queries and steers each key's quantization error orthogonal to it, element by element; this codec
keeps the cheaper part that the cache can read in its own domain — a fitted orthogonal basis and
coefficients quantized per subspace — and does not do SQuat's error-steering loop.

`fit` learns, per kv head:
- a mean and the full PCA basis (exact float64 eigendecomposition, `primitives/pca.py`), stored as
  int8 with an fp16 scale per column; coefficients are least-squares against that stored basis, so
  its rounding costs nothing (the basis stays full rank);
- an fp16 standard deviation per component: coefficients are divided by it, so every component
  reaches the quantizer at unit scale (PCA variances span orders of magnitude), numerically null
  directions excepted (`STD_FLOOR`);
- for each of the `n_subspaces` equal runs of consecutive components, a `2^bits`-level codebook on
  [-1, 1] fitted by 1-D k-means (MSE) to the coefficients divided by their token's subspace absmax.
A token stores, per kv head and subspace, an fp16 absmax scale of its normalized coefficients and
one `bits`-bit code per component. The codebook ends are free, not pinned at ±1 to keep each
token's largest coefficient exact: pinned ends cost half the levels at 2 bits, and on the pydoc
calibration text (SmolLM2, 1K prefix, 512 scored tokens; not the evaluation text) subspace:2 with 4
subspaces gave perplexity 12.39 pinned vs 10.49 free (9.63 uncompressed).

Layout per token and kv head (d channels, b bits, S subspaces): ceil(d*b/8) B codes + 2S B scales;
d = 64, 2 bits, S = 2: 16 + 4 = 20 B vs 128 B in fp16 (6.4x).

Attention never rebuilds K or V: with `c = σ ⊙ (scale ⊙ level)` the coefficients and `B` the basis,
`<q, μ + B c> = <q, μ> + <(Bᵀq) ⊙ σ, scale ⊙ level>`: the query is projected on the basis once and
contracted with the per-chunk scaled levels (a tensor the size of the codes); `Σ_t p_t (μ + B c_t)
= (Σ p) μ + B (σ ⊙ Σ_t p_t scale_t ⊙ level_t)`: probabilities are accumulated on the levels and
projected back once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..primitives.packing import pack_bits, unpack_bits
from ..primitives.pca import pca
from ..primitives.scalar_codebook import lloyd_1d, nearest_level
from ..primitives.validation import check_query
from .base import CHUNK_ELEMENTS, Codec, Packed, check_state, chunked_scores, chunked_sum, group_query, storable, ungroup

BITS = (2, 3, 4)
_CHUNK_ELEMENTS = CHUNK_ELEMENTS  # largest temporary of `scores` / `weighted_sum`: the shared bound, a knob tests shrink
# Components are normalized by max(std, STD_FLOOR * the head's largest std). Directions holding less
# than 1e-4 of the leading variance are numerically null for attention, and normalizing them to unit
# scale would let float noise and the int8 basis's leakage (~1e-3 of the leading std) set a token's
# subspace scale: on rank-1 data at 2 bits that cost 17% relative error instead of 3%.
STD_FLOOR = 1e-2
_TINY = 1e-6  # smallest std at all (an all-constant block has no variance to normalize)


@dataclass(frozen=True)
class SubspaceConfig:
    """bits: 2 | 3 | 4 per component. n_subspaces: equal runs of consecutive PCA components that
    each get their own per-token scale (must divide head_dim; each costs 2 bytes per token and head).

    Default 2: on the pydoc calibration text (SmolLM2, 1K prefix, 512 scored tokens, uncompressed
    perplexity 9.63) subspace:2 gave 21.5 / 10.55 / 10.49 / 10.28 with 1 / 2 / 4 / 8 subspaces: one
    scale over all components is swamped by a few heavy-tailed ones, and past 2 the gain is small
    for 2 more bytes per token and head each (measured before `STD_FLOOR`; with it, 2 gives 10.55)."""

    bits: int = 2
    n_subspaces: int = 2

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.n_subspaces, bool) or not isinstance(self.n_subspaces, int) or self.n_subspaces < 1:
            raise ValueError(f"n_subspaces must be a positive integer, got {self.n_subspaces!r}")


@dataclass
class SubspacePacked(Packed):
    codes: torch.Tensor  # (batch, kv_heads, tokens, ceil(d * bits / 8)) uint8, bit-packed along components
    scale: torch.Tensor  # (batch, kv_heads, tokens, n_subspaces) float16 (float32 past its range) absmax of each subspace's normalized coefficients


class SubspaceCodec(Codec):
    config_class = SubspaceConfig
    name = "subspace"

    def __init__(self, config: SubspaceConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        if head_dim % config.n_subspaces:
            raise ValueError(f"n_subspaces {config.n_subspaces} must divide head_dim {head_dim}")
        self.levels = 1 << config.bits
        self.width = head_dim // config.n_subspaces  # components per subspace
        self.mean: torch.Tensor | None = None  # (kv_heads, d) float16
        self.basis: torch.Tensor | None = None  # (kv_heads, d, d) int8, columns = components by variance
        self.basis_scale: torch.Tensor | None = None  # (kv_heads, d) float16 per column
        self.std: torch.Tensor | None = None  # (kv_heads, d) float16 per component
        self.codebook: torch.Tensor | None = None  # (kv_heads, n_subspaces, 2^bits) float16 on [-1, 1]

    @property
    def fitted(self) -> bool:
        return self.basis is not None

    # -- basis and coefficients -----------------------------------------------------------------
    def _basis(self, device) -> torch.Tensor:
        """Dequantized basis `(kv_heads, d, d)` float32."""
        return self._on("basis", self.basis, device).float() * self._on("basis_scale", self.basis_scale, device).float().unsqueeze(1)

    def _state(self, name: str, device) -> torch.Tensor:
        """Fitted fp16 `mean` / `std` / `codebook` as float32 on `device` (copied there once, see `Codec._on`)."""
        return self._on(name, getattr(self, name), device).float()

    def _coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """Least-squares coefficients of `x (b, h, t, d)` against the stored (int8-rounded) basis: `(b, h, t, d)`."""
        basis = self._basis(x.device).double()
        proj = (basis @ torch.linalg.inv(basis.transpose(1, 2) @ basis)).float()  # (h, d, d)
        return (x.float() - self._state("mean", x.device)[None, :, None]) @ proj

    def _split(self, y: torch.Tensor) -> torch.Tensor:
        """`(..., d)` -> `(..., n_subspaces, width)`."""
        return y.unflatten(-1, (self.config.n_subspaces, self.width))

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Mean, basis, component stds and subspace codebooks from `x (batch, kv_heads, tokens, head_dim)`."""
        self._check(x)
        result = pca(x.float().transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim))
        scale = (result.basis.abs().amax(1) / 127).clamp_min(1e-8).half()  # (h, d) per column
        self.basis = (result.basis / scale.float().unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
        self.basis_scale, self.mean = scale, result.mean.half()
        coefs = self._coefficients(x)
        std = coefs.square().mean((0, 2)).sqrt()  # (h, d)
        self.std = torch.maximum(std, STD_FLOOR * std.amax(-1, keepdim=True)).clamp_min(_TINY).half()
        z, _ = self._normalized(coefs)
        samples = z.permute(1, 3, 0, 2, 4).reshape(self.kv_heads * self.config.n_subspaces, -1)
        init = torch.linspace(-1.0, 1.0, self.levels, device=x.device).expand(samples.shape[0], -1)
        books = lloyd_1d(samples, init)
        self.codebook = books.view(self.kv_heads, self.config.n_subspaces, self.levels).half()

    def _normalized(self, coefs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`coefs (b, h, t, d)` -> (coefficients / std on [-1, 1] `(b, h, t, S, width)`, fp16 absmax scale `(b, h, t, S)`)."""
        groups = self._split(coefs / self._state("std", coefs.device)[None, :, None])
        scale = storable(groups.abs().amax(-1))  # quantize against the stored scale (fp16; fp32 past its range), which decode reads
        return groups / scale.float().clamp_min(1e-30).unsqueeze(-1), scale

    # -- encode / decode ------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> SubspacePacked:
        if not self.fitted:
            self.fit(x)
        self._check(x)
        z, scale = self._normalized(self._coefficients(x))
        b, h, t, s, w = z.shape
        book = self._state("codebook", x.device).view(h * s, self.levels)
        codes = nearest_level(z.permute(1, 3, 0, 2, 4).reshape(h * s, -1), book)
        codes = codes.view(h, s, b, t, w).permute(2, 0, 3, 1, 4).reshape(b, h, t, s * w)
        return SubspacePacked(t, pack_bits(codes.to(torch.uint8), self.config.bits), scale)

    def _scaled_levels(self, packed: SubspacePacked) -> torch.Tensor:
        """Normalized coefficients `(b, h, t, d)` float32: codebook level times the token's subspace scale."""
        codes = self._split(unpack_bits(packed.codes, self.config.bits, self.head_dim).long())  # (b, h, t, S, w)
        b, h, _, s, w = codes.shape
        table = self._state("codebook", codes.device).transpose(1, 2)[None, :, :, :, None].expand(b, h, self.levels, s, w)
        levels = torch.gather(table, 2, codes)  # a gather along the level axis: 2x faster on CPU than flat indexing
        return (levels * packed.scale.float().unsqueeze(-1)).flatten(-2)

    def decode(self, packed: SubspacePacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        device = packed.codes.device
        coefs = self._scaled_levels(packed) * self._state("std", device)[None, :, None]
        return coefs @ self._basis(device).transpose(1, 2) + self._state("mean", device)[None, :, None]

    # -- attention on the coefficients ----------------------------------------------------------
    def scores(self, query: torch.Tensor, packed: SubspacePacked, query_positions=None, key_positions=None) -> torch.Tensor:
        """<q, k> `(batch, q_heads, q_len, tokens)`: the query projected on the basis once, then contracted with the levels."""
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)
        device = q.device
        q_coef = (q @ self._basis(device)) * self._state("std", device)[None, :, None]
        bias = q @ self._state("mean", device)[None, :, :, None]  # (b, kv, rows, 1)
        out = chunked_scores(lambda block, s, e: q_coef @ self._scaled_levels(block).mT + bias, packed, q, self._width(q.shape[2]), limit=_CHUNK_ELEMENTS)
        return ungroup(out, query.shape[1])

    def weighted_sum(self, probs: torch.Tensor, packed: SubspacePacked) -> torch.Tensor:
        """`probs (batch, q_heads, q_len, tokens)` @ V: probabilities accumulated on the levels, projected back once."""
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        acc = chunked_sum(lambda pc, block: pc @ self._scaled_levels(block), p, packed, self._width(p.shape[2]), limit=_CHUNK_ELEMENTS)
        device = acc.device
        coefs = acc * self._state("std", device)[None, :, None]
        out = coefs @ self._basis(device).transpose(1, 2) + p.sum(-1, keepdim=True) * self._state("mean", device)[None, :, None]
        return ungroup(out, probs.shape[1])

    # -- fitted state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """mean, int8 basis + fp16 column scales, component stds and subspace codebooks (all fitted)."""
        if not self.fitted:
            return {}
        return {"mean": self.mean, "basis": self.basis, "basis_scale": self.basis_scale, "std": self.std, "codebook": self.codebook}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        h, d = self.kv_heads, self.head_dim
        expected = {
            "mean": ((h, d), torch.float16),
            "basis": ((h, d, d), torch.int8),
            "basis_scale": ((h, d), torch.float16),
            "std": ((h, d), torch.float16),
            "codebook": ((h, self.config.n_subspaces, self.levels), torch.float16),
        }
        check_state(self.name, state, expected)
        self.mean, self.basis, self.basis_scale = state.get("mean"), state.get("basis"), state.get("basis_scale")
        self.std, self.codebook = state.get("std"), state.get("codebook")
