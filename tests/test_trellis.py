"""Bitshift trellis-coded quantization (`kvpack.primitives.trellis`): the Viterbi search against brute force over every
bit string, decoding from bit windows against the searched path, and the distortion against the published Lloyd-Max
optimum and the Shannon bound."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpack.primitives import trellis


@pytest.mark.parametrize("k,state_bits,n", [(1, 4, 4), (2, 4, 3), (1, 3, 5)])
def test_viterbi_finds_the_best_bit_string(k, state_bits, n):
    """Every bit string of L + (n-1)·k bits, decoded by windows, against the search: none has a smaller error."""
    gen = torch.Generator().manual_seed(k * 10 + n)
    book = torch.randn(1 << state_bits, generator=gen)
    x = torch.randn(6, n, generator=gen)
    width = state_bits + (n - 1) * k
    every = torch.tensor(list(itertools.product((0, 1), repeat=width)), dtype=torch.uint8)  # (2**width, width)
    decoded = trellis.decode(every, book, k)  # (2**width, n)
    best = ((decoded[None] - x[:, None]) ** 2).sum(-1).min(dim=1).values
    states, err = trellis.viterbi(x, book, k)
    torch.testing.assert_close(err.float(), best, rtol=1e-5, atol=1e-6)
    rec = trellis.decode(trellis.to_bits(states, k, state_bits), book, k)
    torch.testing.assert_close(((rec - x) ** 2).sum(-1), best, rtol=1e-5, atol=1e-6)


def test_paths_follow_the_shift_register_and_decode_to_their_states():
    book = torch.randn(256, generator=torch.Generator().manual_seed(0))
    states, _ = trellis.viterbi(torch.randn(32, 64), book, 2)
    assert torch.equal(states[:, 1:] >> 2, states[:, :-1] & 63)  # each step keeps the last L-k bits and shifts k in
    bits = trellis.to_bits(states, 2, 8)
    assert bits.shape == (32, 8 + 63 * 2) and trellis.bits_per_value(64, 2, 8) == bits.shape[1] / 64
    assert torch.equal(trellis.decode(bits, book, 2), book[states])


def test_trained_trellis_beats_the_scalar_optimum_at_two_bits():
    """Held-out Gaussian sequences at 2.09 bits per value: below the Lloyd-Max 2-bit optimum for N(0, 1) (0.1175,
    Max 1960) by at least 25%, and above the Shannon bound 4^-2.09 (no quantizer beats it)."""
    gen = torch.Generator().manual_seed(3)
    book = trellis.train_codebook(torch.randn(1024, 64, generator=gen), k=2, state_bits=8, iters=5)
    test = torch.randn(1024, 64, generator=gen)
    states, _ = trellis.viterbi(test, book, 2)
    mse = ((book[states] - test) ** 2).mean().item()
    bits = trellis.bits_per_value(64, 2, 8)
    assert 4.0**-bits < mse < 0.75 * 0.1175, mse


@pytest.mark.parametrize("book,k,match", [(torch.zeros(12), 2, "2\\*\\*L entries"), (torch.zeros(2, 8), 1, "1-D"), (torch.zeros(16), 4, "1..3")])
def test_bad_codebooks_and_widths_are_refused(book, k, match):
    with pytest.raises(ValueError, match=match):
        trellis.viterbi(torch.zeros(1, 4), book, k)


def test_a_bit_string_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="L \\+ \\(n-1\\)·k bits"):
        trellis.decode(torch.zeros(1, 9, dtype=torch.uint8), torch.zeros(16), 2)


def test_symbols_round_trip_to_the_searched_states():
    """What a cache stores (k-bit symbols, a state per window of L/k of them) decodes to the Viterbi path's values."""
    book = trellis.gaussian_codebook(3, 9)
    y = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(5))
    symbols = trellis.encode_symbols(y, book, 3)
    assert symbols.shape == (2, 3, 40, 64) and int(symbols.max()) < 8  # tail-biting: 3 bits per coordinate, no more
    _, err = trellis.viterbi(y.reshape(-1, 64), book, 3)
    rolled, _ = trellis.viterbi(y.reshape(-1, 64).roll(-32, dims=1), book, 3)
    states, wrapped = trellis.viterbi(y.reshape(-1, 64), book, 3, wrap=rolled[:, 31] & 63)
    assert torch.equal(states[:, 0] >> 3, states[:, -1] & 63) and (wrapped >= err - 1e-9).all()  # the circle closes, at a cost
    assert wrapped.mean() < 1.12 * err.mean()  # a small one (measured 1.075x at k = 3, L = 9)
    torch.testing.assert_close(trellis.decode_symbols(symbols, book, 3), book[states].view(2, 3, 40, 64))
    with pytest.raises(ValueError, match="multiple of k"):
        trellis.encode_symbols(y, torch.zeros(256), 3)


