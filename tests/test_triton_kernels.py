"""Triton kernels against the pure-torch references, run by Triton's interpreter on CPU tensors.

Float outputs (m, denom, o): the kernel's max error against the float32 reference must be at most twice
the error of the same reference computed in float16 (flash-attention's criterion). Integer outputs
(packed codes, fp16 norms and scales) are equal: KIVI's bit for bit, TurboQuant's except values
within float32 rounding of a codebook boundary.
Sizes are the awkward ones: 217 tokens (224 for KIVI keys, whole groups of 32), head dims
64/80/96/128/256, GQA groups 1/4/7, multi-token queries up to 63 rows, batch 3 with a left-padded
row, splits of the sequence that are entirely padding. When triton was imported before this module
could turn the interpreter on (a whole-suite run), the tests run in a fresh process instead.
"""

# ruff: noqa: I001  (triton_device is imported first, before anything can import triton)
from __future__ import annotations

import os

import triton_device  # first: it turns Triton's interpreter on unless KVPACK_TEST_DEVICE=cuda

import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # CI installs triton and sets KVPACK_REQUIRE_TRITON=1: there a missing one fails
    if os.environ.get("KVPACK_REQUIRE_TRITON") == "1":
        raise RuntimeError(f"KVPACK_REQUIRE_TRITON=1 but triton does not import: {e}") from e
    pytest.skip(f"triton does not import ({e}); pip install 'kvpack[triton]'", allow_module_level=True)

from kvpack.kernels import reference, triton_attention
from kvpack.kernels.ops import run_triton
from kvpack.primitives.lloyd_max import lloyd_max_codebook
from triton_device import on_device, to_device
from test_ops import (
    B,
    H,
    T,
    assert_codes_equal_except_ties,
    assert_match_encode,
    assert_norms_equal_except_ties,
    int8_inputs,
    kivi_inputs,
    make_bias,
    tq_inputs,
    turning_inputs,
)

# Triton chooses the interpreter when `triton` is first imported. In a whole-suite run it already was,
# without it (`import kvpack` -> transformers -> hqq -> torch.compile imports triton), so this module's
# tests then run in a fresh process that has TRITON_INTERPRET=1 from the start.
IN_PROCESS = triton_attention.INTERPRETED or triton_device.DEVICE == "cuda"
in_process = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without the interpreter: run by test_in_a_fresh_process")


@pytest.mark.skipif(IN_PROCESS, reason="the interpreter is active in this process")
def test_in_a_fresh_process():
    assert os.environ.get("KVPACK_FRESH_TRITON_PROCESS") != "1", "the interpreter is off even in a fresh process with TRITON_INTERPRET=1"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVPACK_FRESH_TRITON_PROCESS": "1"}
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"


def assert_within_low_precision(op: str, kernel_out, args: dict) -> None:
    """Kernel error <= 2x the float16 reference's error, both against the float32 reference."""
    exact = getattr(reference, op)(**args)
    low = getattr(reference, op)(**args, compute_dtype=torch.float16)
    for name, k, e, lo in zip("mlo", kernel_out, exact, low, strict=True):
        assert k.shape == e.shape and k.dtype == torch.float32
        assert torch.isfinite(k).all(), f"{name} has non-finite values"
        err, base = (k - e).abs().max().item(), (lo - e).abs().max().item()
        assert err <= 2 * base, f"{name}: kernel error {err:.3g} > 2 x float16 reference error {base:.3g}"


# -- TurboQuant attention -----------------------------------------------------------------------------
TQ_CASES = [  # head_dim, GQA group, query tokens, key bits, value bits, splits
    (64, 1, 1, 2, 2, 1),
    (80, 4, 1, 3, 3, 4),
    (96, 7, 1, 4, 2, 2),
    (128, 4, 5, 3, 4, 1),  # 20 rows with a causal mask
    (256, 1, 1, 4, 3, 4),
    (128, 7, 9, 2, 3, 2),  # 63 rows: speculative verification / prefill continuation sizes
]


@in_process
@pytest.mark.parametrize("d,group,q_len,k_bits,v_bits,splits", TQ_CASES, ids=[f"d{c[0]}-g{c[1]}-q{c[2]}-k{c[3]}v{c[4]}-s{c[5]}" for c in TQ_CASES])
def test_tq_attention(d, group, q_len, k_bits, v_bits, splits):
    args = tq_inputs(d, group * q_len, k_bits, v_bits) | {"bias": make_bias(B, q_len, T)}
    assert_within_low_precision("tq_attention", on_device(run_triton, "tq_attention", **args, num_splits=splits), args)


