"""kvpack's fused kernels as `torch.library` custom ops, dispatched by device and backend.

Ops (namespace `kvpack`; arguments and results as in `reference.py`, which is their contract):

    kvpack::tq_attention(Tensor q_rot, Tensor k_codes, Tensor k_norm, Tensor k_centroids, SymInt k_bits,
        Tensor v_codes, Tensor v_norm, Tensor v_centroids, SymInt v_bits, SymInt d, float scale,
        Tensor? row_offset=None, Tensor? bias=None, float softcap=0., Tensor? turn_q=None, Tensor? turn_pair=None,
        Tensor? turn_mu=None, Tensor? turn_freq=None, Tensor? turn_pos0=None) -> (Tensor m, Tensor l, Tensor o)
    kvpack::int8_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale,
        float scale, Tensor? bias=None, float softcap=0.) -> (Tensor m, Tensor l, Tensor o)
    kvpack::kivi_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, SymInt k_bits,
        SymInt k_group, Tensor v_codes, Tensor v_scale, Tensor v_zero, SymInt v_bits, SymInt v_group,
        float scale, Tensor? bias=None, float softcap=0.) -> (Tensor m, Tensor l, Tensor o)
    kvpack::pca_vq_attention(Tensor q, Tensor pos0, Tensor bitpos, Tensor bits, Tensor qmax, Tensor basis_t,
        Tensor mean, Tensor inv_freq, float rope_scale, Tensor k_codes, Tensor books, SymInt v_bits,
        Tensor v_idx, Tensor? v_norm, float scale, Tensor? bias=None, float softcap=0.) -> (Tensor m, Tensor l, Tensor o)
    kvpack::tq_encode(Tensor x, Tensor? mean, Tensor? inv_scale, Tensor signs, Tensor boundaries,
        SymInt bits) -> (Tensor norm, Tensor codes)
    kvpack::kivi_encode(Tensor x, SymInt bits, SymInt group, str axis) -> (Tensor codes, Tensor scale, Tensor zero)
    kvpack::trellis_encode(Tensor y, Tensor codebook, SymInt bits) -> Tensor symbols

Each op has a fake (meta) implementation, so `torch.compile(fullgraph=True)` traces through it, and
one Python body that picks an implementation per call from the tensors' device and the backend:

    CUDA: Triton (when importable), else the torch reference.
    CPU:  `kvpack.kernels.cpu_lut.<op name>` when that C++ kernel exists, takes the op's arguments
          (same parameter names and order as the reference) and `cpu_lut.available()`; else the
          torch reference (a launcher with other parameters is reported once, never called).
          `cpu_lut.pca_vq_attention` takes the codecs' state dicts, so `_pca_vq_cpu` adapts it.

`KVPACK_BACKEND` (or `set_backend`) overrides the choice; see `Backend`. Backends that cannot serve a
call fall back with a one-line warning, once per reason. `run_triton` runs a Triton kernel on CPU
tensors under Triton's interpreter (tests, debugging).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable
from enum import Enum
from functools import cache
from types import ModuleType

import torch
from torch import Tensor

from . import cpu_lut, reference


class Backend(str, Enum):
    """Which implementation the ops run (`KVPACK_BACKEND`, `set_backend`)."""

    AUTO = "auto"  # CUDA: Triton when importable, else torch; CPU: the C++ kernel when built, else torch
    TORCH = "torch"  # the pure-torch references everywhere (chunked, bounded temporaries)
    CPU = "cpu"  # the C++ kernels for CPU tensors; CUDA tensors fall back to torch with a warning
    TRITON = "triton"  # Triton for CUDA tensors; CPU tensors only under TRITON_INTERPRET=1, else as "auto"


BACKENDS = tuple(b.value for b in Backend)
_TRITON_MODULES = {"tq_attention": "triton_attention", "int8_attention": "triton_attention",
                   "kivi_attention": "triton_attention", "pca_vq_attention": "triton_shard", "tq_encode": "triton_encode",
                   "kivi_encode": "triton_encode", "trellis_encode": "triton_encode"}
_override: Backend | None = None
_warned: set[str] = set()


def _parse(name: str, source: str) -> Backend:
    value = str(name).strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return Backend(value)


def set_backend(name: str | Backend | None) -> None:
    """Force a backend for every later call ("auto" | "torch" | "cpu" | "triton"); None restores
    `$KVPACK_BACKEND` (default "auto")."""
    global _override
    _override = None if name is None else _parse(name.value if isinstance(name, Backend) else name, "backend")


def get_backend() -> Backend:
    """The backend in force: `set_backend`'s choice, else `$KVPACK_BACKEND`, else "auto"."""
    if _override is not None:
        return _override
    return _parse(os.environ.get("KVPACK_BACKEND", "auto") or "auto", "KVPACK_BACKEND")


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


