"""The two forward patterns every metric uses: prefill a block of tokens into a cache, then greedy-decode."""

from __future__ import annotations

import torch

from ..support import cache_kwargs

__all__ = ["cache_kwargs", "eos_ids", "forward", "greedy"]


@torch.no_grad()
def forward(model, ids: torch.Tensor, cache, last_only: bool = True) -> torch.Tensor:
    """Append `ids` ([T] or [B, T]) to `cache`; returns the logits [B, T or 1, vocab] (last position only by default)."""
    ids = (ids.view(1, -1) if ids.dim() < 2 else ids).to(model.device)
    kwargs = {"logits_to_keep": 1} if last_only else {}
    return model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache), **kwargs).logits


@torch.no_grad()
def greedy(model, cache, logits: torch.Tensor, max_new_tokens: int, eos_ids: set[int] | None = None) -> list[int]:
    """Greedy tokens following `logits` (the last prompt position), decoding one token per step through `cache`."""
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if (eos_ids and token in eos_ids) or len(out) == max_new_tokens:
            break
        logits = forward(model, torch.tensor([token]), cache)
    return out


def eos_ids(tokenizer, model=None) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos) if isinstance(gen_eos, list) else ({gen_eos} if gen_eos is not None else set())
    return ids
