"""CPU kernels for compressed-domain decode attention, built from the families in `cpp/` on first use.

TurboQuant (`lut_scores`, `lut_weighted_sum`) never widens codes into a float K or V: scores
read a per-byte table of query x centroid partial sums (nbytes x 256 floats per query row), and
weighted sums scatter p·norm into the transposed table, contracted with the centroids once at
the end. int8 (`int8_scores`, `int8_weighted_sum`) widens one token row at a time in registers.

Every `cpp/*.cpp` file (one kernel family each, over the shared online-softmax header `cpp/softmax.h`) is compiled
into one extension with `torch.utils.cpp_extension.load` (`-O3 -march=native`, OpenMP when the compiler supports it) into torch's extensions directory (`$TORCH_EXTENSIONS_DIR`), once per
CPU feature set, source version and torch build (environments with the same torch share it), announced by one line on stderr; `KVCache(model, ...)` on CPU
triggers it, so it never happens silently inside the first decode step.
Any build failure makes `available()` False, with one warning, and callers keep their torch path.
Each launcher checks shapes and dtypes before the C++ call. The attention kernels' references are the ops' contract
in `reference.py`; the references here are those of the helpers that have no op (scores and weighted sums, encode
steps, k-means).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from ..primitives.kmeans import assign
from ..primitives.kmeans import d2_picks as kmeans_d2_picks
from ..primitives.packing import pack_bits, packed_length
from . import reference

SOURCE_DIR = Path(__file__).with_name("cpp")
SOURCES = tuple(sorted(SOURCE_DIR.glob("*.cpp")))  # one family per file, each adding its functions with KVPACK_BIND
LUT_BITS = (1, 2, 3, 4)
BACKENDS = ("auto", "torch")  # values of $KVPACK_KERNELS
TURN_TILE = 64  # tokens per tile of the turning-mean scores (cpp/tq.cpp kTurnTile): the width of their phasor table


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: `-march=native` builds must not be shared across CPUs."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


_build_errors: list[str] = []  # why the last build attempt failed, for `unavailable_reason()`


def _build_name(openmp: bool) -> str:
    """One build per CPU feature set, source version and torch build: a changed source is a new name, never a silent
    rebuild, and so is another torch (its headers and ABI are compiled in; a torch upgraded in place must not load a
    build made against the old one). Environments and checkouts with the same sources and the same torch share one
    build: a built one is imported directly (`_import_built`), never handed to torch's loader, whose ninja file names
    the building environment's header paths and the sources' paths and would rebuild it in place for any other."""
    digest = hashlib.sha1()
    for path in sorted(SOURCE_DIR.iterdir()):  # the header too: a change anywhere is a new build
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    source = digest.hexdigest()[:8]
    abi = f"{torch.__version__}\0{torch.compiled_with_cxx11_abi()}\0{sys.implementation.cache_tag}"
    env = hashlib.sha1(abi.encode()).hexdigest()[:6]
    return f"kvpack_lut_{_cpu_tag()}_{source}_{env}{'_omp' if openmp else ''}"


def _built_library(name: str) -> Path | None:
    """The built extension's shared library for `name`, or None (torch writes `<name>.so` in its build directory)."""
    home = _build_directory(_build_name(True))  # torch creates the directory of every name it is asked about: ask
    library = home.parent / name / f"{name}.so" if home is not None else None  # for the OpenMP build's only, look beside
    return library if library is not None and library.is_file() else None


def _import_built(name: str, library: Path) -> ModuleType:
    """Import a built extension from its shared library, without torch's loader (which would run ninja first)."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STALE_LOCK_S = 30 * 60  # a build takes minutes; a lock older than this was left by a build that was killed


def _build_directory(name: str) -> Path | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, False))
    except Exception:  # a private torch helper: when it moves, we only lose the stale-lock check
        return None


OWNER = "kvpack-builder"  # beside torch's lock: "<host> <pid>" of the process that started the build


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _owner_gone(directory: Path) -> int | None:
    """The pid named in `directory`'s owner file when it ran on this host and is no longer running, else None."""
    try:
        host, pid = (directory / OWNER).read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return None
    return pid if host == socket.gethostname() and pid != os.getpid() and not _alive(pid) else None


