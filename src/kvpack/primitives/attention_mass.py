"""Attention mass each key receives from a sample of queries: which prompt tokens the model reads most.

Pure torch, stateless. Used to choose a prompt's anchors (kvpack/cache/anchors.py): the few tokens
that draw much of the attention, whose unlucky codes move perplexity most (docs/notes/decisions.md).
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 23  # float32 scores per block, 32 MiB: 128 queries of a 3-head group fit whole up to ~21K keys


def received_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float, first_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over query heads and rows of the causal softmax attention each key receives -> `(batch, tokens)` float32.

    queries: `(batch, q_heads, m, d)`, the queries of the last `m` of the keys' own tokens, in order
        (row i is token `tokens - m + i`, and sees keys up to it).
    keys: `(batch, kv_heads, tokens, d)`; query head h reads kv head h // (q_heads // kv_heads).
    first_valid: `(batch,)` index of each row's first real key (left padding before it is never attended), or None.
    """
    b, hq, m, d = queries.shape
    hk, t = keys.shape[1], keys.shape[2]
    if hq % hk or keys.shape[0] != b or keys.shape[3] != d or m > t:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} do not match (q_heads a multiple of kv_heads, m <= tokens)")
    key_idx = torch.arange(t, device=keys.device)
    query_idx = torch.arange(t - m, t, device=keys.device)
    hidden = key_idx.view(1, 1, t) > query_idx.view(1, m, 1)  # (1, m, t): causal
    if first_valid is not None:
        hidden = hidden | (key_idx.view(1, 1, t) < first_valid.to(keys.device).view(b, 1, 1))  # (b, m, t)
    mass = torch.zeros(b, t, dtype=torch.float32, device=keys.device)
    group = hq // hk
    rows = max(1, BLOCK_ELEMENTS // (b * group * t))  # query rows per score block (b, group, rows, t): a long prompt's
    for h in range(hk):  # block stays bounded, one kv head and a few query rows at a time
        k = keys[:, h : h + 1].float().transpose(-1, -2)
        for r0 in range(0, m, rows):
            q = queries[:, h * group : (h + 1) * group, r0 : r0 + rows].float()
            s = (q @ k) * scaling
            p = torch.softmax(s.masked_fill(hidden[:, r0 : r0 + rows].unsqueeze(1), float("-inf")), dim=-1)
            mass += p.nan_to_num(0.0).sum(dim=(1, 2))  # a row with no visible key (all padding) adds nothing
    return mass


def most_attended(mass: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` token indices `(count,)` with the most attention summed over the batch rows, ascending.

    mass: `(batch, tokens)`; each row is normalized to its own total first, so every row weighs the same.
    """
    if not 0 <= count <= mass.shape[1]:
        raise ValueError(f"cannot choose {count} of {mass.shape[1]} tokens")
    share = (mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)).sum(0)
    return share.topk(count).indices.sort().values
