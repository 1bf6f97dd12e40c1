"""Primitives against independent references: published constants, dense matrices built another way,
Monte Carlo on the exact distribution, and exact integer round trips."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.primitives.affine import dequantize_affine, quantize_affine
from kvpack.primitives.lloyd_max import expected_mse, gaussian_unit_mse, lloyd_max_codebook
from kvpack.primitives.packing import pack_bits, packed_length, unpack_bits
from kvpack.primitives.qjl import qjl_matrix
from kvpack.primitives.rotation import (
    derive_seed,
    fwht,
    hadamard_matrix,
    hadamard_transform,
    random_orthogonal,
    random_signs,
    randomized_hadamard,
    randomized_hadamard_inverse,
)

torch.set_num_threads(1)


# -- packing -----------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(1, 77), rows=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_pack_roundtrip_bit_exact(bits, n, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, 2, n), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, 2, math.ceil(n * bits / 8))  # no padding of 3-bit codes to 4 bits
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_layout_is_lsb_first():
    # Hand-packed: 2-bit codes [1, 2, 3, 0] -> 0b00111001; 3-bit [5, 6, 7] -> bits 101 011 111 LSB-first.
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([5, 6, 7]), 3).tolist() == [0b11110101, 0b1]
    assert packed_length(128, 3) == 48 and packed_length(64, 3) == 24 and packed_length(5, 1) == 1


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="integer"):
        pack_bits(torch.zeros(4), 2)
    with pytest.raises(ValueError, match="expected 1 bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 2, 4)


# -- rotations -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [64, 80, 96, 128])
def test_qr_rotation_orthogonal_and_reproducible(dim):
    q = random_orthogonal(dim, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(dim), atol=1e-5, rtol=0)
    assert torch.equal(q, random_orthogonal(dim, seed=3))
    assert not torch.allclose(q, random_orthogonal(dim, seed=4))


def test_qr_rotation_is_haar():
    # A fixed unit vector rotated by Haar matrices is uniform on the sphere: its first coordinate has
    # E[y²] = 1/d and E[y⁴] = 3 / (d (d + 2)) (moments of the Beta marginal), checked over 3000 seeds.
    d = 8
    y = torch.stack([random_orthogonal(d, s)[0, 0] for s in range(3000)]).double()
    assert abs(y.pow(2).mean().item() - 1 / d) < 4 * y.pow(2).std().item() / math.sqrt(3000)
    assert abs(y.pow(4).mean().item() - 3 / (d * (d + 2))) < 4 * y.pow(4).std().item() / math.sqrt(3000)


def test_derive_seed_distinct_per_layer_and_head():
    seeds = {derive_seed(0, layer, head) for layer in range(48) for head in range(32)}
    assert len(seeds) == 48 * 32


def _sylvester(dim: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


@pytest.mark.parametrize("dim", [64, 80, 96, 128])
def test_hadamard_self_inverse_and_matches_sylvester(dim):
    x = torch.randn(5, dim, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x)
    blocks = torch.block_diag(*[_sylvester(b).double() for b in ([dim] if dim & (dim - 1) == 0 else [64, dim - 64])])
    torch.testing.assert_close(hadamard_transform(x), x @ blocks.T)
    signs = random_signs(dim, 1).double()
    torch.testing.assert_close(randomized_hadamard_inverse(randomized_hadamard(x, signs), signs), x)
    r = hadamard_matrix(dim, signs.float())
    torch.testing.assert_close(r @ r.T, torch.eye(dim), atol=1e-5, rtol=0)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(3, 96))


# -- Lloyd-Max codebooks ---------------------------------------------------------------------------
def test_gaussian_codebook_matches_published_table():
    # Max (1960) / TurboQuant pseudocode, d=128: centroids sigma * [..] with sigma = 1/sqrt(128).
    sigma = 1 / math.sqrt(128)
    published = {1: [0.7979], 2: [0.4528, 1.510], 3: [0.2451, 0.7560, 1.344, 2.152]}
    for bits, half in published.items():
        c = lloyd_max_codebook(128, bits, "gaussian").centroids
        torch.testing.assert_close(c[len(c) // 2 :] / sigma, torch.tensor(half), atol=2e-3, rtol=0)
    b = lloyd_max_codebook(128, 3, "gaussian").boundaries / sigma
    torch.testing.assert_close(b[4:], torch.tensor([0.5006, 1.050, 1.748]), atol=2e-3, rtol=0)


def test_gaussian_unit_mse_matches_published():
    for bits, mse in zip((1, 2, 3, 4), (0.3634, 0.1175, 0.03454, 0.009497), strict=True):
        assert gaussian_unit_mse(bits) == pytest.approx(mse, rel=2e-3)


@pytest.mark.parametrize("dim", [8, 64])
def test_expected_mse_matches_monte_carlo(dim):
    # Independent check of the numerical integral: quantize coordinates of uniform unit vectors.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40_000, dim, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    for bits in (1, 2, 3):
        book = lloyd_max_codebook(dim, bits, "beta")
        err = (x - book.lookup(book.quantize(x.float()), torch.float64)).pow(2).sum(1)
        assert err.mean().item() == pytest.approx(expected_mse(dim, bits), abs=4 * err.std().item() / 200)


def test_beta_codebook_beats_gaussian_at_small_dim():
    # At d=8 the marginal is far from Gaussian: the exact-density codebook must be better.
    assert expected_mse(8, 2, "beta") < expected_mse(8, 2, "gaussian")


def test_codebook_rejects_bad_bits():
    with pytest.raises(ValueError, match="bits must be one of"):
        lloyd_max_codebook(64, 0)


# -- QJL sketch ----------------------------------------------------------------------------------
def test_qjl_matrix_rows_orthogonal_per_block_with_gaussian_norms():
    s = qjl_matrix(256, 64, seed=0).double()
    for block in (s[:64], s[64:128]):
        gram = block @ block.T
        torch.testing.assert_close(
            gram - torch.diag(torch.diagonal(gram)), torch.zeros(64, 64, dtype=torch.float64), atol=1e-4, rtol=0
        )
    # Row norms² of N(0, I_64) rows are chi²(64): mean 64, std sqrt(128).
    assert abs(s.pow(2).sum(1).mean().item() - 64) < 4 * math.sqrt(128 / 256)


# -- affine ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,axis", [(2, -1), (4, -1), (2, -2), (4, -2)])
def test_affine_error_at_most_half_step(bits, axis):
    x = torch.randn(2, 3, 64, 32) * torch.linspace(0.1, 5, 32)
    q = quantize_affine(x, bits, 16, axis)
    assert int(q.codes.max()) < 1 << bits
    g = x.movedim(axis, -1).unflatten(-1, (-1, 16))
    step = ((g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)).repeat_interleave(16, -1).movedim(-1, axis)
    err = (dequantize_affine(q, 16, axis) - x).abs()
    assert (err <= step * 0.5 * (1 + 2e-3) + 1e-3 * x.abs()).all()  # fp16 scale/zero rounding slack
