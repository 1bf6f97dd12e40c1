"""Input checks shared by codecs and the cache: messages name the problem and the fix."""

from __future__ import annotations

import torch


def check_kv(x: torch.Tensor, head_dim: int | None = None, name: str = "x") -> None:
    """Validate a block of vectors `(batch, kv_heads, tokens, head_dim)`."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape (batch, kv_heads, tokens, head_dim), got rank {x.dim()} shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point (float16/bfloat16/float32), got {x.dtype}")
    if head_dim is not None and x.shape[-1] != head_dim:
        raise ValueError(f"{name} has head_dim {x.shape[-1]} but this codec was built for head_dim {head_dim}")
    if x.numel() and not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf values; check the model's dtype (fp16 overflow?) before caching")


def check_query(query: torch.Tensor, kv_heads: int, head_dim: int) -> int:
    """Validate `query (batch, q_heads, q_len, head_dim)` against the cached heads; return the GQA ratio."""
    check_kv(query, head_dim, "query")
    q_heads = query.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the {kv_heads} cached kv heads")
    return q_heads // kv_heads
