"""CPU kernels for compressed-domain decode attention, built from `lut_kernels.cpp` on first use.

TurboQuant (`lut_scores`, `lut_weighted_sum`) never widens codes into a float K or V: scores
read a per-byte table of query x centroid partial sums (nbytes x 256 floats per query row), and
weighted sums scatter p·norm into the transposed table, contracted with the centroids once at
the end. int8 (`int8_scores`, `int8_weighted_sum`) widens one token row at a time in registers.

The extension is compiled with `torch.utils.cpp_extension.load` (`-O3 -march=native`, OpenMP
when the compiler supports it) into torch's extensions directory (`$TORCH_EXTENSIONS_DIR`).
Any build failure makes `available()` False, with one warning, and callers keep their torch path.
Each launcher checks shapes and dtypes before the C++ call; the references here are the codecs'
torch math (unpack, look up, matmul) that the tests hold the kernels to.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from ..primitives.packing import packed_length, unpack_bits

SOURCE = Path(__file__).with_name("lut_kernels.cpp")
LUT_BITS = (1, 2, 3, 4)
BACKENDS = ("auto", "torch")  # values of $KVPACK_KERNELS


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: `-march=native` builds must not be shared across CPUs."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


_build_errors: list[str] = []  # why the last build attempt failed, for `unavailable_reason()`


@cache
def _extension() -> ModuleType | None:
    """Build (or load the cached build of) the extension; None, with one warning, if that fails."""
    from torch.utils.cpp_extension import load

    errors = _build_errors
    errors.clear()
    for openmp in (True, False):
        flags = ["-O3", "-march=native", *(["-fopenmp"] if openmp else [])]
        try:
            return load(
                name=f"kvpack_lut_{_cpu_tag()}{'_omp' if openmp else ''}",
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if openmp else [],
                verbose=False,
            )
        except Exception as e:  # no compiler, no headers, a linker error: all mean "use torch"
            errors.append(f"{'with' if openmp else 'without'} OpenMP: {type(e).__name__}: {str(e).strip()[-300:]}")
    warnings.warn("kvpack CPU kernels unavailable, using the torch path: " + " | ".join(errors), RuntimeWarning, stacklevel=3)
    return None


def _ext() -> ModuleType:
    ext = _extension()
    if ext is None:
        raise RuntimeError("kvpack CPU kernels failed to build (see the earlier warning); check kvpack.kernels.available() first")
    return ext


def unavailable_reason() -> str | None:
    """None when the extension builds, else the compiler/loader errors (for logs and test skips)."""
    return None if _extension() is not None else " | ".join(_build_errors)


def backend() -> str:
    """`$KVPACK_KERNELS`: "auto" (default: kernels when they build) or "torch" (force the torch path)."""
    value = os.environ.get("KVPACK_KERNELS", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"KVPACK_KERNELS must be one of {BACKENDS}, got {value!r}")
    return value


def available() -> bool:
    """True when the kernels should run: not forced off by `KVPACK_KERNELS=torch` and the build works."""
    return backend() != "torch" and _extension() is not None


# -- launchers ---------------------------------------------------------------------------------
def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """`t` contiguous on CPU, with `dtype` and `shape` (None entries are free); ValueError otherwise."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=True)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    return t.contiguous()


def _check_lut(codes, norm, centroids, bits: int, b: int, h: int, d: int) -> tuple[torch.Tensor, ...]:
    if bits not in LUT_BITS:
        raise ValueError(f"bits must be one of {LUT_BITS}, got {bits!r}")
    codes = _check("codes", codes, torch.uint8, (b, h, None, packed_length(d, bits)))
    t = codes.shape[2]
    return codes, _check("norm", norm, torch.float16, (b, h, t, 1)), _check("centroids", centroids, torch.float32, (2**bits,))


def lut_scores(q_rot: torch.Tensor, codes: torch.Tensor, norm: torch.Tensor, centroids: torch.Tensor, bits: int) -> torch.Tensor:
    """`norm[t] · <q_rot[r], centroids[code(t)]>`: q_rot (B, H, R, d) f32, codes (B, H, T, ceil(d·bits/8)) u8,
    norm (B, H, T, 1) f16, centroids (2**bits,) f32 -> (B, H, R, T) f32."""
    q_rot = _check("q_rot", q_rot, torch.float32, (None, None, None, None))
    b, h, _, d = q_rot.shape
    codes, norm, centroids = _check_lut(codes, norm, centroids, bits, b, h, d)
    return _ext().lut_scores(q_rot, codes, norm, centroids, bits)


def lut_weighted_sum(p: torch.Tensor, codes: torch.Tensor, norm: torch.Tensor, centroids: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """`Σ_t p[r, t] · norm[t] · centroids[code(t)]` in the rotated space: p (B, H, R, T) f32 -> (B, H, R, d) f32."""
    p = _check("p", p, torch.float32, (None, None, None, None))
    b, h, _, t = p.shape
    codes, norm, centroids = _check_lut(codes, norm, centroids, bits, b, h, d)
    if codes.shape[2] != t:
        raise ValueError(f"p covers {t} tokens but codes hold {codes.shape[2]}")
    return _ext().lut_weighted_sum(p, codes, norm, centroids, bits, d)


def int8_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`scale[t] · <q[r], codes[t]>`: q (B, H, R, d) f32, codes (B, H, T, d) i8, scale (B, H, T, 1) f16 -> (B, H, R, T)."""
    q = _check("q", q, torch.float32, (None, None, None, None))
    b, h, _, d = q.shape
    codes = _check("codes", codes, torch.int8, (b, h, None, d))
    scale = _check("scale", scale, torch.float16, (b, h, codes.shape[2], 1))
    return _ext().int8_scores(q, codes, scale)


def int8_weighted_sum(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`Σ_t p[r, t] · scale[t] · codes[t]`: p (B, H, R, T) f32, codes (B, H, T, d) i8 -> (B, H, R, d) f32."""
    p = _check("p", p, torch.float32, (None, None, None, None))
    b, h, _, t = p.shape
    codes = _check("codes", codes, torch.int8, (b, h, t, None))
    scale = _check("scale", scale, torch.float16, (b, h, t, 1))
    return _ext().int8_weighted_sum(p, codes, scale)


# -- references (the codecs' torch math) -------------------------------------------------------
def lut_centroids_reference(codes: torch.Tensor, centroids: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """`(B, H, T, d)` float32 centroids read from packed codes."""
    return centroids[unpack_bits(codes, bits, d).long()]


def lut_scores_reference(q_rot, codes, norm, centroids, bits: int) -> torch.Tensor:
    return (q_rot @ lut_centroids_reference(codes, centroids, bits, q_rot.shape[-1]).mT) * norm.float().mT


def lut_weighted_sum_reference(p, codes, norm, centroids, bits: int, d: int) -> torch.Tensor:
    return (p * norm.float().mT) @ lut_centroids_reference(codes, centroids, bits, d)


def int8_scores_reference(q, codes, scale) -> torch.Tensor:
    return (q @ codes.float().mT) * scale.float().mT


def int8_weighted_sum_reference(p, codes, scale) -> torch.Tensor:
    return (p * scale.float().mT) @ codes.float()