@cache
def triton_available() -> bool:
    """True when `triton` imports (the kernels themselves compile on first use)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (missing libcuda, wrong Python) means "no Triton"
        return False
    return True


def _triton_module(op: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{_TRITON_MODULES[op]}")


def run_triton(op: str, *args, **kwargs):
    """Run op `op`'s Triton kernel directly (no backend choice): compiled on CUDA tensors, by Triton's
    interpreter on CPU tensors. Extra keywords go to the launcher (e.g. `num_splits=3`).

    The interpreter needs TRITON_INTERPRET=1 before `triton` is first imported (Triton decorates its
    own `tl.zeros`, `tl.sum`... at import), e.g. at the top of a test module.
    """
    if op not in _TRITON_MODULES:
        raise ValueError(f"op must be one of {tuple(_TRITON_MODULES)}, got {op!r}")
    if not triton_available():
        raise ImportError("Triton is not installed: pip install 'kvpack[triton]'")
    device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
    module = _triton_module(op)
    if device.type != "cuda" and not module.INTERPRETED:
        raise RuntimeError(f"Triton kernels run {device} tensors only under Triton's interpreter: set TRITON_INTERPRET=1 before triton is first imported")
    return getattr(module, op)(*args, **kwargs)


@cache
def _parameters(fn: Callable) -> tuple[str, ...]:
    """Positional parameter names of `fn` (keyword-only extras such as `compute_dtype` excluded)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)


def _pca_vq_cpu(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm, scale,
                bias=None, softcap=0.0):
    """`cpu_lut.pca_vq_attention` behind the op's flat arguments. The C++ kernel takes no mask or softcap
    and up to MAX_FUSED_ROWS float32 query rows: other calls take the reference."""
    if bias is not None or softcap or q.shape[2] > cpu_lut.MAX_FUSED_ROWS or q.dtype != torch.float32:
        return reference.pca_vq_attention(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits,
                                          v_idx, v_norm, scale, bias, softcap)
    keys = {"bitpos": bitpos, "bits": bits, "qmax": qmax, "basis_t": basis_t, "mean": mean, "inv_freq": inv_freq,
            "rope_scale": rope_scale, "row_bytes": k_codes.shape[-1]}
    return cpu_lut.pca_vq_attention(q, pos0, keys, k_codes, {"books": books, "bits": v_bits}, v_idx, v_norm, scale)


def _tq_cpu(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, scale, row_offset=None, bias=None,
            softcap=0.0, turn_q=None, turn_pair=None, turn_mu=None, turn_freq=None, turn_pos0=None):
    """`cpu_lut.tq_attention` behind the op's arguments. The C++ kernel takes no mask or softcap, up to
    MAX_FUSED_ROWS float32 query rows, widths in LUT_BITS, values of the keys' head_dim and up to 64 turning
    pairs (its own phasor table, from `turn_freq`): other calls (and empty segments) take the reference."""
    turning = (turn_q, turn_pair, turn_mu, turn_freq, turn_pos0)
    if (bias is not None or softcap or q_rot.dtype != torch.float32 or q_rot.shape[2] > cpu_lut.MAX_FUSED_ROWS
            or d != q_rot.shape[-1] or k_bits not in cpu_lut.LUT_BITS or v_bits not in cpu_lut.LUT_BITS or k_codes.shape[2] == 0
            or (turn_pair is not None and turn_pair.shape[1] > 64)):
        return reference.tq_attention(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, scale,
                                      row_offset, bias, softcap, *turning)
    reference.check_turning(q_rot, *turning)
    turn = None
    if turn_q is not None:
        freq, table = cpu_lut.phasor_table(turn_freq)
        turn = (turn_q, turn_pair, turn_mu, freq, table, turn_pos0)
    return cpu_lut.tq_attention(q_rot, row_offset, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, scale,
                                turning=turn)


