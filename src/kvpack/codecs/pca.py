"""Shard's key codec: RoPE undone, PCA basis, DP-allocated coefficient widths, scores on the coefficients.

Shard blog §3, §5, §9 (https://krishgarg.com/shard); KVTC (arXiv:2511.01815) for PCA + DP bits on
un-RoPEd keys. Keys `(batch, kv_heads, tokens, head_dim)` arrive RoPE'd; the codec undoes RoPE with
the model's own `inv_freq` / `attention_scaling`, where a layer's keys lie close to a low-dimensional
subspace that RoPE's per-token rotation hides. `fit` learns, per layer (or per kv head):
- a mean and an orthonormal basis (exact float64 eigendecomposition), stored as int8 with an fp16
  scale per column (component);
- a width per group of `group_size` components from {0, 2, 4, 6, 8} bits under the budget
  `bits * rank`, by DP with a penalty that makes dropping a direction costlier than quantizing it;
- an fp16 absmax scale per component (symmetric levels `[-(2^(b-1)-1), 2^(b-1)-1]`, e.g. [-7, 7]
  at 4 bits).
A token is then its bit-packed coefficient codes: `Σ bits` per token for the whole layer.

`scores` never rebuilds K: with un-RoPEd query halves `a, b` and basis halves `B_c, B_d`,
`A = a B_c + b B_d` and `B* = b B_c - a B_d` (per pair, per component) are contracted with the
integer coefficient levels and mixed with `cos/sin(θ_i Δ)` (`primitives/rope.py`), plus the mean's
term. Cost per key token is `q_heads * head_dim * rank` multiply-adds, `kv_heads` (per-layer scope)
times more than rebuilding K would take: the price of never materializing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..kernels import pca_vq as _kernel  # noqa: F401  (registers the ("pca", "vq") entry `kernel_kind` names)
from ..primitives.packing import pack_bits, packed_length, unpack_bits
from ..primitives.pca import BIT_OPTIONS, allocate_bits, group_variances, modelled_errors, pca, rank_for_energy
from ..primitives.rope import apply_rope, mix_pairs, relative_cos_sin, undo_rope
from ..primitives.validation import check_query
from .base import Codec, Packed, check_state, group_query
from .rope_keys import UnRopedKeys

_SCORE_KEYS = 1024  # keys sampled from the prompt to measure the score error of a truncated basis
_CHUNK_ELEMENTS = 1 << 22  # float32 entries of the largest temporary in `scores` (16 MiB)


class Allocation(str, Enum):
    """How the DP prices a width for a component group (dropping always costs `drop_penalty * variance`)."""

    MEASURED = "measured"  # squared error of the actual absmax quantizer on the fitted coefficients
    MODEL = "model"  # blog §5 model `variance / (3 * 4^bits)`: blind to 2-bit absmax codes rounding most values to 0


MAX_IDENTITY_QUERIES = 4  # query tokens per call up to which scores use the RoPE identity


def _absmax_error(coefs: torch.Tensor, bits: int) -> float:
    """Mean squared error per sample of symmetric `bits`-bit codes with an absmax scale per component."""
    qmax = (1 << (bits - 1)) - 1
    scale = (coefs.abs().amax(-2, keepdim=True) / qmax).clamp_min(1e-8)
    err = coefs - (coefs / scale).round().clamp(-qmax, qmax) * scale
    return float(err.double().square().sum() / coefs.shape[-2])


class PCAScope(str, Enum):
    """Which keys share one basis."""

    LAYER = "layer"  # one basis over all kv heads' keys concatenated: captures cross-head correlation (blog §5)
    HEAD = "head"  # one basis per kv head: `kv_heads` times cheaper scores, more components for the same energy


@dataclass(frozen=True)
class PCAConfig:
    """rank: components kept before allocation; None picks the smallest rank holding `energy` of the
    un-RoPEd key variance (default 0.90: 8.4x at 8K on SmolLM2 at -0.6% perplexity; 0.95 gave 7.4x,
    see README "Shard results"). bits: average bits per kept component (budget = round(bits * rank) per token).
    group_size: components per DP group. drop_penalty: error multiplier of a 0-bit (dropped) group.
    basis_bits: 8 (int8 + fp16 column scale) or 16 (fp16). scope: `PCAScope`. allocation: `Allocation`."""

    rank: int | None = None
    energy: float = 0.90
    score_error: float | None = 0.03
    bits: float = 4.0
    group_size: int = 16
    drop_penalty: float = 4.0
    basis_bits: int = 8
    scope: PCAScope = PCAScope.LAYER
    allocation: Allocation = Allocation.MEASURED

    def __post_init__(self):
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {self.rank}")
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {self.energy}")
        if self.score_error is not None and not 0.0 < self.score_error < 1.0:
            raise ValueError(f"score_error must be in (0, 1), or None to choose the rank by key energy, got {self.score_error}")
        if not 2.0 <= self.bits <= 8.0:
            raise ValueError(f"bits (average per kept component) must be in [2, 8], got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.drop_penalty < 0:
            raise ValueError(f"drop_penalty must be >= 0, got {self.drop_penalty}")
        if self.basis_bits not in (8, 16):
            raise ValueError(f"basis_bits must be 8 or 16, got {self.basis_bits}")
        for attr, enum in (("scope", PCAScope), ("allocation", Allocation)):
            try:
                object.__setattr__(self, attr, enum(getattr(self, attr)))
            except ValueError:
                raise ValueError(f"{attr} must be one of {[e.value for e in enum]}, got {getattr(self, attr)!r}") from None


@dataclass
class PCAPacked(Packed):
    codes: torch.Tensor  # (batch, groups, tokens, bytes) uint8; groups = 1 (layer scope) or kv_heads


class PCAKeyCodec(UnRopedKeys, Codec):
    config_class = PCAConfig
    name = "pca"
    uses_positions = True
    fits_on_queries = True

    def __init__(self, config: PCAConfig, head_dim: int, kv_heads: int, layer_idx: int = 0):
        super().__init__(config, head_dim, kv_heads, layer_idx)
        if head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head_dim, got {head_dim}")
        self.groups = 1 if config.scope is PCAScope.LAYER else kv_heads
        self.group_dim = kv_heads * head_dim // self.groups
        # Until `set_rope`, keys are taken as RoPE-free: zero frequencies make RoPE the identity.
        self._init_rope()
        self.mean: torch.Tensor | None = None  # (groups, group_dim) float16
        self.basis: torch.Tensor | None = None  # (groups, group_dim, rank) int8 (or float16)
        self.basis_scale: torch.Tensor | None = None  # (groups, rank) float16; None for an fp16 basis
        self.coef_scale: torch.Tensor | None = None  # (groups, rank) float16
        self.segments: tuple[tuple[int, int], ...] = ()  # (components, bits) of consecutive kept components
        self.rank_source: str | None = None  # how `fit` chose the rank: "config", "queries" or "energy"

    # -- RoPE and layout -----------------------------------------------------------------------
    def _positions(self, positions: torch.Tensor | None, batch: int, tokens: int, device) -> torch.Tensor:
        if positions is None:
            if self.rope_set:  # the same refusal as `_cos_sin`, without building cos/sin for every token
                raise ValueError("this codec undoes RoPE: pass positions (batch, tokens) to encode/decode/scores")
            return torch.zeros(batch, tokens, dtype=torch.long, device=device)
        return positions

    def _to_groups(self, x: torch.Tensor) -> torch.Tensor:
        """`(batch, kv_heads, tokens, d)` -> `(batch, groups, tokens, group_dim)`."""
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, self.groups, self.group_dim).transpose(1, 2)

    def _from_groups(self, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        return y.transpose(1, 2).reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)

    def _unroped(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        self._check(x)
        cos, sin = self._cos_sin(positions, x.shape[0], x.shape[2], x.device)
        return self._to_groups(undo_rope(x.float(), cos, sin))

    # -- fitted state ---------------------------------------------------------------------------
    @property
    def fitted(self) -> bool:
        return self.basis is not None

    @property
    def rank(self) -> int:
        """Components actually stored (the DP's dropped groups excluded)."""
        return sum(n for n, _ in self.segments)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted mean, basis (+ its column scales for an int8 basis), coefficient scales and the bit
        allocation `segments` as a `(k, 2)` long tensor of (components, bits); the RoPE frequencies are the model's."""
        if not self.fitted:
            return {}
        state = {"mean": self.mean, "basis": self.basis, "coef_scale": self.coef_scale}
        if self.basis_scale is not None:
            state["basis_scale"] = self.basis_scale
        return state | {"segments": torch.tensor(self.segments, dtype=torch.long).reshape(-1, 2)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        segments = state.get("segments")
        if segments is not None and (segments.dtype != torch.long or segments.dim() != 2 or segments.shape[1] != 2):
            raise ValueError(f"codec {self.name!r} state 'segments' must be a (k, 2) long tensor of (components, bits)")
        pairs = tuple((int(n), int(b)) for n, b in segments.tolist()) if segments is not None else ()
        if any(n < 1 or b not in BIT_OPTIONS or b == 0 for n, b in pairs):
            raise ValueError(f"codec {self.name!r} state 'segments' must hold (components >= 1, bits in {BIT_OPTIONS[1:]}), got {pairs}")
        rank = sum(n for n, _ in pairs)
        g, dim = self.groups, self.group_dim
        expected = {
            "segments": ((len(pairs), 2), torch.long),
            "mean": ((g, dim), torch.float16),
            "basis": ((g, dim, rank), torch.int8 if self.config.basis_bits == 8 else torch.float16),
            "coef_scale": ((g, rank), torch.float16),
        }
        if self.config.basis_bits == 8:
            expected["basis_scale"] = ((g, rank), torch.float16)
        check_state(self.name, state, expected)
        self.segments = pairs
        self.mean, self.basis, self.coef_scale = state.get("mean"), state.get("basis"), state.get("coef_scale")
        self.basis_scale = state.get("basis_scale")

    def _basis(self, device=None) -> torch.Tensor:
        """Dequantized basis `(groups, group_dim, rank)` float32 (state copied to `device` once, see `Codec._on`)."""
        device = self.basis.device if device is None else torch.device(device)
        basis = self._on("basis", self.basis, device).float()
        if self.basis_scale is not None:
            basis = basis * self._on("basis_scale", self.basis_scale, device).float().unsqueeze(1)
        return basis

    def _folded(self, device=None) -> torch.Tensor:
        """The basis codes are read against, `(groups, group_dim, rank)` float32: each component times its
        coefficient scale. For an int8 basis the product is requantized to int8 with one scale per row
        (output coordinate), so a rebuild is an integer product of the codes with it (the CPU kernel's VNNI
        path) plus one scale per coordinate, and decode, scores and every kernel read the same numbers.
        Derived from the stored state on each call (a few thousand entries), not held beside it; the extra
        rounding costs ~0.5/127 of a row's largest entry."""
        folded = self._basis(device) * self._on("coef_scale", self.coef_scale, self.basis.device if device is None else torch.device(device)).float().unsqueeze(1)
        if self.config.basis_bits == 8:
            # A 12-bit mantissa keeps every int8 x scale product exact in float32 (the kernel re-derives both).
            mant, exp = torch.frexp(folded.abs().amax(2, keepdim=True) / 127)  # (groups, group_dim, 1)
            row = torch.ldexp((mant * 4096).round_() / 4096, exp)
            folded = (folded / row.clamp_min(1e-30)).round_().clamp_(-127, 127) * row
        return folded

    def _qmax(self) -> torch.Tensor:
        """Largest code magnitude of every stored component `(rank,)` (cached: read on every decode step)."""
        cached = getattr(self, "_qmax_cache", None)
        if cached is None or cached[0] != self.segments:
            qmax = [torch.full((n,), (1 << (bits - 1)) - 1, dtype=torch.float32) for n, bits in self.segments]
            cached = self._qmax_cache = (self.segments, torch.cat(qmax or [torch.zeros(0)]))
        return cached[1]

    @property
    def kernel_kind(self) -> str | None:
        """"pca" once fitted: the fused kernel rebuilds keys tile by tile from the codes (`kernel_state`)."""
        return "pca" if self.fitted else None

    def kernel_basis_t(self) -> torch.Tensor:
        """The folded basis transposed, `(groups, rank, group_dim)` float32: what the kernels rebuild keys from."""
        return self._folded().transpose(1, 2).contiguous()

    def kernel_state(self) -> dict:
        """What `kernels.cpu_lut.pca_vq_attention` reads, derived once per fit: per component the first bit
        in a packed row, its width and level offset; the folded basis (`_folded`), transposed
        `(groups, rank, group_dim)`; the mean `(groups, group_dim)`; the RoPE frequencies. The CPU launcher adds
        the basis' integer form for its VNNI rebuild on first use (`cpu_lut.int8_basis`) and then drops the float
        basis (an empty tensor), which the device ops derive again if they run on this codec."""
        cached = getattr(self, "_kernel_cache", None)
        if cached is not None and cached[0] is self.basis and cached[1] is self.rope:
            return cached[2]
        bitpos, bits, byte = [], [], 0
        for n, b in self.segments:
            bitpos += [8 * byte + k * b for k in range(n)]
            bits += [b] * n
            byte += packed_length(n, b)
        basis_t = self.kernel_basis_t()
        state = {
            "bitpos": torch.tensor(bitpos, dtype=torch.int32),
            "bits": torch.tensor(bits, dtype=torch.uint8),
            "qmax": self._qmax().contiguous(),
            "basis_t": basis_t,
            "mean": self.mean.float().contiguous(),
            "inv_freq": self.rope.inv_freq.float().contiguous(),
            "rope_scale": self.rope.scaling,
            "row_bytes": byte,
        }
        self._kernel_cache = (self.basis, self.rope, state)
        return state

    def fit(self, x: torch.Tensor, positions: torch.Tensor | None = None, queries: torch.Tensor | None = None) -> None:
        """Basis, bit allocation and scales from keys `x (batch, kv_heads, tokens, head_dim)` (RoPE'd);
        `queries (batch, q_heads, m, head_dim)` (RoPE'd, e.g. the prompt's last ones) choose the rank."""
        cfg = self.config
        x0 = self._unroped(x, positions)
        samples = x0.transpose(0, 1).reshape(self.groups, -1, self.group_dim).cpu()
        result = pca(samples)
        if cfg.rank is not None:
            rank, self.rank_source = min(cfg.rank, self.group_dim), "config"
        elif queries is not None and cfg.score_error is not None:
            pos = self._positions(positions, x.shape[0], x.shape[2], x.device).cpu()
            rank, self.rank_source = self._rank_for_scores(x0.cpu(), pos, result, queries.cpu()), "queries"
        else:
            rank, self.rank_source = rank_for_energy(result.variances, cfg.energy), "energy"
        sizes = [min(cfg.group_size, rank - i) for i in range(0, rank, cfg.group_size)]
        starts = [i * cfg.group_size for i in range(len(sizes))]
        # One allocation for all groups (a per-head basis shares it), so every token packs to the same bytes.
        variances = group_variances(result.variances[:, :rank].sum(0), cfg.group_size)
        if cfg.allocation is Allocation.MODEL:
            errors = modelled_errors(variances, BIT_OPTIONS, cfg.drop_penalty)
        else:
            coefs = (samples - result.mean.unsqueeze(1)) @ result.basis[:, :, :rank]  # (groups, N, rank)
            errors = [
                {0: v * cfg.drop_penalty} | {b: _absmax_error(coefs[..., s : s + n], b) for b in BIT_OPTIONS if b}
                for v, s, n in zip(variances, starts, sizes, strict=True)
            ]
        alloc = allocate_bits(errors, sizes, round(cfg.bits * rank))
        if not any(alloc):
            # A degenerate block (all-zero or constant keys: no variance to code) drops every group;
            # keep the first at the narrowest width so tokens still pack to codes and scores work.
            alloc = (min(b for b in BIT_OPTIONS if b),) + tuple(alloc[1:])
        kept = [c for s, n, b in zip(starts, sizes, alloc, strict=True) if b for c in range(s, s + n)]
        self.segments = tuple((n, b) for n, b in zip(sizes, alloc, strict=True) if b)
        basis = result.basis[:, :, kept]
        if cfg.basis_bits == 8:
            scale = (basis.abs().amax(1) / 127).clamp_min(1e-8).half()  # (groups, rank)
            self.basis = (basis / scale.float().unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
            self.basis_scale = scale
        else:
            self.basis, self.basis_scale = basis.half(), None
        self.mean = result.mean.half()
        # Absmax scales, not MSE-optimal clipping: clipping lowers the key error but clips the rare
        # large-coefficient tokens attention targets (measured on SmolLM2: attention error 0.16 vs 0.09).
        coefs = self._project(x0.cpu(), self._basis())
        absmax = coefs.abs().amax((0, 2)).clamp_min(1e-8)  # (groups, rank)
        self.coef_scale = (absmax / self._qmax()).half()

    def _rank_for_scores(self, x0: torch.Tensor, positions: torch.Tensor, result, queries: torch.Tensor) -> int:
        """Smallest multiple of `group_size` whose truncation keeps the relative score error within `score_error`.

        x0: un-RoPEd keys `(b, groups, t, group_dim)`; positions `(b, t)`; queries `(b, q_heads, m, d)`.
        Error = Σ (q·RoPE(k - k_r))² / Σ (q·k - mean over keys)², over the queries and up to
        `_SCORE_KEYS` keys spread over the prompt; the truncation residual shrinks one group at a time.
        """
        t = x0.shape[2]
        idx = torch.linspace(0, t - 1, min(t, _SCORE_KEYS)).round().long().unique()
        x0, pos = x0[:, :, idx].double(), positions[:, idx]
        cos, sin = self._cos_sin(pos, x0.shape[0], len(idx), x0.device)
        q = group_query(queries.double(), self.kv_heads)  # (b, kv, rows, d)

        def scores(y: torch.Tensor) -> torch.Tensor:  # un-RoPEd grouped vectors -> raw scores (b, kv, rows, n)
            return q @ apply_rope(self._from_groups(y), cos.double(), sin.double()).mT

        residual = x0 - result.mean.double()[None, :, None]
        exact = scores(x0)
        total = (exact - exact.mean(-1, keepdim=True)).square().sum().clamp_min(1e-30)
        basis = result.basis.double()  # (groups, D, D') full
        coefs = residual @ basis  # (b, groups, n, D')
        step = self.config.group_size
        for r in range(step, basis.shape[-1], step):
            residual = residual - coefs[..., r - step : r] @ basis[:, :, r - step : r].mT[None]
            if scores(residual).square().sum() <= self.config.score_error * total:
                return r
        return basis.shape[-1]

    def _project(self, x0: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """Least-squares coefficients against `basis (groups, D, rank)` as stored (dequantized):
        `(b, groups, t, D) -> (b, groups, t, rank)`."""
        basis = basis.to(x0.device).double()
        proj = basis @ torch.linalg.pinv(basis.transpose(1, 2) @ basis)  # (groups, D, rank)
        centered = x0 - self._on("mean", self.mean, x0.device).float()[None, :, None]
        return centered @ proj.float()

    # -- encode / decode ------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> PCAPacked:
        if not self.fitted:
            self.fit(x, positions)
        x0 = self._unroped(x, positions)
        levels = self._project(x0, self._folded(x.device))  # (b, groups, t, rank), in units of each level
        qmax = self._on("qmax", self._qmax(), x.device)
        levels = levels.round_().clamp_(-qmax, qmax) + qmax  # offset to unsigned codes
        parts, start = [], 0
        for n, bits in self.segments:
            parts.append(pack_bits(levels[..., start : start + n].to(torch.uint8), bits))
            start += n
        codes = torch.cat(parts, -1) if parts else torch.zeros(*levels.shape[:-1], 0, dtype=torch.uint8, device=x.device)
        return PCAPacked(x.shape[2], codes)

    def _levels(self, codes: torch.Tensor) -> torch.Tensor:
        """Signed integer levels `(b, groups, t, rank)` float32 from packed codes."""
        parts, start = [], 0
        for n, bits in self.segments:
            nbytes = packed_length(n, bits)
            parts.append(unpack_bits(codes[..., start : start + nbytes], bits, n))
            start += nbytes
        if not parts:
            return codes.new_zeros(*codes.shape[:-1], 0, dtype=torch.float32)
        return torch.cat(parts, -1).float() - self._on("qmax", self._qmax(), codes.device)

    def decode(self, packed: PCAPacked, positions: torch.Tensor | None = None) -> torch.Tensor:
        levels = self._levels(packed.codes)
        x0 = levels @ self._folded(levels.device).transpose(1, 2) + self._on("mean", self.mean, levels.device).float()[None, :, None]
        keys = self._from_groups(x0)
        cos, sin = self._cos_sin(positions, keys.shape[0], keys.shape[2], keys.device)
        return apply_rope(keys, cos, sin)

    # -- attention on the coefficients ----------------------------------------------------------
    def scores(
        self,
        query: torch.Tensor,
        packed: PCAPacked,
        query_positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Raw <RoPE(q), RoPE(k)> `(batch, q_heads, q_len, tokens)` from the coefficient codes (blog §9).

        Decode steps (q_len <= MAX_IDENTITY_QUERIES) use the relative-position identity and never
        rebuild K. Its cost per key token is rows·d·rank, which for a multi-token chunk (prompt
        continuation, perplexity scoring) exceeds rebuilding K in token chunks by ~100x on CPU,
        so those calls decode, re-RoPE and matmul instead.
        """
        check_query(query, self.kv_heads, self.head_dim)
        b, q_heads, q_len, d = query.shape
        if q_len > MAX_IDENTITY_QUERIES:
            return super().scores(query, packed, query_positions, key_positions)
        device, tokens = query.device, packed.num_tokens
        cos, sin = self._cos_sin(query_positions, b, q_len, device)
        q0 = undo_rope(query.float(), cos, sin) * self.rope.scaling**2  # <RoPE q, RoPE k> = s² <q0, R(Δ) k0>
        q_pos = self._positions(query_positions, b, q_len, device)
        k_pos = self._positions(key_positions, b, tokens, device)
        q_step = max(1, _CHUNK_ELEMENTS // max(1, b * q_heads * d * max(self.rank, 1)))
        out = []
        for qs in range(0, q_len, q_step):
            chunk = slice(qs, qs + q_step)
            out.append(self._scores_chunk(q0[:, :, chunk], q_pos[:, chunk], packed.codes, k_pos))
        return torch.cat(out, 2)

    def _scores_chunk(self, q0: torch.Tensor, q_pos: torch.Tensor, codes: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        b, q_heads, q_len, d = q0.shape
        half, groups, per = d // 2, self.groups, self.kv_heads // self.groups
        rows = q_heads // self.kv_heads * q_len
        # q: (b, groups, heads per group, rows, d/2) halves, rows = (query head in kv group, query position)
        a, bb = group_query(q0, self.kv_heads).reshape(b, groups, per, rows, d).chunk(2, dim=-1)
        # Basis halves with both scales folded in: (groups, heads per group, d/2, rank).
        basis = self._folded(q0.device).reshape(groups, per, d, -1)
        bc, bd = basis[:, :, :half].unsqueeze(0).unsqueeze(3), basis[:, :, half:].unsqueeze(0).unsqueeze(3)
        a_, b_ = a.unsqueeze(-1), bb.unsqueeze(-1)
        ab = torch.stack((a_ * bc + b_ * bd, b_ * bc - a_ * bd), dim=-3)  # (b, g, per, rows, 2, d/2, rank)
        mean = self._on("mean", self.mean, q0.device).float().reshape(1, groups, per, 1, d)
        mc, md = mean[..., :half], mean[..., half:]
        bias = torch.stack((a * mc + bb * md, bb * mc - a * md), dim=-2)  # (b, g, per, rows, 2, d/2)
        width = per * rows * d
        ab, bias = ab.reshape(b * groups, width, -1).transpose(1, 2), bias.reshape(b * groups, 1, width)
        step = max(1, _CHUNK_ELEMENTS // max(1, b * groups * width))
        out = []
        for ts in range(0, k_pos.shape[1], step):
            levels = self._levels(codes[:, :, ts : ts + step]).reshape(b * groups, -1, ab.shape[1])
            uv = torch.baddbmm(bias, levels, ab)  # (b*g, t, width): per-pair u and v, mean included
            t = levels.shape[1]
            uv = uv.reshape(b, groups, t, per, rows // q_len, q_len, 2, half)
            delta = k_pos[:, ts : ts + step, None] - q_pos[:, None, :]  # (b, t, q_len)
            cos_d, sin_d = relative_cos_sin(delta, self._on("inv_freq", self.rope.inv_freq, q0.device))
            cos_d, sin_d = cos_d[:, None, :, None, None], sin_d[:, None, :, None, None]
            mixed = mix_pairs(uv[..., 0, :], uv[..., 1, :], cos_d, sin_d)  # (b, g, t, per, group, q_len)
            out.append(mixed.permute(0, 1, 3, 4, 5, 2).reshape(b, q_heads, q_len, t))
        return torch.cat(out, -1) if out else q0.new_zeros(b, q_heads, q_len, 0)
