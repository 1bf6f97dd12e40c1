"""Prefill and decode throughput: time a prompt of length L into a fresh cache, then greedy-decode N tokens.

Warm-up (first calls, lazy codebooks and kernels) is run separately by `warmup` and never timed.
Decode speed is 1 / median step time: robust to other processes sharing the CPU for a moment.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .generate import forward


@dataclass(frozen=True)
class SpeedResult:
    prompt_tokens: int
    prefill_s: float
    prefill_tok_s: float
    new_tokens: int
    decode_step_s: float  # median seconds per decoded token
    decode_tok_s: float

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def warmup(model, new_cache: Callable[[], object], prompt_tokens: int = 64, steps: int = 4) -> None:
    """Run one short prefill and a few decode steps through a fresh cache, untimed."""
    ids = torch.arange(prompt_tokens) % model.config.get_text_config(decoder=True).vocab_size
    cache = new_cache()
    logits = forward(model, ids, cache)
    for _ in range(steps):
        logits = forward(model, logits[0, -1].argmax().view(1), cache)


@torch.no_grad()
def measure_speed(
    model,
    ids: torch.Tensor,
    cache,
    new_tokens: int = 32,
    after_prefill: Callable[[object], torch.Tensor | None] | None = None,
    progress: bool = True,
) -> SpeedResult:
    """Prefill `ids` ([L]) into `cache`, then greedy-decode `new_tokens` tokens.

    `after_prefill(cache)` runs between the two phases, untimed (memory, fidelity probes); when it
    feeds tokens and returns their last logits, decoding continues from those.
    """
    start = time.perf_counter()
    logits = forward(model, ids, cache)
    prefill_s = time.perf_counter() - start
    if after_prefill is not None:
        probed = after_prefill(cache)
        if probed is not None:
            logits = probed
    steps = []
    for _ in tqdm(range(new_tokens), desc="decode", unit="tok", disable=not progress, leave=False):
        token = logits[0, -1].argmax().view(1)
        start = time.perf_counter()
        logits = forward(model, token, cache)
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    return SpeedResult(len(ids), prefill_s, len(ids) / prefill_s, new_tokens, step, 1.0 / step)
