"""Exact, reproducible PCA and the DP bit allocation over component groups (Shard's K path).

PCA is an eigendecomposition of the float64 covariance rather than `torch.svd_lowrank`: at the
dimensions of a layer's keys (`kv_heads * head_dim` <= 1024) forming the covariance costs one
`(N, D) x (D, N)` product and `eigh` is exact and deterministic, where the randomized SVD needs
`niter=24` power iterations to stop its basis swinging across seeds (blog §5) and is still only
approximate. Eigenvector signs are fixed (largest-magnitude entry positive), so the same data
always gives bit-identical bases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

BIT_OPTIONS = (0, 2, 4, 6, 8)


@dataclass(frozen=True)
class PCAResult:
    """mean `(groups, D)` and basis `(groups, D, rank)` float32 (orthonormal columns, variance-descending);
    variances `(groups, D)` float64: every eigenvalue of the covariance, descending."""

    mean: torch.Tensor
    basis: torch.Tensor
    variances: torch.Tensor


def pca(x: torch.Tensor, rank: int | None = None) -> PCAResult:
    """Principal components of each group of samples `x (groups, N, D)`, keeping `rank` (default all)."""
    if x.dim() != 3:
        raise ValueError(f"x must be (groups, samples, dim), got shape {tuple(x.shape)}")
    dim = x.shape[-1]
    rank = dim if rank is None else rank
    if not 1 <= rank <= dim:
        raise ValueError(f"rank must be in 1..{dim}, got {rank}")
    x64 = x.double()
    mean = x64.mean(1)
    centered = x64 - mean.unsqueeze(1)
    cov = centered.transpose(1, 2) @ centered / max(x.shape[1], 1)
    variances, vectors = torch.linalg.eigh(cov)  # ascending
    variances, vectors = variances.flip(-1).clamp_min(0), vectors.flip(-1)
    # Deterministic signs: the largest-magnitude entry of every component is positive.
    pivot = vectors.gather(1, vectors.abs().argmax(1, keepdim=True))
    vectors = torch.where(pivot < 0, -vectors, vectors)
    return PCAResult(mean.float(), vectors[..., :rank].float().contiguous(), variances)


def rank_for_energy(variances: torch.Tensor, energy: float) -> int:
    """Smallest rank whose components hold `energy` of the total variance, in every group.

    variances: `(groups, D)` descending, as `PCAResult.variances`.
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    total = variances.sum(-1, keepdim=True).clamp_min(1e-300)
    short = (variances.cumsum(-1) / total < energy - 1e-12).sum(-1)  # prefixes still below the target
    return min(int(short.max()) + 1, variances.shape[-1])


def group_variances(variances: Sequence[float] | torch.Tensor, group_size: int) -> list[float]:
    """Sum of the variances of consecutive components in groups of `group_size` (the last may be short)."""
    v = torch.as_tensor(variances, dtype=torch.float64).flatten()
    return [float(v[i : i + group_size].sum()) for i in range(0, v.numel(), group_size)]


def allocation_error(variance: float, bits: int, drop_penalty: float) -> float:
    """Modelled squared error of one group (blog §5): dropped `drop_penalty * variance`, `b` bits `variance / (3 * 4^b)`."""
    return variance * drop_penalty if bits == 0 else variance / (3.0 * (1 << (2 * bits)))


def modelled_errors(
    variances: Sequence[float], options: Sequence[int] = BIT_OPTIONS, drop_penalty: float = 4.0
) -> list[dict[int, float]]:
    """`allocation_error` of every group at every option: the error table `allocate_bits` takes."""
    return [{bits: allocation_error(v, bits, drop_penalty) for bits in options} for v in variances]


def allocate_bits(errors: Sequence[Mapping[int, float]], sizes: Sequence[int], budget_bits: int) -> tuple[int, ...]:
    """Bits per group minimizing the summed error with `Σ bits * size <= budget_bits`.

    errors: per group, the squared error at each allowed width (0 = dropped), e.g. `modelled_errors`
    (KVTC-style model with a drop penalty) or errors measured with the actual quantizer.
    Exact DP over the bits used so far. A drop penalty > 1 makes a dropped direction costlier than
    its variance, so the budget goes to coarse quantization of more directions before it buys finer
    quantization of a few (blog §5: dropping a routing direction is a categorical error).
    Ties go to the allocation using fewer bits, then to the earlier-found one: deterministic.
    """
    if len(errors) != len(sizes):
        raise ValueError(f"got {len(errors)} error rows for {len(sizes)} group sizes")
    if budget_bits < 0:
        raise ValueError(f"budget_bits must be >= 0, got {budget_bits}")
    for row in errors:
        if 0 not in row or any(not (b == 0 or 2 <= b <= 8) for b in row):
            raise ValueError(
                f"options must include 0 and otherwise lie in 2..8 (symmetric codes need >= 2 bits), got {sorted(row)}"
            )
    states: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for row, size in zip(errors, sizes, strict=True):
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (err, alloc) in states.items():
            for bits in sorted(row):
                total = used + bits * size
                if total > budget_bits:
                    continue
                cand = (err + row[bits], alloc + (bits,))
                if total not in nxt or cand[0] < nxt[total][0]:
                    nxt[total] = cand
        states = nxt
    best = min(states.items(), key=lambda kv: (kv[1][0], kv[0]))
    return best[1][1]
