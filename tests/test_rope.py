"""RoPE primitives against transformers' own Llama rotary embedding (an independent reference)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

from kvpack.primitives.rope import apply_rope, relative_rope_scores, rope_cos_sin, rope_mean_scores, rotate_half, undo_rope

HEAD_DIM = 64


def rotary(rope_type: str) -> LlamaRotaryEmbedding:
    params = {"rope_type": rope_type, "rope_theta": 1e5}
    if rope_type == "yarn":  # attention_scaling != 1: the scaled case
        params |= {"factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        rope_parameters=params,
    )
    return LlamaRotaryEmbedding(cfg)


def test_rotate_half_matches_transformers():
    x = torch.randn(2, 3, 5, HEAD_DIM)
    assert torch.equal(rotate_half(x), hf_rotate_half(x))


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_cos_sin_and_apply_match_transformers(rope_type):
    rot = rotary(rope_type)
    positions = torch.tensor([[0, 1, 7, 300, 2047], [5, 6, 7, 8, 4000]])
    x = torch.randn(2, 3, 5, HEAD_DIM)
    hf_cos, hf_sin = rot(x, positions)
    cos, sin = rope_cos_sin(positions, rot.inv_freq, rot.attention_scaling)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    hf_q, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), hf_q, rtol=0, atol=0)


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_undo_then_redo_is_identity(rope_type):
    rot = rotary(rope_type)
    positions = torch.arange(3, 3 + 129)[None].repeat(2, 1) + torch.tensor([[0], [1000]])
    keys = torch.randn(2, 3, 129, HEAD_DIM)
    hf_cos, hf_sin = rot(keys, positions)
    roped, _ = apply_rotary_pos_emb(keys, keys, hf_cos, hf_sin)  # what the model stores
    cos, sin = rope_cos_sin(positions, rot.inv_freq, rot.attention_scaling)
    torch.testing.assert_close(undo_rope(roped, cos, sin), keys, rtol=0, atol=2e-6)
    torch.testing.assert_close(apply_rope(undo_rope(roped, cos, sin), cos, sin), roped, rtol=0, atol=4e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**20), st.integers(1, 5), st.integers(1, 9), st.floats(0.5, 2.0))
def test_relative_identity_equals_rope_matmul(seed, q_len, tokens, scaling):
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    q0, k0 = torch.randn(1, 2, q_len, HEAD_DIM, generator=gen), torch.randn(1, 2, tokens, HEAD_DIM, generator=gen)
    k_pos = torch.randint(0, 3000, (1, tokens), generator=gen)
    q_pos = torch.randint(0, 3000, (1, q_len), generator=gen)
    q_cos, q_sin = rope_cos_sin(q_pos, inv_freq, scaling)
    k_cos, k_sin = rope_cos_sin(k_pos, inv_freq, scaling)
    ref = apply_rope(q0, q_cos, q_sin) @ apply_rope(k0, k_cos, k_sin).transpose(-1, -2)
    delta = (k_pos[:, None, :] - q_pos[:, :, None]).unsqueeze(1)  # (1, 1, q_len, tokens)
    got = relative_rope_scores(q0, k0, delta, inv_freq, scaling)
    # The reference rounds θp in float32 (error ~ p * 6e-8 rad); the identity uses exact θΔ.
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-3 * scaling**2 * HEAD_DIM**0.5)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**20), st.integers(1, 4), st.integers(1, 9), st.floats(0.5, 2.0), st.booleans())
def test_rope_mean_scores_equal_products_with_rotated_means(seed, rows, tokens, scaling, some_pairs):
    """`rope_mean_scores` against the plain route: rotate the mean to every key position, then a matmul. With
    `some_pairs`, a random set of pairs has a zero mean in every head and only the others are passed as `pairs`."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    q = torch.randn(2, 3, rows, HEAD_DIM, generator=gen)
    mean = torch.randn(3, HEAD_DIM, generator=gen)
    pairs = None
    if some_pairs:
        turning = torch.rand(HEAD_DIM // 2, generator=gen) < 0.3
        mean = mean * turning.repeat(2).float()  # pair i is channels i and i + d/2
        pairs = turning.nonzero().flatten()
    cos, sin = rope_cos_sin(torch.randint(0, 3000, (2, tokens), generator=gen), inv_freq, scaling)
    rotated = apply_rope(mean[None, :, None, :].expand(2, 3, tokens, HEAD_DIM), cos, sin)  # (2, 3, tokens, d)
    torch.testing.assert_close(rope_mean_scores(q, mean, cos, sin, pairs), q @ rotated.mT, rtol=1e-5, atol=1e-4)
    base = torch.randn(2, 3, rows, tokens, generator=gen)
    torch.testing.assert_close(rope_mean_scores(q, mean, cos, sin, pairs, add_to=base), base + q @ rotated.mT, rtol=1e-5, atol=1e-4)