def test_turboquant_with_a_trellis_stores_less_error_and_attends_on_its_codes():
    """`TurboQuantConfig.trellis`: the same rotation, centering and norms as the scalar codec, a smaller reconstruction
    error on the same keys (what the trellis is for) in the same bytes, and scores / weighted sums equal to
    products with its own decoded vectors."""
    from kvpack.registry import CodecSpec, get_method

    x = torch.randn(1, 2, 96, 64, generator=torch.Generator().manual_seed(2)) * 2 + 0.5
    scalar = CodecSpec("turboquant", {"bits": 3, "center": True}).build(64, 2)
    coded = CodecSpec("turboquant", {"bits": 3, "center": True, "trellis": 9}).build(64, 2)
    ps, pt = scalar.encode(x), coded.encode(x)
    err = {name: (c.decode(p) - x).pow(2).sum().item() for name, c, p in (("scalar", scalar, ps), ("trellis", coded, pt))}
    assert err["trellis"] < 0.8 * err["scalar"], err
    assert coded.nbytes(pt) == scalar.nbytes(ps)  # tail-biting: the scalar code's bytes
    assert coded.state_nbytes() == scalar.state_nbytes()  # the shared table is not the codec's, as Lloyd-Max's is not
    q = torch.randn(1, 6, 2, 64)
    k = coded.decode(pt).repeat_interleave(3, 1)
    torch.testing.assert_close(coded.scores(q, pt), q @ k.mT, atol=1e-4, rtol=1e-4)
    p = torch.softmax(torch.randn(1, 6, 2, 96), -1)
    torch.testing.assert_close(coded.weighted_sum(p, pt), p @ k, atol=1e-4, rtol=1e-4)
    method = get_method("turboquant:k3v2+ropemean+tcq")
    assert (method.key.options["trellis"], method.value.options["trellis"]) == (9, 8)
    for side, widths in (("k", (9, None)), ("v", (None, 8))):  # one side only
        method = get_method(f"turboquant:k3v2+tcq{side}")
        assert (method.key.options.get("trellis"), method.value.options.get("trellis")) == widths
    with pytest.raises(ValueError, match="not with '\\+qjl'"):
        get_method("turboquant:k3v3+qjl+tcq")


@pytest.mark.parametrize("options", [{"bits": 3, "trellis": 8}, {"bits": 2, "trellis": 2}, {"bits": 3, "qjl": True, "trellis": 6}, {"bits": 2, "trellis": 14}])
def test_trellis_widths_are_validated(options):
    from kvpack.registry import CodecSpec

    with pytest.raises(ValueError, match="trellis \\(state bits L"):
        CodecSpec("turboquant", options)


# -- the kernels' form: raw windows of the packed string, the C++ encoder ------------------------------------------------
@pytest.mark.parametrize("k,state_bits,n", [(3, 9, 64), (2, 8, 80), (1, 5, 36), (4, 12, 24)])
def test_window_table_reads_the_same_values_as_the_states(k, state_bits, n):
    """`reference.code_values` (a table indexed by each coordinate's raw window of the packed bytes, oldest symbol
    lowest) against `decode_symbols` (states assembled oldest-highest, the state codebook): two independent readings of
    the same stored codes."""
    from kvpack.kernels.reference import code_values
    from kvpack.primitives.packing import pack_bits

    gen = torch.Generator().manual_seed(k * n)
    book = torch.randn(1 << state_bits, generator=gen)
    symbols = torch.randint(0, 1 << k, (3, 5, n), generator=gen, dtype=torch.uint8)
    want = trellis.decode_symbols(symbols, book, k)
    assert torch.equal(code_values(pack_bits(symbols, k), trellis.window_table(book, k), k, n), want)


@pytest.mark.parametrize("k,state_bits,n", [(3, 9, 64), (2, 8, 64), (2, 8, 80), (3, 6, 36), (1, 4, 24)])
def test_cpp_encoder_finds_the_torch_search_paths(k, state_bits, n):
    """`cpu_lut.trellis_encode` (float32 costs, C++) against `trellis.encode_symbols` (float64, torch): the same symbols
    wherever the two searches' path errors are not within float32 rounding of a tie, and never a worse path by more
    than that rounding. Gaussian rows and heavy-tailed ones (the rotated unit vectors of real keys are near Gaussian;
    the tails test the costs' range)."""
    from kvpack.kernels import cpu_lut

    if not cpu_lut.available():
        pytest.skip(cpu_lut.unavailable_reason())
    gen = torch.Generator().manual_seed(n + k)
    book = trellis.train_codebook(torch.randn(256, n, generator=gen), k, state_bits, iters=2)
    y = torch.cat([torch.randn(300, n, generator=gen), torch.distributions.StudentT(3.0).sample((100, n)) ])
    fast, slow = cpu_lut.trellis_encode(y, book, k), trellis.encode_symbols(y, book, k)
    err_fast = (trellis.decode_symbols(fast, book, k) - y).pow(2).sum(-1).double()
    err_slow = (trellis.decode_symbols(slow, book, k) - y).pow(2).sum(-1).double()
    assert fast.dtype == torch.uint8 and fast.shape == y.shape
    assert (err_fast <= err_slow * (1 + 1e-5) + 1e-6).all()
    assert (fast == slow).all(-1).float().mean() > 0.98


def test_cpp_encoder_refuses_bad_tables():
    from kvpack.kernels import cpu_lut

    if not cpu_lut.available():
        pytest.skip(cpu_lut.unavailable_reason())
    with pytest.raises(ValueError, match="L a multiple of 3"):
        cpu_lut.trellis_encode(torch.zeros(2, 8), torch.zeros(256), 3)
    with pytest.raises(ValueError, match="L > bits"):
        cpu_lut.trellis_encode(torch.zeros(2, 8), torch.zeros(8), 3)


def test_the_op_routes_cpu_tensors_to_the_cpp_search():
    """`ops.trellis_encode` (what the codec calls): on CPU tensors the C++ search when built, the torch reference under
    `KVPACK_BACKEND=torch`; both give the reference's symbols."""
    from kvpack.kernels import cpu_lut, ops, reference

    y = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(9))
    book = trellis.gaussian_codebook(2, 8)
    want = reference.trellis_encode(y, book, 2)
    if cpu_lut.available():
        assert ops.implementation("trellis_encode", y.device) is cpu_lut.trellis_encode
    assert torch.equal(ops.trellis_encode(y, book, 2), want)
    ops.set_backend("torch")
    try:
        assert ops.implementation("trellis_encode", y.device) is reference.trellis_encode
        assert torch.equal(ops.trellis_encode(y, book, 2), want)
    finally:
        ops.set_backend(None)
