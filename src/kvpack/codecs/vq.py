"""Shard's value codec: randomized Hadamard, per-channel scale, k-means VQ on groups of channels.

Shard blog §4, §6, §10 (https://krishgarg.com/shard). Values have a flat spectrum, so no subspace
to exploit; instead each `(batch, kv_heads, tokens, head_dim)` vector is rotated by H·diag(signs)
(signs seeded per (layer, kv head)) so channels look alike and near-Gaussian, divided by a per
(kv head, channel) RMS scale, and cut into groups of `group_size` channels; each group is replaced
by the index of its nearest codeword in a `codebook_size`-entry k-means codebook. The defaults
(groups of 4, 256 entries) store one byte per 4 channels: 2 bits per value element.

`weighted_sum` never leaves the rotated space per token: `Σ_t p_t V_t = H(Σ_t p_t V^rot_t)`, so it
accumulates codeword lookups weighted by the probabilities and applies the scale and ONE inverse
Hadamard to the `(q_len, head_dim)` result (blog §10).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..kernels import cpu_lut
from ..primitives.kmeans import kmeans
from ..primitives.packing import pack_bits, packed_length, unpack_bits
from ..primitives.rotation import derive_seed, hadamard_transform, is_power_of_two, random_signs
from .base import ByteBudget, Codec, Packed, check_state, group_query, ungroup

_CHUNK_ELEMENTS = 1 << 22  # float32 entries of looked-up codewords held at once in `weighted_sum`
MIN_BUDGET_ENTRIES = 16  # the smallest codebook a byte budget may choose (`VQValueCodec._sizes`)


def _index_bits(entries: int) -> int:
    """Bits of one codeword index for an `entries`-codebook."""
    return (entries - 1).bit_length()


class VQScope(str, Enum):
    """Which vectors share one codebook."""

    LAYER = "layer"  # one codebook for all kv heads of the layer (blog §6)
    HEAD = "head"  # one codebook per kv head: kv_heads times the (small) codebook bytes


@dataclass(frozen=True)
class VQConfig:
    """group_size: channels per codeword (divides head_dim). codebook_size: entries per codebook, 2..256
    (indices take ceil(log2) bits). n_iter: Lloyd iterations. seed: rotation signs and k-means.
    fit_points: k-means is fit on at most this many groups per codebook (a seeded sample); every
    group is then assigned. scope: `VQScope`. token_norm: also divide each vector by its own RMS
    (stored fp16, 2 bytes per token and head) so the codebook models directions, not magnitudes;
    the norm folds into the attention probabilities, so `weighted_sum` stays in the rotated space."""

    group_size: int = 4
    codebook_size: int = 256
    n_iter: int = 16
    seed: int = 0
    fit_points: int = 32768
    scope: VQScope = VQScope.LAYER
    token_norm: bool = False

    def __post_init__(self):
        if not isinstance(self.token_norm, bool):
            raise ValueError(f"token_norm must be True or False, got {self.token_norm!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 2 <= self.codebook_size <= 256:
            raise ValueError(f"codebook_size must be in 2..256 (uint8 indices), got {self.codebook_size}")
        if self.n_iter < 1:
            raise ValueError(f"n_iter must be >= 1, got {self.n_iter}")
        if self.fit_points < self.codebook_size:
            raise ValueError(f"fit_points must be >= codebook_size ({self.codebook_size}), got {self.fit_points}")
        try:
            object.__setattr__(self, "scope", VQScope(self.scope))
        except ValueError:
            raise ValueError(f"scope must be one of {[s.value for s in VQScope]}, got {self.scope!r}") from None


@dataclass
class VQPacked(Packed):
    indices: torch.Tensor  # (batch, kv_heads, tokens, bytes) uint8: bit-packed codeword indices per channel group
    norm: torch.Tensor | None = None  # (batch, kv_heads, tokens, 1) float16 per-vector RMS (token_norm only)


class VQValueCodec(Codec):
    config_class = VQConfig
    name = "vq"
    fits_to_budget = True

    def __init__(self, config: VQConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        if head_dim % config.group_size:
            raise ValueError(f"group_size {config.group_size} must divide head_dim {head_dim}")
        self.n_groups = head_dim // config.group_size
        self.entries = config.codebook_size  # a byte budget may fit a smaller codebook (`fit`)
        self.budget_met: bool | None = None  # whether the last `fit` with a byte budget found a codebook within it
        self.bits = _index_bits(self.entries)
        signs = [random_signs(head_dim, derive_seed(config.seed, layer_idx, h)) for h in range(kv_heads)]
        self.signs = torch.stack(signs).to(torch.int8)  # (kv_heads, head_dim)
        self.scale: torch.Tensor | None = None  # (kv_heads, head_dim) float16, RMS of each rotated channel
        self.codebooks: torch.Tensor | None = None  # (1 or kv_heads, entries, group_size) float16

    @property
    def fitted(self) -> bool:
        return self.codebooks is not None

    def _signs(self, device) -> torch.Tensor:
        return self._on("signs", self.signs, torch.device(device)).float()[None, :, None]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(x.float() * self._signs(x.device))

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(y) * self._signs(y.device)

    def _points(self, y: torch.Tensor) -> torch.Tensor:
        """Normalized rotated values `(b, h, t, d)` -> `(codebooks, points, group_size)`."""
        g = y.reshape(*y.shape[:3], self.n_groups, self.config.group_size)
        if self.config.scope is VQScope.LAYER:
            return g.reshape(1, -1, self.config.group_size)
        return g.transpose(0, 1).reshape(self.kv_heads, -1, self.config.group_size)

    def _token_rms(self, y: torch.Tensor) -> torch.Tensor:
        """Per-vector RMS `(b, h, t, 1)` fp16 of channel-scaled rotated values (kept above 0)."""
        return y.square().mean(-1, keepdim=True).sqrt().clamp_min(1e-4).half()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted channel `scale` and `codebooks` (float16); the Hadamard signs are reseeded."""
        return {} if not self.fitted else {"scale": self.scale, "codebooks": self.codebooks}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        books = 1 if self.config.scope is VQScope.LAYER else self.kv_heads
        saved = state.get("codebooks")
        # A codebook fitted to a byte budget has one of the sizes `fit` chooses from; any other size is refused below.
        entries = saved.shape[1] if saved is not None and saved.dim() == 3 and saved.shape[1] in self._sizes() else self.config.codebook_size
        expected = {
            "scale": ((self.kv_heads, self.head_dim), torch.float16),
            "codebooks": ((books, entries, self.config.group_size), torch.float16),
        }
        check_state(self.name, state, expected)
        self.scale, self.codebooks = state.get("scale"), saved
        self._set_entries(entries)

    def _set_entries(self, entries: int) -> None:
        self.entries, self.bits = entries, _index_bits(entries)

    def _sizes(self) -> tuple[int, ...]:
        """Codebook sizes a byte budget chooses from, largest first: halvings of `codebook_size` down to 16 entries
        (1 bit per value at groups of 4; below it the values' error grows past what any key rank makes up)."""
        sizes = [self.config.codebook_size]
        while sizes[-1] // 2 >= min(MIN_BUDGET_ENTRIES, self.config.codebook_size):
            sizes.append(sizes[-1] // 2)
        return tuple(sizes)

    def budget_nbytes(self, entries: int, batch: int, tokens: int) -> int:
        """Bytes this codec holds for `tokens` tokens of `batch` sequences with an `entries`-codebook: the packed
        indices and per-token norms of every token and kv head; the Hadamard signs (int8), the channel scales and the
        codebook(s) (float16)."""
        books = 1 if self.config.scope is VQScope.LAYER else self.kv_heads
        per_token = packed_length(self.n_groups, _index_bits(entries)) + (2 if self.config.token_norm else 0)
        state = 3 * self.kv_heads * self.head_dim + 2 * books * entries * self.config.group_size
        return batch * self.kv_heads * tokens * per_token + state

    def _entries_within(self, budget: ByteBudget, batch: int) -> int:
        """The largest codebook in `_sizes()` whose bytes for `budget.tokens` tokens fit `budget.allowed` (`budget_met`).
        When none does:
        - on a short prompt (the smallest codebook's tokens would fit the layer's own share, were it not for the parts
          that do not grow with the prompt) `codebook_size`: a smaller codebook would cost quality without reaching the
          target, and a short prompt is a small cache (on 1K prompts, where no layer of SmolLM2 reaches 10x, 16
          entries lost 2 of 6 needles). The carry is left out of that test: other layers' debts on a short prompt
          must not make this one look long;
        - where this layer's keys leave too little at any length, the smallest: the layers after it make up the rest."""
        allowed, tokens, fixed, carry = budget
        fitting = next((e for e in self._sizes() if self.budget_nbytes(e, batch, tokens) <= allowed), None)
        self.budget_met = fitting is not None
        if fitting is not None:
            return fitting
        smallest = self._sizes()[-1]
        short = self.budget_nbytes(smallest, batch, tokens) - self.budget_nbytes(smallest, 0, 0) <= allowed - carry + fixed
        return self.config.codebook_size if short else smallest

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None, byte_budget: ByteBudget | None = None) -> None:
        """Channel scales and codebook(s) from values `x (batch, kv_heads, tokens, head_dim)`. byte_budget: the codebook
        is then the largest of `_sizes()` whose bytes fit it (`_entries_within`, `MethodConfig.prompt_ratio`)."""
        self._check(x)
        cfg = self.config
        self._set_entries(cfg.codebook_size if byte_budget is None else self._entries_within(byte_budget, x.shape[0]))
        y = self._rotate(x).cpu()
        self.scale = y.square().mean((0, 2)).sqrt().clamp_min(1e-6).half()
        y = y / self.scale.float()[None, :, None]
        if cfg.token_norm:
            y = y / self._token_rms(y).float()
        points = self._points(y)
        if points.shape[1] > cfg.fit_points:
            # Pseudo-head ids -1 / -2 keep these streams apart from the per-head rotation signs.
            gen = torch.Generator().manual_seed(derive_seed(cfg.seed, self.layer_idx, -2))
            points = points[:, torch.randperm(points.shape[1], generator=gen)[: cfg.fit_points]]
        result = kmeans(points, self.entries, cfg.n_iter, seed=derive_seed(cfg.seed, self.layer_idx, -1), nearest=cpu_lut.nearest_codeword,
                        picks=cpu_lut.d2_picks)
        self.codebooks = result.centroids.half()

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> VQPacked:
        if not self.fitted:
            self.fit(x, positions)
        self._check(x)
        b, h, t, _ = x.shape
        y = self._rotate(x) / self._on("scale", self.scale, x.device).float()[None, :, None]
        norm = self._token_rms(y) if self.config.token_norm else None
        if norm is not None:
            y = y / norm.float()
        index, _ = cpu_lut.nearest_codeword(self._points(y), self._on("codebooks", self.codebooks, x.device).float())
        if self.config.scope is VQScope.LAYER:
            index = index.reshape(b, h, t, self.n_groups)
        else:
            index = index.reshape(h, b, t, self.n_groups).transpose(0, 1)
        return VQPacked(t, pack_bits(index, self.bits), norm)

    def _lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """Normalized rotated values `(b, h, t, head_dim)` float32 from packed indices."""
        index = unpack_bits(indices, self.bits, self.n_groups).long()
        codebooks = self._on("codebooks", self.codebooks, indices.device).float()
        if self.config.scope is VQScope.HEAD:  # per-head codebooks stacked: offset each head's indices
            index = index + (torch.arange(self.kv_heads, device=indices.device) * self.entries)[None, :, None, None]
        return codebooks.reshape(-1, self.config.group_size)[index].flatten(-2)

    @property
    def kernel_kind(self) -> str | None:
        """"vq" once fitted: the fused kernel gathers codewords per token in L1 (`kernel_state`)."""
        return "vq" if self.fitted else None

    def kernel_state(self) -> dict:
        """Codebooks `(1 or kv_heads, entries, group_size)` as stored (float16) and the index width, for the fused
        kernels: the CPU kernel widens them per call (a few KB), so no float32 copy is held beside the codec's own
        (memory_report counts what a codec holds); the kernels widen them to float32 (`kernels.pca_vq`)."""
        return {"books": self.codebooks, "bits": self.bits}

    def kernel_output(self, o: torch.Tensor) -> torch.Tensor:
        """Rotated, channel-normalized `Σ p·v̂` `(b, kv_heads, rows, head_dim)` -> value space: one inverse Hadamard with the
        channel scale before it (in C++ on the calling thread for decode rows on CPU, `fwht_rows`)."""
        if not is_power_of_two(self.head_dim):  # block Hadamard (hadamard_transform): the torch path
            return self._unrotate(o * self._on("scale", self.scale, o.device).float()[None, :, None])
        scale = self._on("scale", self.scale, o.device).float()  # small per-call casts: no float copies held
        return cpu_lut.fwht_rows(o.float(), pre=scale, post=self._signs(o.device)[0, :, 0])

    def decode(self, packed: VQPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        scale = self._on("scale", self.scale, packed.indices.device).float()[None, :, None]
        y = self._lookup(packed.indices)
        if packed.norm is not None:
            y = y * packed.norm.float()
        return self._unrotate(y * scale)

    def weighted_sum(self, probs: torch.Tensor, packed: VQPacked) -> torch.Tensor:
        """`probs (batch, q_heads, q_len, tokens)` -> `(batch, q_heads, q_len, head_dim)`, one Hadamard at the end."""
        p = group_query(probs.float(), self.kv_heads)  # (b, kv, rows, t)
        if packed.norm is not None:  # Σ_t p_t n_t c_t: the per-token norm rides on the probabilities
            p = p * packed.norm.float().transpose(-1, -2)
        b, _, rows, tokens = p.shape
        step = max(1, _CHUNK_ELEMENTS // max(1, b * self.kv_heads * self.head_dim))
        acc = p.new_zeros(b, self.kv_heads, rows, self.head_dim)
        for ts in range(0, tokens, step):
            acc += p[..., ts : ts + step] @ self._lookup(packed.indices[:, :, ts : ts + step])
        out = self._unrotate(acc * self._on("scale", self.scale, p.device).float()[None, :, None])
        return ungroup(out, probs.shape[1])
