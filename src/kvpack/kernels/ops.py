"""kvpack's fused kernels as `torch.library` custom ops, dispatched by device and backend.

Ops (namespace `kvpack`; arguments and results as in `reference.py`, which is their contract; each schema is
written once, in its `define` call below or in its family's file, e.g. `kernels/int4.py`):

    attention partials (m, l, o): tq_attention, int8_attention, kivi_attention, pca_vq_attention, exact_attention,
        int4_attention; each takes `Tensor? bias=None, float softcap=0.` and `Tensor? skip=None` after its inputs
    the step's last stage: exact_merge -> the normalized output (the exact rows' partial merged with the segments')
    encode: tq_encode -> (norm, codes), kivi_encode -> (codes, scale, zero), trellis_encode -> symbols

`define` registers an op once through `torch.library` (its schema, a fake (meta) implementation so
`torch.compile(fullgraph=True)` traces through it, and kernels for the CPU and CUDA dispatch keys, the
pure-torch reference for any other device); torch's dispatcher picks the device, and the registered
kernel then picks the implementation from the backend:

    CUDA: Triton (when importable and the op has a Triton kernel), else the torch reference.
    CPU:  the op's C++ adapter given to `define` (or `kvpack.kernels.cpu_lut.<op name>`) when it takes the
          op's arguments (same parameter names and order as the reference) and `cpu_lut.available()`;
          else the torch reference (a launcher with other parameters is reported once, never called).

A kernel family (`table.py`) defines its op where it is defined, e.g. `kernels/int4.py`. Attention ops take
`skip`, int64 token offsets the partial leaves out (a segment's anchors, held exact in another part): the
C++ kernels skip them, the reference and Triton mask them with a bias (`reference.skip_bias`).

`KVPACK_BACKEND` (or `set_backend`) overrides the choice; see `Backend`. Backends that cannot serve a
call fall back with a one-line warning, once per reason. `run_triton` runs a Triton kernel on CPU
tensors under Triton's interpreter (tests, debugging).
"""

from __future__ import annotations

import functools
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

from ..primitives.validation import DEBUG
from . import cpu_lut, reference


class Backend(str, Enum):
    """Which implementation the ops run (`KVPACK_BACKEND`, `set_backend`)."""

    AUTO = "auto"  # CUDA: Triton when importable, else torch; CPU: the C++ kernel when built, else torch
    TORCH = "torch"  # the pure-torch references everywhere (chunked, bounded temporaries)
    CPU = "cpu"  # the C++ kernels for CPU tensors; CUDA tensors fall back to torch with a warning
    TRITON = "triton"  # Triton for CUDA tensors; CPU tensors only under TRITON_INTERPRET=1, else as "auto"


BACKENDS = tuple(b.value for b in Backend)
_REFERENCES: dict[str, Callable] = {}  # op name -> its pure-torch reference (the contract)
_CPU_ADAPTERS: dict[str, Callable] = {}  # op name -> its C++ kernel behind the op's arguments
_TRITON_MODULES: dict[str, str] = {}  # op name -> the module of this package holding its Triton launcher (same name)
_LIB = torch.library.Library("kvpack", "FRAGMENT")
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
    return _parse_env(os.environ.get("KVPACK_BACKEND", "auto"))


@cache
def _parse_env(value: str) -> Backend:
    """`$KVPACK_BACKEND` parsed once per value: every op call asks (a decode step makes ~100)."""
    return _parse(value or "auto", "KVPACK_BACKEND")


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
        raise ValueError(f"op must be one of the ops with a Triton kernel {tuple(_TRITON_MODULES)}, got {op!r}")
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


def _cpu_kernel(op: str) -> Callable | None:
    """`cpu_lut.<op>` (or its adapter) when it exists, takes the op's arguments and the extension builds; else None."""
    kernel = _CPU_ADAPTERS.get(op) or getattr(cpu_lut, op, None)
    if kernel is None:
        return None
    want = _parameters(_REFERENCES[op])
    if _parameters(kernel) != want:
        _warn_once(f"cpu-signature-{op}", f"kvpack: cpu_lut.{op}{_parameters(kernel)} does not take the op's arguments {want}; using the torch reference")
        return None
    return kernel if cpu_lut.available() else None


