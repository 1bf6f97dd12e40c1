"""KIVI: asymmetric 2/4-bit quantization, per-channel for keys and per-token for values.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (arXiv:2402.02750).
Keys have outlier *channels*, so `axis="channel"` gives every channel its own fp16 scale and
zero over each group of `group_size` tokens; values are quantized per token in groups of
`group_size` channels (`axis="token"`). Zero-point (min) + scale, codes bit-packed.

Every packed tensor keeps tokens at dim 2. For `axis="channel"` the per-(token group, channel)
scales are *spread* over the group's token rows: a group of G tokens holds d scales, stored as
G rows of ceil(d / G) values (zero-padded when G does not divide d). Blocks therefore concatenate
along dim 2 like every other codec, and slicing at group boundaries stays exact. For
`axis="token"` a head_dim that G does not divide (48, 80 with G = 32) ends in a shorter channel
group: the vector is padded to a whole group by repeating its last channel (which leaves that
group's min and max unchanged), and only the d real codes are stored.

Compressed-domain attention never rebuilds K or V in float: the scale is folded into the
smaller operand and the zero point becomes a rank-one correction.
  channel (keys):  <q, k_t> = Σ_c (q_c s_gc) code_tc + Σ_c q_c z_gc   (q·scale per token group)
  token (values):  Σ_t p_t v_t[j] = (p ⊙ s_j) @ codes[:, j] + (p @ z_j) (probs·scale per channel group)
On CPU this is one batched float matmul over the uint8 codes (as `int8.py` does): the folded
operand has rows × d (or rows × tokens) entries, much fewer than the tokens × d of a float
rebuild when decoding (rows = GQA group), and equal work in prefill.

Layout per vector (d, b bits, G = 32): d·b/8 B codes + 2·2·d/G B of scale/zero;
d=128, 2 bits: 32 + 16 = 48 B (3 bits/value); 4 bits: 64 + 16 = 80 B. A partial last group
costs a whole group's scale and zero: d=80 (token axis), 2 bits: 20 + 12 = 32 B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import kivi as _kernel  # noqa: F401  (registers the ("kivi", "kivi") entry `kernel_kind` names)
from ..primitives.affine import quantize_affine
from ..primitives.packing import pack_bits, unpack_bits
from ..primitives.validation import check_query
from .base import FP16_MAX, Codec, Packed, chunked_scores, chunked_sum, group_query, ungroup

AXES = ("channel", "token")


@dataclass(frozen=True)
class KiviConfig:
    """bits: 2 | 4. axis: "channel" (keys: per-channel groups of `group_size` tokens; token
    counts must be multiples of group_size) | "token" (values: per-token groups of
    `group_size` channels, clamped to head_dim; the last group is shorter when it does not divide it)."""

    bits: int = 2
    axis: str = "channel"
    group_size: int = 32

    def __post_init__(self):
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be one of (2, 4), got {self.bits!r}")
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")


@dataclass
class KiviPacked(Packed):
    codes: torch.Tensor  # (batch, kv_heads, tokens, ceil(d * bits / 8)) uint8, packed along channels
    scale: torch.Tensor  # float16: token axis (b, kv, t, ceil(d / G)); channel axis spread (b, kv, t, ceil(d / G))
    zero: torch.Tensor  # float16, same shape as scale: the group minimum


def _spread(meta: torch.Tensor, group: int) -> torch.Tensor:
    """Per-(token group, channel) `(b, kv, ng, d)` -> `(b, kv, ng * group, ceil(d / group))`."""
    b, h, ng, d = meta.shape
    per_row = -(-d // group)
    return F.pad(meta, (0, group * per_row - d)).reshape(b, h, ng * group, per_row)


def _collect(spread: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """Inverse of `_spread`: `(b, kv, t, k)` -> `(b, kv, t / group, dim)` float32."""
    b, h, t, per_row = spread.shape
    return spread.float().reshape(b, h, t // group, group * per_row)[..., :dim]


class KiviCodec(Codec):
    config_class = KiviConfig
    name = "kivi"

    @classmethod
    def max_entry(cls, config: KiviConfig, head_dim: int) -> float:
        return FP16_MAX  # each group's minimum and step are float16 (the layout its kernel reads)

    def __init__(self, config: KiviConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        self.group = config.group_size if config.axis == "channel" else min(config.group_size, head_dim)
        self.pad = (-head_dim) % self.group if config.axis == "token" else 0  # channels padding the last group

    @property
    def token_multiple(self) -> int:
        return self.group if self.config.axis == "channel" else 1

    @property
    def kernel_kind(self) -> str | None:
        # The `kvpack::kivi_attention` op reads channel-axis keys and token-axis values whose groups tile the head.
        return "kivi" if self.pad == 0 else None

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> KiviPacked:
        self._check(x)
        g, bits = self.group, self.config.bits
        if self.config.axis == "channel":
            if x.shape[2] % g:
                raise ValueError(
                    f"kivi axis='channel' needs a token count that is a multiple of group_size {g}, got {x.shape[2]}"
                )
            q = quantize_affine(x, bits, g, axis=-2)
            return KiviPacked(x.shape[2], pack_bits(q.codes, bits), _spread(q.scale, g), _spread(q.zero, g))
        q = quantize_affine(self._pad_channels(x), bits, g, axis=-1)
        return KiviPacked(x.shape[2], pack_bits(q.codes[..., : self.head_dim], bits), q.scale, q.zero)

    def _pad_channels(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., d)` -> `(..., d + pad)`: the last channel repeated, so the last group's min and max stay its own."""
        return torch.cat([x, x[..., -1:].expand(*x.shape[:-1], self.pad)], -1) if self.pad else x

    def _codes(self, packed: KiviPacked) -> torch.Tensor:
        return unpack_bits(packed.codes, self.config.bits, self.head_dim).float()

    def _meta(self, packed: KiviPacked) -> tuple[torch.Tensor, torch.Tensor]:
        """scale, zero float32: channel (b, kv, ng, d); token (b, kv, t, ceil(d / G))."""
        if self.config.axis == "channel":
            return _collect(packed.scale, self.group, self.head_dim), _collect(packed.zero, self.group, self.head_dim)
        return packed.scale.float(), packed.zero.float()

    def decode(self, packed: KiviPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        scale, zero = self._meta(packed)
        if self.config.axis == "channel":
            return self._codes(packed) * scale.repeat_interleave(self.group, -2) + zero.repeat_interleave(self.group, -2)
        d = self.head_dim
        return self._codes(packed) * scale.repeat_interleave(self.group, -1)[..., :d] + zero.repeat_interleave(self.group, -1)[..., :d]

    def _by_group(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `(b, kv, t, d)` -> channel: `(b, kv, ng, G, d)`; token: `(b, kv, nj, t, G)` (zero codes pad the last group)."""
        b, h, t, d = codes.shape
        if self.config.axis == "channel":
            return codes.view(b, h, t // self.group, self.group, d)
        codes = F.pad(codes, (0, self.pad))
        return codes.view(b, h, t, -1, self.group).permute(0, 1, 3, 2, 4)

    def _width(self, rows: int) -> int:
        """Largest temporary per token of `scores` / `weighted_sum`: the float codes (d + pad entries) or the
        query or probabilities folded with each group's scales (rows x ceil(d / G) entries)."""
        return max(self.head_dim + self.pad, rows * -(-self.head_dim // self.group))

    def scores(self, query: torch.Tensor, packed: KiviPacked, query_positions=None, key_positions=None) -> torch.Tensor:
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query.float(), self.kv_heads)  # (b, kv, R, d)
        # Channel-axis chunks hold whole token groups (`token_multiple`): their scales are spread over the group.
        out = chunked_scores(lambda block, s, e: self._scores(q, block), packed, q, self._width(q.shape[2]), self.token_multiple)
        return ungroup(out, query.shape[1])

    def _scores(self, q: torch.Tensor, packed: KiviPacked) -> torch.Tensor:
        """Grouped query `(b, kv, R, d)` against one chunk of keys -> `(b, kv, R, t)`."""
        b, h, rows, d = q.shape
        codes = self._by_group(self._codes(packed))
        scale, zero = self._meta(packed)
        if self.config.axis == "channel":
            qs = q.unsqueeze(2) * scale.unsqueeze(3)  # (b, kv, ng, R, d): query folded with each group's scale
            out = (qs @ codes.mT).permute(0, 1, 3, 2, 4).reshape(b, h, rows, -1)
            return out + (q @ zero.mT).repeat_interleave(self.group, -1)
        qj = F.pad(q, (0, self.pad)).view(b, h, rows, -1, self.group).permute(0, 1, 3, 2, 4)  # (b, kv, nj, R, G), zero-padded
        out = ((qj @ codes.mT) * scale.permute(0, 1, 3, 2).unsqueeze(3)).sum(2)  # (b, kv, R, t)
        return out + qj.sum(-1).transpose(2, 3) @ zero.mT

    def weighted_sum(self, probs: torch.Tensor, packed: KiviPacked) -> torch.Tensor:
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, R, t)
        out = chunked_sum(self._weighted_sum, p, packed, self._width(p.shape[2]), self.token_multiple)
        return ungroup(out[..., : self.head_dim], probs.shape[1])

    def _weighted_sum(self, p: torch.Tensor, packed: KiviPacked) -> torch.Tensor:
        """Probabilities `(b, kv, R, t)` over one chunk of values -> `(b, kv, R, d)` (token axis: `d + pad`)."""
        b, h, rows, t = p.shape
        codes = self._by_group(self._codes(packed))
        scale, zero = self._meta(packed)
        if self.config.axis == "channel":
            pg = p.reshape(b, h, rows, -1, self.group).transpose(2, 3)  # (b, kv, ng, R, G)
            out = ((pg @ codes) * scale.unsqueeze(3)).sum(2)  # (b, kv, R, d)
            return out + pg.sum(-1).transpose(2, 3) @ zero
        ps = p.unsqueeze(2) * scale.permute(0, 1, 3, 2).unsqueeze(3)  # (b, kv, nj, R, t): probs folded with scale
        out = (ps @ codes).permute(0, 1, 3, 2, 4).reshape(b, h, rows, -1)
        return out + (p @ zero).repeat_interleave(self.group, -1)