TRELLIS_CASES = [  # head_dim, GQA group, query tokens, (key bits, L), (value bits, L), splits; L == bits: scalar codes
    (64, 3, 1, (3, 9), (2, 8), 2),  # +tcq's pair
    (128, 4, 5, (3, 9), (3, 3), 1),  # trellis keys, scalar values, a causal mask
    (80, 7, 1, (2, 2), (2, 8), 3),  # scalar keys, trellis values
    (36, 2, 1, (3, 9), (2, 8), 2),  # 36 channels: no whole 8-channel groups, so windows by channel
]


@in_process
@pytest.mark.parametrize("d,group,q_len,kspec,vspec,splits", TRELLIS_CASES, ids=[f"d{c[0]}-k{c[3]}-v{c[4]}" for c in TRELLIS_CASES])
def test_tq_attention_on_trellis_codes(d, group, q_len, kspec, vspec, splits):
    """Trellis codes (`(2**L,)` tables read at each channel's window of the packed bits, `reference.code_values`)
    within the float16 criterion, with turning means on the first case."""
    gen = torch.Generator().manual_seed(d)
    args = tq_inputs(d, group * q_len, kspec[0], vspec[0]) | {"bias": make_bias(B, q_len, T)}
    args |= {"k_centroids": torch.randn(2 ** kspec[1], generator=gen) * d**-0.5, "v_centroids": torch.randn(2 ** vspec[1], generator=gen) * d**-0.5}
    if d == 64:
        args |= turning_inputs(d, group * q_len, 5)
    assert_within_low_precision("tq_attention", on_device(run_triton, "tq_attention", **args, num_splits=splits), args)


@in_process
@pytest.mark.parametrize("bits,state_bits,n,rows", [(3, 9, 64, 37), (2, 8, 80, 21), (1, 4, 36, 5)])
def test_trellis_encode(bits, state_bits, n, rows):
    """The Triton Viterbi search (both tail-biting passes, back-pointers walked per row) against `reference.trellis_encode`
    (float64 torch): the same symbols on every row (float32 costs: a near-tie could differ, none does on these draws), or
    failing that no worse a path than the float32 rounding of the costs."""
    from kvpack.kernels import triton_encode
    from kvpack.primitives import trellis

    gen = torch.Generator().manual_seed(n)
    book = trellis.train_codebook(torch.randn(128, n, generator=gen), bits, state_bits, iters=2)
    y = torch.randn(rows, n, generator=gen) * 1.5
    out = triton_encode.trellis_encode(to_device(y), to_device(book), bits).cpu()
    want = reference.trellis_encode(y, book, bits)
    err = lambda sym: (trellis.decode_symbols(sym, book, bits) - y).pow(2).sum(-1)  # noqa: E731
    assert out.dtype == torch.uint8 and out.shape == y.shape
    assert (out == want).all(-1).float().mean() >= 0.95 and (err(out) <= err(want) * (1 + 1e-5) + 1e-6).all()


@triton.jit
def _codes_kernel(src, out, T, C: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, GROUPED: tl.constexpr):
    toks, cols, groups = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_C // 8)
    code = triton_attention._codes(src + toks[:, None] * NBYTES, cols, groups, toks < T, C, BITS, NBYTES, BLOCK_T, BLOCK_C, GROUPED)
    tl.store(out + toks[:, None] * C + cols[None, :], code, mask=(toks < T)[:, None] & (cols < C)[None, :])


@in_process
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("c,grouped", [(64, True), (80, True), (80, False), (36, False)])
def test_code_unpacking_by_groups_and_by_code(bits, c, grouped):
    """The kernels' two unpackers (8-code groups: b byte loads; per code: one or two) against packing.py's
    torch unpack, on random bytes of 37 tokens (a partial tile)."""
    from kvpack.primitives.packing import packed_length, unpack_bits

    nbytes, t = packed_length(c, bits), 37
    packed = torch.randint(0, 256, (t, nbytes), generator=torch.Generator().manual_seed(bits * c), dtype=torch.uint8)
    out = to_device(torch.full((t, c), -1, dtype=torch.int32))
    _codes_kernel[(1,)](to_device(packed), out, t, C=c, BITS=bits, NBYTES=nbytes, BLOCK_T=64,
                        BLOCK_C=triton.next_power_of_2(c), GROUPED=grouped)
    assert torch.equal(out.cpu(), unpack_bits(packed, bits, c).to(torch.int32))


