"""Perplexity measured so that the scored tokens read the compressed cache.

Protocol: prefill `prefix` tokens into the cache (their logits are not scored), then feed the next
`n_score` tokens in chunks of `chunk`; every scored token's query attends to the compressed prefix
(and to the earlier chunks as the cache holds them). Token t+1 is scored from the logits at t.
A single full-window forward would attend to uncompressed keys only and measure nothing.

The per-token NLLs are kept (`PerplexityResult.token_nll`), so two runs on the same tokens can be
compared pairwise: `delta_ci` puts a paired bootstrap interval on the perplexity delta (stats.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .generate import forward
from .stats import BootstrapConfig, ppl_delta_ci


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens: int  # scored tokens
    prefix: int
    chunk: int
    token_nll: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [tokens] float64, nats, in text order

    def as_dict(self) -> dict:
        """The scalar summary (JSON-ready); the per-token NLLs stay in `token_nll`."""
        return {"ppl": self.ppl, "nll": self.nll, "tokens": self.tokens, "prefix": self.prefix, "chunk": self.chunk}


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
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> PerplexityResult:
    """ids: [T] token ids with T >= prefix + n_score + 1. `after_prefill(cache)` runs once the prefix is in;
    `on_logits(logits)` gets each scored chunk's float32 logits `[chunk tokens, vocab]`, in order (e.g. for a KL)."""
    ids = ids.view(-1)
    n_score = len(ids) - prefix - 1 if n_score is None else n_score
    if prefix < 1 or n_score < 1 or prefix + n_score + 1 > len(ids):
        raise ValueError(f"need prefix >= 1, n_score >= 1 and prefix + n_score + 1 <= {len(ids)} tokens; got {prefix} + {n_score}")
    forward(model, ids[:prefix], cache)
    if after_prefill is not None:
        after_prefill(cache)
    parts = []
    starts = range(prefix, prefix + n_score, chunk)
    for start in tqdm(starts, desc="perplexity", unit="chunk", disable=not progress, leave=False):
        stop = min(start + chunk, prefix + n_score)
        logits = forward(model, ids[start:stop], cache, last_only=False)[0].float()  # [stop - start, vocab]
        if on_logits is not None:
            on_logits(logits)
        parts.append(F.cross_entropy(logits, ids[start + 1 : stop + 1].to(logits.device), reduction="none").double().cpu())
    token_nll = torch.cat(parts)  # [n_score]
    nll = token_nll.mean().item()
    return PerplexityResult(ppl=math.exp(nll), nll=nll, tokens=n_score, prefix=prefix, chunk=chunk, token_nll=token_nll)


def delta(result: PerplexityResult, baseline: PerplexityResult) -> tuple[float, float]:
    """(percent, absolute) perplexity change vs the baseline."""
    return 100.0 * (result.ppl / baseline.ppl - 1.0), result.ppl - baseline.ppl


def delta_ci(result: PerplexityResult, baseline: PerplexityResult, cfg: BootstrapConfig | None = None) -> tuple[float, float]:
    """Paired bootstrap interval (percent) of the perplexity delta; both runs must have scored the same tokens."""
    if result.token_nll is None or baseline.token_nll is None:
        raise ValueError("both results need per-token NLLs (token_nll); they come from perplexity()")
    if (result.prefix, result.tokens) != (baseline.prefix, baseline.tokens):
        raise ValueError(f"not the same scored tokens: prefix/tokens {result.prefix}/{result.tokens} vs {baseline.prefix}/{baseline.tokens}")
    return ppl_delta_ci(result.token_nll, baseline.token_nll, cfg or BootstrapConfig())
