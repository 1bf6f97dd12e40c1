"""Rotate-half RoPE: apply, undo exactly, and score through the relative-position identity.

Convention of transformers' Llama family: `freqs = positions * inv_freq`, `cos/sin = cat(freqs,
freqs).cos()/.sin() * attention_scaling` and `RoPE(x) = x * cos + rotate_half(x) * sin` with
`rotate_half([a, b]) = [-b, a]`. Pair `i` is the coordinates `(i, i + d/2)` rotated by `θ_i p`.

The identity (RoFormer; Shard blog §9): with un-RoPEd halves `q = [a, b]`, `k = [c, e]`, scaling `s`
and `Δ = p_k - p_q`,
    <RoPE(q, p_q), RoPE(k, p_k)> = s² Σ_i (a_i c_i + b_i e_i) cos(θ_i Δ) + (b_i c_i - a_i e_i) sin(θ_i Δ),
so a score needs only the un-RoPEd vectors and the relative position: keys can be stored without
RoPE (or as PCA coefficients) and never re-rotated.
"""

from __future__ import annotations

import math

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[a, b] -> [-b, a]` over the last dim."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`positions (batch, tokens)` -> float32 `cos, sin (batch, tokens, head_dim)`, computed as transformers does.

    Same float32 arithmetic as `LlamaRotaryEmbedding.forward`, so undoing a model's RoPE uses the
    very rotation the model applied, not a more accurate but different one.
    """
    freqs = positions[..., None].float() * inv_freq.float().to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `x (batch, heads, tokens, d)` with `cos, sin (batch, tokens, d)` (broadcast over heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def undo_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `apply_rope` (up to float rounding), attention scaling included.

    Each pair is rotated by `R(θp)` and scaled by `s`; the inverse is `R(-θp) / s`, and since
    `cos² + sin² = s²` elementwise no separate scaling argument is needed.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (y * cos - rotate_half(y) * sin) / (cos * cos + sin * sin)


def rope_mean_scores(q: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     pairs: torch.Tensor | None = None, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """`<q, RoPE(μ, p_t)>` for each key position `t`, never forming the rotated means.

    q: `(batch, heads, rows, d)` RoPE'd queries; mean `(heads, d)` un-RoPEd; cos, sin `(batch, tokens, d)` of the
    keys' positions in transformers' layout (`rope_cos_sin`: each pair's angle in channel i and i + d/2) -> `(batch,
    heads, rows, tokens)`. Per pair i (channels i, i + d/2), `RoPE(μ)` is `(μ₁c - μ₂s, μ₂c + μ₁s)`, so
    `q·RoPE(μ) = Σ_i c_i (q₁μ₁ + q₂μ₂) + s_i (q₂μ₁ - q₁μ₂)`: one matmul of inner size 2·(pairs) per head, where the
    plain route (`q⊙μ` against cos, `q⊙rotate_half(μ)` against sin) takes two of size d each. `pairs (M,)` long:
    the pair indices whose mean is nonzero in some head (the others add nothing); None: every pair. `add_to`, scores
    of the same shape, is added in the matmul itself (one pass over the output instead of two).
    """
    batch, heads, rows, d = q.shape
    half = d // 2
    q1, q2, m1, m2 = q[..., :half], q[..., half:], mean[None, :, None, :half], mean[None, :, None, half:]
    c, s = cos[..., :half], sin[..., :half]
    a, b = q1 * m1 + q2 * m2, q2 * m1 - q1 * m2  # (batch, heads, rows, d/2): each pair's cos and sin coefficients
    if pairs is not None:
        a, b, c, s = a[..., pairs], b[..., pairs], c[..., pairs], s[..., pairs]
    lhs = torch.cat((a, b), -1).reshape(batch, heads * rows, -1)  # heads share the keys' angles: one matmul per batch row
    rhs = torch.cat((c, s), -1).expand(batch, -1, -1).mT  # (batch, 2M, tokens)
    if add_to is None:
        return (lhs @ rhs).view(batch, heads, rows, -1)
    return torch.baddbmm(add_to.reshape(batch, heads * rows, -1), lhs, rhs).view(add_to.shape)


def relative_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos(θ_i Δ), sin(θ_i Δ)` for `delta (...)` -> float32 `(..., d/2)`.

    The phase is formed and reduced modulo 2π in float64: `θ_0 Δ` reaches tens of thousands of
    radians at long context, where a float32 product would be off by ~1e-3 rad.
    """
    phase = delta.double().unsqueeze(-1) * inv_freq.double().to(delta.device)
    phase = torch.remainder(phase, 2 * math.pi).float()
    return phase.cos(), phase.sin()


def mix_pairs(u: torch.Tensor, v: torch.Tensor, cos_delta: torch.Tensor, sin_delta: torch.Tensor) -> torch.Tensor:
    """`Σ_i u_i cos(θ_i Δ) + v_i sin(θ_i Δ)` over the pair axis, the last dim of all four tensors.

    `u` holds the per-pair `a_i c_i + b_i e_i` terms and `v` the `b_i c_i - a_i e_i` terms.
    """
    return (u * cos_delta).sum(-1) + (v * sin_delta).sum(-1)


def relative_rope_scores(
    query: torch.Tensor, keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> torch.Tensor:
    """<RoPE(q, p_q), RoPE(k, p_k)> from un-RoPEd vectors and relative positions only.

    query: `(..., q_len, d)`, keys: `(..., tokens, d)`, delta: `p_k - p_q` broadcastable to
    `(..., q_len, tokens)` -> `(..., q_len, tokens)`. Materializes `(..., q_len, tokens, d/2)`:
    a reference for small inputs; codecs contract their compressed form into `u, v` first.
    """
    a, b = query.float().chunk(2, dim=-1)
    c, e = keys.float().chunk(2, dim=-1)
    a, b, c, e = a.unsqueeze(-2), b.unsqueeze(-2), c.unsqueeze(-3), e.unsqueeze(-3)
    cos_d, sin_d = relative_cos_sin(delta, inv_freq)
    return mix_pairs(a * c + b * e, b * c - a * e, cos_d, sin_d) * scaling**2
