"""TurboQuant: random rotation + Lloyd-Max scalar codes, with an optional 1-bit QJL residual.

Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate" (arXiv:2504.19874). Each vector is split into its norm (fp16) and direction;
the direction is rotated by a seeded Haar matrix Π, after which every coordinate follows the
known Beta marginal, and each coordinate gets a `bits`-bit Lloyd-Max code (Algorithm 1, the MSE
quantizer). With `qjl=True` the MSE stage uses `bits - 1` bits and the residual r = x - x̂ gets a
1-bit QJL sketch plus its fp16 norm (Algorithm 2): inner products become unbiased.

Layout per vector (d = head_dim, b = MSE bits): norm fp16 (2 B) + ceil(d·b/8) B of codes
[+ residual norm fp16 (2 B) + ceil(d/8) B of signs]. d=128, 2+1 bits: 2 + 32 + 2 + 16 = 52 B.

The QJL sketch acts on the *rotated* residual: S' = S·Πᵀ has the same distribution as S (rows
Gaussian, orthogonalized), so sampling S' directly costs nothing and lets scores and weighted
sums stay in the rotated space: one query rotation per call, one inverse rotation per output.

A block whose norms pass fp16's range (65504: entries of 1e4 at d = 64) stores them in float32 (`storable`); its
segment then runs the torch paths, since the fused kernels read fp16 norms.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import cpu_lut, ops
from ..kernels import tq as _kernel  # noqa: F401  (registers the ("tq", "tq") entry `kernel_kind` names)
from ..kernels.reference import MATCH_FLOOR
from ..primitives import trellis
from ..primitives.lloyd_max import DISTRIBUTIONS, Codebook, lloyd_max_codebook
from ..primitives.packing import pack_bits, unpack_bits
from ..primitives.qjl import qjl_matrix
from ..primitives.rope import apply_rope, rope_mean_scores, undo_rope
from ..primitives.rotation import (
    derive_seed,
    hadamard_matrix,
    is_power_of_two,
    random_orthogonal,
    random_signs,
    randomized_hadamard,
    randomized_hadamard_inverse,
)
from ..primitives.validation import check_query, checks_values
from .base import Codec, Packed, check_state, chunked_scores, chunked_sum, group_query, storable, ungroup
from .rope_keys import UnRopedKeys

ROTATIONS = ("auto", "qr", "hadamard")
# What a vector's stored scalar holds (TurboQuantConfig.norm).
NORMS = ("input", "match", "unbiased")

# Fewer vectors per channel than this and the channel mean / RMS are not estimated (see `fit`).
MIN_FIT_SAMPLES = 32
# Turning RoPE pairs per head a `rope_center` fit keeps at most (the CPU kernel's bound; d = 64 has 32 pairs).
MAX_TURNING_PAIRS = 64


@dataclass(frozen=True)
class TurboQuantConfig:
    """bits: total bits per coordinate, 1-4 (with `qjl`, bits - 1 for the MSE codes + 1 sign bit).

    qjl: add the 1-bit QJL residual stage (unbiased inner products; meant for keys).
    rotation: "qr" (dense Haar, exact Beta marginals) | "hadamard" (randomized Hadamard,
        block-diagonal for non-power-of-two head dims; marginals only approximately Beta).
    codebook: "beta" (exact coordinate density) | "gaussian" (N(0, 1/d) approximation).
    seed: base seed; each (layer, head) derives its own rotation and sketch from it.
    center: subtract a per-head mean (fitted on the first block, e.g. the prompt) before
        quantizing. Off in the paper; on in kvpack's methods: Qwen2's QKV bias gives every key a
        shared component (272 of a 277 norm in layer 0) and quantization error scales with the
        whole norm, swamping the token-to-token variation that attention reads. The mean costs
        one q·μ per query and μ·Σp per output: exact in the compressed domain.
    trellis: L, the state bits of a bitshift trellis-coded quantizer (`primitives.trellis`) in place of the scalar
        Lloyd-Max codes (0, the default): each head's rotated coordinates become one Viterbi-searched bit string,
        0.54-0.68x the scalar error at `bits` + (L - bits)/d bits per value, or at `bits` with the tail-biting path a
        cache stores (docs/guide/methods.md). No fused kernel reads it
        yet: attention runs the torch paths, and encoding is a Viterbi search (exploratory).
    channel_scale: α in [0, 1]; divide each channel by RMS^α of its fitted values (tied across
        RoPE pairs i, i + d/2, which RoPE mixes) before rotating; 0 disables. A rotation makes the error isotropic, so without it
        Qwen2's few huge key channels push error into the small channels attention also reads;
        scaled, the error follows each channel's range (KIVI's per-channel insight). The scale
        folds into the query (q⊙σ) and into the output: exact in the compressed domain.
    norm: the scalar stored beside each vector's codes, which decode multiplies the unit-scale centroids c by.
        "input" (the paper): ||x||. Lloyd-Max centroids are conditional means, so the reconstruction is shrunk along x
        by about 1 - D (D the code's per-coordinate MSE on the unit sphere: 0.117 at 2 bits, 0.034 at 3): every score
        ~D too small and every attention output that averages many values ~D too short, a bias that averaging over
        tokens does not remove. "match": ||x|| / ||c||, the reconstruction as long as the input (KVQuant's Q-Norm and
        the INT4 design renormalize their centroids alike). "unbiased": ||x|| / <u, c> (u the rotated unit input), so
        the reconstruction's component along x is exactly x and its error is orthogonal to it: scores unbiased
        without QJL's extra bits, at a little more per-vector error (D / (1 - D) against D). Encode-side only: the
        same bytes, and every attention kernel reads the stored scalar as it is; "match" runs inside the fused encode
        (`kvpack::tq_encode` given the centroids), "unbiased" on the torch path (it needs the rotated input).
    """

    bits: int = 4
    qjl: bool = False
    rotation: str = "auto"
    codebook: str = "beta"
    seed: int = 0
    center: bool = False
    channel_scale: float = 0.0
    rope_center: bool = False
    trellis: int = 0
    norm: str = "input"

    def __post_init__(self):
        if self.bits not in (1, 2, 3, 4):
            raise ValueError(f"bits must be one of (1, 2, 3, 4), got {self.bits!r}")
        if not isinstance(self.qjl, bool):
            raise ValueError(f"qjl must be True or False, got {self.qjl!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.codebook not in DISTRIBUTIONS:
            raise ValueError(f"codebook must be one of {DISTRIBUTIONS}, got {self.codebook!r}")
        if not 0.0 <= float(self.channel_scale) <= 1.0:
            raise ValueError(f"channel_scale must be in [0, 1] (0 disables), got {self.channel_scale!r}")
        if not isinstance(self.rope_center, bool):
            raise ValueError(f"rope_center must be True or False, got {self.rope_center!r}")
        if self.rope_center and not self.center:
            raise ValueError("rope_center centers keys on their un-RoPEd mean: it needs center=True")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm != "input" and self.qjl:
            raise ValueError(f"norm={self.norm!r} rescales the MSE codes' reconstruction; with qjl the residual stage "
                             "corrects it instead: use norm='input' with qjl")
        k = self.mse_bits
        if self.trellis and (self.qjl or self.trellis % k or not k < self.trellis <= 12):
            raise ValueError(f"trellis (state bits L of a trellis-coded quantizer; 0: scalar codes) must be a multiple of the "
                             f"{k} code bits in {k + k}..12, without qjl, got {self.trellis!r}")

    @property
    def mse_bits(self) -> int:
        return self.bits - 1 if self.qjl else self.bits


@dataclass
class TurboQuantPacked(Packed):
    norm: torch.Tensor  # (batch, kv_heads, tokens, 1) float16 (float32 past its range, `storable`), ||x||
    codes: torch.Tensor  # (batch, kv_heads, tokens, ceil(d * mse_bits / 8)) uint8, bit-packed indices
    residual_norm: torch.Tensor | None = None  # (batch, kv_heads, tokens, 1) float16, ||x - x̂|| (qjl only)
    signs: torch.Tensor | None = None  # (batch, kv_heads, tokens, ceil(d / 8)) uint8, sign(S' Π r) (qjl only)


def head_rotations(kind: str, dim: int, kv_heads: int, seed: int, layer_idx: int) -> torch.Tensor:
    """`(kv_heads, dim, dim)` float32 rotations Π (rotate rows with `x @ Π.mT`), one per (layer, head)."""
    seeds = [derive_seed(seed, layer_idx, h) for h in range(kv_heads)]
    if kind == "qr":
        return torch.stack([random_orthogonal(dim, s) for s in seeds])
    return torch.stack([hadamard_matrix(dim, random_signs(dim, s)) for s in seeds])


def norm_and_direction(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`||x||` `(..., 1)` and `x / ||x||`; a zero vector keeps norm 0 and direction 0."""
    norm = x.norm(dim=-1, keepdim=True)
    return norm, x / norm.clamp_min(torch.finfo(torch.float32).tiny)


def turning_means(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys' centers for `rope_center`: `(mean, rope_mean)`, each `(kv_heads, d)`, from RoPE'd keys `x (b, kv, t, d)` at
    cos/sin `(b, t, d)`. The center of key t is `mean + RoPE_t(rope_mean)`.

    RoPE turns a component that is constant before it (a QKV bias, a massive channel) at each pair's own frequency,
    so a post-RoPE mean removes it only from pairs that barely turn over the context. Per head and RoPE pair
    (i, i + d/2), the un-RoPEd mean is used where it lowers the pair's mean squared residual by more than the average
    pair's residual under it (a pair whose gain is below that moves the error by less than one pair's share), and
    the post-RoPE mean elsewhere; `rope_mean` is zero outside those turning pairs, `mean` zero inside them. Each
    turning pair costs decode two products per token (`rope_mean_scores`), so pairs that gain little stay constant.
    """
    half = x.shape[-1] // 2
    constant = x.mean(dim=(0, 2))  # (kv, d)
    unroped = undo_rope(x, cos, sin).mean(dim=(0, 2))
    turned = apply_rope(unroped[None, :, None, :].expand_as(x), cos, sin)

    def pair_energy(r: torch.Tensor) -> torch.Tensor:  # (b, kv, t, d) -> (kv, d/2) mean squared residual per pair
        e = r.pow(2).mean(dim=(0, 2))
        return e[:, :half] + e[:, half:]

    residual = pair_energy(x - turned)
    gain = pair_energy(x - constant[None, :, None, :]) - residual
    gain = torch.where(gain > residual.sum(-1, keepdim=True) / half, gain, float("-inf"))
    # At most MAX_TURNING_PAIRS per head (the CPU kernel's bound), those that gain most.
    top = gain.topk(min(MAX_TURNING_PAIRS, half), dim=-1)
    turning = torch.zeros_like(gain, dtype=torch.bool).scatter(-1, top.indices, top.values > float("-inf"))
    turning = turning.repeat(1, 2)  # (kv, d): both coordinates of a pair
    return torch.where(turning, 0.0, constant), torch.where(turning, unroped, 0.0)


class TurboQuantCodec(UnRopedKeys, Codec):
    config_class = TurboQuantConfig
    name = "turboquant"
    uses_positions = False  # the class default; an instance with `rope_center` reads positions (set in __init__)

    @classmethod
    def needs_positions(cls, config: TurboQuantConfig) -> bool:
        return bool(config.rope_center)

    def __init__(self, config: TurboQuantConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        self.uses_positions = self.needs_positions(config)  # per instance: only the rope-centered variant reads positions
        self._init_rope()
        self.mse_bits = config.mse_bits
        self.codebook: Codebook | None = lloyd_max_codebook(head_dim, self.mse_bits, config.codebook) if self.mse_bits else None
        self._rotation: torch.Tensor | None = None  # (kv_heads, d, d), built on first use (QR only)
        self._signs_vec: torch.Tensor | None = None  # (kv_heads, 1, d) Hadamard signs
        self.mean: torch.Tensor | None = None  # (kv_heads, d) float32 when `center`
        self.rope_mean: torch.Tensor | None = None  # (kv_heads, d) float32 un-RoPEd, zero outside turning pairs, when `rope_center`
        self.scale: torch.Tensor | None = None  # (kv_heads, d) float32 when `channel_scale`
        self._sketch: torch.Tensor | None = None  # (kv_heads, d, d) S' acting on rotated residuals

    # -- lazily built per-head state ------------------------------------------------------------
    @property
    def rotation_kind(self) -> str:
        """"auto" is the randomized Hadamard for power-of-two head dims (O(d log d), only d signs
        held per head), the dense QR rotation otherwise (a block Hadamard would not mix blocks)."""
        if self.config.rotation != "auto":
            return self.config.rotation
        return "hadamard" if is_power_of_two(self.head_dim) else "qr"

    def rotation(self, device: torch.device) -> torch.Tensor:
        """The dense `(kv_heads, d, d)` rotations Π; held only for QR (Hadamard is applied by FWHT)."""
        if self.rotation_kind == "hadamard" and is_power_of_two(self.head_dim):
            return head_rotations("hadamard", self.head_dim, self.kv_heads, self.config.seed, self.layer_idx).to(device)
        if self._rotation is None:
            self._rotation = head_rotations(self.rotation_kind, self.head_dim, self.kv_heads, self.config.seed, self.layer_idx)
        return self._on("rotation", self._rotation, device)

    def _hadamard_signs(self, device: torch.device) -> torch.Tensor | None:
        """`(kv_heads, 1, d)` signs when Π is a randomized Hadamard of power-of-two size, else None."""
        if self.rotation_kind != "hadamard" or not is_power_of_two(self.head_dim):
            return None
        if self._signs_vec is None:
            seeds = [derive_seed(self.config.seed, self.layer_idx, h) for h in range(self.kv_heads)]
            self._signs_vec = torch.stack([random_signs(self.head_dim, s) for s in seeds]).unsqueeze(1)
        return self._on("signs", self._signs_vec, device)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of `x (b, kv, n, d)` mapped to Πx."""
        signs = self._hadamard_signs(x.device)
        return x @ self.rotation(x.device).mT if signs is None else randomized_hadamard(x, signs)

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Rows of `y (b, kv, n, d)` mapped to Πᵀy."""
        signs = self._hadamard_signs(y.device)
        return y @ self.rotation(y.device) if signs is None else randomized_hadamard_inverse(y, signs)

    def sketch(self, device: torch.device) -> torch.Tensor:
        if self._sketch is None:
            # A seed stream disjoint from the rotation's: derive again from the head's rotation seed.
            seeds = [derive_seed(derive_seed(self.config.seed, self.layer_idx, h), 1, 0) for h in range(self.kv_heads)]
            self._sketch = torch.stack([qjl_matrix(self.head_dim, self.head_dim, s) for s in seeds])
        return self._on("sketch", self._sketch, device)

    def _lookup(self, idx: torch.Tensor) -> torch.Tensor:
        """Centroids c[idx] float32 for integer codes `idx` (any shape), the codebook on `idx`'s device."""
        return self._on("centroids", self.codebook.centroids, idx.device)[idx.long()]

    def _centroids(self, packed: TurboQuantPacked) -> torch.Tensor:
        """Rotated-space unit reconstruction c[idx] `(batch, kv, tokens, d)` float32, read from codes."""
        shape = (*packed.codes.shape[:3], self.head_dim)
        if self.codebook is None:
            return packed.codes.new_zeros(shape, dtype=torch.float32)
        if self._trellis_book is not None:  # symbols -> states by windows -> table; the table is for sqrt(d)-scaled coordinates
            symbols = unpack_bits(packed.codes, self.mse_bits, self._trellis_symbols)
            return trellis.decode_symbols(symbols, self._trellis_book, self.mse_bits) / math.sqrt(self.head_dim)
        if 8 % self.mse_bits:
            return self._lookup(unpack_bits(packed.codes, self.mse_bits, self.head_dim))
        # Whole bytes: one embedding row of 8/bits centroids per byte (2-2.7x faster than unpack + lookup).
        per = 8 // self.mse_bits
        byte_table = self._lookup(unpack_bits(torch.arange(256, dtype=torch.uint8, device=packed.codes.device)[:, None], self.mse_bits, per))
        return torch.nn.functional.embedding(packed.codes.long(), byte_table).flatten(-2)[..., : self.head_dim]

    @property
    def _trellis_book(self) -> torch.Tensor | None:
        """The trellis codebook `(2**L,)` for N(0, 1) coordinates, or None for scalar codes: one table per (k, L) shared
        by every codec of the process (`trellis.gaussian_codebook`), like the Lloyd-Max tables, so not held (or counted)
        per codec."""
        return trellis.gaussian_codebook(self.mse_bits, self.config.trellis) if self.config.trellis else None

    @property
    def _trellis_symbols(self) -> int:
        """k-bit symbols per token of a trellis codec: d (a tail-biting path: the scalar code's size)."""
        return self.head_dim

    def _use_kernels(self, packed: TurboQuantPacked, rows: int) -> bool:
        """The fused kernel for decode-sized row counts; many rows (prompt chunks) amortize one
        unpack over a matmul better than a lookup table per row."""
        return (self.codebook is not None and self._trellis_book is None and rows <= kernels.MAX_KERNEL_ROWS and packed.codes.device.type == "cpu"
                and packed.norm.dtype == torch.float16 and kernels.available())

    def _signs(self, packed: TurboQuantPacked) -> torch.Tensor:
        return unpack_bits(packed.signs, 1, self.head_dim).float() * 2 - 1

    def _width(self, rows: int) -> int:
        """Decoded centroids or signs (d + 8 entries per token: a byte-table row may overshoot d by 7) or a
        `(rows, tokens)` product: the largest temporary per token of the torch attention paths."""
        return max(self.head_dim + 8, rows)

    # -- codec interface ---------------------------------------------------------------------------
    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Per-head mean of `x (batch, kv_heads, tokens, d)` when `center` (else nothing to learn)."""
        self._check(x)
        x = x.float()
        if x.shape[0] * x.shape[2] < MIN_FIT_SAMPLES:
            # Statistics of a handful of tokens are noise, and of one token degenerate (its centered
            # residual is zero, so its RMS scale would blow later tokens up to Inf): normalize by identity.
            self.mean = torch.zeros(self.kv_heads, self.head_dim, device=x.device) if self.config.center else None
            self.rope_mean = torch.zeros(self.kv_heads, self.head_dim, device=x.device) if self.config.rope_center else None
            self.scale = torch.ones(self.kv_heads, self.head_dim, device=x.device) if self.config.channel_scale else None
            return
        if self.config.rope_center:
            self.mean, self.rope_mean = turning_means(x, *self._cos_sin(positions, x.shape[0], x.shape[2], x.device))
            x = x - self._center(positions, x.shape[0], x.shape[2], x.device)
        elif self.config.center:
            self.mean = x.mean(dim=(0, 2))
            x = x - self.mean[None, :, None, :]
        if self.config.channel_scale:
            ms = x.pow(2).mean(dim=(0, 2))  # (kv, d)
            half = self.head_dim // 2
            if self.head_dim % 2 == 0:  # tie RoPE pairs so a rotation by RoPE keeps the scaling valid
                ms = ms.view(-1, 2, half).mean(1, keepdim=True).expand(-1, 2, half).reshape(-1, self.head_dim)
            rms = ms.sqrt().clamp_min(1e-6 * ms.sqrt().max().clamp_min(1e-30))
            self.scale = rms.pow(self.config.channel_scale)

    @property
    def learns(self) -> bool:
        """Only centering and channel scaling learn from the data; rotations and codebooks come from the seed."""
        return bool(self.config.center or self.config.channel_scale or self.config.rope_center)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted `mean` / `scale` (`(kv_heads, d)` float32, each when configured); rotations, sketches and
        the Lloyd-Max codebook are rebuilt from the config and seed."""
        return {k: v for k, v in (("mean", self.mean), ("scale", self.scale), ("rope_mean", self.rope_mean)) if v is not None}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        shape = ((self.kv_heads, self.head_dim), torch.float32)
        on = (("mean", self.config.center), ("scale", self.config.channel_scale), ("rope_mean", self.config.rope_center))
        check_state(self.name, state, {k: shape for k, flag in on if flag})
        self.mean, self.scale, self.rope_mean = state.get("mean"), state.get("scale"), state.get("rope_mean")

    def _scale(self, device: torch.device) -> torch.Tensor | None:
        """`(1, kv_heads, 1, d)` fitted channel scale, or None."""
        if self.scale is None:
            return None
        return self._on("scale", self.scale, device)[None, :, None, :]

    def _center(self, positions: torch.Tensor | None, batch: int, tokens: int, device) -> torch.Tensor | None:
        """What `encode` subtracts: `(batch, kv_heads, tokens, d)` when rope-centered (the constant mean plus the turning
        pairs' un-RoPEd mean rotated to each token's position), else `(1, kv_heads, 1, d)` (the fitted mean), or None."""
        if self.rope_mean is None:
            return self._mean(device)
        cos, sin = self._cos_sin(positions, batch, tokens, device)
        turning = self._on("rope_mean", self.rope_mean, device)[None, :, None, :].expand(batch, -1, tokens, -1)
        return self._mean(device) + apply_rope(turning, cos, sin)

    def _mean(self, device: torch.device) -> torch.Tensor | None:
        """`(1, kv_heads, 1, d)` fitted mean, or None when not centering."""
        if self.mean is None:
            return None
        return self._on("mean", self.mean, device)[None, :, None, :]

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> TurboQuantPacked:
        self._check(x)
        if (self.config.center and self.mean is None) or (self.config.channel_scale and self.scale is None):
            self.fit(x, positions)
        if self.rope_mean is not None:
            x = x.float() - self._center(positions, x.shape[0], x.shape[2], x.device)
            mean = None
        else:
            mean = self._mean(x.device)
        packed = self._op_encode(x, mean is not None)
        return packed if packed is not None else self._encode_torch(x, mean)

    def _norm_factor(self, y: torch.Tensor, packed: TurboQuantPacked) -> torch.Tensor:
        """`(b, kv, t, 1)` factor on ||x|| for `TurboQuantConfig.norm`: 1 / ||c|| ("match") or 1 / <y, c> ("unbiased"),
        c the codes' unit-scale centroids and y `(b, kv, t, d)` the rotated unit input."""
        c = self._centroids(packed)
        length = c.norm(dim=-1, keepdim=True) if self.config.norm == "match" else (y * c).sum(-1, keepdim=True)
        # A zero vector (norm 0) has nothing to rescale; a code whose centroids have no length along y cannot occur
        # for Lloyd-Max or trellis codes (each centroid keeps its coordinate's sign), so the floor only guards 0 / 0.
        return 1.0 / length.clamp_min(MATCH_FLOOR)

    def _encode_torch(self, x: torch.Tensor, mean: torch.Tensor | None) -> TurboQuantPacked:
        packed, y = self._encode_codes(x, mean)
        if self.config.norm != "input" and self.codebook is not None:
            packed.norm = storable(packed.norm * self._norm_factor(y, packed))
        elif packed.residual_norm is None:  # QJL's norm is stored already (its residual is taken against it)
            packed.norm = storable(packed.norm)
        return packed

    def _encode_codes(self, x: torch.Tensor, mean: torch.Tensor | None) -> tuple[TurboQuantPacked, torch.Tensor]:
        """(packed codes with the float32 norm ||x'|| still unrounded (QJL's: rounded, as its residual needs), the
        rotated unit vectors y) of `x` centered by `mean` and scaled by the channel scale."""
        x = x.float()
        scale = self._scale(x.device)
        if mean is not None:
            x = x - mean
        if scale is not None:
            x = x / scale
        norm, unit = norm_and_direction(x)
        y = self._rotate(unit)  # (b, kv, t, d) rotated unit vectors
        if self.codebook is None:
            codes = torch.empty(*x.shape[:3], 0, dtype=torch.uint8, device=x.device)
            y_hat = torch.zeros_like(y)
        elif self._trellis_book is not None:
            symbols = ops.trellis_encode(y * math.sqrt(self.head_dim), self._on("trellis_book", self._trellis_book, y.device), self.mse_bits)
            return TurboQuantPacked(x.shape[2], norm, pack_bits(symbols, self.mse_bits)), y
        elif not self.config.qjl and y.device.type == "cpu" and kernels.available():
            # Bucketize + pack in one pass (the reconstruction y_hat only feeds the QJL residual).
            return TurboQuantPacked(x.shape[2], norm, kernels.cpu_lut.quantize_pack(y, self.codebook.boundaries, self.mse_bits)), y
        else:
            idx = torch.bucketize(y.contiguous(), self._on("boundaries", self.codebook.boundaries, y.device)).to(torch.uint8)
            codes = pack_bits(idx, self.mse_bits)
            y_hat = self._lookup(idx) if self.config.qjl else None
        if not self.config.qjl:
            return TurboQuantPacked(x.shape[2], norm, codes), y
        # Residual in the original scale against what decode will actually produce (fp16 norm).
        norm16 = storable(norm)  # float32 for a block whose norms pass fp16's range (attention then skips the fused kernels)
        r = norm * y - norm16.float() * y_hat  # rotated residual Π(x - x̂)
        bits = (r @ self.sketch(x.device).mT >= 0).to(torch.uint8)
        return TurboQuantPacked(x.shape[2], norm16, codes, storable(r.norm(dim=-1, keepdim=True)), pack_bits(bits, 1)), y

    def _op_encode(self, x: torch.Tensor, centered: bool) -> TurboQuantPacked | None:
        """An MSE-only codec with a randomized Hadamard encodes through the `kvpack::tq_encode` op, subtracting its fitted
        mean when `centered` (a turning mean is subtracted before): on CUDA one Triton kernel, on CPU one C++ pass per
        row, each centering, scaling, rotating, searching the codebook and packing, where the torch ops below take a
        dozen launches and float copies of the block (a batch-32 block flush was the GPU's p99 step, docs/guide/gpu.md;
        on CPU the encode was a serving engine's largest cost after attention, docs/guide/vllm-pool.md). None where it
        does not apply: QJL, trellis codes, dense rotations, CPU without the C++ kernels (unless the backend is Triton's
        interpreter)."""
        if self.config.qjl or self.codebook is None or self._trellis_book is not None or self.config.norm == "unbiased":
            return None
        if x.device.type == "cpu" and ops.get_backend() is not ops.Backend.TRITON and not kernels.available():
            return None
        signs = self._hadamard_signs(x.device)
        if signs is None:
            return None
        mean = None if self.mean is None or not centered else self._on("mean", self.mean, x.device)
        inv_scale = None if self.scale is None else 1.0 / self._on("scale", self.scale, x.device)
        centroids = self._on("centroids", self.codebook.centroids, x.device) if self.config.norm == "match" else None
        norm, codes = ops.tq_encode(x, mean, inv_scale, signs[:, 0], self._on("boundaries", self.codebook.boundaries, x.device),
                                    self.mse_bits, centroids)
        if checks_values(norm) and not torch.isfinite(norm).all():
            return None  # norms past fp16's range: the torch path stores them in float32 (`storable`)
        return TurboQuantPacked(x.shape[2], norm, codes)

    def _decode_rotated(self, packed: TurboQuantPacked) -> torch.Tensor:
        y = packed.norm.float() * self._centroids(packed)
        if packed.signs is not None:
            coef = math.sqrt(math.pi / 2) / self.head_dim * packed.residual_norm.float()
            y = y + coef * (self._signs(packed) @ self.sketch(y.device))
        return y

    def decode(self, packed: TurboQuantPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        y = self._unrotate(self._decode_rotated(packed))
        mean, scale = self._center(positions, y.shape[0], y.shape[2], y.device), self._scale(y.device)
        if scale is not None:
            y = y * scale
        return y if mean is None else y + mean

    def scores(self, query: torch.Tensor, packed: TurboQuantPacked, query_positions=None, key_positions=None) -> torch.Tensor:
        """<q, k̂> = ||k|| <Πq, c[idx]> (+ sqrt(pi/2)/d ||r|| <S'Πq, signs>), query rotated once.

        On CPU the MSE term runs in `kvpack.kernels.lut_scores` (a per-byte table of query x
        centroid sums, no float K); elsewhere the centroid gather is a float tensor in the
        rotated space and one dense matmul per chunk of tokens.
        """
        check_query(query, self.kv_heads, self.head_dim)
        q = group_query(query.float(), self.kv_heads)  # (b, kv, rows, d)
        scale = self._scale(q.device)
        q_rot = self._rotate(q if scale is None else q * scale)
        qs = None if packed.signs is None else q_rot @ self.sketch(q.device).mT  # S'Πq, once per call
        kernel = self._use_kernels(packed, q.shape[2])
        # The kernel reads the whole segment with no float temporary (a slice would copy its codes).
        out = kernels.lut_scores(q_rot, packed.codes, packed.norm, self.codebook.centroids, self.mse_bits) if kernel else None
        if not kernel or qs is not None:
            part = chunked_scores(lambda block, s, e: self._rotated_scores(q_rot, qs, block, not kernel), packed, q, self._width(q.shape[2]))
            out = part if out is None else out + part
        if self.rope_mean is not None:  # <q, RoPE_t(μ)> of the turning pairs, added in one matmul with the keys' cos/sin
            out = self._turning_scores(q, key_positions, packed.codes.shape[2], add_to=out)
        if self.mean is not None:  # <q, μ>: one product per query row, Πq·Πμ = q·μ (out is this call's own tensor)
            out = out.add_(q @ self._mean(q.device).transpose(-1, -2))
        return ungroup(out, query.shape[1])

    def _rotated_scores(self, q_rot: torch.Tensor, qs: torch.Tensor | None, block: TurboQuantPacked, mse: bool) -> torch.Tensor:
        """Scores `(b, kv, rows, t)` of one chunk from the rotated query `(b, kv, rows, d)`: the MSE term when `mse`
        (else a kernel computed it), plus the QJL residual's when `qs` (S'Πq) is given."""
        out = (q_rot @ self._centroids(block).mT) * block.norm.float().mT if mse else None
        if qs is not None:
            coef = math.sqrt(math.pi / 2) / self.head_dim * block.residual_norm.float().mT
            residual = (qs @ self._signs(block).mT) * coef
            out = residual if out is None else out + residual
        return out

    # -- fused attention hooks (kvpack.kernels.tq reads these) -----------------------------------
    @property
    def kernel_kind(self) -> str | None:
        """"tq" when a fused kernel can read this codec's blocks (MSE codes only), else None."""
        return "tq" if self.codebook is not None and not self.config.qjl else None

    def kernel_table(self, device: torch.device) -> torch.Tensor:
        """The table a fused kernel looks codes up in, on `device`: the `(2**bits,)` unit centroids, or for trellis codes
        the `(2**L,)` table indexed by each coordinate's raw window of bits (`trellis.window_table`, unit scale)."""
        if self._trellis_book is None:
            return self._on("centroids", self.codebook.centroids, device)
        return self._on("window_table", _unit_window_table(self.mse_bits, self.config.trellis, self.head_dim), device)

    def _signs_times_scale(self, device: torch.device) -> torch.Tensor:
        """`(kv, d)` Hadamard signs times the channel scale σ (or the signs alone): the pre-factor of the query's map and
        the post-factor of the output's. Held per device while the signs and scale are the same tensors (a refit or
        `load_state_dict` assigns new ones): a decode step reads it twice per layer, and the product cost ~5 us each
        time. `state_nbytes` counts it (kv·d floats)."""
        signs = self._hadamard_signs(device)  # (kv, 1, d), the same tensor while the seed and device are
        if self.scale is None:
            return signs[:, 0]
        scale = self._on("scale", self.scale, device)  # (kv, d), the same tensor until a refit
        held = self.__dict__.get("_premap")
        if held is None or held[0] is not signs or held[1] is not scale:
            held = self._premap = (signs, scale, signs[:, 0] * scale)
        return held[2]

    def kernel_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grouped query `(b, kv, rows, d)` -> (Π(q⊙σ) for the codes, q·μ `(b, kv, rows, 1)` or None). For decode rows on
        CPU both run in C++ on the calling thread (`fwht_rows`, `head_matmul`): no torch parallel region per layer."""
        q = q.float()
        if self._hadamard_signs(q.device) is not None:
            q_rot = cpu_lut.fwht_rows(q, pre=self._signs_times_scale(q.device))
        else:
            scale = self._scale(q.device)
            q_rot = cpu_lut.head_matmul(q if scale is None else q * scale, self.rotation(q.device).mT)
        offset = None if self.mean is None else cpu_lut.head_matmul(q, self._mean(q.device)[0].mT)
        return q_rot, offset

    def _turning_scores(self, q: torch.Tensor, key_positions: torch.Tensor | None, tokens: int,
                        add_to: torch.Tensor | None = None) -> torch.Tensor:
        """`<q, RoPE(rope_mean, p_t)>` `(b, kv, rows, tokens)` for grouped queries `(b, kv, rows, d)` and the keys'
        positions `(b, tokens)` (as `encode` had them), plus `add_to` when given."""
        cos, sin = self._cos_sin(key_positions, q.shape[0], tokens, q.device)
        held = self.__dict__.get("_turning_union")
        if held is None or held[0] is not self.rope_mean:  # the pairs that turn in some head, found once per fit
            half = self.head_dim // 2
            pairs = (self.rope_mean[:, :half].ne(0) | self.rope_mean[:, half:].ne(0)).any(0).nonzero().flatten()
            held = self._turning_union = (self.rope_mean, pairs)
        return rope_mean_scores(q, self._on("rope_mean", self.rope_mean, q.device), cos, sin, self._on("turning_union", held[1], q.device),
                                add_to)

    def kernel_turning(self, q: torch.Tensor, first_position) -> tuple | None:
        """What the CPU kernel needs for `rope_center` keys (`cpu_lut.tq_attention`'s `turning`): the grouped query
        `(b, kv, rows, d)` as the model formed it, each head's turning pairs and their un-RoPEd means, and the RoPE
        position `(b,)` of the segment's first token (`first_position()`); None when no pair turns."""
        state = self._turning_state()
        if state is None:
            return None
        return (q.float().contiguous(), *state, first_position().to(torch.int64).contiguous())

    def ops_turning(self, q: torch.Tensor, first_position) -> tuple[torch.Tensor, ...] | None:
        """The `kvpack::tq_attention` op's `turn_*` arguments on the query's device: `(q (b, kv, rows, d) f32, pair, mu,
        freq, pos0)` as `kernel_turning`'s (no phasor table: the op's kernels make their own); None when no pair turns.
        The state's device copies are made once (`_on`), so a decode step copies only the one position."""
        state = self._turning_state()
        if state is None:
            return None
        pair, mu, freq, _ = state
        dev = q.device
        held = (self._on("turn_pair", pair, dev), self._on("turn_mu", mu, dev), self._on("turn_freq", freq, dev))
        return (q.float().contiguous(), *held, first_position().to(device=dev, dtype=torch.int64).contiguous())

    def _turning_state(self) -> tuple[torch.Tensor, ...] | None:
        """`(pair (kv, M) i64, mu (kv, M, 2) f32 times RoPE's scaling, freq (d/2,) f64, w (d/2, 2, 64) f32)` of the turning
        pairs, M the most any head has (a head with fewer repeats pairs whose mean is zero). `pair` and `mu` are derived
        from `rope_mean` once and held (counted in `state_nbytes`); `freq` and the phasor table `w` follow the model's
        `inv_freq`, shared by its layers (`cpu_lut.phasor_table`). None when no pair turns."""
        if self.rope_mean is None:
            return None
        cached = getattr(self, "_kernel_cache", None)
        if cached is None or cached[0] is not self.rope_mean:
            half = self.head_dim // 2
            turning = self.rope_mean[:, :half].ne(0) | self.rope_mean[:, half:].ne(0)  # (kv, d/2)
            count = int(turning.sum(-1).max())
            held = None
            if count:
                pair = torch.sort(turning.to(torch.uint8).cpu(), dim=-1, descending=True, stable=True).indices[:, :count].contiguous()
                mean = self.rope_mean.float().cpu() * self.rope.scaling
                held = (pair, torch.stack((mean[:, :half].gather(1, pair), mean[:, half:].gather(1, pair)), dim=-1).contiguous())
            self._kernel_cache = cached = (self.rope_mean, held)
        if cached[1] is None:
            return None
        return (*cached[1], *cpu_lut.phasor_table(self.rope.inv_freq))

    def kernel_output(self, o: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        """Rotated-space Σp·v̂ `(b, kv, rows, d)` and Σp `(b, kv, rows, 1)` -> Σp·v = (Πᵀo)⊙σ + Σp·μ in the value space."""
        mean = None if self.mean is None else self._mean(o.device)[0, :, 0]
        if self._hadamard_signs(o.device) is not None:
            return cpu_lut.fwht_rows(o, post=self._signs_times_scale(o.device), s=None if mean is None else denom, bias=mean)
        out = cpu_lut.head_matmul(o, self.rotation(o.device))
        if self.scale is not None:
            out = out * self._scale(out.device)
        return out if mean is None else out + denom * mean[None, :, None]

    # -- a batch whose rows hold their own codecs (codecs.rows.RowsCodec; kvpack.kernels.tq.tq_rows_partial) ---------
    # Each row's centering, channel scale and turning means are its own; the rotation, codebook and sketch come from the
    # config, seed and layer, so they are one for the batch. The maps below stack the rows' state once (held while every
    # row's state is the same tensors) and serve all rows in one op call.
    def rows_kernel_query(self, codecs: list[TurboQuantCodec], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`kernel_query` for grouped queries `(b, kv, rows, d)` whose row i reads `codecs[i]`."""
        q = q.float()
        if self._hadamard_signs(q.device) is not None:
            pre = _stack(self, "premap", [c._signs_times_scale(q.device) for c in codecs])  # (b, kv, d)
            q_rot = cpu_lut.fwht_rows(q * pre[:, :, None, :])
        else:
            scale = None if self.scale is None else _stack(self, "scale", [c._on("scale", c.scale, q.device) for c in codecs])
            q_rot = cpu_lut.head_matmul(q if scale is None else q * scale[:, :, None, :], self.rotation(q.device).mT)
        if self.mean is None:
            return q_rot, None
        mean = _stack(self, "mean", [c._on("mean", c.mean, q.device) for c in codecs])  # (b, kv, d)
        return q_rot, (q * mean[:, :, None, :]).sum(-1, keepdim=True)

    def rows_kernel_output(self, codecs: list[TurboQuantCodec], o: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        """`kernel_output` for rotated-space outputs `(b, kv, rows, d)` whose row i reads `codecs[i]`."""
        if self._hadamard_signs(o.device) is not None:
            out = cpu_lut.fwht_rows(o) * _stack(self, "premap", [c._signs_times_scale(o.device) for c in codecs])[:, :, None, :]
        else:
            out = cpu_lut.head_matmul(o, self.rotation(o.device))
            if self.scale is not None:
                out = out * _stack(self, "scale", [c._on("scale", c.scale, o.device) for c in codecs])[:, :, None, :]
        if self.mean is None:
            return out
        return out + denom * _stack(self, "mean", [c._on("mean", c.mean, o.device) for c in codecs])[:, :, None, :]

    def rows_ops_turning(self, codecs: list[TurboQuantCodec], q: torch.Tensor, first_position) -> tuple[torch.Tensor, ...] | None:
        """`ops_turning` with `pair (b, kv, M)` and `mu (b, kv, M, 2)`, one per row: rows with fewer turning pairs repeat
        pair 0 with a zero mean (no term); None when no row's pairs turn."""
        states = [c._turning_state() for c in codecs]
        live = [st for st in states if st is not None]
        if not live:
            return None
        dev = q.device
        count = max(st[0].shape[1] for st in live)

        def padded(st, i: int) -> torch.Tensor:  # (kv, count) pairs or (kv, count, 2) means of one row
            if st is None:
                return torch.zeros((self.kv_heads, count, 2)[: 2 + i], dtype=(torch.int64, torch.float32)[i])
            extra = count - st[i].shape[1]
            return st[i] if not extra else torch.cat([st[i], torch.zeros_like(st[i][:, :1]).expand(-1, extra, *st[i].shape[2:])], 1)

        pair = _stack(self, "turn_pair", [None if st is None else st[0] for st in states], lambda: torch.stack([padded(st, 0) for st in states]).to(dev))
        mu = _stack(self, "turn_mu", [None if st is None else st[1] for st in states], lambda: torch.stack([padded(st, 1) for st in states]).to(dev))
        freq = self._on("turn_freq", live[0][2], dev)
        return (q.float().contiguous(), pair, mu, freq, first_position().to(device=dev, dtype=torch.int64).contiguous())

    def _rotated_sum(self, p: torch.Tensor, block: TurboQuantPacked, mse: bool) -> torch.Tensor:
        """Σ_t p_t·v̂_t of one chunk in the rotated space `(b, kv, rows, d)`: the MSE term when `mse` (else a
        kernel computed it), plus the QJL residual's when the block has signs."""
        acc = (p * block.norm.float().mT) @ self._centroids(block) if mse else None
        if block.signs is not None:
            coef = math.sqrt(math.pi / 2) / self.head_dim * block.residual_norm.float().mT
            residual = ((p * coef) @ self._signs(block)) @ self.sketch(p.device)
            acc = residual if acc is None else acc + residual
        return acc

    def weighted_sum(self, probs: torch.Tensor, packed: TurboQuantPacked) -> torch.Tensor:
        """Σ p·||v||·c[idx] accumulated in the rotated space (the CPU kernel decodes codes only in
        registers and L1), then one inverse rotation per head."""
        if self.config.rope_center:
            raise ValueError("rope_center is a key option (values carry no RoPE): build the value codec without it")
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        kernel = self._use_kernels(packed, p.shape[2])
        acc = kernels.lut_weighted_sum(p, packed.codes, packed.norm, self.codebook.centroids, self.mse_bits, self.head_dim) if kernel else None
        if not kernel or packed.signs is not None:
            part = chunked_sum(lambda pc, block: self._rotated_sum(pc, block, not kernel), p, packed, self._width(p.shape[2]))
            acc = part if acc is None else acc + part
        out = self._unrotate(acc)
        if self.scale is not None:
            out = out * self._scale(out.device)
        if self.mean is not None:  # Σ p·μ = μ·Σp (probs are unnormalized partials)
            out = out + p.sum(-1, keepdim=True) * self._mean(out.device)
        return ungroup(out, probs.shape[1])


def _stack(owner: TurboQuantCodec, name: str, parts: list, make=None) -> torch.Tensor:
    """The rows' state `parts` stacked along a new dim 0 (or `make()` when given), held on `owner` while every part is the
    same tensor (a refit or `load_state_dict` assigns new ones; weak references, so the held stack keeps no row's state
    alive and `state_nbytes` counts only the stack). A part that is None (a row padded by `make`) matches only None."""
    held = owner.__dict__.setdefault("_row_stacks", {}).get(name)
    if held is not None and len(held[0]) == len(parts) and all((r is None and p is None) or (r is not None and r() is p)
                                                                for r, p in zip(held[0], parts, strict=True)):
        return held[1]
    stacked = make() if make is not None else torch.stack(parts)
    owner._row_stacks[name] = (tuple(None if p is None else weakref.ref(p) for p in parts), stacked)
    return stacked


@functools.lru_cache(maxsize=16)
def _unit_window_table(bits: int, state_bits: int, head_dim: int) -> torch.Tensor:
    """`trellis.window_table` of the shared Gaussian codebook at unit scale (the codebook is for sqrt(d)-scaled
    coordinates): one per (bits, L, d) in a process, like the codebook itself."""
    return trellis.window_table(trellis.gaussian_codebook(bits, state_bits), bits) / math.sqrt(head_dim)
