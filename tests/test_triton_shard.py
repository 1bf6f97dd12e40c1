"""Shard's decode attention (PCA-coefficient keys without RoPE, VQ values): the torch reference against
the codecs' own path, the `kvpack::pca_vq_attention` op's CPU dispatch against the C++ kernel, and the
Triton kernel, run by Triton's interpreter on CPU tensors, against the reference.

Segments are real: Shard's prefill codec specs fitted on structured low-rank keys (RoPE'd at each batch
row's own positions) and Gaussian values, with options that make the bit allocation mix widths (2, 4, 6,
8 bits) and the VQ indices take 4, 5, 6 or 8 bits. Float outputs (m, denom, o): the kernel's max error
against the float32 reference must be at most twice the error of the same reference computed in
float16 (flash-attention's criterion). Sizes: 217 tokens, head dims 64/80/128, GQA groups 1/4/7 with
up to 16 query rows, batch 3 with a left-padded row, splits of the sequence that are all padding. As in
test_triton_kernels.py, when triton was imported before this module could turn the interpreter on (a
whole-suite run), the Triton tests run in a fresh process; the torch-only tests run in the first one.
"""

# ruff: noqa: I001  (triton_device is imported first, before anything can import triton)
from __future__ import annotations

import os

import triton_device  # first: it turns Triton's interpreter on unless KVPACK_TEST_DEVICE=cuda

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpack.cache.layer import Segment
from kvpack.codecs.base import group_query, ungroup
from kvpack.kernels import cpu_lut, ops, reference, table
from kvpack.primitives.rope import apply_rope, rope_cos_sin
from kvpack.registry import CodecSpec, get_method
from test_ops import PAD, B, T, assert_partial_close, make_bias
from triton_device import on_device, to_device

try:
    import triton  # noqa: F401

    TRITON_MISSING = None
except ImportError as e:  # CI installs triton and sets KVPACK_REQUIRE_TRITON=1: there a missing one fails
    if os.environ.get("KVPACK_REQUIRE_TRITON") == "1":
        raise RuntimeError(f"KVPACK_REQUIRE_TRITON=1 but triton does not import: {e}") from e
    TRITON_MISSING = f"triton does not import ({e}); pip install 'kvpack[triton]'"

# See test_triton_kernels.py: the interpreter is on only if this process imported triton with TRITON_INTERPRET=1.
FRESH = os.environ.get("KVPACK_FRESH_TRITON_PROCESS") == "1"
if TRITON_MISSING is None:
    from kvpack.kernels import triton_shard

    IN_PROCESS = triton_shard.INTERPRETED or triton_device.DEVICE == "cuda"
else:
    IN_PROCESS = False
in_process = pytest.mark.skipif(not IN_PROCESS, reason=TRITON_MISSING or "triton was imported without the interpreter: run by test_in_a_fresh_process")
first_process = pytest.mark.skipif(FRESH or triton_device.DEVICE == "cuda", reason="torch-only: ran in the process that started this one, or on CPU")


@pytest.mark.skipif(IN_PROCESS or TRITON_MISSING is not None, reason=TRITON_MISSING or "the interpreter is active in this process")
def test_in_a_fresh_process():
    assert not FRESH, "the interpreter is off even in a fresh process with TRITON_INTERPRET=1"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVPACK_FRESH_TRITON_PROCESS": "1"}
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"


# -- Shard segments ----------------------------------------------------------------------------------
STARTS = (0, 37, 3000)  # RoPE position of each batch row's first token
# name: (head_dim, kv heads, PCA options, VQ options) over Shard's prefill specs. The allocations they give
# (asserted in test_segments_cover_the_layouts) reach every packed width the kernel unpacks. k-means runs
# 4 iterations on a 4096-group sample, to keep the fits short: the kernels read any codebook alike.
SEGMENTS = {
    "layer-d64": (64, 2, {"rank": 40, "group_size": 4}, {"n_iter": 4, "fit_points": 4096}),  # 8/6/4/2-bit components, 256 entries, token norm
    "layer-d128": (128, 1, {"rank": 36, "group_size": 4, "bits": 3.0}, {"codebook_size": 32, "n_iter": 4, "fit_points": 4096}),  # 5-bit indices
    "head-d80": (80, 2, {"scope": "head", "group_size": 4}, {"codebook_size": 16, "n_iter": 4, "fit_points": 4096, "token_norm": False}),
    "head-d128-kv4": (128, 4, {"scope": "head", "rank": 64, "group_size": 8}, {"codebook_size": 64, "n_iter": 4, "fit_points": 4096, "scope": "head"}),
}


