"""CPU kernels against their pure-torch references (unpack, look up, matmul), on awkward sizes.

Float outputs: the kernels sum in a different order than torch's matmul (per-byte tables, four
tokens per pass), so they are held to fp32 tolerance relative to the output's scale:
|kernel - reference| <= 1e-5 * (|reference| + max |reference|). Measured against an fp64
reference the kernels' error stays below 4e-6 of max |output| on this grid.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import pytest
import torch

from kvpack.codecs.int8 import Int8Codec, Int8Config
from kvpack.codecs.int8_rotated import RotatedInt8Codec, RotatedInt8Config
from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig
from kvpack.kernels import cpu_lut, reference
from kvpack.primitives.kmeans import d2_picks as kmeans_d2_picks
from kvpack.primitives.lloyd_max import lloyd_max_codebook
from kvpack.primitives.packing import pack_bits, unpack_bits

if cpu_lut.unavailable_reason() is not None:
    # CI sets KVPACK_REQUIRE_KERNELS=1: there a failed build is a failure, never a silent skip.
    if os.environ.get("KVPACK_REQUIRE_KERNELS") == "1":
        raise RuntimeError(f"KVPACK_REQUIRE_KERNELS=1 but the CPU kernels did not build: {cpu_lut.unavailable_reason()}")
    pytest.skip(f"kvpack CPU kernels did not build here: {cpu_lut.unavailable_reason()}", allow_module_level=True)

B, H = 2, 2
GRID = list(itertools.product((64, 80, 128), (1, 37, 217, 1000), (1, 3, 7)))  # (d, tokens, rows)
GRID_IDS = [f"d{d}-t{t}-r{r}" for d, t, r in GRID]


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def lut_inputs(bits: int, d: int, t: int, r: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    centroids = lloyd_max_codebook(d, bits, "beta").centroids
    codes = pack_bits(torch.randint(0, 2**bits, (B, H, t, d), generator=gen), bits)
    norm = (torch.rand(B, H, t, 1, generator=gen) * 4 + 0.1).half()
    q = torch.randn(B, H, r, d, generator=gen)
    p = torch.rand(B, H, r, t, generator=gen)
    return q, p, codes, norm, centroids


def int8_inputs(d: int, t: int, r: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (B, H, t, d), generator=gen).to(torch.int8)
    scale = (torch.rand(B, H, t, 1, generator=gen) / 50 + 1e-3).half()
    return torch.randn(B, H, r, d, generator=gen), torch.rand(B, H, r, t, generator=gen), codes, scale


# -- kernels equal their references ---------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("d,t,r", GRID, ids=GRID_IDS)
def test_lut_kernels_match_reference(bits, d, t, r):
    q, p, codes, norm, c = lut_inputs(bits, d, t, r)
    assert_fp32_close(cpu_lut.lut_scores(q, codes, norm, c, bits), cpu_lut.lut_scores_reference(q, codes, norm, c, bits))
    assert_fp32_close(cpu_lut.lut_weighted_sum(p, codes, norm, c, bits, d), cpu_lut.lut_weighted_sum_reference(p, codes, norm, c, bits, d))


@pytest.mark.parametrize("d,t,r", GRID, ids=GRID_IDS)
def test_int8_kernels_match_reference(d, t, r):
    q, p, codes, scale = int8_inputs(d, t, r)
    assert_fp32_close(cpu_lut.int8_scores(q, codes, scale), cpu_lut.int8_scores_reference(q, codes, scale))
    assert_fp32_close(cpu_lut.int8_weighted_sum(p, codes, scale), cpu_lut.int8_weighted_sum_reference(p, codes, scale))


@pytest.mark.parametrize("bits", [1, 3, 4])
@pytest.mark.parametrize("rows", [16, 23])  # one full 16-row table block, and 16 + a 7-row remainder
def test_lut_kernels_many_rows(bits, rows):
    q, p, codes, norm, c = lut_inputs(bits, 96, 300, rows, seed=1)
    assert_fp32_close(cpu_lut.lut_scores(q, codes, norm, c, bits), cpu_lut.lut_scores_reference(q, codes, norm, c, bits))
    assert_fp32_close(cpu_lut.lut_weighted_sum(p, codes, norm, c, bits, 96), cpu_lut.lut_weighted_sum_reference(p, codes, norm, c, bits, 96))


@pytest.mark.parametrize("d", [6, 21])  # codes that do not fill the last byte: padding must contribute nothing
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lut_kernels_partial_last_byte(bits, d):
    q, p, codes, norm, c = lut_inputs(bits, d, 50, 3, seed=2)
    assert_fp32_close(cpu_lut.lut_scores(q, codes, norm, c, bits), cpu_lut.lut_scores_reference(q, codes, norm, c, bits))
    assert_fp32_close(cpu_lut.lut_weighted_sum(p, codes, norm, c, bits, d), cpu_lut.lut_weighted_sum_reference(p, codes, norm, c, bits, d))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernels_do_not_depend_on_thread_count(threads):
    q, p, codes, norm, c = lut_inputs(4, 64, 1000, 3, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_lut.lut_scores(q, codes, norm, c, 4), cpu_lut.lut_weighted_sum(p, codes, norm, c, 4, 64)
        torch.set_num_threads(threads)
        many = cpu_lut.lut_scores(q, codes, norm, c, 4), cpu_lut.lut_weighted_sum(p, codes, norm, c, 4, 64)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0])  # each score is one thread's sum: bitwise equal
    assert_fp32_close(many[1], one[1])  # token slices are summed at the end: order depends on threads


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("t", [40, 3000])  # a part run on the calling thread, and one whose items threads take in turn
def test_decode_kernels_are_bitwise_equal_for_any_thread_count(threads, t):
    """Each work item writes its own partial and the splits merge in a fixed order, so which thread
    took which item (handed out from a shared counter) cannot change a bit of the result."""
    gen = torch.Generator().manual_seed(t)
    b, h, r, d = 1, 3, 3, 64
    codes = [pack_bits(torch.randint(0, 2**bits, (b, h, t, d), generator=gen), bits) for bits in (3, 2)]
    norms = [(torch.rand(b, h, t, 1, generator=gen) + 0.5).half() for _ in range(2)]
    q = torch.randn(b, h, r, d, generator=gen)
    tq = (q, torch.randn(b, h, r, 1, generator=gen), codes[0], norms[0], lloyd_max_codebook(d, 3).centroids, 3,
          codes[1], norms[1], lloyd_max_codebook(d, 2).centroids, 2, 0.125)
    dense = (q, torch.randn(b, h, t, d, generator=gen).half(), None, torch.randn(b, h, t, d, generator=gen).half(), None, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [*cpu_lut.tq_attention(*tq), *cpu_lut.dense_attention(*dense)]
        torch.set_num_threads(threads)
        many = [*cpu_lut.tq_attention(*tq), *cpu_lut.dense_attention(*dense)]
    finally:
        torch.set_num_threads(before)
    for a, e in zip(many, one, strict=True):
        assert torch.equal(a, e)


def test_non_contiguous_inputs_are_accepted():
    q, p, codes, norm, c = lut_inputs(4, 64, 200, 3)
    sliced_codes, sliced_norm = codes[:, :, 50:150], norm[:, :, 50:150]
    assert not sliced_codes.is_contiguous()
    assert_fp32_close(cpu_lut.lut_scores(q, sliced_codes, sliced_norm, c, 4), cpu_lut.lut_scores_reference(q, sliced_codes, sliced_norm, c, 4))


# -- launchers validate before calling C++ --------------------------------------------------------
def test_launchers_name_the_problem():
    q, p, codes, norm, c = lut_inputs(4, 64, 10, 3)
    cases = [
        (lambda: cpu_lut.lut_scores(q.double(), codes, norm, c, 4), "q_rot must be torch.float32"),
        (lambda: cpu_lut.lut_scores(q, codes, norm, c, 5), r"bits must be one of \(1, 2, 3, 4\)"),
        (lambda: cpu_lut.lut_scores(q, codes, norm, c, 2), r"codes must have shape \(2, 2, \*, 16\)"),
        (lambda: cpu_lut.lut_scores(q, codes, norm.float(), c, 4), "norm must be torch.float16"),
        (lambda: cpu_lut.lut_scores(q, codes, norm[:, :, :5], c, 4), r"norm must have shape \(2, 2, 10, 1\)"),
        (lambda: cpu_lut.lut_scores(q, codes, norm, c[:8], 4), r"centroids must have shape \(16,\)"),
        (lambda: cpu_lut.lut_scores(q[0], codes, norm, c, 4), "q_rot must have shape"),
        (lambda: cpu_lut.lut_weighted_sum(p[..., :9], codes, norm, c, 4, 64), "p covers 9 tokens but codes hold 10"),
        (lambda: cpu_lut.int8_scores(q, codes, norm), "codes must be torch.int8"),
        (lambda: cpu_lut.int8_weighted_sum(p, codes.view(torch.int8)[:, :, :5], norm), r"codes must have shape \(2, 2, 10, \*\)"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


# -- backend selection and fallback ----------------------------------------------------------------
def test_backend_env_var(monkeypatch):
    monkeypatch.setenv("KVPACK_KERNELS", "torch")
    assert not cpu_lut.available()
    monkeypatch.setenv("KVPACK_KERNELS", "auto")
    assert cpu_lut.available()
    monkeypatch.setenv("KVPACK_KERNELS", "triton")
    with pytest.raises(ValueError, match=r"KVPACK_KERNELS must be one of \('auto', 'torch'\)"):
        cpu_lut.available()


def test_failed_build_warns_once_and_reports_unavailable(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu_lut, "_built_library", lambda name: None)  # nothing built yet: a build is tried
    monkeypatch.setattr(cpu_lut, "_build_directory", lambda name: tmp_path)
    build = cpu_lut._extension.__wrapped__  # the uncached builder: the real cache stays intact
    with pytest.warns(RuntimeWarning, match="kvpack CPU kernels unavailable.*no compiler") as record:
        assert build() is None
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_lut.available()  # the cached, working build is untouched



def test_a_build_is_announced_and_a_cached_build_is_silent(monkeypatch, capsys, tmp_path):
    """The first build on a CPU prints one line before compiling (and one when done); loading a cached build prints nothing."""
    import torch.utils.cpp_extension

    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append(kw["name"]) or "module")
    monkeypatch.setattr(cpu_lut, "_build_directory", lambda name: tmp_path)
    build = cpu_lut._extension.__wrapped__
    monkeypatch.setattr(cpu_lut, "_built_library", lambda name: None)
    assert build() == "module"
    err = capsys.readouterr().err
    assert f"compiling its CPU kernels for this CPU (once, a few minutes): {calls[0]}" in err and "CPU kernels ready" in err
    monkeypatch.setattr(cpu_lut, "_built_library", lambda name: tmp_path / f"{name}.so")
    monkeypatch.setattr(cpu_lut, "_import_built", lambda name, library: ("imported", library.name))
    assert build() == ("imported", f"{calls[0]}.so") and capsys.readouterr().err == "" and len(calls) == 1


def test_a_stale_build_lock_is_removed_and_a_fresh_one_is_named(tmp_path):
    """torch's loader waits forever on a lock a killed build left; kvpack removes an old one and names a young one."""
    lock = tmp_path / "lock"
    lock.write_text("")
    now = lock.stat().st_mtime
    message = cpu_lut.clear_stale_lock(tmp_path, now=now + 60)
    assert lock.exists() and str(lock) in message and "delete" in message  # a build a minute old may be running
    message = cpu_lut.clear_stale_lock(tmp_path, now=now + cpu_lut.STALE_LOCK_S + 1)
    assert not lock.exists() and str(lock) in message and "interrupted" in message
    assert cpu_lut.clear_stale_lock(tmp_path, now=now) is None  # no lock: nothing to say


