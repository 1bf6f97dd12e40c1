"""Attention-output fidelity per layer: compressed vs uncompressed cache on the same real tokens.

Both caches hold the same prefilled text; the same next real tokens are then fed one at a time
(teacher forcing, so the inputs never diverge) and each layer's `self_attn` output is captured at
every step. Per layer: mean cosine similarity and mean relative L2 error vs the reference. The
model runs end to end, so a layer's error includes what earlier layers' errors propagated to it:
that is what the next token sees.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .generate import forward


def attention_modules(model) -> list[torch.nn.Module]:
    """The per-layer attention modules (named `...self_attn`), in layer order."""
    mods = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no modules named '*self_attn' to hook")
    return mods


@contextmanager
def _capture(model, store: list[list[torch.Tensor]]):
    def hook(idx):
        def fn(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            store[idx].append(out.detach().float().reshape(-1).cpu())

        return fn

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(attention_modules(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture_attention(model, cache, step_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Feed `step_ids` ([S]) one token per step into `cache` (already prefilled).

    Returns (per layer a [S, hidden] tensor of attention outputs, the last step's logits).
    """
    store: list[list[torch.Tensor]] = [[] for _ in attention_modules(model)]
    logits = None
    with _capture(model, store):
        for token in step_ids.view(-1):
            logits = forward(model, token.view(1), cache)
    return [torch.stack(outputs) for outputs in store], logits


def compare_outputs(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> list[dict]:
    """Per layer {"layer", "cosine", "rel_error"}, each averaged over steps."""
    rows = []
    for i, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        cos = torch.nn.functional.cosine_similarity(ref, cand, dim=-1)
        rel = (cand - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
        rows.append({"layer": i, "cosine": cos.mean().item(), "rel_error": rel.mean().item()})
    return rows


@torch.no_grad()
def attention_fidelity(model, ids: torch.Tensor, reference_cache, candidate_cache, prefix: int, steps: int = 8) -> list[dict]:
    """Prefill ids[:prefix] into both caches, then compare `steps` decode steps over ids[prefix:prefix + steps]."""
    outputs = []
    for cache in (reference_cache, candidate_cache):
        forward(model, ids[:prefix], cache)
        outputs.append(capture_attention(model, cache, ids[prefix : prefix + steps])[0])
    return compare_outputs(*outputs)


def summarize(rows: list[dict]) -> dict:
    """Mean and worst layer."""
    return {
        "cosine_mean": sum(r["cosine"] for r in rows) / len(rows),
        "cosine_min": min(r["cosine"] for r in rows),
        "rel_error_mean": sum(r["rel_error"] for r in rows) / len(rows),
        "rel_error_max": max(r["rel_error"] for r in rows),
    }
