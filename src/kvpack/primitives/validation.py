"""Input checks shared by codecs and the cache: messages name the problem and the fix."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_kv(x: torch.Tensor, head_dim: int | None = None, name: str = "x") -> None:
    """Validate a block of vectors `(batch, kv_heads, tokens, head_dim)` of a float dtype (float16/bfloat16/float32/float64).

    TypeError for a wrong type or dtype, ValueError for a wrong shape or non-finite values.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, kv_heads, tokens, head_dim), got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64 (the model's key/value states), got {x.dtype}; "
            f"convert with {name}.float() if these are real keys or values"
        )
    if x.dim() != 4:
        raise ValueError(
            f"{name} must have shape (batch, kv_heads, tokens, head_dim), got rank {x.dim()} shape {tuple(x.shape)}; "
            "add the missing axes (e.g. x[None] for a single batch row)"
        )
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