def test_a_lock_whose_builder_was_killed_is_removed_at_once(tmp_path):
    """A build killed mid-compile (SIGKILL here: nothing of it runs after) leaves torch's lock; the next load finds
    its owner gone and removes the lock, instead of waiting 30 minutes for it to age. A live builder's is kept."""
    import signal
    import subprocess
    import sys
    import time

    child = ("import sys, time; from pathlib import Path; from kvpack.kernels import cpu_lut; d = Path(sys.argv[1]); "
             "assert cpu_lut._claim(d) is not None; (d / 'lock').write_text(''); time.sleep(120)")
    builder = subprocess.Popen([sys.executable, "-c", child, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "lock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "lock").exists() and builder.poll() is None
        message = cpu_lut.clear_stale_lock(tmp_path)  # the builder is running: its lock stays
        assert (tmp_path / "lock").exists() and "waiting for another process" in message
        builder.send_signal(signal.SIGKILL)
        builder.wait(30)
    finally:
        builder.kill()
    message = cpu_lut.clear_stale_lock(tmp_path)
    assert not (tmp_path / "lock").exists() and not (tmp_path / cpu_lut.OWNER).exists()
    assert f"process {builder.pid}, which is no longer running" in message and str(tmp_path / "lock") in message


def test_a_lock_owned_on_another_host_waits_for_its_age(tmp_path):
    """A build directory shared between machines: a pid of another host says nothing here, so the age rule decides."""
    lock = tmp_path / "lock"
    lock.write_text("")
    (tmp_path / cpu_lut.OWNER).write_text("some-other-host 1")
    now = lock.stat().st_mtime
    assert lock.exists() and "waiting" in cpu_lut.clear_stale_lock(tmp_path, now=now + 60)
    assert "interrupted" in cpu_lut.clear_stale_lock(tmp_path, now=now + cpu_lut.STALE_LOCK_S + 1) and not lock.exists()


@pytest.mark.parametrize("openmp", [True, False])
def test_a_failed_build_is_not_tried_again_another_way(monkeypatch, tmp_path, openmp):
    """The compiler is asked once whether it does OpenMP, and the one build it can do is tried: a failed (or
    interrupted) OpenMP build must not start a second build of several minutes without OpenMP."""
    import torch.utils.cpp_extension

    calls = []

    def fail(**kw):
        calls.append(kw["name"])
        assert not (tmp_path / "lock").exists() and (tmp_path / cpu_lut.OWNER).read_text().split()[1] == str(os.getpid())
        raise RuntimeError("Error building extension: ninja: build stopped: interrupted by user.")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    monkeypatch.setattr(cpu_lut, "_built_library", lambda name: None)
    monkeypatch.setattr(cpu_lut, "_build_directory", lambda name: tmp_path)
    monkeypatch.setattr(cpu_lut, "openmp_works", lambda: openmp)
    with pytest.warns(RuntimeWarning, match="kvpack CPU kernels unavailable, using the torch path.*interrupted by user"):
        assert cpu_lut._extension.__wrapped__() is None
    assert calls == [cpu_lut._build_name(openmp)]
    assert not (tmp_path / cpu_lut.OWNER).exists()  # the owner file goes with the attempt


def test_a_compiler_without_openmp_is_told_apart(monkeypatch, tmp_path):
    """`openmp_works` runs the compiler torch builds with; one that fails the probe, or is missing, means no OpenMP."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_lut.openmp_works() is False
    monkeypatch.setenv("CXX", "false")  # exits 1 whatever it is given
    assert cpu_lut.openmp_works() is False


def test_environments_with_one_torch_share_a_build_and_another_torch_gets_its_own(monkeypatch, tmp_path):
    """A second virtual environment (vLLM's, a worktree's) with the same torch reuses the build; a torch upgraded in
    place, whose headers and ABI differ, gets a new one instead of loading a library built against the old."""
    here = cpu_lut._build_name(openmp=True)
    monkeypatch.setattr(cpu_lut.sys, "prefix", "/elsewhere/.venv")
    copy = tmp_path / "cpp"
    copy.mkdir()
    for path in cpu_lut.SOURCE_DIR.iterdir():
        if path.suffix in (".cpp", ".h"):
            (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_lut, "SOURCE_DIR", copy)
    assert cpu_lut._build_name(openmp=True) == here  # another environment and checkout, the same sources and torch
    monkeypatch.setattr(cpu_lut.torch, "__version__", "9.9.9+cpu")
    there = cpu_lut._build_name(openmp=True)
    assert here != there and here.rsplit("_", 2)[0] == there.rsplit("_", 2)[0]  # same CPU tag and source hash


def test_a_built_extension_is_imported_without_torchs_loader(monkeypatch):
    """torch's loader runs ninja on a build file that names the building environment's paths, so calling it from
    another environment rebuilt the shared extension in place: a built one is imported directly instead."""
    import torch.utils.cpp_extension

    name = cpu_lut._build_name(openmp=True)
    if not cpu_lut._is_built(name):
        pytest.skip("this run's kernels were built without OpenMP")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: pytest.fail("torch's loader called for a built extension"))
    ext = cpu_lut._extension.__wrapped__()
    assert ext is not None and ext.__name__ == name and hasattr(ext, "merge_partials")


def test_the_installed_build_is_found_as_built():
    """The real, cached build of this session is recognised, so users see no message on a second run."""
    assert cpu_lut._is_built(cpu_lut._build_name(openmp=True)) or cpu_lut._is_built(cpu_lut._build_name(openmp=False))

# -- codecs: kernel path equals torch path ---------------------------------------------------------
CODEC_CASES = [
    ("turboquant", TurboQuantConfig(bits=b, qjl=qjl), d) for b in (1, 2, 3, 4) for qjl in (False, True) for d in (64, 80)
] + [("turboquant", TurboQuantConfig(bits=3, rotation="hadamard"), 80), ("int8", Int8Config(), 64), ("int8", Int8Config(), 80)] + [
    ("int8_rotated", RotatedInt8Config(seed=2), 64), ("int8_rotated", RotatedInt8Config(seed=2), 80)]


@pytest.mark.parametrize("name,config,d", CODEC_CASES, ids=[f"{n}-{c}-d{d}" for n, c, d in CODEC_CASES])
def test_codec_kernel_path_equals_torch_path(monkeypatch, name, config, d):
    torch.manual_seed(0)
    codec = {"turboquant": TurboQuantCodec, "int8": Int8Codec, "int8_rotated": RotatedInt8Codec}[name](config, d, 2, layer_idx=1)
    packed = codec.encode(torch.randn(2, 2, 217, d))
    query, probs = torch.randn(2, 6, 2, d), torch.softmax(torch.randn(2, 6, 2, 217), -1)
    monkeypatch.setenv("KVPACK_KERNELS", "torch")
    ref = codec.scores(query, packed), codec.weighted_sum(probs, packed)
    monkeypatch.setenv("KVPACK_KERNELS", "auto")
    assert_fp32_close(codec.scores(query, packed), ref[0])
    assert_fp32_close(codec.weighted_sum(probs, packed), ref[1])


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_torch_byte_table_centroids_equal_unpack_lookup(bits):
    codec = TurboQuantCodec(TurboQuantConfig(bits=bits), 80, 2)
    packed = codec.encode(torch.randn(1, 2, 37, 80))
    expected = codec.codebook.lookup(unpack_bits(packed.codes, bits, 80))
    assert torch.equal(codec._centroids(packed), expected)


# -- fused online-softmax partials -------------------------------------------------------------
def _tq_reference(q_rot, row_offset, k_codes, k_norm, k_cent, k_bits, v_codes, v_norm, v_cent, v_bits, scale):
    """The op's reference (`reference.tq_attention`) with the C++ launcher's argument order."""
    return reference.tq_attention(q_rot, k_codes, k_norm, k_cent, k_bits, v_codes, v_norm, v_cent, v_bits, q_rot.shape[-1], scale, row_offset)


def _dense_reference(q, k, k_scale, v, v_scale, scale):
    """`cpu_lut.dense_attention`'s references: the int8 op's for scaled int8 rows, the exact op's for float rows."""
    if k_scale is None:
        return reference.exact_attention(q, k, v, scale)
    return reference.int8_attention(q, k, k_scale, v, v_scale, scale)


def _turning_scores(turning: tuple, tokens: int) -> torch.Tensor:
    """`(B, H, R, tokens)` turning-mean terms of the launcher's `turning` tuple (its phasor table left out): the ops'
    float64 reference (`reference.turning_scores`)."""
    q, pair, mu, freq, _, pos0 = turning
    return reference.turning_scores(q, pair, mu, freq, pos0, 0, tokens).float()


def _normalized(part):
    m, denom, o = part
    return o / denom, m + denom.log()


@pytest.mark.parametrize("k_bits,v_bits", [(3, 2), (4, 4), (2, 3), (1, 4)])
@pytest.mark.parametrize("b,h,r,d,t", [(1, 3, 3, 64, 1100), (2, 2, 7, 64, 217), (1, 1, 1, 128, 600), (3, 2, 16, 96, 513)])
def test_tq_attention_matches_reference_on_capacity_views(k_bits, v_bits, b, h, r, d, t):
    gen = torch.Generator().manual_seed(t + r)
    cap = t + 37  # token-narrowed views of larger buffers: the kernel reads them in place

    def packed(bits):
        codes = pack_bits(torch.randint(0, 2**bits, (b, h, cap, d), generator=gen), bits)
        return codes[:, :, :t], (torch.rand(b, h, cap, 1, generator=gen) + 0.5).half()[:, :, :t]

    (kc, kn), (vc, vn) = packed(k_bits), packed(v_bits)
    args = (torch.randn(b, h, r, d, generator=gen), torch.randn(b, h, r, 1, generator=gen), kc, kn,
            lloyd_max_codebook(d, k_bits).centroids, k_bits, vc, vn, lloyd_max_codebook(d, v_bits).centroids, v_bits, 0.125)
    out, ref = _normalized(cpu_lut.tq_attention(*args)), _normalized(_tq_reference(*args))
    for a, e in zip(out, ref, strict=True):
        assert (a - e).abs().max() <= 1e-5 * (1 + e.abs().max())


TRELLIS_CASES = [  # (key bits, key state bits L; L == bits: scalar codes), (value bits, L), b, h, r, d, t
    ((3, 9), (2, 8), 1, 3, 3, 64, 1100),  # +tcq's pair: splits and a part tile
    ((3, 9), (3, 3), 2, 2, 7, 80, 217),  # trellis keys, scalar values
    ((2, 2), (2, 8), 1, 2, 16, 96, 513),  # scalar keys, trellis values
    ((3, 3), (2, 8), 1, 3, 3, 64, 1100),  # +tcqv: the default's 3-bit keys through their tables, trellis values
    ((4, 4), (3, 9), 2, 1, 5, 80, 77),  # scalar keys, trellis values past a group of eight (80 channels)
    ((1, 5), (4, 12), 2, 1, 1, 36, 40),  # 36 channels: a group of four past the last whole eight
]


@pytest.mark.parametrize("kspec,vspec,b,h,r,d,t", TRELLIS_CASES)
def test_tq_attention_on_trellis_codes_matches_reference(kspec, vspec, b, h, r, d, t):
    """Trellis codes (a `(2**L,)` table indexed by each coordinate's window of the packed bits) through the C++ kernel's
    decoded-rows path, against `reference.code_values` lookups: token-narrowed views, row offsets, skipped anchors and
    turning means included."""
    gen = torch.Generator().manual_seed(t + d)
    cap = t + 11

    def packed(bits, state_bits):
        codes = pack_bits(torch.randint(0, 2**bits, (b, h, cap, d), generator=gen), bits)[:, :, :t]
        return codes, (torch.rand(b, h, cap, 1, generator=gen) + 0.5).half()[:, :, :t], torch.randn(2**state_bits, generator=gen) * d**-0.5

    (kc, kn, kt), (vc, vn, vt) = packed(*kspec), packed(*vspec)
    args = (torch.randn(b, h, r, d, generator=gen), torch.randn(b, h, r, 1, generator=gen), kc, kn, kt, kspec[0], vc, vn, vt, vspec[0], 0.125)
    skip = torch.tensor([0, t // 3, t - 1]).unique()
    turning = _turning(b, h, r, d, min(4, d // 2), gen) if d % 2 == 0 else None
    out = _normalized(cpu_lut.tq_attention(*args, skip=skip, turning=turning))
    s = cpu_lut.lut_scores_reference(args[0], kc, kn, kt, kspec[0]) + args[1] + _turning_scores(turning, t)
    s[..., skip] = float("-inf")
    ref = _normalized(reference.partial_from_scores(s * 0.125, reference.code_values(vc, vt, vspec[0], d) * vn.float()))
    for a, e in zip(out, ref, strict=True):
        assert (a - e).abs().max() <= 2e-5 * (1 + e.abs().max())


def test_tq_attention_names_a_bad_trellis_table():
    codes = pack_bits(torch.zeros(1, 1, 8, 64, dtype=torch.long), 3)
    norm = torch.ones(1, 1, 8, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="2\\*\\*L for trellis codes with L a multiple of 3"):
        cpu_lut.tq_attention(torch.randn(1, 1, 3, 64), None, codes, norm, torch.zeros(256), 3, codes, norm, torch.zeros(512), 3, 1.0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.float32])
@pytest.mark.parametrize("b,h,r,d,t", [(1, 3, 3, 64, 1100), (2, 2, 7, 80, 217), (3, 1, 16, 256, 40)])
def test_dense_attention_matches_reference(dtype, b, h, r, d, t):
    gen = torch.Generator().manual_seed(d + t)
    k, v = torch.randn(b, h, t + 9, d, generator=gen) * 3, torch.randn(b, h, t + 9, d, generator=gen)
    if dtype == torch.int8:
        k, v = (k * 20).clamp(-127, 127).to(dtype), (v * 40).clamp(-127, 127).to(dtype)
        ks, vs = (torch.rand(b, h, t + 9, 1, generator=gen) * 0.02).half()[:, :, :t], (torch.rand(b, h, t + 9, 1, generator=gen) * 0.02).half()[:, :, :t]
    else:
        k, v, ks, vs = k.to(dtype), v.to(dtype), None, None
    args = (torch.randn(b, h, r, d, generator=gen), k[:, :, :t], ks, v[:, :, :t], vs, d**-0.5)
    out, ref = _normalized(cpu_lut.dense_attention(*args)), _normalized(_dense_reference(*args))
    for a, e in zip(out, ref, strict=True):
        assert (a - e).abs().max() <= 1e-5 * (1 + e.abs().max())


def _turning(b, h, r, d, m, gen, pos_hi=9000):
    """Random `turning` tensors: each head's m pairs (distinct), their means, the model's frequencies and phasor table."""
    half = d // 2
    pair = torch.stack([torch.randperm(half, generator=gen)[:m] for _ in range(h)])
    freq, table = cpu_lut.phasor_table(1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)))
    mu = torch.randn(h, m, 2, generator=gen) * 3
    return (torch.randn(b, h, r, d, generator=gen), pair, mu, freq, table, torch.randint(0, pos_hi, (b,), generator=gen))


@pytest.mark.parametrize("b,h,r,d,t,m", [(1, 3, 3, 64, 1100, 9), (2, 2, 7, 64, 217, 32), (1, 1, 1, 128, 600, 1), (3, 2, 16, 96, 513, 20),
                                         (1, 2, 4, 256, 31, 64)])
def test_tq_attention_with_turning_means_matches_reference(b, h, r, d, t, m):
    """Keys centered on a turning mean: the kernel's tiled phasors against a float64 cos/sin per token and pair,
    with anchors skipped, over splits (t > 512) and part tiles (t % 16 != 0)."""
    gen = torch.Generator().manual_seed(t + m)
    codes = [pack_bits(torch.randint(0, 2**bits, (b, h, t, d), generator=gen), bits) for bits in (3, 2)]
    norms = [(torch.rand(b, h, t, 1, generator=gen) + 0.5).half() for _ in range(2)]
    turning = _turning(b, h, r, d, m, gen)
    args = (torch.randn(b, h, r, d, generator=gen), torch.randn(b, h, r, 1, generator=gen), codes[0], norms[0],
            lloyd_max_codebook(d, 3).centroids, 3, codes[1], norms[1], lloyd_max_codebook(d, 2).centroids, 2, 0.125)
    skip = torch.tensor([0, t // 2, t - 1]).unique()
    out = _normalized(cpu_lut.tq_attention(*args, skip=skip, turning=turning))
    s = cpu_lut.lut_scores_reference(args[0], codes[0], norms[0], args[4], 3) + args[1] + _turning_scores(turning, t)
    s[..., skip] = float("-inf")
    v = reference.code_values(codes[1], args[8], 2, d) * norms[1].float()
    ref = _normalized(reference.partial_from_scores(s * 0.125, v))
    for a, e in zip(out, ref, strict=True):
        assert (a - e).abs().max() <= 2e-5 * (1 + e.abs().max())
    # The turning term is large here (|μ| ~ 3 against unit codes): without it the log-sum-exp would be far off.
    assert (_normalized(cpu_lut.tq_attention(*args, skip=skip))[1] - ref[1]).abs().max() > 1e-2


def test_turning_scores_reference_equals_rope_of_the_mean():
    """The reference's A cos + B sin form against the plain route: RoPE the pair's mean to each position, dot with q."""
    from kvpack.primitives.rope import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(5)
    b, h, r, d, t = 2, 3, 4, 64, 50
    q, pair, mu, freq, w, pos0 = _turning(b, h, r, d, 7, gen)
    mean = torch.zeros(h, d)
    mean.scatter_(1, pair, mu[..., 0])
    mean.scatter_(1, pair + d // 2, mu[..., 1])
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(pos0[:, None] + torch.arange(t), inv_freq)
    rotated = apply_rope(mean[None, :, None, :].expand(b, h, t, d), cos, sin)
    torch.testing.assert_close(_turning_scores((q, pair, mu, freq, w, pos0), t), q @ rotated.mT, rtol=1e-4, atol=2e-3)


def test_tq_attention_turning_names_the_problem():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64)
    codes = pack_bits(torch.zeros(1, 2, 8, 64, dtype=torch.long), 2)
    norm = torch.ones(1, 2, 8, 1, dtype=torch.float16)
    cent = lloyd_max_codebook(64, 2).centroids
    turning = _turning(1, 2, 3, 64, 4, gen)
    with pytest.raises(ValueError, match="6 tensors"):
        cpu_lut.tq_attention(q, None, codes, norm, cent, 2, codes, norm, cent, 2, 1.0, turning=turning[:5])
    with pytest.raises(ValueError, match="turning freq"):
        cpu_lut.tq_attention(q, None, codes, norm, cent, 2, codes, norm, cent, 2, 1.0, turning=(*turning[:3], turning[3].float(), *turning[4:]))
    bad_pair = turning[1].clone()
    bad_pair[0, 0] = 32
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        cpu_lut.tq_attention(q, None, codes, norm, cent, 2, codes, norm, cent, 2, 1.0, turning=(turning[0], bad_pair, *turning[2:]))


def test_tq_attention_refuses_too_many_rows():
    q = torch.randn(1, 1, 17, 64)
    codes = pack_bits(torch.zeros(1, 1, 8, 64, dtype=torch.long), 2)
    norm = torch.ones(1, 1, 8, 1, dtype=torch.float16)
    cent = lloyd_max_codebook(64, 2).centroids
    with pytest.raises(ValueError, match="up to 16 query rows"):
        cpu_lut.tq_attention(q, None, codes, norm, cent, 2, codes, norm, cent, 2, 1.0)


# -- Shard: PCA-coefficient keys + VQ values ---------------------------------------------------
def _shard_codecs(kv: int, d: int, key_scope: str, value_scope: str, widths, codebook: int, token_norm: bool):
    """Fitted Shard codecs; `widths` (components, bits) replaces the DP's allocation so every packed
    width (2, 4, 6, 8 bits, odd counts) reaches the kernel."""
    from kvpack.codecs.pca import PCAConfig, PCAKeyCodec
    from kvpack.codecs.vq import VQConfig, VQValueCodec

    kc = PCAKeyCodec(PCAConfig(scope=key_scope), d, kv)
    kc.set_rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.25)
    vc = VQValueCodec(VQConfig(scope=value_scope, codebook_size=codebook, token_norm=token_norm, group_size=4), d, kv)
    gen = torch.Generator().manual_seed(d)
    rank = sum(n for n, _ in widths)
    basis, _ = torch.linalg.qr(torch.randn(kc.groups, kc.group_dim, rank, generator=gen, dtype=torch.float64))
    scale = (basis.abs().amax(1) / 127).half()
    state = {
        "segments": torch.tensor(widths), "mean": torch.randn(kc.groups, kc.group_dim, generator=gen).half(),
        "basis": (basis / scale.double().unsqueeze(1)).round().clamp(-127, 127).to(torch.int8), "basis_scale": scale,
        "coef_scale": (torch.rand(kc.groups, rank, generator=gen) + 0.2).half(),
    }
    kc.load_state_dict(state)
    return kc, vc, gen


@pytest.mark.parametrize("key_scope,value_scope,widths,codebook,token_norm", [
    ("layer", "layer", ((16, 4), (16, 4), (9, 4)), 256, True),
    ("layer", "head", ((5, 2), (7, 6), (3, 8), (9, 4)), 16, False),
    ("head", "layer", ((4, 4), (3, 2), (1, 8)), 256, True),
    # 6-bit (the tiered archive's 64 entries) and 3-bit indices: rows the kernel widens to a byte per index, as
    # one stream where rows end on a byte (d = 64, 96) and row by row where they leave padding bits (3 bits, d = 80)
    ("layer", "layer", ((16, 4), (16, 4)), 64, True),
    ("head", "head", ((8, 4), (6, 2)), 8, False),
])
@pytest.mark.parametrize("b,kv,r,d,t", [(1, 3, 3, 64, 1100), (2, 2, 7, 64, 217), (3, 2, 16, 96, 513), (1, 1, 1, 80, 40)])
def test_pca_vq_attention_matches_decoded_reference(key_scope, value_scope, widths, codebook, token_norm, b, kv, r, d, t):
    """The fused kernel (keys rebuilt per tile, RoPE by a float64 recurrence) against the codecs' own
    decode (unpack, basis matmul, RoPE from float32 angles) followed by plain softmax attention."""
    from kvpack.primitives.rope import apply_rope, rope_cos_sin

    kc, vc, gen = _shard_codecs(kv, d, key_scope, value_scope, widths, codebook, token_norm)
    cap = t + 29  # segments may be token-narrowed views of larger buffers
    pos = torch.arange(cap)[None] + torch.randint(0, 3000, (b, 1), generator=gen)  # a different start per batch row
    cos, sin = rope_cos_sin(pos, kc.rope.inv_freq, kc.rope.scaling)
    keys = apply_rope(torch.randn(b, kv, cap, d, generator=gen) * 2, cos, sin)
    kp, vp = kc.encode(keys, pos), vc.encode(torch.randn(b, kv, cap, d, generator=gen))
    codes, idx, norm = kp.codes[:, :, :t], vp.indices[:, :, :t], None if vp.norm is None else vp.norm[:, :, :t]
    q = torch.randn(b, kv, r, d, generator=gen)
    m, denom, o = cpu_lut.pca_vq_attention(q, pos[:, 0].contiguous(), kc.kernel_state(), codes, vc.kernel_state(), idx, norm, d**-0.5)
    k_ref = kc.decode(type(kp)(cap, kp.codes), pos)[:, :, :t]
    v_ref = vc.decode(type(vp)(cap, vp.indices, vp.norm))[:, :, :t]
    ref = reference.partial_from_scores((q @ k_ref.mT) * d**-0.5, v_ref)
    out = (vc.kernel_output(o) / denom, m + denom.log())
    for a, e in zip(out, _normalized(ref), strict=True):
        # float32 RoPE angles at positions up to ~4K differ from exact phases by ~3e-4 rad
        assert (a - e).abs().max() <= 2e-3 * (1 + e.abs().max())


def _cpu_flags() -> set[str]:
    from pathlib import Path

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_int8_rebuild_follows_the_cpu():
    """The build compiles for this CPU: the VNNI rebuild exactly where the CPU has AVX-512 VNNI (never assumed)."""
    flags = _cpu_flags()
    assert cpu_lut.int8_rebuild() == ({"avx512_vnni", "avx512bw"} <= flags)


@pytest.mark.parametrize("widths", [((16, 4), (16, 4), (9, 4)), ((5, 2), (7, 6), (3, 8), (9, 4)), ((4, 8), (3, 2), (1, 8))])
def test_pca_integer_rebuild_equals_the_float_rebuild(widths):
    """The VNNI path (unsigned codes x the int8 folded basis, one scale per column) against the float path on the
    same segment: the same numbers to float rounding, since the folded basis is exactly int8 x its scales."""
    if not cpu_lut.int8_rebuild():
        pytest.skip("this CPU's build has no integer rebuild (no AVX-512 VNNI)")
    kc, vc, gen = _shard_codecs(3, 64, "layer", "layer", widths, 256, True)
    pos = torch.arange(600)[None] + 1000
    kp = kc.encode(apply_rope_random(kc, pos, gen), pos)
    vp = vc.encode(torch.randn(1, 3, 600, 64, generator=gen))
    keys = kc.kernel_state()
    integer = cpu_lut.int8_basis(keys["basis_t"], keys["mean"], keys["qmax"])
    assert integer is not None and integer["w8"].dtype == torch.int8
    rank = keys["basis_t"].shape[1]
    w = integer["w8"].permute(0, 1, 3, 2).reshape(1, -1, 192)[:, :rank].float()  # back to (groups, rank, gdim)
    assert torch.equal(w * integer["col_scale"][:, None], keys["basis_t"])  # exact: the folded basis is int8 x scale
    q = torch.randn(1, 3, 3, 64, generator=gen)
    args = (kp.codes, vc.kernel_state(), vp.indices, vp.norm, 0.125)
    float_basis = keys["basis_t"]
    got = cpu_lut.pca_vq_attention(q, pos[:, 0].contiguous(), keys, *args)
    # The integer path never reads the float basis, so the codec stops holding it (memory_report counts what is held).
    assert keys["basis_t"].numel() == 0 and kc.state_nbytes() < float_basis.numel() * 4
    ref = cpu_lut.pca_vq_attention(q, pos[:, 0].contiguous(), keys | {"int8": None, "basis_t": float_basis}, *args)
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def apply_rope_random(kc, pos: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random keys `(1, kv, t, d)` RoPE'd at `pos` with the codec's own frequencies."""
    from kvpack.primitives.rope import apply_rope, rope_cos_sin

    cos, sin = rope_cos_sin(pos, kc.rope.inv_freq, kc.rope.scaling)
    return apply_rope(torch.randn(1, kc.kv_heads, pos.shape[1], kc.head_dim, generator=gen) * 2, cos, sin)


def test_int8_basis_refuses_a_basis_that_is_not_int8_per_column():
    """An fp16-style basis (not int8 x one scale per column) gets no integer form: the float rebuild runs."""
    if not cpu_lut.int8_rebuild():
        pytest.skip("this CPU's build has no integer rebuild (no AVX-512 VNNI)")
    basis_t = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(3))
    assert cpu_lut.int8_basis(basis_t, torch.zeros(1, 64), torch.full((12,), 7.0)) is None
    scale = (torch.rand(1, 64) * 4096).round() / 4096 + 0.5  # 12 mantissa bits: int8 x scale is exact in float32
    exact = torch.randint(-127, 128, (1, 12, 64)).float()
    exact[:, 0] = 127  # every column reaches 127, as the codec's fold makes it
    got = cpu_lut.int8_basis(exact * scale[:, None], torch.zeros(1, 64), torch.full((12,), 7.0))
    assert got is not None and torch.equal(got["col_scale"], scale)
    # mean8 turns the unsigned codes (level + 7) back into levels: mean8 = mean - scale * sum_r 7 * w[r]
    torch.testing.assert_close(got["mean8"], -(scale * 7 * exact.sum(1)), rtol=1e-6, atol=1e-3)


def test_softmax_exp_is_accurate_over_the_whole_range():
    """The kernels' vectorized exp (dense_attention over fp32 K/V) against torch's softmax, on scores spread
    over hundreds (std ~50): terms from 1 down to those that underflow float32 to 0."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 4, 64, generator=gen) * 4
    k = torch.randn(1, 2, 300, 64, generator=gen) * 3
    v = torch.randn(1, 2, 300, 64, generator=gen)
    m, denom, o = cpu_lut.dense_attention(q, k, None, v, None, 0.5)
    s = (q @ k.mT) * 0.5
    torch.testing.assert_close(m, s.amax(-1, keepdim=True))
    # Scores of magnitude ~100 carry ~1e-5 of float32 rounding from the dot products' summation order, which exp
    # turns into relative error; a wrong exp (a coefficient off, a bad range reduction) is off by far more.
    torch.testing.assert_close(denom, torch.exp(s - m).sum(-1, keepdim=True), rtol=1e-4, atol=0)
    torch.testing.assert_close(o / denom, torch.softmax(s, -1) @ v, rtol=1e-4, atol=1e-5)


def test_pca_vq_attention_names_the_problem():
    kc, vc, gen = _shard_codecs(2, 64, "layer", "layer", ((16, 4),), 256, False)
    keys, values = torch.randn(1, 2, 8, 64, generator=gen), torch.randn(1, 2, 8, 64, generator=gen)
    pos = torch.arange(8)[None]
    kp, vp = kc.encode(keys, pos), vc.encode(values)
    args = (kc.kernel_state(), kp.codes, vc.kernel_state(), vp.indices, vp.norm, 0.125)
    with pytest.raises(ValueError, match="up to 16 query rows"):
        cpu_lut.pca_vq_attention(torch.randn(1, 2, 17, 64), pos[:, 0], *args)
    with pytest.raises(ValueError, match="k_codes must have shape"):
        cpu_lut.pca_vq_attention(torch.randn(1, 2, 3, 64), pos[:, 0], kc.kernel_state(), kp.codes[..., :3], *args[2:])
    with pytest.raises(ValueError, match="does not cover 3 kv heads"):
        cpu_lut.pca_vq_attention(torch.randn(1, 3, 3, 64), pos[:, 0], *args)


@pytest.mark.parametrize("b,h,r,d", [(1, 3, 3, 64), (2, 2, 7, 80)])
def test_merge_partials_equals_softmax_over_all_tokens(b, h, r, d):
    """Partials of disjoint token ranges (one fully masked) merge into exact softmax attention over all of them."""
    from kvpack.kernels import table

    gen = torch.Generator().manual_seed(r)
    s, v = torch.randn(b, h, r, 300, generator=gen) * 4, torch.randn(b, h, 300, d, generator=gen)
    s[..., 100:140] = float("-inf")  # a masked part: l = 0, contributes nothing
    cuts = [(0, 100), (100, 140), (140, 141), (141, 300)]
    parts = [reference.partial_from_scores(s[..., a:z], v[:, :, a:z]) for a, z in cuts]
    expected = torch.softmax(s, -1) @ v
    assert (table.merge(parts) - expected).abs().max() <= 1e-5 * (1 + expected.abs().max())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(2, 3, 37, 64), (1, 1, 5, 21), (700, 128)])
def test_quantize_pack_equals_bucketize_then_pack(bits, shape):
    """Integer output: exactly torch.bucketize's indices packed by primitives.pack_bits, ties on boundaries included."""
    gen = torch.Generator().manual_seed(bits)
    boundaries = torch.sort(torch.randn(2**bits - 1, generator=gen) * 0.2).values
    y = torch.randn(*shape, generator=gen) * 0.2
    y.view(-1)[:: 7] = boundaries[torch.randint(0, 2**bits - 1, (y.numel() // 7 + 1,), generator=gen)][: y.view(-1)[::7].numel()]
    assert torch.equal(cpu_lut.quantize_pack(y, boundaries, bits), cpu_lut.quantize_pack_reference(y, boundaries, bits))


@pytest.mark.parametrize("g,n,d,k", [(1, 3001, 4, 256), (3, 17, 4, 37), (2, 64, 8, 16), (1, 5, 3, 1)])
def test_nearest_codeword_equals_brute_force_distances(g, n, d, k):
    """Index and squared distance of the nearest codeword against torch.cdist in fp64, with K not a multiple of the
    kernel's 16 lanes, N not a multiple of its 4-point tiles, several groups, and duplicated codewords (the lowest
    index wins a tie, as torch.min's does)."""
    gen = torch.Generator().manual_seed(n)
    x, c = torch.randn(g, n, d, generator=gen), torch.randn(g, k, d, generator=gen)
    if k > 20:
        c[:, 20] = c[:, 3]  # an exact tie between codewords 3 and 20
        x[:, :4] = c[:, 3:4]
    index, dist = cpu_lut.nearest_codeword(x, c)
    exact = torch.cdist(x.double(), c.double()).square()
    best = exact.min(-1)
    torch.testing.assert_close(dist.double(), best.values, atol=1e-5, rtol=1e-5)
    chosen = exact.gather(-1, index[..., None]).squeeze(-1)
    assert (chosen <= best.values + 1e-5).all()
    if k > 20:
        assert (index[:, :4] == 3).all()


@pytest.mark.parametrize("g,n,d,k", [(1, 4096, 4, 256), (3, 500, 4, 17), (2, 7, 8, 7)])
def test_d2_picks_equal_the_torch_seeding(g, n, d, k):
    """k-means++ seeds in C++ against primitives.kmeans.d2_picks fed the same draws: the same indices, including a
    group whose points all coincide (zero weight: uniform draws) and one with a few distinct points."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(g, n, d, generator=gen)
    if g > 1:
        x[0] = 1.0  # every point the same
        x[1] = x[1, torch.randint(0, 3, (n,), generator=gen)]  # three distinct points
    first = torch.randint(0, n, (g,), generator=gen)
    u = torch.rand(g, k - 1, generator=gen, dtype=torch.float64)
    expected = kmeans_d2_picks(x, first, u)
    assert torch.equal(cpu_lut.d2_picks(x, first, u), expected)
    assert expected.min() >= 0 and expected.max() < n


@pytest.mark.parametrize("b,h,r,d,e", [(1, 3, 3, 64, 65), (2, 2, 7, 80, 80), (1, 1, 1, 256, 256)])
def test_head_matmul_equals_float64_product(b, h, r, d, e):
    """The C++ per-head product (and its affine form) against an fp64 einsum; a non-contiguous x is read as its values."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(b, h, d, r, generator=gen).mT  # non-contiguous view
    w, s, bias = torch.randn(h, d, e, generator=gen), torch.rand(b, h, r, 1, generator=gen), torch.randn(h, e, generator=gen)
    plain = torch.einsum("bhrd,hde->bhre", x.double(), w.double())
    assert_fp32_close(cpu_lut.head_matmul(x, w), plain.float())
    assert_fp32_close(cpu_lut.head_matmul(x, w, s, bias), (plain + s.double() * bias.double()[None, :, None]).float())
    if d == e:  # a transposed view (a rotation's inverse) is read through its strides
        assert_fp32_close(cpu_lut.head_matmul(x, w.mT), torch.einsum("bhrd,hed->bhre", x.double(), w.double()).float())


@pytest.mark.parametrize("b,h,r,d", [(1, 3, 3, 64), (2, 2, 7, 128), (1, 1, 1, 256), (1, 2, 2, 8)])
def test_fwht_rows_equals_dense_hadamard_in_float64(b, h, r, d):
    """`FWHT(x ⊙ pre) ⊙ post + s·bias` in C++ against the dense Sylvester matrix (built by its definition
    H_2n = [[H, H], [H, -H]] / sqrt 2) in fp64, with and without each factor."""
    gen = torch.Generator().manual_seed(d)
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < d:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0) / 2**0.5
    x = torch.randn(b, h, r, d, generator=gen)
    pre, post, bias = (torch.randn(h, d, generator=gen) for _ in range(3))
    s = torch.rand(b, h, r, 1, generator=gen)
    def expected(pre_, post_, s_):
        y = (x.double() * (1 if pre_ is None else pre_.double()[None, :, None])) @ hadamard
        y = y * (1 if post_ is None else post_.double()[None, :, None])
        return (y if s_ is None else y + s_.double() * bias.double()[None, :, None]).float()
    for pre_, post_, s_ in [(None, None, None), (pre, None, None), (None, post, s), (pre, post, s)]:
        assert_fp32_close(cpu_lut.fwht_rows(x, pre_, post_, s_, None if s_ is None else bias), expected(pre_, post_, s_))


@pytest.mark.parametrize("rotation", ["hadamard", "qr"])
def test_turboquant_query_and_output_maps_follow_the_fit(rotation):
    """kernel_query = (Π(q⊙σ), q·μ) and kernel_output = (Πᵀo)⊙σ + Σp·μ, written out from the codec's rotation;
    after a refit (new σ, μ) the folded matrices follow the new state instead of a stale copy."""
    codec = TurboQuantCodec(TurboQuantConfig(bits=3, rotation=rotation, center=True, channel_scale=0.5), 64, 3, layer_idx=2)
    gen = torch.Generator().manual_seed(1)
    q, o, denom = torch.randn(1, 3, 4, 64, generator=gen), torch.randn(1, 3, 4, 64, generator=gen), torch.rand(1, 3, 4, 1, generator=gen)
    for shift in (0.0, 3.0):
        codec.fit(torch.randn(1, 3, 200, 64, generator=gen) * torch.linspace(0.1, 4, 64) + shift)
        sigma, mu = codec.scale[None, :, None], codec.mean[None, :, None]
        rot = codec.rotation(torch.device("cpu"))  # (kv, d, d): Πx = rot @ x
        q_rot, offset = codec.kernel_query(q)
        assert_fp32_close(q_rot, (q * sigma) @ rot.mT)
        assert_fp32_close(offset, (q * mu).sum(-1, keepdim=True))
        assert_fp32_close(codec.kernel_output(o, denom), (o @ rot) * sigma + denom * mu)


def test_vq_output_map_is_scale_then_inverse_hadamard():
    """Shard's VQ values: kernel_output(o) = diag(signs)·H·(o⊙scale) per head, from the dense Hadamard matrix."""
    from kvpack.codecs.vq import VQConfig, VQValueCodec
    from kvpack.primitives.rotation import dense_hadamard

    codec = VQValueCodec(VQConfig(), 64, 2, layer_idx=1)
    gen = torch.Generator().manual_seed(2)
    codec.fit(torch.randn(1, 2, 300, 64, generator=gen))
    o = torch.randn(1, 2, 3, 64, generator=gen)
    signs, scale = codec.signs.float()[None, :, None], codec.scale.float()[None, :, None]
    assert_fp32_close(codec.kernel_output(o), ((o * scale) @ dense_hadamard(64, o.device, torch.float32)) * signs)
