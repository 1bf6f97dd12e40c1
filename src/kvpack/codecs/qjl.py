"""QJL: 1-bit quantized Johnson-Lindenstrauss sketches of keys, with fp16 outlier channels.

Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
Overhead" (arXiv:2406.03482). A key k is stored as sign(S k) (m = sketch_ratio · d bits) and
||k|| in fp16; <q, k> is estimated without bias by sqrt(pi/2)/m · ||k|| · <S q, sign(S k)>
(Lemma 3.2), with Var <= pi/(2m) · ||q||² ||k||². S is orthogonalized (rows orthogonal within
each block of d, chi-distributed norms), which lowers the variance (§4.2).

Outliers (§4.2): a few fixed channels of deep layers carry most of a key's norm and inflate the
error. `fit()` picks, per kv head, the `n_outliers` channels with the largest absolute value
over the tokens seen (`encode` fits on its first call); those channels are stored exactly in
fp16 and removed from the sketch by zeroing the matching columns of S, so the sketch, the norm
and the query projection all see only the inlier part. Blocks encoded before a later `fit()`
are not decodable with the new state.

Layout per key (d, m = r·d, n outliers): m/8 B signs + 2 B norm + 2n B outliers;
d=128, r=2, n=4: 32 + 2 + 8 = 42 B. A block whose norms (or outlier values) exceed fp16's
range (65504) keeps them in float32 instead (4 B each) rather than storing inf: rare (a key
that large is already near the limit of an fp16 model), and exact where fp16 would return NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..primitives.packing import pack_bits, unpack_bits
from ..primitives.qjl import qjl_matrix
from ..primitives.rotation import derive_seed
from ..primitives.validation import check_query
from .base import Codec, Packed, check_state, chunked_scores, chunked_sum, group_query, storable, ungroup


@dataclass(frozen=True)
class QJLConfig:
    """sketch_ratio: sign bits per coordinate (m = sketch_ratio · head_dim must be an integer >= 1).

    n_outliers: channels per kv head kept exactly in fp16 (0 disables outlier handling).
    seed: base seed of the per-(layer, head) sketches.
    """

    sketch_ratio: float = 2
    n_outliers: int = 4
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.sketch_ratio, bool) or not isinstance(self.sketch_ratio, (int, float)) or not self.sketch_ratio > 0:
            raise ValueError(f"sketch_ratio must be a positive number (e.g. 1, 2, 4), got {self.sketch_ratio!r}")
        if isinstance(self.n_outliers, bool) or not isinstance(self.n_outliers, int) or self.n_outliers < 0:
            raise ValueError(f"n_outliers must be an integer >= 0, got {self.n_outliers!r}")


@dataclass
class QJLPacked(Packed):
    signs: torch.Tensor  # (batch, kv_heads, tokens, ceil(m / 8)) uint8, sign(S k_inlier)
    norm: torch.Tensor  # (batch, kv_heads, tokens, 1) float16 (float32 past fp16's range), ||k_inlier||
    outliers: torch.Tensor  # (batch, kv_heads, tokens, n_outliers) float16 (float32 past fp16's range), exact outlier channels


class QJLCodec(Codec):
    config_class = QJLConfig
    name = "qjl"

    def __init__(self, config: QJLConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        m = config.sketch_ratio * head_dim
        if m != int(m) or m < 1:
            raise ValueError(f"sketch_ratio * head_dim must be a positive integer, got {config.sketch_ratio} * {head_dim}")
        if config.n_outliers >= head_dim:
            raise ValueError(f"n_outliers must be < head_dim ({head_dim}), got {config.n_outliers}")
        self.m = int(m)
        self.outlier_idx: torch.Tensor | None = None  # (kv_heads, n_outliers) long, set by fit()
        self._sketch: torch.Tensor | None = None  # (kv_heads, m, d) with outlier columns zeroed

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Choose each kv head's outlier channels: the largest absmax over batch and tokens."""
        self._check(x)
        absmax = x.float().abs().amax(dim=(0, 2))  # (kv, d)
        self.outlier_idx = absmax.topk(self.config.n_outliers, dim=-1).indices.sort(-1).values
        self._sketch = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted outlier channels `(kv_heads, n_outliers)` long; the sketch is rebuilt from the seed."""
        return {} if self.outlier_idx is None else {"outlier_idx": self.outlier_idx}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        check_state(self.name, state, {"outlier_idx": ((self.kv_heads, self.config.n_outliers), torch.long)})
        idx = state.get("outlier_idx")
        if idx is not None and ((idx < 0) | (idx >= self.head_dim)).any():
            raise ValueError(f"codec {self.name!r} state 'outlier_idx' must hold channels in [0, {self.head_dim}), got {idx.tolist()}")
        self.outlier_idx, self._sketch = idx, None  # the sketch zeroes the outlier columns: rebuild it

    def sketch(self, device: torch.device) -> torch.Tensor:
        if self._sketch is None:
            if self.outlier_idx is None:
                raise ValueError("QJL codec is not fitted: call fit() or encode() before scores()/decode()")
            # Built beside the fitted outlier channels, then copied to other devices once (`_on`).
            seeds = [derive_seed(self.config.seed, self.layer_idx, h) for h in range(self.kv_heads)]
            s = torch.stack([qjl_matrix(self.m, self.head_dim, seed) for seed in seeds]).to(self.outlier_idx.device)
            self._sketch = s.scatter(-1, self.outlier_idx.unsqueeze(1).expand(-1, self.m, -1), 0.0)
        return self._on("sketch", self._sketch, device)

    def _outlier_index(self, x: torch.Tensor) -> torch.Tensor:
        """`outlier_idx` expanded to gather from `x (b, kv, n, d)`: `(b, kv, n, n_outliers)`."""
        idx = self._on("outlier_idx", self.outlier_idx, x.device)[None, :, None, :]
        return idx.expand(x.shape[0], -1, x.shape[2], -1)

    def state_nbytes(self) -> int:
        """The sketch (fp32, regenerable from the seed but held) plus the outlier channel indices."""
        return sum(t.numel() * t.element_size() for t in (self._sketch, self.outlier_idx) if t is not None)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> QJLPacked:
        self._check(x)
        if self.outlier_idx is None:
            self.fit(x)
        x = x.float()
        idx = self._outlier_index(x)
        outliers = x.gather(-1, idx)
        inlier = x.scatter(-1, idx, 0.0)
        bits = (inlier @ self.sketch(x.device).mT >= 0).to(torch.uint8)  # S has zero outlier columns
        return QJLPacked(x.shape[2], pack_bits(bits, 1), storable(inlier.norm(dim=-1, keepdim=True)), storable(outliers))

    def _signs(self, packed: QJLPacked) -> torch.Tensor:
        return unpack_bits(packed.signs, 1, self.m).float() * 2 - 1

    def decode(self, packed: QJLPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The unbiased reconstruction sqrt(pi/2)/m · ||k|| · Sᵀ sign(S k), plus the exact outliers."""
        coef = math.sqrt(math.pi / 2) / self.m * packed.norm.float()
        k = coef * (self._signs(packed) @ self.sketch(packed.signs.device))
        return k.scatter(-1, self._outlier_index(k), packed.outliers.float())

    def scores(self, query: torch.Tensor, packed: QJLPacked, query_positions=None, key_positions=None) -> torch.Tensor:
        """Exact outlier part + QJL estimate of the inlier part, with S q computed once per call."""
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)
        sq = q @ self.sketch(q.device).mT  # outlier columns of S are zero: this is S q_inlier
        q_out = q.gather(-1, self._outlier_index(q))  # (b, kv, rows, n_outliers)

        def part(block: QJLPacked, start: int, stop: int) -> torch.Tensor:
            coef = math.sqrt(math.pi / 2) / self.m * block.norm.float().mT
            return (sq @ self._signs(block).mT) * coef + q_out @ block.outliers.float().mT

        return ungroup(chunked_scores(part, packed, q, self._width(q.shape[2])), query.shape[1])

    def _width(self, rows: int) -> int:
        """The float signs (m entries per token) or a `(rows, tokens)` product: the largest temporary per token."""
        return max(self.m, rows)

    def weighted_sum(self, probs: torch.Tensor, packed: QJLPacked) -> torch.Tensor:
        """Σ p·(estimate): signs weighted once, then one (rows, m) @ S per head; outliers scattered."""
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)

        def part(pc: torch.Tensor, block: QJLPacked) -> torch.Tensor:
            # S has zero outlier columns, so the estimate is 0 there and the scatter adds across chunks.
            coef = math.sqrt(math.pi / 2) / self.m * block.norm.float().mT
            acc = ((pc * coef) @ self._signs(block)) @ self.sketch(p.device)
            return acc.scatter(-1, self._outlier_index(acc), pc @ block.outliers.float())

        return ungroup(chunked_sum(part, p, packed, self._width(p.shape[2])), probs.shape[1])