def implementation(op: str, device: torch.device) -> Callable:
    """The function that serves `op` for tensors on `device` under the current backend."""
    choice = get_backend()
    ref = _REFERENCES[op]
    if choice is Backend.TORCH:
        return ref
    if device.type == "cuda":
        if choice is Backend.CPU:
            _warn_once("cpu-on-cuda", "kvpack backend 'cpu' has no kernels for CUDA tensors; using the torch reference")
            return ref
        if op not in _TRITON_MODULES:  # an op without a Triton kernel: its reference is its CUDA implementation
            return ref
        if triton_available():
            return getattr(_triton_module(op), op)
        if choice is Backend.TRITON:
            _warn_once("no-triton", "kvpack backend 'triton' requested but Triton is not installed (pip install 'kvpack[triton]'); using the torch reference")
        return ref
    if device.type == "cpu":
        if choice is Backend.TRITON and op in _TRITON_MODULES:
            if os.environ.get("TRITON_INTERPRET") == "1" and triton_available() and _triton_module(op).INTERPRETED:
                return getattr(_triton_module(op), op)
            _warn_once("triton-on-cpu", "kvpack backend 'triton' runs CUDA tensors (CPU tensors only with TRITON_INTERPRET=1); using the CPU path")
        kernel = _cpu_kernel(op)
        if kernel is not None:
            return kernel
        if choice is Backend.CPU:
            _warn_once(f"no-cpu-{op}", f"kvpack backend 'cpu': no C++ kernel for {op} (or the build failed); using the torch reference")
    return ref


def define(name: str, schema: str, reference_fn: Callable, fake: Callable, *, cpu: Callable | None = None,
           triton: str | None = None) -> torch._ops.OpOverload:
    """Register `kvpack::<name><schema>` once and return the op (`torch.ops.kvpack.<name>.default`).

    `reference_fn`: the pure-torch reference, the op's contract (parameters named and ordered as the schema);
    `fake`: shapes and dtypes of the outputs from the inputs' (meta tensors, for `torch.compile`); `cpu`: the C++
    kernel behind the op's arguments, or None (a `cpu_lut.<name>` launcher with those arguments is also taken);
    `triton`: the module of this package whose function `<name>` is the Triton launcher, or None. Each device key
    gets one kernel that picks the implementation under the backend in force (`implementation`)."""
    if name in _REFERENCES:
        raise ValueError(f"op kvpack::{name} is already defined")
    _LIB.define(name + schema)
    _REFERENCES[name] = reference_fn
    if cpu is not None:
        _CPU_ADAPTERS[name] = cpu
    if triton is not None:
        _TRITON_MODULES[name] = triton
    for key, device in (("CPU", torch.device("cpu")), ("CUDA", torch.device("cuda"))):
        _LIB.impl(name, functools.partial(_dispatch, name, device), key)
    _LIB.impl(name, reference_fn, "CompositeExplicitAutograd")  # any other device: the reference
    torch.library.register_fake(f"kvpack::{name}", fake, lib=_LIB)
    return getattr(torch.ops.kvpack, name).default


def _dispatch(name: str, device: torch.device, *args):
    return implementation(name, device)(*args)


_RUN: dict[tuple, Callable] = {}  # (op, device type, backend settings) -> implementation, for `run`


