"""Confidence intervals for the evaluation: perplexity deltas (paired bootstrap) and recall (Wilson). Stateless.

Perplexity delta. Both caches score the same tokens, so the comparison is paired: per token t the
difference d_t = NLL_method[t] - NLL_base[t] cancels what makes a token hard for both runs (a rare
name, a new story), which dominates the spread of either run's NLLs alone. The statistic is

    delta = exp(mean NLL_method) / exp(mean NLL_base) - 1 = exp(mean d) - 1,

and each bootstrap resample draws token positions with replacement, the same positions for both
runs, and recomputes it. The interval is the percentile interval of the resampled deltas.

Neighbouring tokens need not be independent: a damaged key in the cache hurts every token that
attends to it, and a hard passage raises the NLL of several tokens in a row, so d_t can be
autocorrelated. An i.i.d. bootstrap would then count correlated tokens as independent evidence and
give too narrow an interval. The default therefore resamples circular blocks of consecutive tokens
(Politis & Romano 1992), which keeps any correlation shorter than a block inside the resample;
`block=1` is the plain i.i.d. bootstrap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

# Measured on SmolLM2-135M, news text, 2048-token context, 2048 scored tokens, turboquant:k3v2 and kivi:2
# vs the uncompressed cache: d_t has lag-1 autocorrelation 0.04-0.05 and |acf| < 0.09 up to lag 64, and
# the 95% intervals with blocks of 1 to 32 tokens are within 6% of each other in width (k3v2: 2.59 to
# 2.73 points); at 128 tokens only 16 blocks remain and the interval itself gets noisy. 16 tokens costs
# nothing where tokens are independent and covers short-range correlation where a method creates it.
# (Unpaired, bootstrapping each run alone, the k3v2 interval is [-14.7%, +21.1%]: the pairing is what
# makes the delta measurable; per-token NLLs of the two runs correlate at 0.995.)
DEFAULT_BLOCK = 16
_MAX_ELEMENTS = 1 << 22  # resampled positions held at once (about 100 MiB with temporaries), whatever the token count


@dataclass(frozen=True)
class BootstrapConfig:
    """How the paired bootstrap resamples.

    resamples: bootstrap replicates (at 2000 the Monte Carlo error of the 2.5% / 97.5% percentiles is about
               0.06 standard errors of the delta itself).
    level: two-sided coverage of the interval, in (0, 1).
    block: consecutive tokens drawn together (circular block bootstrap); 1 = i.i.d. tokens.
           A run shorter than two blocks falls back to the largest block that leaves two.
    seed: the resampling is reproducible from it.
    """

    resamples: int = 2000
    level: float = 0.95
    block: int = DEFAULT_BLOCK
    seed: int = 0

    def __post_init__(self):
        if self.resamples < 2:
            raise ValueError(f"resamples must be an integer >= 2, got {self.resamples}")
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level must be in (0, 1), e.g. 0.95; got {self.level}")
        if self.block < 1:
            raise ValueError(f"block must be an integer >= 1 (1 = i.i.d. bootstrap), got {self.block}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def resample_indices(n: int, count: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """[count, n] token positions: ceil(n / block) circular blocks of `block` consecutive positions per row."""
    blocks = math.ceil(n / block)
    starts = torch.randint(0, n, (count, blocks, 1), generator=generator)  # any position may start a block
    return ((starts + torch.arange(block)) % n).view(count, blocks * block)[:, :n]


def bootstrap_means(values: torch.Tensor, cfg: BootstrapConfig) -> torch.Tensor:
    """values: [n] -> [cfg.resamples] float64 means of block-bootstrap resamples of `values`."""
    n = values.numel()
    block = min(cfg.block, max(1, n // 2))
    generator = torch.Generator().manual_seed(cfg.seed)
    values = values.detach().reshape(-1).double().cpu()
    batch = max(1, _MAX_ELEMENTS // n)
    means = [values[resample_indices(n, min(batch, cfg.resamples - done), block, generator)].mean(dim=1)
             for done in range(0, cfg.resamples, batch)]
    return torch.cat(means)


def percentile_interval(samples: torch.Tensor, level: float) -> tuple[float, float]:
    """samples: [R] -> the (1 - level) / 2 and (1 + level) / 2 quantiles."""
    q = torch.tensor([(1.0 - level) / 2, (1.0 + level) / 2], dtype=samples.dtype)
    lo, hi = torch.quantile(samples, q).tolist()
    return lo, hi


def ppl_delta_ci(nll: torch.Tensor, base_nll: torch.Tensor, cfg: BootstrapConfig | None = None) -> tuple[float, float]:
    """Paired bootstrap interval, in percent, of exp(mean nll) / exp(mean base_nll) - 1.

    nll, base_nll: [n] per-token negative log-likelihoods (nats) of the same n tokens under two caches,
    in text order (the order matters for the block bootstrap). Identical inputs give exactly (0.0, 0.0).
    """
    if nll.shape != base_nll.shape or nll.dim() != 1 or nll.numel() < 2:
        raise ValueError(f"need two 1-D tensors of the same length >= 2 (paired tokens), got {tuple(nll.shape)} and {tuple(base_nll.shape)}")
    cfg = cfg or BootstrapConfig()
    diff = nll.double().cpu() - base_nll.double().cpu()  # [n]: the pairing is this subtraction
    lo, hi = percentile_interval(bootstrap_means(diff, cfg), cfg.level)
    return 100.0 * math.expm1(lo), 100.0 * math.expm1(hi)  # exp is monotone: the percentiles map through it


def wilson_interval(found: int, total: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion found / total.

    Unlike the normal (Wald) interval it stays inside [0, 1] and does not collapse to zero width at
    0/n or n/n, which is where needle recall usually sits. total = 0 gives the uninformative (0, 1).
    """
    if not 0 <= found <= total:
        raise ValueError(f"need 0 <= found <= total, got {found}/{total}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95; got {level}")
    if total == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf((1.0 + level) / 2)
    p, n = found / total, total
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # The closed form's endpoints at 0/n and n/n are 0 and 1 in exact arithmetic; clamp the rounding.
    lo = max(0.0, center - half) if found else 0.0
    hi = min(1.0, center + half) if found < total else 1.0
    return lo, hi