@functools.cache
def shard_segment(name: str):
    """(key codec, value codec, keys, values, positions (B, T)) of a Shard segment fitted and encoded by the codecs."""
    d, kv, key_opts, value_opts = SEGMENTS[name]
    method = get_method("shard")
    kc = CodecSpec(method.prefill_key.codec, method.prefill_key.options | key_opts).build(d, kv)
    vc = CodecSpec(method.prefill_value.codec, method.prefill_value.options | value_opts).build(d, kv)
    kc.set_rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.25)
    gen = torch.Generator().manual_seed(d + kv)
    pos = torch.arange(T)[None] + torch.tensor(STARTS)[:, None]
    rank = 48  # keys near a rank-48 subspace with a decaying spectrum, plus a mean and noise
    basis, _ = torch.linalg.qr(torch.randn(kv * d, rank, generator=gen))
    coefs = torch.randn(B, T, rank, generator=gen) * torch.logspace(1.5, -1.5, rank)
    k0 = (coefs @ basis.T + torch.randn(kv * d, generator=gen)).reshape(B, T, kv, d).transpose(1, 2)
    k0 = k0 + 0.01 * torch.randn(k0.shape, generator=gen)
    cos, sin = rope_cos_sin(pos, kc.rope.inv_freq, kc.rope.scaling)
    keys, values = kc.encode(apply_rope(k0, cos, sin), pos), vc.encode(torch.randn(B, kv, T, d, generator=gen) * 1.5 + 0.3)
    return kc, vc, keys, values, pos


def op_args(name: str, rows: int, seed: int = 0) -> dict:
    """Keyword arguments of `pca_vq_attention` over segment `name` with `rows` random query rows per kv head."""
    kc, vc, keys, values, pos = shard_segment(name)
    ks, vs = kc.kernel_state(), vc.kernel_state()
    d, kv = kc.head_dim, kc.kv_heads
    return dict(
        q=torch.randn(B, kv, rows, d, generator=torch.Generator().manual_seed(seed)) * 2, pos0=pos[:, 0].contiguous(),
        bitpos=ks["bitpos"], bits=ks["bits"], qmax=ks["qmax"], basis_t=ks["basis_t"], mean=ks["mean"], inv_freq=ks["inv_freq"],
        rope_scale=ks["rope_scale"], k_codes=keys.codes, books=vs["books"].float(), v_bits=vs["bits"], v_idx=values.indices, v_norm=values.norm,
        scale=d**-0.5,
    )