def clear_stale_lock(directory: Path, now: float | None = None) -> str | None:
    """Remove torch's build lock in `directory` when the build that took it is gone; the line to print, or None.

    torch's `load` waits, silently and forever, while `<build dir>/lock` exists: a build killed mid-compile (a SIGTERM,
    a test timeout) leaves it behind, and every later kernel load hangs. kvpack names the building process in an owner
    file beside the lock (`OWNER`), so a lock whose builder ran on this host and has exited is removed at once; one
    without a readable owner (another host sharing the directory, a build started by an older kvpack) when it is older
    than `STALE_LOCK_S`. A younger one may be another process building now, so it is kept and named: the user can tell
    a hang from a wait, and knows which file to delete."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    gone = _owner_gone(directory)
    if gone is not None:
        lock.unlink(missing_ok=True)
        (directory / OWNER).unlink(missing_ok=True)
        return f"kvpack: removed a build lock left by process {gone}, which is no longer running: {lock}"
    if age > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        return f"kvpack: removed a build lock {age / 60:.0f} min old, left by an interrupted build: {lock}"
    return f"kvpack: waiting for another process building its CPU kernels; if none is running, delete {lock}"


def _claim(directory: Path | None) -> Path | None:
    """Name this process as the builder in `directory` when no build holds its lock; the owner file to remove after."""
    if directory is None or (directory / "lock").exists():
        return None
    owner = directory / OWNER
    try:
        owner.write_text(f"{socket.gethostname()} {os.getpid()}")
    except OSError:
        return None
    return owner


def openmp_works() -> bool:
    """Whether the C++ compiler torch builds with (`$CXX`, else `c++`) compiles and links an OpenMP program.

    Decided once before a build, in well under a second, so that only a compiler without OpenMP gets the build without
    it: retrying on any failure of the OpenMP build turned an interrupted build (a killed engine, a timeout) into a
    second build of several minutes."""
    program = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run([os.environ.get("CXX", "c++"), "-fopenmp", "-x", "c++", "-", "-o", str(Path(tmp) / "probe")],
                                  input=program, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def _is_built(name: str) -> bool:
    return _built_library(name) is not None


@cache
def _extension() -> ModuleType | None:
    """Build (or load the cached build of) the extension; None, with one warning, if that fails.

    A build prints one line to stderr before it starts (1.5 minutes on 2 cores, once per CPU, torch build and kvpack
    version): `KVCache(model, ...)` triggers it on CPU, so it never hides inside a decode step."""
    from torch.utils.cpp_extension import load

    errors = _build_errors
    errors.clear()
    # A cached build of either kind is imported without asking the compiler; a new one is built with OpenMP when the
    # compiler has it, else without: one build, never a second after a failed first.
    libraries = {openmp: _built_library(_build_name(openmp)) for openmp in (True, False)}
    openmp = True if libraries[True] else False if libraries[False] else openmp_works()
    name, library = _build_name(openmp), libraries[openmp]
    directory = _build_directory(name)
    message = clear_stale_lock(directory) if directory is not None else None
    if message:
        print(message, file=sys.stderr, flush=True)
    if library is not None:
        try:
            return _import_built(name, library)
        except Exception as e:  # a library that no longer loads: say why and use torch
            errors.append(f"importing {library}: {type(e).__name__}: {str(e).strip()[-300:]}")
    else:
        print(f"kvpack: compiling its CPU kernels for this CPU (once, a few minutes): {name}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        owner = _claim(directory)
        flags = ["-O3", "-march=native", *(["-fopenmp"] if openmp else [])]
        try:
            ext = load(name=name, sources=[str(p) for p in SOURCES], extra_include_paths=[str(SOURCE_DIR)], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"] if openmp else [], verbose=False)
        except Exception as e:  # no compiler, no headers, a linker error, an interrupted build: all mean "use torch"
            errors.append(f"{'with' if openmp else 'without'} OpenMP: {type(e).__name__}: {str(e).strip()[-300:]}")
        else:
            print(f"kvpack: CPU kernels ready ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
            return ext
        finally:
            if owner is not None:
                owner.unlink(missing_ok=True)
    warnings.warn("kvpack CPU kernels unavailable, using the torch path: " + " | ".join(errors), RuntimeWarning, stacklevel=3)
    return None


def extension() -> ModuleType:
    """The built extension (each family's functions by name); RuntimeError when the build failed."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("kvpack CPU kernels failed to build (see the earlier warning); check kvpack.kernels.available() first")
    return ext


def unavailable_reason() -> str | None:
    """None when the extension builds, else the compiler/loader errors (for logs and test skips)."""
    return None if _extension() is not None else " | ".join(_build_errors)


def backend() -> str:
    """`$KVPACK_KERNELS`: "auto" (default: kernels when they build) or "torch" (force the torch path)."""
    return _parse_kernels(os.environ.get("KVPACK_KERNELS", "auto"))


@cache
def _parse_kernels(raw: str) -> str:
    """`$KVPACK_KERNELS` parsed once per value: every op call on CPU asks."""
    value = raw.strip().lower() or "auto"
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
    return extension().lut_scores(q_rot, codes, norm, centroids, bits)


def lut_weighted_sum(p: torch.Tensor, codes: torch.Tensor, norm: torch.Tensor, centroids: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """`Σ_t p[r, t] · norm[t] · centroids[code(t)]` in the rotated space: p (B, H, R, T) f32 -> (B, H, R, d) f32."""
    p = _check("p", p, torch.float32, (None, None, None, None))
    b, h, _, t = p.shape
    codes, norm, centroids = _check_lut(codes, norm, centroids, bits, b, h, d)
    if codes.shape[2] != t:
        raise ValueError(f"p covers {t} tokens but codes hold {codes.shape[2]}")
    return extension().lut_weighted_sum(p, codes, norm, centroids, bits, d)


def int8_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`scale[t] · <q[r], codes[t]>`: q (B, H, R, d) f32, codes (B, H, T, d) i8, scale (B, H, T, 1) f16 -> (B, H, R, T)."""
    q = _check("q", q, torch.float32, (None, None, None, None))
    b, h, _, d = q.shape
    codes = _check("codes", codes, torch.int8, (b, h, None, d))
    scale = _check("scale", scale, torch.float16, (b, h, codes.shape[2], 1))
    return extension().int8_scores(q, codes, scale)


def int8_weighted_sum(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`Σ_t p[r, t] · scale[t] · codes[t]`: p (B, H, R, T) f32, codes (B, H, T, d) i8 -> (B, H, R, d) f32."""
    p = _check("p", p, torch.float32, (None, None, None, None))
    b, h, _, t = p.shape
    codes = _check("codes", codes, torch.int8, (b, h, t, None))
    scale = _check("scale", scale, torch.float16, (b, h, t, 1))
    return extension().int8_weighted_sum(p, codes, scale)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """(B, H, T, n) with contiguous rows and heads at one stride: a capacity buffer narrowed along tokens."""
    return t.dim() == 4 and t.stride(3) == 1 and (t.shape[2] <= 1 or t.stride(2) == t.shape[3]) and (t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1))


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Like `_check`, but a token-narrowed view passes without a copy (the kernels read rows through
    the head stride); anything else is made contiguous."""
    if not isinstance(t, torch.Tensor) or not _rows_contiguous(t):
        return _check(name, t, dtype, shape)
    _check(name, t[:, :, :0], dtype, (*shape[:2], 0, shape[3]))  # device, dtype and shape checks without a copy
    if shape[2] is not None and t.shape[2] != shape[2]:
        raise ValueError(f"{name} must hold {shape[2]} tokens, got {t.shape[2]}")
    return t


def tq_attention(q_rot, row_offset, k_codes, k_norm, k_cent, k_bits: int, v_codes, v_norm, v_cent, v_bits: int, scale: float,
                 validate: bool = True, skip: torch.Tensor | None = None, turning: tuple | None = None):
    """Online-softmax partial over a TurboQuant K/V segment, V accumulated in its rotated space.

    q_rot (B, H, R <= 16, d) f32 (query rotated and scaled for the key codec); row_offset (B, H, R, 1)
    f32 or None, added to raw scores (the key mean's q·μ); codes/norms (B, H, T, ·) as the codecs
    store them (token-narrowed views allowed); s = scale · (norm·<q_rot, c[code]> + row_offset).
    Returns m, l (B, H, R, 1) and o (B, H, R, d) f32: max score, Σ exp(s - m), Σ exp(s - m)·v̂_rot.
    `validate=False` (the cache's own decode calls, whose codecs built these tensors) skips the Python
    checks, ~10 us per call; the C++ side still checks layouts. `skip` (S,) i64: ascending token offsets
    left out of the partial for every row and head (a segment's anchors, kept exact elsewhere), or None.
    `turning`: keys centered on a turning mean (`TurboQuantCodec.kernel_turning`), `(q (B, H, R, d) f32, pair (H, M)
    i64, mu (H, M, 2) f32, freq (d/2,) f64, w (d/2, 2, 64) f32 (`phasor_table`), pos0 (B,) i64)`: each raw score
    also gains `Σ_m A_m cos(θ_m p_t) + B_m sin(θ_m p_t)` (`reference.turning_scores`), or None.
    """
    extra = [] if turning is None else list(turning)
    if not validate:
        off = torch.empty(0) if row_offset is None else row_offset
        return tuple(extension().tq_attention(q_rot, off, k_codes, k_norm, k_cent, k_bits, v_codes, v_norm, v_cent, v_bits, float(scale), _skip(skip),
                                         extra))
    q_rot = _check("q_rot", q_rot, torch.float32, (None, None, None, None))
    b, h, r, d = q_rot.shape
    if r > MAX_FUSED_ROWS:
        raise ValueError(f"tq_attention serves up to {MAX_FUSED_ROWS} query rows per kv head, got {r}")
    off = torch.empty(0) if row_offset is None else _check("row_offset", row_offset, torch.float32, (b, h, r, 1))
    for bits in (k_bits, v_bits):
        if bits not in LUT_BITS:
            raise ValueError(f"bits must be one of {LUT_BITS}, got {bits!r}")
    k_codes = _check_rows("k_codes", k_codes, torch.uint8, (b, h, None, packed_length(d, k_bits)))
    t = k_codes.shape[2]
    k_norm = _check_rows("k_norm", k_norm, torch.float16, (b, h, t, 1))
    v_codes = _check_rows("v_codes", v_codes, torch.uint8, (b, h, t, packed_length(d, v_bits)))
    v_norm = _check_rows("v_norm", v_norm, torch.float16, (b, h, t, 1))
    reference.check_table("k_cent", k_cent, k_bits, k_cent.device)  # (2**bits,) centroids, or a (2**L,) trellis table
    reference.check_table("v_cent", v_cent, v_bits, v_cent.device)
    if turning is not None:
        _check_turning(turning, (b, h, r, d))
    return tuple(extension().tq_attention(q_rot, off, k_codes, k_norm, k_cent, k_bits, v_codes, v_norm, v_cent, v_bits, float(scale),
                                     _checked_skip(skip, t), extra))


def tq_paged_attention(q_rot, row_offset, pool, block_table, start, end, offsets, k_centroids, k_bits: int, v_centroids, v_bits: int, scale: float):
    """`tq_attention` over a paged pool's rows read where they lie, through the block table (`reference.tq_paged_attention`
    has the arguments). q_rot `(B, H, R <= 16, d)` f32, row_offset `(B, H, R, 1)` f32 or None, pool `(blocks, H, bs, C)`
    uint8 contiguous (C even), block_table `(B, M)` int32 or int64, start/end `(B,)`. Block ids inside each sequence's
    range are checked against the pool in C++ (a bad one raises; none is read)."""
    off = torch.empty(0) if row_offset is None else row_offset
    return tuple(extension().tq_paged_attention(q_rot, off, pool, block_table.long(), start.long(), end.long(), [int(o) for o in offsets],
                                                k_centroids, k_bits, v_centroids, v_bits, float(scale)))


def int8_paged_attention(q, pool, block_table, start, end, offsets, scale: float):
    """`dense_attention` over a paged pool's int8 rows read where they lie (`reference.int8_paged_attention` has the
    arguments); q `(B, H, R, d)` f32."""
    return tuple(extension().int8_paged_attention(q, pool, block_table.long(), start.long(), end.long(), [int(o) for o in offsets], float(scale)))


def _check_turning(turning: tuple, q_shape: tuple[int, int, int, int]) -> None:
    """The `turning` tensors' dtypes and shapes against the query's `(B, H, R, d)`."""
    if len(turning) != 6:
        raise ValueError(f"turning takes 6 tensors (q, pair, mu, freq, w, pos0), got {len(turning)}")
    b, h, _, d = q_shape
    q, pair = turning[0], turning[1]
    m = pair.shape[-1] if pair.dim() == 2 else -1
    if not 0 < m <= min(64, d // 2):
        raise ValueError(f"turning pair must be (H, M) with 0 < M <= {min(64, d // 2)}, got {tuple(pair.shape)}")
    for name, t, dtype, shape in (("q", q, torch.float32, q_shape), ("pair", pair, torch.int64, (h, m)),
                                  ("mu", turning[2], torch.float32, (h, m, 2)), ("freq", turning[3], torch.float64, (d // 2,)),
                                  ("w", turning[4], torch.float32, (d // 2, 2, TURN_TILE)), ("pos0", turning[5], torch.int64, (b,))):
        _check(f"turning {name}", t, dtype, shape)
    if bool(((pair < 0) | (pair >= d // 2)).any()):
        raise ValueError(f"turning pair indices must lie in [0, {d // 2})")


def _skip(skip: torch.Tensor | None) -> torch.Tensor:
    return _NONE_I64 if skip is None else skip


def _checked_skip(skip: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """`skip` as the kernels take it: ascending distinct int64 offsets into the `tokens` of the call."""
    if skip is None:
        return _NONE_I64
    skip = _check("skip", skip, torch.long, (None,))
    if skip.numel() and (int(skip.min()) < 0 or int(skip.max()) >= tokens or not bool((skip[1:] > skip[:-1]).all())):
        raise ValueError(f"skip must hold ascending, distinct token offsets in [0, {tokens}), got {skip.tolist()}")
    return skip


DENSE_DTYPES = (torch.int8, torch.float16, torch.float32)


def dense_attention(q, k, k_scale, v, v_scale, scale: float, validate: bool = True, skip: torch.Tensor | None = None):
    """Online-softmax partial over dense K/V: int8 with per-token fp16 scales, or fp16/fp32 (scales None).

    q (B, H, R, d) f32 (any R); k (B, H, T, d), v (B, H, T, dv) of one dtype in DENSE_DTYPES (token-narrowed
    views allowed); k_scale, v_scale (B, H, T, 1) f16 or None. Returns m, l (B, H, R, 1), o (B, H, R, dv) f32.
    `validate=False`, `skip`: as in `tq_attention`.
    """
    if not validate:
        none = torch.empty(0)
        return tuple(extension().dense_attention(q, k, none if k_scale is None else k_scale, v, none if v_scale is None else v_scale, float(scale),
                                            _skip(skip)))
    q = _check("q", q, torch.float32, (None, None, None, None))
    b, h, _, d = q.shape
    if not isinstance(k, torch.Tensor) or k.dtype not in DENSE_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must share one dtype of {DENSE_DTYPES}, got {getattr(k, 'dtype', type(k))} and {getattr(v, 'dtype', type(v))}")
    k = _check_rows("k", k, k.dtype, (b, h, None, d))
    t = k.shape[2]
    v = _check_rows("v", v, v.dtype, (b, h, t, None))
    ks = torch.empty(0) if k_scale is None else _check_rows("k_scale", k_scale, torch.float16, (b, h, t, 1))
    vs = torch.empty(0) if v_scale is None else _check_rows("v_scale", v_scale, torch.float16, (b, h, t, 1))
    return tuple(extension().dense_attention(q, k, ks, v, vs, float(scale), _checked_skip(skip, t)))


_NONE, _NONE_I8 = torch.empty(0), torch.empty(0, dtype=torch.int8)  # "no integer form" for the C++ call
_NONE_I64 = torch.empty(0, dtype=torch.long)  # "skip no token"


def int8_rebuild() -> bool:
    """Whether the built kernels rebuild Shard's keys with integer (VNNI) products: chosen when the
    extension compiles for this CPU (`-march=native`), so an AVX2-only CPU keeps the float rebuild."""
    return available() and bool(extension().int8_rebuild())


def int8_basis(basis_t: torch.Tensor, mean: torch.Tensor, qmax: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """basis_t `(groups, rank, gdim)` f32 as int8 x one scale per column, for the VNNI rebuild; None when it is
    not exactly that (an fp16 basis) or the kernels have no integer rebuild.

    A column's scale is its largest magnitude / 127 (exact for `PCAKeyCodec`'s folded basis, whose scales carry
    12 mantissa bits). Returns w8 `(groups, ceil(rank / 4), gdim, 4)` int8 (4 consecutive components per column,
    zero-padded: VPDPBUSD's operand layout), col_scale `(groups, gdim)` f32 and mean8 = mean - col_scale ·
    Σ_r qmax[r] w8[r] `(groups, gdim)` f32, which makes the unsigned codes' product equal the levels'.
    """
    if not int8_rebuild():
        return None
    groups, rank, gdim = basis_t.shape
    col_scale = basis_t.abs().amax(1) / 127  # (groups, gdim)
    w = (basis_t / col_scale[:, None].clamp_min(torch.finfo(torch.float32).tiny)).round()
    if w.abs().max() > 127 or not torch.equal(w * col_scale[:, None], basis_t):
        return None
    rank4 = -(-rank // 4)
    w8 = torch.zeros(groups, 4 * rank4, gdim, dtype=torch.int8)
    w8[:, :rank] = w.to(torch.int8)
    mean8 = mean.double() - col_scale.double() * (qmax.double()[None, :, None] * w.double()).sum(1)
    return {"w8": w8.view(groups, rank4, 4, gdim).permute(0, 1, 3, 2).contiguous(), "col_scale": col_scale.contiguous(),
            "mean8": mean8.float().contiguous()}


def pca_integer_form(keys: dict) -> dict[str, torch.Tensor] | None:
    """`keys["int8"]` of a `PCAKeyCodec.kernel_state()`: the basis' integer form (`int8_basis`, or None), derived on the
    first call. A codec's kernel_state() is cached per fit, so this memoizes there. The integer rebuild never reads
    the float basis, so it is dropped (4x the stored int8 basis; memory_report counts what a codec holds): the
    reference and Triton rebuild it from the integer form (`reference.pca_basis_t`)."""
    if "int8" not in keys:
        keys["int8"] = int8_basis(keys["basis_t"], keys["mean"], keys["qmax"])
        if keys["int8"] is not None:
            keys["basis_t"] = _NONE
    return keys["int8"]


def pca_vq_attention(q, pos0, keys: dict, k_codes, v_state: dict, v_idx, v_norm, scale: float, validate: bool = True,
                     skip: torch.Tensor | None = None):
    """Online-softmax partial over a Shard segment: PCA-coefficient keys (RoPE undone) and VQ values.

    q (B, kv, R <= 16, d) f32, the model's RoPE'd query grouped by kv head; pos0 (B,) i64, the RoPE
    position of the segment's first token per batch row; `keys` from `PCAKeyCodec.kernel_state()`
    (bitpos (rank,) i32, bits (rank,) u8, qmax (rank,) f32, basis_t (groups, rank, gdim) f32, mean
    (groups, gdim) f32, inv_freq (d/2,) f32, rope_scale float, row_bytes int); k_codes (B, groups, T, nbytes) u8;
    `v_state` from `VQValueCodec.kernel_state()` (books (1 or kv, entries, gsize) f16 or f32, bits int);
    v_idx (B, kv, T, vbytes) u8; v_norm (B, kv, T, 1) f16 or None. Token-narrowed views allowed. `keys` gains
    "int8" (`int8_basis`, or None) on the first call, so the integer form is derived once per codec fit.
    Returns m, l (B, kv, R, 1) and o (B, kv, R, d) f32, o in VQ's rotated, channel-normalized space.
    `validate=False`, `skip`: as in `tq_attention`.
    """
    integer = pca_integer_form(keys)
    integer = (integer["w8"], integer["col_scale"], integer["mean8"]) if integer is not None else (_NONE_I8, _NONE, _NONE)
    if not validate:
        norm = torch.empty(0) if v_norm is None else v_norm
        return tuple(extension().pca_vq_attention(q, pos0, keys["inv_freq"], float(keys["rope_scale"]), k_codes, keys["bitpos"], keys["bits"],
                                             keys["qmax"], keys["basis_t"], keys["mean"], v_idx, int(v_state["bits"]), norm,
                                             v_state["books"], float(scale), *integer, _skip(skip)))
    q = _check("q", q, torch.float32, (None, None, None, None))
    b, kv, r, d = q.shape
    if r > MAX_FUSED_ROWS:
        raise ValueError(f"pca_vq_attention serves up to {MAX_FUSED_ROWS} query rows per kv head, got {r}")
    mean = _check("mean", keys["mean"], torch.float32, (None, None))
    (groups, gdim), rank = mean.shape, keys["qmax"].numel()
    if groups < 1 or kv % groups or gdim != kv // groups * d:
        raise ValueError(f"mean {tuple(mean.shape)} (groups, gdim) does not cover {kv} kv heads of {d} dims")
    basis_t = keys["basis_t"]
    if keys["int8"] is None:
        basis_t = _check("basis_t", basis_t, torch.float32, (groups, rank, gdim))
    k_codes = _check_rows("k_codes", k_codes, torch.uint8, (b, groups, None, keys["row_bytes"]))
    t = k_codes.shape[2]
    books = v_state["books"]
    books = _check("books", books, torch.float16 if books.dtype == torch.float16 else torch.float32, (None, None, None))
    vbits = v_state["bits"]
    if vbits not in range(1, 9) or d % books.shape[2]:
        raise ValueError(f"VQ bits must be 1..8 and the group size must divide {d}, got {vbits} and {books.shape[2]}")
    v_idx = _check_rows("v_idx", v_idx, torch.uint8, (b, kv, t, packed_length(d // books.shape[2], vbits)))
    norm = torch.empty(0) if v_norm is None else _check_rows("v_norm", v_norm, torch.float16, (b, kv, t, 1))
    return tuple(
        extension().pca_vq_attention(
            q, _check("pos0", pos0, torch.long, (b,)), _check("inv_freq", keys["inv_freq"], torch.float32, (d // 2,)),
            float(keys["rope_scale"]), k_codes, _check("bitpos", keys["bitpos"], torch.int32, (rank,)),
            _check("bits", keys["bits"], torch.uint8, (rank,)), _check("qmax", keys["qmax"], torch.float32, (rank,)),
            basis_t, mean, v_idx, int(vbits), norm, books, float(scale), *integer,
            _checked_skip(skip, t),
        )
    )


def exact_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ms: list[torch.Tensor], ls: list[torch.Tensor],
                os_: list[torch.Tensor]) -> torch.Tensor:
    """`merge_partials` of [`dense_attention` over fp16 / fp32 rows `k`, `v` `(B, H, T, d)`, *parts] in one call: the
    normalized attention `(B, H, R, dv)` f32 (`reference.exact_merge`). q `(B, H, R, d)` f32; the parts' m, l
    `(B, H, R, 1)`, o `(B, H, R, dv)` f32."""
    return extension().exact_merge(q, k, v, float(scale), list(ms), list(ls), list(os_))


def merge_partials(ms: list[torch.Tensor], ls: list[torch.Tensor], os_: list[torch.Tensor]) -> torch.Tensor:
    """Normalized attention `(B, H, R, d)` f32 from parts' partials m, l `(B, H, R, 1)`, o `(B, H, R, d)` f32:
    `Σ_i e^(m_i - M) o_i / Σ_i e^(m_i - M) l_i` with `M = max_i m_i` (one call instead of ~10 torch ops)."""
    return extension().merge_partials(list(ms), list(ls), list(os_))


def quantize_pack(y: torch.Tensor, boundaries: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_bits(torch.bucketize(y, boundaries), bits)` in one pass: y (..., d) f32, boundaries (2**bits - 1,)
    f32 sorted -> (..., ceil(d * bits / 8)) u8."""
    if not isinstance(y, torch.Tensor) or y.dim() < 1:
        raise ValueError(f"y must be a float32 tensor (..., d), got {type(y).__name__}")
    y = _check("y", y, torch.float32, (None,) * y.dim())
    if bits not in range(1, 9):
        raise ValueError(f"bits must be in 1..8, got {bits!r}")
    boundaries = _check("boundaries", boundaries, torch.float32, (2**bits - 1,))
    return extension().quantize_pack(y, boundaries, bits)


def quantize_pack_reference(y: torch.Tensor, boundaries: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_bits(torch.bucketize(y, boundaries).to(torch.uint8), bits)


def tq_encode(x: torch.Tensor, mean: torch.Tensor | None, inv_scale: torch.Tensor | None, signs: torch.Tensor,
              boundaries: torch.Tensor, bits: int, centroids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.tq_encode` in C++, one pass per row: x (B, H, T, d) float -> (norm (B, H, T, 1) f16, codes
    (B, H, T, d·bits/8) u8). The Hadamard runs as butterflies where the reference multiplies by the dense matrix, so a
    coordinate within float32 rounding of a boundary may take the neighbouring code. Falls back to the torch reference
    off the CPU or without the kernels."""
    if not (available() and isinstance(x, torch.Tensor) and x.device.type == "cpu"):
        return reference.tq_encode(x, mean, inv_scale, signs, boundaries, bits, centroids)
    reference.check_tq_encode(x, mean, inv_scale, signs, boundaries, bits, centroids)
    norm, codes = extension().tq_encode(x.float(), _NONE if mean is None else mean, _NONE if inv_scale is None else inv_scale,
                                        signs, boundaries, bits, _NONE if centroids is None else centroids.contiguous(),
                                        reference.MATCH_FLOOR)
    return norm, codes


def trellis_encode(y: torch.Tensor, codebook: torch.Tensor, bits: int) -> torch.Tensor:
    """`reference.trellis_encode` in C++: y (..., n) float -> (..., n) uint8 `bits`-bit symbols of tail-biting paths
    through the bitshift trellis of a `(2**L,)` state codebook (the same two Viterbi passes, float32 costs, sixteen rows
    in lockstep, blocks of rows in parallel). Falls back to the torch reference off the CPU or without the kernels."""
    if not (available() and isinstance(y, torch.Tensor) and y.device.type == "cpu"):
        return reference.trellis_encode(y, codebook, bits)
    reference.check_trellis_encode(y, codebook, bits)  # (2**L,) with L a multiple of bits, up to 12: what the C++ search takes
    flat = y.float().reshape(-1, y.shape[-1])
    return extension().trellis_encode(flat, codebook.float().contiguous(), bits).view(y.shape)


def nearest_codeword(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest codeword of each point: x (G, N, D), centroids (G, K, D) f32 -> index (G, N) i64, squared distance
    (G, N) f32 (ties to the lowest index). k-means' assignment step and VQ's encode; falls back to the torch
    reference (`primitives.kmeans.assign`) off the CPU or without the kernels."""
    if not (available() and x.device.type == "cpu" and centroids.device.type == "cpu"):
        return nearest_codeword_reference(x, centroids)
    x = _check("x", x.float(), torch.float32, (None, None, None))
    g, _, d = x.shape
    centroids = _check("centroids", centroids.float().contiguous(), torch.float32, (g, None, d))
    index, dist = extension().nearest_codeword(x, centroids)
    return index, dist


def nearest_codeword_reference(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return assign(x, centroids)


def d2_picks(x: torch.Tensor, first: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """k-means++ seed indices from pre-drawn uniforms (`primitives.kmeans.d2_picks`, same arguments, same picks):
    x (G, N, D) f32, first (G,) i64, u (G, k - 1) f64 -> (G, k) i64. Falls back to the torch reference off the CPU
    or without the kernels."""
    if not (available() and x.device.type == "cpu"):
        return d2_picks_reference(x, first, u)
    x = _check("x", x.float(), torch.float32, (None, None, None))
    first = _check("first", first, torch.int64, (x.shape[0],))
    u = _check("u", u, torch.float64, (x.shape[0], None))
    return extension().d2_picks(x, first, u)


def d2_picks_reference(x: torch.Tensor, first: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return kmeans_d2_picks(x, first, u)


# Multiply-adds up to which `head_matmul` / `fwht_rows` run on the calling thread (a decode step's few rows per
# head); larger products (big batches, prompt chunks) go to torch's threaded ops.
SERIAL_MAX_MACS = 1 << 21


def _serial(x: torch.Tensor, macs: int) -> bool:
    """Whether a per-head product over `x` runs in C++ on the calling thread: small, float32, on the CPU, kernels built.
    A torch matmul opens a parallel region per call, and under load each one waited for a preempted thread (two per
    layer step cost the default half its speed on a busy machine, docs/notes/speed.md)."""
    return macs <= SERIAL_MAX_MACS and x.device.type == "cpu" and x.dtype == torch.float32 and available()


def serial_rows(heads: int, d: int) -> int:
    """How many query rows of `heads` heads of size d `fwht_rows` and `head_matmul` (to at most d outputs) take in C++
    on the calling thread: past it they run torch's matmul, which rounds differently."""
    return max(1, SERIAL_MAX_MACS // (heads * d * max(d, d.bit_length())))


def head_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w[h] (+ s * bias[h])` per head: x (B, H, R, D), w (H, D, E) (any strides), s (B, H, R, 1), bias (H, E) -> (B, H, R, E) f32."""
    if not (_serial(x, x.numel() * w.shape[-1]) and w.dtype == torch.float32):
        return head_matmul_reference(x, w, s, bias)
    if s is None:
        return extension().head_matmul(x, w, _NONE, _NONE)
    return extension().head_matmul(x, w, s.float(), bias.float())


def head_matmul_reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x.float() @ w.unsqueeze(0)
    return out if s is None else out + s.float() * bias.float()[None, :, None, :]


def fwht_rows(x: torch.Tensor, pre: torch.Tensor | None = None, post: torch.Tensor | None = None, s: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """`FWHT(x ⊙ pre[h]) ⊙ post[h] (+ s · bias[h])`: x (B, H, R, D) f32 (D a power of two), pre, post, bias (H, D) f32,
    s (B, H, R, 1) -> (B, H, R, D) f32, FWHT orthonormal (`primitives.rotation.fwht`). The query and output maps of
    Hadamard-rotated codecs: in C++ on the calling thread for decode rows, holding no dense matrix."""
    d = x.shape[-1]
    if not _serial(x, x.numel() * max(1, d.bit_length())):
        return fwht_rows_reference(x, pre, post, s, bias)
    none = _NONE
    return extension().fwht_rows(x, none if pre is None else pre.float(), none if post is None else post.float(),
                            none if s is None else s.float(), none if bias is None else bias.float())


def fwht_rows_reference(x, pre=None, post=None, s=None, bias=None) -> torch.Tensor:
    from ..primitives.rotation import fwht

    y = fwht(x.float() if pre is None else x.float() * pre.float()[None, :, None, :])
    y = y if post is None else y * post.float()[None, :, None, :]
    return y if s is None else y + s.float() * bias.float()[None, :, None, :]


MAX_FUSED_ROWS = 16


# -- RoPE phasors of the turning-mean scores ----------------------------------------------------------------
_PHASORS: dict[int, tuple] = {}  # id(inv_freq) -> (weak reference to it, freq, table)


def phasor_table(inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(freq (d/2,) float64, table (d/2, 2, TURN_TILE) float32)` for a layer's rotary `inv_freq (d/2,)`: the table holds
    `cos(jθ), sin(jθ)` for j < TURN_TILE, what the turning-mean kernel multiplies each tile's phasors by. Kept per
    `inv_freq` tensor while it lives (the model's own, shared by its layers: 4 KB at d = 64), like a codebook, and
    found by identity, so a decode step pays no hashing of values."""
    hit = _PHASORS.get(id(inv_freq))
    if hit is None or hit[0]() is not inv_freq:
        freq = inv_freq.detach().double().cpu().contiguous()
        phase = freq[:, None] * torch.arange(TURN_TILE, dtype=torch.float64)
        key = id(inv_freq)
        hit = _PHASORS[key] = (weakref.ref(inv_freq, lambda _, key=key, held=_PHASORS: held.pop(key, None)), freq,
                               torch.stack((phase.cos(), phase.sin()), dim=1).float().contiguous())
    return hit[1], hit[2]


# -- references of the helpers without an op (the attention kernels' are the ops' in reference.py) ---------
def lut_scores_reference(q_rot, codes, norm, centroids, bits: int) -> torch.Tensor:
    return (q_rot @ reference.code_values(codes, centroids, bits, q_rot.shape[-1]).mT) * norm.float().mT


def lut_weighted_sum_reference(p, codes, norm, centroids, bits: int, d: int) -> torch.Tensor:
    return (p * norm.float().mT) @ reference.code_values(codes, centroids, bits, d)


def int8_scores_reference(q, codes, scale) -> torch.Tensor:
    return (q @ codes.float().mT) * scale.float().mT


def int8_weighted_sum_reference(p, codes, scale) -> torch.Tensor:
    return (p * scale.float().mT) @ codes.float()