def _int8_cpu(q, k_codes, k_scale, v_codes, v_scale, scale, bias=None, softcap=0.0):
    """`cpu_lut.dense_attention` (int8 rows, fp16 per-token scales) behind the op's arguments; masked,
    softcapped, non-float32 or empty calls take the reference."""
    if bias is not None or softcap or q.dtype != torch.float32 or k_codes.shape[2] == 0:
        return reference.int8_attention(q, k_codes, k_scale, v_codes, v_scale, scale, bias, softcap)
    return cpu_lut.dense_attention(q, k_codes, k_scale, v_codes, v_scale, scale)


# Ops whose C++ launcher takes other arguments than the op.
_CPU_ADAPTERS = {"pca_vq_attention": _pca_vq_cpu, "tq_attention": _tq_cpu, "int8_attention": _int8_cpu}


def _cpu_kernel(op: str) -> Callable | None:
    """`cpu_lut.<op>` (or its adapter) when it exists, takes the op's arguments and the extension builds; else None."""
    kernel = _CPU_ADAPTERS.get(op) or getattr(cpu_lut, op, None)
    if kernel is None:
        return None
    want = _parameters(getattr(reference, op))
    if _parameters(kernel) != want:
        _warn_once(f"cpu-signature-{op}", f"kvpack: cpu_lut.{op}{_parameters(kernel)} does not take the op's arguments {want}; using the torch reference")
        return None
    return kernel if cpu_lut.available() else None


def implementation(op: str, device: torch.device) -> Callable:
    """The function that serves `op` for tensors on `device` under the current backend."""
    choice = get_backend()
    if choice is Backend.TORCH:
        return getattr(reference, op)
    if device.type == "cuda":
        if choice is Backend.CPU:
            _warn_once("cpu-on-cuda", "kvpack backend 'cpu' has no kernels for CUDA tensors; using the torch reference")
            return getattr(reference, op)
        if triton_available():
            return getattr(_triton_module(op), op)
        if choice is Backend.TRITON:
            _warn_once("no-triton", "kvpack backend 'triton' requested but Triton is not installed (pip install 'kvpack[triton]'); using the torch reference")
        return getattr(reference, op)
    if device.type == "cpu":
        if choice is Backend.TRITON:
            if os.environ.get("TRITON_INTERPRET") == "1" and triton_available() and _triton_module(op).INTERPRETED:
                return getattr(_triton_module(op), op)
            _warn_once("triton-on-cpu", "kvpack backend 'triton' runs CUDA tensors (CPU tensors only with TRITON_INTERPRET=1); using the CPU path")
        kernel = _cpu_kernel(op)
        if kernel is not None:
            return kernel
        if choice is Backend.CPU:
            _warn_once(f"no-cpu-{op}", f"kvpack backend 'cpu': no C++ kernel for {op} (or the build failed); using the torch reference")
    return getattr(reference, op)


# -- the ops -----------------------------------------------------------------------------------------
def _partial_fake(q: Tensor, dv: int) -> tuple[Tensor, Tensor, Tensor]:
    b, h, r, _ = q.shape
    return (q.new_empty((b, h, r, 1), dtype=torch.float32), q.new_empty((b, h, r, 1), dtype=torch.float32),
            q.new_empty((b, h, r, dv), dtype=torch.float32))