def codec_attention(name: str, query: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Normalized attention `(B, q_heads, q_len, d)` by the codecs' own path: scores, softmax, weighted sum.
    The queries sit right after the segment (their positions matter to `scores`' relative identity only)."""
    kc, vc, keys, values, pos = shard_segment(name)
    q_len = query.shape[2]
    s = kc.scores(query, keys, pos[:, -1:] + 1 + torch.arange(q_len), pos) * kc.head_dim**-0.5
    return vc.weighted_sum(torch.softmax(s if bias is None else s + bias, -1), values)


def assert_matches_codec_path(got: torch.Tensor, want: torch.Tensor) -> None:
    """Attention `(B, q_heads, q_len, d)` by a kernel path vs `codec_attention`. The kernels rotate keys by
    float32 angles pos · inv_freq (as the model did), `PCAKeyCodec.scores` by exact relative ones: they
    differ by ~position · 6e-8 rad, so each batch row's tolerance grows with its positions."""
    for row, start in enumerate(STARTS):
        torch.testing.assert_close(got[row], want[row], rtol=1e-4, atol=2e-4 * (1 + (start + T) / 1000))


def normalized(partial, name: str, q_heads: int) -> torch.Tensor:
    """A grouped partial `(m, l, o)` with o in VQ's rotated space -> `(B, q_heads, R / group, d)` attention."""
    _, denom, o = partial
    return ungroup(shard_segment(name)[1].kernel_output(o) / denom, q_heads)


@first_process
def test_segments_cover_the_layouts():
    """The fitted segments mix component widths 2, 4, 6 and 8 and give VQ indices of 4, 5, 6 and 8 bits."""
    widths = {b for name in SEGMENTS for _, b in shard_segment(name)[0].segments}
    assert widths == {2, 4, 6, 8}, widths
    assert {shard_segment(name)[1].bits for name in SEGMENTS} == {4, 5, 6, 8}
    assert max(shard_segment(name)[0].rank for name in SEGMENTS) > 32  # the kernel's rank loop takes two steps


# -- the reference against the codecs -------------------------------------------------------------------
@first_process
@pytest.mark.parametrize("name,group,q_len", [("layer-d64", 4, 1), ("head-d80", 7, 2)])
def test_reference_matches_codec_path(name, group, q_len):
    """Rebuilt keys RoPE'd at absolute positions (reference) vs the relative-position identity on the
    coefficients (`PCAKeyCodec.scores`), masks included."""
    args = op_args(name, group * q_len)
    kv = args["q"].shape[1]
    query = ungroup(args["q"], kv * group)
    bias = make_bias(B, q_len, T)
    got = normalized(reference.pca_vq_attention(**args, bias=bias), name, kv * group)
    assert_matches_codec_path(got, codec_attention(name, query, bias))


# -- the op's CPU dispatch ------------------------------------------------------------------------------
@first_process
def test_cpu_dispatch_runs_the_cpp_kernel():
    """On CPU the op runs the C++ kernel (float64 RoPE recurrence) when it builds, which agrees with the
    reference to float32 angle rounding; masked or softcapped calls, which it cannot take, are the reference's."""
    if not cpu_lut.available():
        pytest.skip("the C++ kernels did not build")
    args = op_args("layer-d64", 8)
    assert ops.implementation("pca_vq_attention", torch.device("cpu")) is ops._pca_vq_cpu
    keys = {n: args[n] for n in ("bitpos", "bits", "qmax", "basis_t", "mean", "inv_freq", "rope_scale")} | {"row_bytes": args["k_codes"].shape[-1]}

    def kernel(integer):
        return cpu_lut.pca_vq_attention(args["q"], args["pos0"], keys | {"int8": integer}, args["k_codes"],
                                        {"books": args["books"], "bits": args["v_bits"]}, args["v_idx"], args["v_norm"], args["scale"])

    out = ops.pca_vq_attention(**args)  # without the basis' integer form: the float rebuild
    for a, e in zip(out, kernel(None), strict=True):
        assert torch.equal(a, e)
    integer = cpu_lut.int8_basis(args["basis_t"], args["mean"], args["qmax"])
    if integer is not None:  # with it (a VNNI CPU): the integer rebuild, and no float basis needed
        for a, e in zip(ops.pca_vq_attention(**args | {"basis_t": torch.empty(0)}, **integer), kernel(integer), strict=True):
            assert torch.equal(a, e)
    assert_partial_close(out, reference.pca_vq_attention(**args), rtol=1e-4)
    bias = make_bias(B, 1, T)
    for extra in ({"bias": bias}, {"softcap": 4.0}):
        for a, e in zip(ops.pca_vq_attention(**args, **extra), reference.pca_vq_attention(**args, **extra), strict=True):
            assert torch.equal(a, e)


@first_process
def test_opcheck():
    args = op_args("head-d80", 4)
    args |= {name: args[name][:, :, :40] for name in ("k_codes", "v_idx")}
    results = torch.library.opcheck(torch.ops.kvpack.pca_vq_attention.default, tuple(args.values()) + (make_bias(B, 1, 40), 0.0))
    assert results and all(v == "SUCCESS" for v in results.values()), results


@first_process
def test_checks_name_the_problem():
    args = op_args("layer-d64", 4)
    with pytest.raises(ValueError, match=r"basis_t must be \(groups, rank, kv_heads / groups \* 64\)"):
        reference.pca_vq_attention(**args | {"q": torch.randn(B, 3, 4, 64)})
    with pytest.raises(ValueError, match="pos0 must be torch.int64"):
        reference.pca_vq_attention(**args | {"pos0": args["pos0"].int()})
    with pytest.raises(ValueError, match="v_idx must have shape"):
        reference.pca_vq_attention(**args | {"v_bits": 6})


# -- Triton against the reference --------------------------------------------------------------------------
def assert_within_low_precision(kernel_out, args: dict) -> None:
    """Kernel error <= 2x the float16 reference's error, both against the float32 reference."""
    exact = reference.pca_vq_attention(**args)
    low = reference.pca_vq_attention(**args, compute_dtype=torch.float16)
    for name, k, e, lo in zip("mlo", kernel_out, exact, low, strict=True):
        assert k.shape == e.shape and k.dtype == torch.float32
        assert torch.isfinite(k).all(), f"{name} has non-finite values"
        err, base = (k - e).abs().max().item(), (lo - e).abs().max().item()
        assert err <= 2 * base, f"{name}: kernel error {err:.3g} > 2 x float16 reference error {base:.3g}"


TRITON_CASES = [  # segment, GQA group, query tokens, splits (of 64-token tiles; row 1's first 100 tokens are padding)
    ("layer-d64", 1, 1, 1),
    ("layer-d128", 7, 2, 4),  # 14 rows, causal; the first split of padded row 1 is all padding
    ("head-d80", 4, 4, 3),  # 16 rows
    ("head-d128-kv4", 4, 1, 2),  # rank > 32: two steps of the rank loop
]


@in_process
@pytest.mark.parametrize("name,group,q_len,splits", TRITON_CASES, ids=[f"{c[0]}-g{c[1]}-q{c[2]}-s{c[3]}" for c in TRITON_CASES])
def test_pca_vq_attention(name, group, q_len, splits):
    args = op_args(name, group * q_len) | {"bias": make_bias(B, q_len, T)}
    assert_within_low_precision(on_device(triton_shard.pca_vq_attention, **args, num_splits=splits), args)


@in_process
def test_softcap_strided_and_masked_rows():
    """Softcap, codes read through token-narrowed views of a larger buffer (no copy), a batch row masked
    entirely (m = l = o = 0) and 4 splits, the first all padding in row 1 (PAD = 100 > 64)."""
    assert PAD > 64
    args = op_args("layer-d64", 4) | {"bias": make_bias(B, 1, T, masked_row=2), "softcap": 5.0}
    dev = to_device(args)  # `args` stays on the CPU for the reference
    for name in ("k_codes", "v_idx", "v_norm"):  # the segment's tokens at [13, 13 + T) of a capacity buffer
        x = dev[name]
        dev[name] = torch.cat((x[:, :, -13:], x, x[:, :, :27]), dim=2)[:, :, 13 : 13 + T]
    assert not dev["k_codes"].is_contiguous() and torch.equal(dev["k_codes"].cpu(), args["k_codes"])
    m, denom, o = out = on_device(triton_shard.pca_vq_attention, **dev, num_splits=4)
    assert_within_low_precision(out, args)
    assert not m[2].any() and not denom[2].any() and not o[2].any()


@in_process
def test_empty_segment():
    args = op_args("head-d80", 4)
    args |= {name: args[name][:, :, :0] for name in ("k_codes", "v_idx")}
    m, denom, o = on_device(triton_shard.pca_vq_attention, **args)
    assert o.shape == (B, 2, 4, 80) and not m.any() and not denom.any() and not o.any()


# -- the decode path: table.segment_partial ----------------------------------------------------------------
def _check_segment_partial_matches_codec_path(backend: str) -> None:
    name, group = "layer-d64", 4
    kc, vc, keys, values, pos = shard_segment(name)
    seg = Segment("prefill", kc, vc, keys, values, start=0)
    query = torch.randn(B, kc.kv_heads * group, 1, kc.head_dim, generator=torch.Generator().manual_seed(5)) * 2
    q = group_query(query, kc.kv_heads)
    assert table.segment_partial(q, seg, kc.head_dim**-0.5) is None  # without the first position: the codecs' own path
    ops.set_backend(backend)
    try:
        m, denom, o = table.segment_partial(q, seg, kc.head_dim**-0.5, lambda: pos[:, 0])
    finally:
        ops.set_backend(None)
    assert_matches_codec_path(ungroup(o / denom, query.shape[1]), codec_attention(name, query))


@first_process
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_ops_segment_partial_matches_codec_path(backend):
    _check_segment_partial_matches_codec_path(backend)


@in_process
@pytest.mark.skipif(triton_device.DEVICE == "cuda", reason="routes CPU tensors through Triton's interpreter")
def test_ops_segment_partial_runs_triton():
    """With backend "triton" under the interpreter the op runs `triton_shard` on CPU tensors."""
    ops.set_backend("triton")
    try:
        assert ops.implementation("pca_vq_attention", torch.device("cpu")) is triton_shard.pca_vq_attention
    finally:
        ops.set_backend(None)
    _check_segment_partial_matches_codec_path("triton")