@in_process
@pytest.mark.parametrize("op", ["tq_attention", "int8_attention"])
def test_float32_dots_and_per_code_unpacking(op, monkeypatch):
    """The paths the defaults leave (float32 dots at the plan's precision, per-code unpacking, centroids by a select
    chain), still held to the same bound: the GPU sweep (scripts/gpu_sweep.py) times them against the defaults."""
    init = triton_attention._Plan.__init__

    def plain(self, *a, **k):
        init(self, *a, **k)
        self.f16, self.grouped, self.select = False, False, True

    monkeypatch.setattr(triton_attention._Plan, "__init__", plain)
    args = (tq_inputs(96, 8, 3, 2) if op == "tq_attention" else int8_inputs(96, 8)) | {"bias": make_bias(B, 2, T)}
    assert_within_low_precision(op, on_device(run_triton, op, **args, num_splits=3), args)


PAIR_CASES = [  # head_dim, GQA group, key bits, value bits, token tile, turning pairs (0: none)
    (128, 4, 3, 2, 64, 0),  # the default's widths: byte-assembled keys, word-read values
    (64, 7, 3, 2, 32, 5),  # with the turning term
    (128, 1, 4, 1, 16, 0),  # words on both sides; one-bit values
    (80, 3, 2, 4, 64, 0),  # 80 channels: 20- and 40-byte rows, a tile padded to 128
    (96, 2, 1, 3, 32, 0),  # 12-byte rows of one-bit keys, 3-bit values assembled from bytes
]


@in_process
@pytest.mark.parametrize("d,group,k_bits,v_bits,block_t,pairs", PAIR_CASES, ids=[f"d{c[0]}-k{c[2]}v{c[3]}-t{c[4]}" for c in PAIR_CASES])
@pytest.mark.parametrize("words", [False, True])
def test_tq_attention_reading_centroid_pairs(d, group, k_bits, v_bits, block_t, pairs, words, monkeypatch):
    """Two channels' fp16 centroids per table read (`pair_table`), codes assembled from bytes or read as 32-bit words,
    the loop not pipelined: the same float16 criterion as the default path, at awkward widths and token tiles."""
    init = triton_attention._Plan.__init__

    def paired(self, *a, **k):
        init(self, *a, **k)
        self.pairs, self.words, self.num_stages, self.block_t = True, words, 1, block_t

    monkeypatch.setattr(triton_attention._Plan, "__init__", paired)
    args = tq_inputs(d, group, k_bits, v_bits) | {"bias": make_bias(B, 1, T)}
    if pairs:
        args |= turning_inputs(d, group, pairs)
    assert_within_low_precision("tq_attention", on_device(run_triton, "tq_attention", **args, num_splits=3), args)


