"""Perplexity measured so that the scored tokens read the compressed cache.

Protocol: prefill `prefix` tokens into the cache (their logits are not scored), then feed the next
`n_score` tokens in chunks of `chunk`; every scored token's query attends to the compressed prefix
(and to the earlier chunks as the cache holds them). Token t+1 is scored from the logits at t.
A single full-window forward would attend to uncompressed keys only and measure nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .generate import forward


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens: int  # scored tokens
    prefix: int
    chunk: int

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def perplexity(
    model,
    ids: torch.Tensor,
    cache,
    prefix: int = 2048,
    chunk: int = 256,
    n_score: int | None = None,
    after_prefill: Callable[[object], None] | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """ids: [T] token ids with T >= prefix + n_score + 1. `after_prefill(cache)` runs once the prefix is in."""
    ids = ids.view(-1)
    n_score = len(ids) - prefix - 1 if n_score is None else n_score
    if prefix < 1 or n_score < 1 or prefix + n_score + 1 > len(ids):
        raise ValueError(f"need prefix >= 1, n_score >= 1 and prefix + n_score + 1 <= {len(ids)} tokens; got {prefix} + {n_score}")
    forward(model, ids[:prefix], cache)
    if after_prefill is not None:
        after_prefill(cache)
    nll_sum = 0.0
    starts = range(prefix, prefix + n_score, chunk)
    for start in tqdm(starts, desc="perplexity", unit="chunk", disable=not progress, leave=False):
        stop = min(start + chunk, prefix + n_score)
        logits = forward(model, ids[start:stop], cache, last_only=False)[0].float()  # [stop - start, vocab]
        nll_sum += F.cross_entropy(logits, ids[start + 1 : stop + 1].to(logits.device), reduction="sum").item()
    nll = nll_sum / n_score
    return PerplexityResult(ppl=math.exp(nll), nll=nll, tokens=n_score, prefix=prefix, chunk=chunk)


def delta(result: PerplexityResult, baseline: PerplexityResult) -> tuple[float, float]:
    """(percent, absolute) perplexity change vs the baseline."""
    return 100.0 * (result.ppl / baseline.ppl - 1.0), result.ppl - baseline.ppl