def run(name: str, *args):
    """Op `kvpack::<name>` on `args` (the first a tensor on the device that decides), as the kernel table calls it.

    Under `torch.compile` tracing, the op itself. In eager mode, the implementation the op's registered kernel for
    that device picks (`implementation`), looked up once per backend setting: the same function, without the
    dispatcher's round trip into Python and the per-call choice (~10 us together per call on the test machine; a
    decode step calls ~60 ops on SmolLM2, two per layer)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.kvpack, name).default(*args)
    device = args[0].device
    env = os.environ  # each read ~1 us: only the settings `implementation` consults for this device and backend
    backend = _override if _override is not None else env.get("KVPACK_BACKEND")
    kernels = env.get("KVPACK_KERNELS") if device.type == "cpu" else None
    interpret = env.get("TRITON_INTERPRET") if backend is Backend.TRITON or str(backend).strip().lower() == "triton" else None
    key = (name, device.type, backend, kernels, interpret)
    fn = _RUN.get(key)
    if fn is None:
        fn = _RUN[key] = implementation(name, device)
    return fn(*args)


# -- the ops -----------------------------------------------------------------------------------------
VALIDATE = DEBUG  # the C++ adapters skip the launchers' Python checks (~10 us a call; the C++ side checks layouts)


def partial_fake(q: Tensor, dv: int) -> tuple[Tensor, Tensor, Tensor]:
    b, h, r, _ = q.shape
    return (q.new_empty((b, h, r, 1), dtype=torch.float32), q.new_empty((b, h, r, 1), dtype=torch.float32),
            q.new_empty((b, h, r, dv), dtype=torch.float32))


def _tq_cpu(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, scale, row_offset=None, bias=None,
            softcap=0.0, turn_q=None, turn_pair=None, turn_mu=None, turn_freq=None, turn_pos0=None, skip=None):
    """`cpu_lut.tq_attention` behind the op's arguments. The C++ kernel takes no mask or softcap, up to
    MAX_FUSED_ROWS float32 query rows, widths in LUT_BITS, values of the keys' head_dim and up to 64 turning
    pairs (its own phasor table, from `turn_freq`): other calls (and empty segments) take the reference."""
    turning = (turn_q, turn_pair, turn_mu, turn_freq, turn_pos0)
    if (bias is not None or softcap or q_rot.dtype != torch.float32 or q_rot.shape[2] > cpu_lut.MAX_FUSED_ROWS
            or d != q_rot.shape[-1] or k_bits not in cpu_lut.LUT_BITS or v_bits not in cpu_lut.LUT_BITS or k_codes.shape[2] == 0
            or (turn_pair is not None and turn_pair.shape[-1] > 64)):
        return reference.tq_attention(q_rot, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, d, scale,
                                      row_offset, bias, softcap, *turning, skip)
    turn = None
    if reference.turning_given(*turning):
        if VALIDATE:  # the C++ side checks their shapes too; the cache's own calls skip the Python pass (~20 us)
            reference.check_turning(q_rot, *turning)
        freq, table = cpu_lut.phasor_table(turn_freq)
        turn = (turn_q, turn_pair, turn_mu, freq, table, turn_pos0)
    return cpu_lut.tq_attention(q_rot, row_offset, k_codes, k_norm, k_centroids, k_bits, v_codes, v_norm, v_centroids, v_bits, scale,
                                validate=VALIDATE, skip=skip, turning=turn)


tq_attention = define(
    "tq_attention",
    "(Tensor q_rot, Tensor k_codes, Tensor k_norm, Tensor k_centroids, SymInt k_bits, Tensor v_codes, Tensor v_norm, "
    "Tensor v_centroids, SymInt v_bits, SymInt d, float scale, Tensor? row_offset=None, Tensor? bias=None, float softcap=0., "
    "Tensor? turn_q=None, Tensor? turn_pair=None, Tensor? turn_mu=None, Tensor? turn_freq=None, Tensor? turn_pos0=None, "
    "Tensor? skip=None) -> (Tensor, Tensor, Tensor)",
    reference.tq_attention,
    lambda q_rot, *args: partial_fake(q_rot, args[8]),
    cpu=_tq_cpu,
    triton="triton_attention",
)


tq_paged_attention = define(
    "tq_paged_attention",
    "(Tensor q_rot, Tensor? row_offset, Tensor pool, Tensor block_table, Tensor start, Tensor end, int[] offsets, Tensor k_centroids, "
    "SymInt k_bits, Tensor v_centroids, SymInt v_bits, float scale) -> (Tensor, Tensor, Tensor)",
    reference.tq_paged_attention,
    lambda q_rot, *args: partial_fake(q_rot, q_rot.shape[-1]),
)

int8_paged_attention = define(
    "int8_paged_attention",
    "(Tensor q, Tensor pool, Tensor block_table, Tensor start, Tensor end, int[] offsets, float scale) -> (Tensor, Tensor, Tensor)",
    reference.int8_paged_attention,
    lambda q, *args: partial_fake(q, q.shape[-1]),
)

def _int8_cpu(q, k_codes, k_scale, v_codes, v_scale, scale, bias=None, softcap=0.0, skip=None):
    """`cpu_lut.dense_attention` (int8 rows, fp16 per-token scales) behind the op's arguments; masked,
    softcapped, non-float32 or empty calls take the reference."""
    if bias is not None or softcap or q.dtype != torch.float32 or k_codes.shape[2] == 0:
        return reference.int8_attention(q, k_codes, k_scale, v_codes, v_scale, scale, bias, softcap, skip)
    return cpu_lut.dense_attention(q, k_codes, k_scale, v_codes, v_scale, scale, validate=VALIDATE, skip=skip)


int8_attention = define(
    "int8_attention",
    "(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, float scale, Tensor? bias=None, float softcap=0., "
    "Tensor? skip=None) -> (Tensor, Tensor, Tensor)",
    reference.int8_attention,
    lambda q, k_codes, k_scale, v_codes, *args: partial_fake(q, v_codes.shape[-1]),
    cpu=_int8_cpu,
    triton="triton_attention",
)


def _exact_cpu(q, k, v, scale, bias=None, softcap=0.0, skip=None):
    """`cpu_lut.dense_attention` over fp16 or fp32 rows; other dtypes, masked, softcapped or empty calls take the reference."""
    if (bias is not None or softcap or q.dtype != torch.float32 or k.shape[2] == 0 or k.dtype not in (torch.float16, torch.float32)
            or v.dtype != k.dtype):
        return reference.exact_attention(q, k, v, scale, bias, softcap, skip)
    return cpu_lut.dense_attention(q, k, None, v, None, scale, validate=VALIDATE, skip=skip)


exact_attention = define(
    "exact_attention",
    "(Tensor q, Tensor k, Tensor v, float scale, Tensor? bias=None, float softcap=0., Tensor? skip=None) -> (Tensor, Tensor, Tensor)",
    reference.exact_attention,
    lambda q, k, v, *args: partial_fake(q, v.shape[-1]),
    cpu=_exact_cpu,
)


def _exact_merge_cpu(q, k, v, scale, m, l, o):  # noqa: E741
    """`cpu_lut.exact_merge` over fp16 or fp32 rows; other dtypes and empty rows take the reference."""
    if q.dtype != torch.float32 or k.shape[2] == 0 or k.dtype not in (torch.float16, torch.float32) or v.dtype != k.dtype:
        return reference.exact_merge(q, k, v, scale, m, l, o)
    return cpu_lut.exact_merge(q, k, v, scale, m, l, o)


exact_merge = define(
    "exact_merge",
    "(Tensor q, Tensor k, Tensor v, float scale, Tensor[] m, Tensor[] l, Tensor[] o) -> Tensor",
    reference.exact_merge,
    lambda q, k, v, *args: q.new_empty((*q.shape[:3], v.shape[-1]), dtype=torch.float32),
    cpu=_exact_merge_cpu,
    triton="triton_attention",
)

kivi_attention = define(
    "kivi_attention",
    "(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, SymInt k_bits, SymInt k_group, Tensor v_codes, Tensor v_scale, "
    "Tensor v_zero, SymInt v_bits, SymInt v_group, float scale, Tensor? bias=None, float softcap=0., Tensor? skip=None) "
    "-> (Tensor, Tensor, Tensor)",
    reference.kivi_attention,
    lambda q, k_codes, k_scale, k_zero, k_bits, k_group, v_codes, v_scale, v_zero, v_bits, v_group, *args: partial_fake(q, v_scale.shape[-1] * v_group),
    triton="triton_attention",
)


def _pca_vq_cpu(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits, v_idx, v_norm, scale,
                bias=None, softcap=0.0, w8=None, col_scale=None, mean8=None, skip=None):
    """`cpu_lut.pca_vq_attention` behind the op's flat arguments. The C++ kernel takes no mask or softcap
    and up to MAX_FUSED_ROWS float32 query rows: other calls take the reference."""
    if bias is not None or softcap or q.shape[2] > cpu_lut.MAX_FUSED_ROWS or q.dtype != torch.float32:
        return reference.pca_vq_attention(q, pos0, bitpos, bits, qmax, basis_t, mean, inv_freq, rope_scale, k_codes, books, v_bits,
                                          v_idx, v_norm, scale, bias, softcap, w8, col_scale, mean8, skip)
    integer = None if w8 is None else {"w8": w8, "col_scale": col_scale, "mean8": mean8}
    keys = {"bitpos": bitpos, "bits": bits, "qmax": qmax, "basis_t": basis_t, "mean": mean, "inv_freq": inv_freq,
            "rope_scale": rope_scale, "row_bytes": k_codes.shape[-1], "int8": integer}
    return cpu_lut.pca_vq_attention(q, pos0, keys, k_codes, {"books": books, "bits": v_bits}, v_idx, v_norm, scale, validate=VALIDATE,
                                    skip=skip)


pca_vq_attention = define(
    "pca_vq_attention",
    "(Tensor q, Tensor pos0, Tensor bitpos, Tensor bits, Tensor qmax, Tensor basis_t, Tensor mean, Tensor inv_freq, float rope_scale, "
    "Tensor k_codes, Tensor books, SymInt v_bits, Tensor v_idx, Tensor? v_norm, float scale, Tensor? bias=None, float softcap=0., "
    "Tensor? w8=None, Tensor? col_scale=None, Tensor? mean8=None, Tensor? skip=None) -> (Tensor, Tensor, Tensor)",
    reference.pca_vq_attention,
    lambda q, *args: partial_fake(q, q.shape[-1]),
    cpu=_pca_vq_cpu,
    triton="triton_shard",
)


def _tq_encode_fake(x, mean, inv_scale, signs, boundaries, bits, centroids=None):
    b, h, t, d = x.shape
    return x.new_empty((b, h, t, 1), dtype=torch.float16), x.new_empty((b, h, t, d * bits // 8), dtype=torch.uint8)


tq_encode = define(
    "tq_encode",
    "(Tensor x, Tensor? mean, Tensor? inv_scale, Tensor signs, Tensor boundaries, SymInt bits, Tensor? centroids=None) -> (Tensor, Tensor)",
    reference.tq_encode,
    _tq_encode_fake,
    triton="triton_encode",
)


def _kivi_encode_fake(x, bits, group, axis):
    b, h, t, d = x.shape
    meta = -(-d // group) if axis == "channel" else d // group
    return (x.new_empty((b, h, t, (d * bits + 7) // 8), dtype=torch.uint8), x.new_empty((b, h, t, meta), dtype=torch.float16),
            x.new_empty((b, h, t, meta), dtype=torch.float16))


kivi_encode = define(
    "kivi_encode",
    "(Tensor x, SymInt bits, SymInt group, str axis) -> (Tensor, Tensor, Tensor)",
    reference.kivi_encode,
    _kivi_encode_fake,
    triton="triton_encode",
)

trellis_encode = define(
    "trellis_encode",
    "(Tensor y, Tensor codebook, SymInt bits) -> Tensor",
    reference.trellis_encode,
    lambda y, codebook, bits: y.new_empty(y.shape, dtype=torch.uint8),
    triton="triton_encode",
)