def test_pair_table_holds_both_centroids():
    """Entry lo + n·hi: fp16 of centroid lo in the low half, of centroid hi in the high half (read back bit by bit)."""
    cent = lloyd_max_codebook(64, 3, "gaussian").centroids
    table = triton_attention.pair_table(cent)
    assert table.dtype == torch.int32 and table.shape == (64,)
    lo = (table & 0xFFFF).to(torch.int16).view(torch.float16)
    hi = ((table >> 16) & 0xFFFF).to(torch.int16).view(torch.float16)
    idx = torch.arange(64)
    assert torch.equal(lo, cent.half()[idx % 8]) and torch.equal(hi, cent.half()[idx // 8])
    assert triton_attention.pair_table(cent) is table  # built once per centroid tensor


MERGE_CASES = [  # head dim, value dim, query rows, exact rows, segment partials, exact rows' dtype
    (64, 64, 7, 37, 1, torch.float32),
    (128, 128, 4, 300, 3, torch.bfloat16),  # sinks + window + anchors of a 32K prompt
    (80, 96, 63, 5, 2, torch.float16),
    (64, 64, 1, 0, 2, torch.float32),  # no exact rows
    (96, 96, 9, 40, 0, torch.float32),  # no segments
]


@in_process
@pytest.mark.parametrize("d,dv,rows,e,p,dtype", MERGE_CASES, ids=[f"d{c[0]}-r{c[2]}-e{c[3]}-p{c[4]}" for c in MERGE_CASES])
def test_exact_merge(d, dv, rows, e, p, dtype):
    """The exact rows' online softmax and the merge with the segments' partials in one launch, against the reference:
    float32 throughout, so within float32 rounding (a fully masked partial, m = l = o = 0, among the segments)."""
    gen = torch.Generator().manual_seed(e)
    q = torch.randn(B, H, rows, d, generator=gen)
    k, v = (torch.randn(B, H, e, n, generator=gen).to(dtype) for n in (d, dv))
    parts = [reference.exact_attention(q, torch.randn(B, H, 20, d, generator=gen), torch.randn(B, H, 20, dv, generator=gen), 0.1) for _ in range(p)]
    if p > 1:
        parts[1] = tuple(torch.zeros_like(x) for x in parts[1])
    args = (q, k, v, 0.1, *(list(x) for x in zip(*parts, strict=True))) if parts else (q, k, v, 0.1, [], [], [])
    got = on_device(run_triton, "exact_merge", *args)
    want = reference.exact_merge(*args)
    assert got.shape == want.shape == (B, H, rows, dv) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@in_process
def test_tq_attention_offset_softcap_strided_and_masked_rows():
    """Row offsets, softcap, codes read through token-narrowed views of a larger buffer (no copy), a
    batch row masked entirely (m = l = o = 0) and a split that is all padding (4 splits of 64 < PAD)."""
    d, rows = 96, 4
    args = tq_inputs(d, rows, 3, 3, t=T + 40)
    dev = to_device(args)  # narrowed where the kernel reads them; `args` stays on the CPU for the reference
    for name in ("k_codes", "k_norm", "v_codes", "v_norm"):
        args[name], dev[name] = args[name][:, :, 13 : 13 + T], dev[name][:, :, 13 : 13 + T]
    assert not dev["k_codes"].is_contiguous()
    args |= {"row_offset": torch.randn(B, H, rows, 1), "bias": make_bias(B, 1, T, masked_row=2), "softcap": 5.0}
    m, denom, o = out = on_device(run_triton, "tq_attention", **(args | {k: dev[k] for k in ("k_codes", "k_norm", "v_codes", "v_norm")}), num_splits=4)
    assert_within_low_precision("tq_attention", out, args)
    assert not m[2].any() and not denom[2].any() and not o[2].any()


TURN_CASES = [(64, 7, 1, 9, 3), (128, 4, 5, 40, 1), (96, 1, 1, 48, 2)]  # head_dim, GQA group, query tokens, turning pairs, splits


@in_process
@pytest.mark.parametrize("d,group,q_len,pairs,splits", TURN_CASES, ids=[f"d{c[0]}-g{c[1]}-q{c[2]}-m{c[3]}-s{c[4]}" for c in TURN_CASES])
def test_tq_attention_with_turning_means(d, group, q_len, pairs, splits):
    """Keys centered on a turning mean (`+ropemean`): the kernel forms their per-token term itself (segments starting at
    RoPE positions 0, 3000 and 200K), within the float16 criterion of the float64-term reference."""
    args = tq_inputs(d, group * q_len, 3, 2) | turning_inputs(d, group * q_len, pairs) | {"row_offset": torch.randn(B, H, group * q_len, 1)}
    assert_within_low_precision("tq_attention", on_device(run_triton, "tq_attention", **args, num_splits=splits), args)
    m, denom, _ = on_device(run_triton, "tq_attention", **(args | {"k_norm": torch.zeros_like(args["k_norm"])}), num_splits=splits)
    exact = reference.tq_attention(**(args | {"k_norm": torch.zeros_like(args["k_norm"])}))  # the term alone (and the offset)
    torch.testing.assert_close(m, exact[0], rtol=3e-3, atol=3e-3 * float(exact[0].abs().max()))  # fp16 operands: ~1e-3


@in_process
def test_turning_term_phase_holds_at_long_positions(monkeypatch):
    """With the codes' norms zero the scores are the turning term alone, so m and l show its phase error directly. At
    RoPE positions 200K-1M a float32 θ·p is off by ~0.01 rad (a 1e-2 relative error here); the kernel reduces each tile's
    first phase in float64 and, with float32 dots, must agree with the float64 reference to 2e-5."""
    init = triton_attention._Plan.__init__

    def float32_dots(self, *a, **k):  # fp16 operands would round the term by ~1e-3: the phase would hide under it
        init(self, *a, **k)
        self.f16 = False

    monkeypatch.setattr(triton_attention._Plan, "__init__", float32_dots)
    d, rows = 64, 4
    args = tq_inputs(d, rows, 3, 2) | turning_inputs(d, rows, 24, pos0=(200_000, 1_000_003, 77))
    args["k_norm"] = torch.zeros_like(args["k_norm"])
    m, denom, _ = on_device(run_triton, "tq_attention", **args, num_splits=2)
    m_ref, denom_ref, _ = reference.tq_attention(**args)
    assert m_ref.abs().amax() > 5.0  # the term is large: a phase error would show
    torch.testing.assert_close(m, m_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(denom, denom_ref, rtol=2e-5, atol=2e-5)


@in_process
def test_empty_segment():
    args = tq_inputs(64, 4, 2, 2, t=8)
    args |= {name: args[name][:, :, :0] for name in ("k_codes", "k_norm", "v_codes", "v_norm")}
    m, denom, o = on_device(run_triton, "tq_attention", **args)
    assert o.shape == (B, H, 4, 64) and not m.any() and not denom.any() and not o.any()


# -- int8 and KIVI attention --------------------------------------------------------------------------------
INT8_CASES = [(64, 1, 1, 1), (80, 4, 1, 3), (96, 7, 1, 2), (128, 4, 5, 1), (256, 4, 1, 4)]  # d, group, q_len, splits


@in_process
@pytest.mark.parametrize("d,group,q_len,splits", INT8_CASES, ids=[f"d{c[0]}-g{c[1]}-q{c[2]}-s{c[3]}" for c in INT8_CASES])
def test_int8_attention(d, group, q_len, splits):
    args = int8_inputs(d, group * q_len) | {"bias": make_bias(B, q_len, T)}
    assert_within_low_precision("int8_attention", on_device(run_triton, "int8_attention", **args, num_splits=splits), args)


KIVI_CASES = [  # d, group, q_len, key bits, value bits, value group, splits
    (64, 1, 1, 2, 2, 32, 1),
    (80, 4, 1, 4, 2, 16, 2),  # 80 channels: spread key scales padded to 3 x 32, value groups of 16
    (96, 7, 1, 2, 4, 32, 4),
    (128, 4, 3, 4, 4, 32, 1),
]


@in_process
@pytest.mark.parametrize("d,group,q_len,k_bits,v_bits,v_group,splits", KIVI_CASES, ids=[f"d{c[0]}-g{c[1]}-q{c[2]}-k{c[3]}v{c[4]}-s{c[6]}" for c in KIVI_CASES])
def test_kivi_attention(d, group, q_len, k_bits, v_bits, v_group, splits):
    args = kivi_inputs(d, group * q_len, k_bits, v_bits, v_group) | {"bias": make_bias(B, q_len, 224)}
    assert_within_low_precision("kivi_attention", on_device(run_triton, "kivi_attention", **args, num_splits=splits), args)


# -- TurboQuant encode ----------------------------------------------------------------------------------
ENCODE_CASES = [(64, 2, True), (64, 3, False), (128, 4, True), (128, 3, True), (256, 2, False), (256, 4, True)]  # d, bits, center+scale


@in_process
@pytest.mark.parametrize("d,bits,fitted", ENCODE_CASES, ids=[f"d{c[0]}-b{c[1]}{'-fitted' if c[2] else ''}" for c in ENCODE_CASES])
def test_tq_encode(d, bits, fitted):
    gen = torch.Generator().manual_seed(d + bits)
    x = (torch.randn(B, H, T, d, generator=gen) * 2 + 0.5).to(torch.bfloat16 if d == 256 and not fitted else torch.float32)  # bf16 in, as models cache
    mean = torch.randn(H, d, generator=gen) if fitted else None
    inv_scale = torch.rand(H, d, generator=gen) + 0.5 if fitted else None
    x[1, 0, 3] = 0 if mean is None else mean[0]  # a vector that centers to zero: norm 0, direction 0
    signs = (torch.randint(0, 2, (H, d), generator=gen) * 2 - 1).float()
    boundaries = lloyd_max_codebook(d, bits, "gaussian").boundaries
    args = (x, mean, inv_scale, signs, boundaries, bits)
    norm, codes = on_device(run_triton, "tq_encode", *args)
    ref_norm, ref_codes = reference.tq_encode(*args)
    assert norm.dtype == torch.float16 and codes.dtype == torch.uint8 and codes.shape == ref_codes.shape
    assert norm[1, 0, 3].item() == 0
    assert_norms_equal_except_ties(norm, ref_norm)
    _, y = reference.tq_rotated_unit(*args[:4])
    assert_codes_equal_except_ties(codes, ref_codes, y, boundaries, bits)



@in_process
@pytest.mark.parametrize("d,bits,fitted", [(64, 3, True), (128, 2, False)], ids=["d64-b3-fitted", "d128-b2"])
def test_tq_encode_match(d, bits, fitted):
    """`tq_encode` given the centroids (`norm="match"`) in Triton against the torch reference."""
    gen = torch.Generator().manual_seed(d * 3 + bits)
    x = torch.randn(B, H, T, d, generator=gen) * 2 + 0.5
    mean = torch.randn(H, d, generator=gen) if fitted else None
    inv_scale = torch.rand(H, d, generator=gen) + 0.5 if fitted else None
    signs = (torch.randint(0, 2, (H, d), generator=gen) * 2 - 1).float()
    book = lloyd_max_codebook(d, bits, "gaussian")
    args = (x, mean, inv_scale, signs, book.boundaries, bits)
    norm, codes = on_device(run_triton, "tq_encode", *args, book.centroids)
    ref_norm, ref_codes = reference.tq_encode(*args, book.centroids)
    assert_match_encode(norm, codes, ref_norm, ref_codes, args, book.centroids)


# -- KIVI encode --------------------------------------------------------------------------------------------
KIVI_ENCODE_CASES = [(64, 2, "channel", 32), (80, 4, "channel", 32), (96, 2, "token", 32), (80, 4, "token", 16), (96, 4, "token", 24)]


# Constant groups store scale 0 (1e-8 rounds to 0 in fp16) and divide by it, as torch does: the
# interpreter's numpy reports the 0/0 and x/0 (and inf - inf in the rounding).
@in_process
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("d,bits,axis,group", KIVI_ENCODE_CASES, ids=[f"d{c[0]}-b{c[1]}-{c[2]}{c[3]}" for c in KIVI_ENCODE_CASES])
def test_kivi_encode(d, bits, axis, group):
    """Bit-exact codes, scales and zeros; constant groups and padded spread rows included."""
    gen = torch.Generator().manual_seed(d + bits)
    x = torch.randn(B, H, 224, d, generator=gen) * 2 + torch.linspace(-3, 3, d)
    x[0, 0, :32, 5] = 1.5  # constant key groups: x - zero is 0 (0/0 -> code 0) ...
    x[0, 0, 32:64, 6] = 0.1  # ... or, zero rounded to fp16, a tiny positive (x/0 = inf -> top code)
    x[0, 1, 7] = 0.25  # a constant value token
    got = on_device(run_triton, "kivi_encode", x, bits, group, axis)
    for name, g, want in zip(("codes", "scale", "zero"), got, reference.kivi_encode(x, bits, group, axis), strict=True):
        assert g.dtype == want.dtype and torch.equal(g, want), f"{name}: {int((g != want).sum())} entries differ"


def test_a_launch_short_of_shared_memory_retries_with_half_the_token_tile(monkeypatch):
    """On a GPU a tile can need more shared memory than the chip has (found on an H200: 288 KB for 63 rows
    at d = 128); the launch halves BLOCK_T with no pipelining until it fits, and the shape keeps that."""
    from triton.runtime.errors import OutOfResources

    class Kernel:  # stands in for a jit function: kernel[grid](*args, **meta), short of memory above `fits`
        def __init__(self, fits: int):
            self.fits, self.launches = fits, []

        def __getitem__(self, grid):
            def run(*args, **meta):
                self.launches.append((meta["BLOCK_T"], meta.get("num_stages")))
                if meta["BLOCK_T"] > self.fits:
                    raise OutOfResources(294912, 232448, "shared memory")
            return run

    monkeypatch.setattr(triton_attention, "_SHRUNK", {})
    plan = triton_attention._Plan(torch.zeros(1, 2, 63, 128), 500, 128, 128, num_splits=2)
    assert plan.block_t == 64 and plan.split_len % 16 == 0
    kernel = Kernel(fits=16)
    plan.launch(kernel, "args", D=128)
    assert kernel.launches == [(64, None), (32, 1), (16, 1)]
    plan.launch(kernel, "args", D=128)  # the same shape starts from what fit
    assert kernel.launches[3:] == [(16, 1)]
    never = Kernel(fits=0)
    with pytest.raises(OutOfResources):  # nothing smaller than 16 tokens: the error stands
        plan.launch(never, "args", D=128)
    assert never.launches == [(64, None), (32, 1), (16, 1)]
