"""Triton flash-decoding attention over a Shard segment: PCA-coefficient keys (RoPE undone) and VQ values.

Same contract as `reference.pca_vq_attention` (partial softmax `(m, denom, o)`, GQA rows grouped per kv
head, optional softcap and additive bias). Grid: (B·kv, row blocks, splits), as `triton_attention.py`:
each program loads its kv head's query rows once and walks its split of the sequence BLOCK_T tokens at
a time, so one pass over the codes serves the whole GQA group. Per tile it unpacks each token's
coefficient levels (a width per component), rebuilds the un-RoPEd key of its head from the basis
(rank x head_dim, coefficient scale folded in), applies RoPE at the keys' positions, and folds the
scores into an online softmax; values are codeword lookups scaled by the token norm. `_merge_kernel`
combines the split partials. Launch helpers and the merge come from `triton_attention.py`.

Scores rebuild K (per token: rank·d multiply-adds, then R·d for the dot) rather than undoing RoPE on
the query and mixing per pair by the relative angle, as `PCAKeyCodec.scores` does: the query is
already RoPE'd, so the rotation depends on the key position alone, and cos/sin form one (BLOCK_T x d/2)
tile per token tile. The identity would need a (rows x tokens x d/2) tile of relative-angle terms and
rank·d multiply-adds per query row and token, R times the rebuild's work for a GQA group.

Block sizes and split counts are first choices, interpreter-tested, not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_pca_vq_attention, pca_basis_t, skip_bias
from .triton_attention import (
    INTERPRETED,
    _bias_args,
    _check_device,
    _empty,
    _finish_scores,
    _Plan,
    _rows_last,
    _softmax_step,
    _store_partial,
    _strides,
    _unpack,
)

__all__ = ["INTERPRETED", "pca_vq_attention"]


@triton.jit
def _levels(row_ptrs, tok_ok, rk, bitpos_ptr, bits_ptr, qmax_ptr, RANK: tl.constexpr, NBYTES: tl.constexpr):
    """Signed levels (BT, BK) float32 of components `rk (BK,)` from packed rows `row_ptrs (BT, 1)`.

    Each component has its own first bit and width (the DP's mixed widths), so the widths are loaded
    rather than constexpr as in `_unpack`; a code of <= 8 bits is read through a 16-bit window."""
    rk_ok = rk < RANK
    pos = tl.load(bitpos_ptr + rk, mask=rk_ok, other=0)
    width = tl.load(bits_ptr + rk, mask=rk_ok, other=0).to(tl.int32)  # 0 on padded components: level 0
    byte = (pos // 8)[None, :]
    ok = tok_ok[:, None] & rk_ok[None, :]
    word = tl.load(row_ptrs + byte, mask=ok, other=0).to(tl.int32)
    word = word | (tl.load(row_ptrs + byte + 1, mask=ok & (byte + 1 < NBYTES), other=0).to(tl.int32) << 8)
    code = (word >> (pos % 8)[None, :]) & ((tl.full(width.shape, 1, tl.int32) << width) - 1)[None, :]
    return code.to(tl.float32) - tl.load(qmax_ptr + rk, mask=rk_ok, other=0.0)[None, :]


@triton.jit
def _pca_vq_attention_kernel(
    q_ptr, sq_b, sq_h, sq_r,
    pos0_ptr, freq_ptr, rope_scale,
    kc_ptr, skc_b, skc_g, skc_t, bitpos_ptr, bits_ptr, qmax_ptr, basis_ptr, mean_ptr,
    vi_ptr, svi_b, svi_h, svi_t, vn_ptr, svn_b, svn_h, svn_t, books_ptr, s_book,
    bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows,
    m_ptr, l_ptr, o_ptr,
    H, R, T, split_len, scale, softcap,
    D: tl.constexpr, PER: tl.constexpr, RANK: tl.constexpr, KBYTES: tl.constexpr,
    VBITS: tl.constexpr, VBYTES: tl.constexpr, GSIZE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FINAL: tl.constexpr, PRECISION: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    pid_bh = tl.program_id(0).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    g, hh = h // PER, h % PER  # head h is the hh-th head of PCA group g (one group: layer scope)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    j = tl.arange(0, BLOCK_HALF)  # RoPE pair j: coordinates j and j + d/2, kept as two half tiles
    j_ok = j < HALF
    dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + j[None, :]
    q_ok = row_ok[:, None] & j_ok[None, :]
    q_lo = tl.load(q_rows, mask=q_ok, other=0.0).to(tl.float32)  # (BR, BH)
    q_hi = tl.load(q_rows + HALF, mask=q_ok, other=0.0).to(tl.float32)
    freq = tl.load(freq_ptr + j, mask=j_ok, other=0.0)
    pos0 = tl.load(pos0_ptr + b)
    gdim = PER * D
    basis = basis_ptr + g * RANK * gdim + hh * D  # this head's (rank, d) columns of the group's basis
    mean = mean_ptr + g * gdim + hh * D
    mean_lo = tl.load(mean + j, mask=j_ok, other=0.0)
    mean_hi = tl.load(mean + HALF + j, mask=j_ok, other=0.0)
    kc = kc_ptr + b * skc_b + g * skc_g
    vi = vi_ptr + b * svi_b + h * svi_h
    vn = vn_ptr + b * svn_b + h * svn_h
    book = books_ptr + h * s_book

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    start = tl.program_id(2) * split_len
    end = tl.minimum(start + split_len, T)
    for t0 in range(start, end, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        tok_ok = toks < end
        k_lo = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32) + mean_lo[None, :]
        k_hi = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32) + mean_hi[None, :]
        for r0 in range(0, RANK, BLOCK_K):
            rk = r0 + tl.arange(0, BLOCK_K)
            lev = _levels(kc + toks[:, None] * skc_t, tok_ok, rk, bitpos_ptr, bits_ptr, qmax_ptr, RANK, KBYTES)
            b_ptrs = basis + rk[:, None] * gdim + j[None, :]
            b_ok = (rk[:, None] < RANK) & j_ok[None, :]
            k_lo += tl.dot(lev, tl.load(b_ptrs, mask=b_ok, other=0.0), input_precision=PRECISION)
            k_hi += tl.dot(lev, tl.load(b_ptrs + HALF, mask=b_ok, other=0.0), input_precision=PRECISION)
        # RoPE at positions pos0 + t: the float32 angle transformers forms (pos · inv_freq), so the rebuilt
        # key is rotated exactly as the model rotated it before the codec undid RoPE.
        phase = (pos0 + toks).to(tl.float32)[:, None] * freq[None, :]
        cos = tl.cos(phase) * rope_scale
        sin = tl.sin(phase) * rope_scale
        s = tl.dot(q_lo, tl.trans(k_lo * cos - k_hi * sin), input_precision=PRECISION)
        s += tl.dot(q_hi, tl.trans(k_hi * cos + k_lo * sin), input_precision=PRECISION)
        s = _finish_scores(s, b, h, rows, toks, row_ok, tok_ok, scale, softcap,
                           bias_ptr, sb_b, sb_h, sb_r, sb_t, bias_rows, HAS_BIAS, HAS_SOFTCAP)
        m_i, alpha, p = _softmax_step(s, m_i)
        v_ok = tok_ok[:, None] & (dv[None, :] < D)
        entry = _unpack(vi + toks[:, None] * svi_t, (dv // GSIZE)[None, :], v_ok, VBITS, VBYTES)  # codeword of dv's group
        v = tl.load(book + entry * GSIZE + (dv % GSIZE)[None, :], mask=v_ok, other=0.0)  # (BT, BDV)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_NORM:  # the token norm scales p (BR x BT), not the codeword tile: fewer multiplies
            p = p * tl.load(vn + toks * svn_t, mask=tok_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    _store_partial(m_i, l_i, acc, m_ptr, l_ptr, o_ptr, pid_bh, rows, row_ok, dv, R, D, FINAL)


def pca_vq_attention(
    q: torch.Tensor,
    pos0: torch.Tensor,
    bitpos: torch.Tensor,
    bits: torch.Tensor,
    qmax: torch.Tensor,
    basis_t: torch.Tensor,
    mean: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    k_codes: torch.Tensor,
    books: torch.Tensor,
    v_bits: int,
    v_idx: torch.Tensor,
    v_norm: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    w8: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    mean8: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `reference.pca_vq_attention`; `num_splits` overrides the sequence split count (tests)."""
    basis_t, books = pca_basis_t(basis_t, w8, col_scale, qmax.numel()), books.float()
    check_pca_vq_attention(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm,
                           bias, softcap)
    _check_device(q)
    bias = skip_bias(bias, skip, k_codes.shape[2], q.device)
    b, kv, _, d = q.shape
    t = k_codes.shape[2]
    if t == 0 or q.numel() == 0:
        return _empty(q, d)
    groups, rank, _ = basis_t.shape
    q, kc, vi = (_rows_last(x) for x in (q, k_codes, v_idx))
    vn = q if v_norm is None else _rows_last(v_norm)
    plan = _Plan(q, t, d, d, num_splits)
    m, denom, o = plan.buffers(q.device)
    plan.launch(
        _pca_vq_attention_kernel,
        q, *_strides(q), pos0.contiguous(), inv_freq.contiguous(), float(rope_scale),
        kc, *_strides(kc), bitpos.contiguous(), bits.contiguous(), qmax.contiguous(), basis_t.contiguous(), mean.contiguous(),
        vi, *_strides(vi), vn, *((0, 0, 0) if v_norm is None else _strides(vn)), books.contiguous(),
        books[0].numel() if books.shape[0] > 1 else 0,
        *_bias_args(bias, q), m, denom, o,
        plan.h, plan.r, t, plan.split_len, float(scale), float(softcap),
        D=d, PER=kv // groups, RANK=rank, KBYTES=kc.shape[-1], VBITS=v_bits, VBYTES=vi.shape[-1], GSIZE=books.shape[2],
        BLOCK_R=plan.block_r, BLOCK_K=16 if rank <= 16 else 32,
        BLOCK_HALF=max(16, triton.next_power_of_2(d // 2)), BLOCK_DV=plan.block_dv,
        HAS_NORM=v_norm is not None, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, FINAL=plan.splits == 1,
        PRECISION=plan.precision,
    )
    return plan.finish(m, denom, o)