@torch.library.custom_op("kvpack::tq_attention", mutates_args=())
def tq_attention(
    q_rot: Tensor,
    k_codes: Tensor,
    k_norm: Tensor,
    k_centroids: Tensor,
    k_bits: int,
    v_codes: Tensor,
    v_norm: Tensor,
    v_centroids: Tensor,
    v_bits: int,
    d: int,
    scale: float,
    row_offset: Tensor | None = None,
    bias: Tensor | None = None,
    softcap: float = 0.0,
    turn_q: Tensor | None = None,
    turn_pair: Tensor | None = None,
    turn_mu: Tensor | None = None,
    turn_freq: Tensor | None = None,
    turn_pos0: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Partial attention over TurboQuant MSE codes (`reference.tq_attention`; `turn_*`: keys centered on a turning
    mean): -> (m, l, o) float32."""
    fn = implementation("tq_attention", q_rot.device)
    return fn(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, scale, row_offset, bias, softcap,
              turn_q, turn_pair, turn_mu, turn_freq, turn_pos0)


@tq_attention.register_fake
def _(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, scale, row_offset=None, bias=None, softcap=0.0,
      turn_q=None, turn_pair=None, turn_mu=None, turn_freq=None, turn_pos0=None):
    return _partial_fake(q_rot, d)


@torch.library.custom_op("kvpack::int8_attention", mutates_args=())
def int8_attention(
    q: Tensor,
    k_codes: Tensor,
    k_scale: Tensor,
    v_codes: Tensor,
    v_scale: Tensor,
    scale: float,
    bias: Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Partial attention over per-token int8 K/V (`reference.int8_attention`): -> (m, l, o) float32."""
    return implementation("int8_attention", q.device)(q, k_codes, k_scale, v_codes, v_scale, scale, bias, softcap)


@int8_attention.register_fake
def _(q, k_codes, k_scale, v_codes, v_scale, scale, bias=None, softcap=0.0):
    return _partial_fake(q, v_codes.shape[-1])


@torch.library.custom_op("kvpack::kivi_attention", mutates_args=())
def kivi_attention(
    q: Tensor,
    k_codes: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    k_bits: int,
    k_group: int,
    v_codes: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    v_bits: int,
    v_group: int,
    scale: float,
    bias: Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Partial attention over KIVI keys (per channel) and values (per token) (`reference.kivi_attention`)."""
    fn = implementation("kivi_attention", q.device)
    return fn(q, k_codes, k_scale, k_zero, k_bits, k_group, v_codes, v_scale, v_zero, v_bits, v_group, scale, bias, softcap)


@kivi_attention.register_fake
def _(q, k_codes, k_scale, k_zero, k_bits, k_group, v_codes, v_scale, v_zero, v_bits, v_group, scale, bias=None, softcap=0.0):
    return _partial_fake(q, v_scale.shape[-1] * v_group)


@torch.library.custom_op("kvpack::pca_vq_attention", mutates_args=())
def pca_vq_attention(
    q: Tensor,
    pos0: Tensor,
    bitpos: Tensor,
    bits: Tensor,
    qmax: Tensor,
    basis_t: Tensor,
    mean: Tensor,
    inv_freq: Tensor,
    rope_scale: float,
    k_codes: Tensor,
    books: Tensor,
    v_bits: int,
    v_idx: Tensor,
    v_norm: Tensor | None,
    scale: float,
    bias: Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Partial attention over a Shard segment, PCA keys without RoPE and VQ values (`reference.pca_vq_attention`)."""
    fn = implementation("pca_vq_attention", q.device)
    return fn(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm, scale, bias, softcap)


@pca_vq_attention.register_fake
def _(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm, scale, bias=None, softcap=0.0):
    return _partial_fake(q, q.shape[-1])


@torch.library.custom_op("kvpack::tq_encode", mutates_args=())
def tq_encode(
    x: Tensor,
    mean: Tensor | None,
    inv_scale: Tensor | None,
    signs: Tensor,
    boundaries: Tensor,
    bits: int,
) -> tuple[Tensor, Tensor]:
    """TurboQuant MSE encode (`reference.tq_encode`): -> (norm (B, H, T, 1) f16, codes (B, H, T, d·bits/8) u8)."""
    return implementation("tq_encode", x.device)(x, mean, inv_scale, signs, boundaries, bits)


@tq_encode.register_fake
def _(x, mean, inv_scale, signs, boundaries, bits):
    b, h, t, d = x.shape
    return x.new_empty((b, h, t, 1), dtype=torch.float16), x.new_empty((b, h, t, d * bits // 8), dtype=torch.uint8)


@torch.library.custom_op("kvpack::kivi_encode", mutates_args=())
def kivi_encode(x: Tensor, bits: int, group: int, axis: str) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI encode (`reference.kivi_encode`): -> (codes u8, scale f16, zero f16), the codec's layout."""
    return implementation("kivi_encode", x.device)(x, bits, group, axis)


@kivi_encode.register_fake
def _(x, bits, group, axis):
    b, h, t, d = x.shape
    meta = -(-d // group) if axis == "channel" else d // group
    return (x.new_empty((b, h, t, (d * bits + 7) // 8), dtype=torch.uint8), x.new_empty((b, h, t, meta), dtype=torch.float16),
            x.new_empty((b, h, t, meta), dtype=torch.float16))


@torch.library.custom_op("kvpack::trellis_encode", mutates_args=())
def trellis_encode(y: Tensor, codebook: Tensor, bits: int) -> Tensor:
    """Trellis-coded TurboQuant symbols (`reference.trellis_encode`): y (..., n) -> (..., n) uint8 of a tail-biting path."""
    return implementation("trellis_encode", y.device)(y, codebook, bits)


@trellis_encode.register_fake
def _(y, codebook, bits):
    return y.new_empty(y.shape, dtype=torch.uint8)
