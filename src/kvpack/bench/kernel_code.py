"""What a decode-attention launch compiles to on a GPU, read without one: registers, shared memory and the main loop's
instruction mix of the Triton kernels' machine code for a chosen architecture (sm_90, an H100 or H200, by default).

    python -m kvpack.bench.kernel_code                     # the shipped plans at the shapes of docs/guide/gpu.md
    python -m kvpack.bench.kernel_code --json out.json
    python -m kvpack.bench.kernel_code --set pairs=0 words=0 block_t=64 num_stages=1   # another plan
    python -m kvpack.bench.kernel_code --all      # every shipped launch compiles (run with the GPU's Triton version)

A GPU is lent rarely and briefly; this is how a plan is judged between GPU runs (docs/guide/gpu.md). The launchers in
`kernels/triton_attention.py` run as they would on a GPU, up to the launch itself, which is replaced by a compile for
the target (Triton's `ASTSource`, its bundled `ptxas` and `cuobjdump`; no driver needed). So every constexpr, block
size and stage count is the launcher's own. Reported per launch:

- `shared_bytes`: what the launch asks; more than the target has (227 KB on sm_90) and the launch fails there (the
  launcher then retries with a smaller tile, `_Plan.launch`).
- `registers`, `stack_bytes` (`cuobjdump --dump-resource-usage`): what bounds how many programs share a multiprocessor.
- `loop_instructions` and `per_code`: the longest loop's SASS instructions (the walk over a split's tiles) and warp
  instructions per K and V code of a tile: the work a memory-bound step cannot hide when it is too large.
  `mix`: the loop's most frequent opcodes.

Launches are compiled with the alignment facts a GPU launch would give (pointers aligned to 16 bytes, strides divisible
by 16, as the stand-in tensors' are), so loads widen as they would there. It is the code, not its time: a loop waiting
on memory runs slower than its instruction count says, so plans are compared here and timed on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}  # bytes of shared memory one block may use, by compute capability
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64", torch.uint8: "u8",
           torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


@dataclass
class Launch:
    """One launch's compiled code on the target."""

    kernel: str
    block_t: int
    num_warps: int
    num_stages: int | None
    constexprs: dict
    shared_bytes: int
    registers: int
    stack_bytes: int
    loop_instructions: int
    per_code: float  # warp instructions of the loop per K and V code it reads (tile tokens x (d_k + d_v))
    mix: dict = field(default_factory=dict)
    fits: bool = True


def _tools() -> tuple[Path, Path]:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return bin_dir / "cuobjdump", bin_dir / "ptxas"


def available() -> bool:
    """Whether this Triton can compile for an NVIDIA target here (its NVIDIA backend with `ptxas` and `cuobjdump`)."""
    try:
        cuobjdump, ptxas = _tools()
    except ImportError:
        return False
    return cuobjdump.exists() and ptxas.exists()


def _signature(fn, args: tuple, constexprs: dict) -> tuple[dict[str, str], dict]:
    """Triton's signature of a launch and the alignment facts its launcher would specialize on: pointers aligned to 16
    bytes and integers divisible by 16 (what lets the compiler widen loads)."""
    sig, attrs, pos = {}, {}, iter(args)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        value = next(pos)
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _DTYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            sig[name], aligned = "i1", False
        elif isinstance(value, int):
            sig[name], aligned = ("i64" if abs(value) >= 2**31 else "i32"), value % 16 == 0
        else:
            sig[name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _loop(sass: str) -> list[str]:
    """Instructions of the longest backward branch's body (the kernel's main loop)."""
    lines = [m for m in (re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    addr = [int(m.group(1), 16) for m in lines]
    best = (0, -1)
    for i, m in enumerate(lines):
        target = re.search(r"\bBRA\s+0x([0-9a-f]+)", m.group(2))
        if target and int(target.group(1), 16) < addr[i] and addr[i] - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr[i])
    return [m.group(2) for a, m in zip(addr, lines, strict=True) if best[0] <= a <= best[1]]


def compile_launch(kernel, args: tuple, constexprs: dict, block_t: int, num_warps: int, num_stages: int | None,
                   arch: int = 90) -> Launch:
    """Compile one launch for `sm_<arch>` and read its resources and main loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {**constexprs, "BLOCK_T": block_t}
    sig, attrs = _signature(kernel, args, consts)
    src = ASTSource(kernel, sig, consts, attrs)
    options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump, _ = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    loop = _loop(sass)
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in loop)
    codes = block_t * (consts.get("D", 0) + consts.get("DV", 0))
    shared = compiled.metadata.shared
    return Launch(kernel.fn.__name__, block_t, num_warps, num_stages, {k: v for k, v in consts.items() if not isinstance(v, str) or len(v) < 16},
                  shared, regs, stack, len(loop), len(loop) * num_warps / max(codes, 1), dict(ops.most_common(12)),
                  shared <= SHARED_LIMIT.get(arch, SHARED_LIMIT[90]))


@contextlib.contextmanager
def _capturing(target, overrides: dict | None = None):
    """Within: the attention launchers record each launch into `target` (a list) instead of launching, and accept CPU
    tensors (shapes and dtypes are all a compile needs); `overrides` replace the plan's attributes (another tile, stage
    count or read path), the split length re-derived for another tile."""
    import triton

    from ..kernels import triton_attention as ta

    saved = (ta._Plan.launch, ta._check_device, ta._Plan.finish, ta._Plan.__init__, ta.launch)
    init = ta._Plan.__init__

    def planned(plan, q, t, *a, **k):
        init(plan, q, t, *a, **k)
        for name, value in (overrides or {}).items():
            setattr(plan, name, value)
        plan.split_len = triton.cdiv(t, plan.splits * plan.block_t) * plan.block_t

    def record(plan, kernel, *args, **constexprs):
        target.append((plan, kernel, args, constexprs))

    def record_plain(kernel, grid, *args, num_warps: int = 4, num_stages: int | None = None, **constexprs):
        target.append((SimpleNamespace(block_t=constexprs.pop("BLOCK_T"), num_warps=num_warps, num_stages=num_stages), kernel, args,
                       constexprs))

    ta._Plan.launch, ta._Plan.__init__, ta.launch = record, planned, record_plain
    ta._check_device = lambda t: None
    ta._Plan.finish = lambda plan, m, denom, o: (m, denom, o)
    try:
        yield
    finally:
        ta._Plan.launch, ta._check_device, ta._Plan.finish, ta._Plan.__init__, ta.launch = saved


def _inputs(kind: str, d: int, rows: int, tokens: int, turning: bool, bits: tuple[int, int] = (3, 2)) -> tuple:
    """CPU stand-ins for a launcher's arguments (contents are irrelevant: only shapes, dtypes and flags compile)."""
    from ..primitives.lloyd_max import lloyd_max_codebook
    from ..primitives.packing import packed_length

    b, h = 1, 1
    u8 = lambda n: torch.zeros(b, h, tokens, n, dtype=torch.uint8)  # noqa: E731
    f16 = lambda: torch.ones(b, h, tokens, 1, dtype=torch.float16)  # noqa: E731
    q = torch.zeros(b, h, rows, d)
    if kind == "int8":
        return (q, u8(d).view(torch.int8), f16(), u8(d).view(torch.int8), f16(), d**-0.5), {}
    if kind == "exact":  # the step's last stage: ~300 exact rows in bf16 and two segment partials
        k = torch.zeros(b, h, 300, d, dtype=torch.bfloat16)
        part = (torch.zeros(b, h, rows, 1), torch.zeros(b, h, rows, 1), torch.zeros(b, h, rows, d))
        return (q, k, k.clone(), d**-0.5, *([x, x] for x in part)), {}
    kb, vb = bits
    cent = {n: lloyd_max_codebook(d, n, "gaussian").centroids for n in {kb, vb}}
    kwargs = {}
    if turning:
        pairs = max(1, d // 8)
        kwargs = dict(turn_q=q.clone(), turn_pair=torch.arange(pairs).repeat(h, 1), turn_mu=torch.zeros(h, pairs, 2),
                      turn_freq=torch.ones(d // 2, dtype=torch.float64), turn_pos0=torch.zeros(b, dtype=torch.int64))
    return (q, u8(packed_length(d, kb)), f16(), cent[kb], kb, u8(packed_length(d, vb)), f16(), cent[vb], vb, d, d**-0.5), kwargs


def shipped(kind: str, d: int, rows: int, tokens: int = 32768, turning: bool = False, anchors: bool = False,
            arch: int = 90, overrides: dict | None = None, bits: tuple[int, int] = (3, 2)) -> Launch:
    """The launch the shipped plan makes for one decode step's part: `kind` "tq" (TurboQuant codes of `bits` (key,
    value) widths; the default's k3v2), "int8" or "exact" (`exact_merge`: the exact rows and the merge); `turning`:
    keys centered on a turning mean (`+ropemean`); `anchors`: a skip mask (a bias row); `overrides`: plan attributes
    replaced (`_capturing`)."""
    from ..kernels import triton_attention as ta

    args, kwargs = _inputs(kind, d, rows, tokens, turning, bits)
    if anchors:
        kwargs["skip"] = torch.tensor([0, 5])
    launches: list = []
    with _capturing(launches, overrides):
        {"int8": ta.int8_attention, "exact": ta.exact_merge}.get(kind, ta.tq_attention)(*args, **kwargs)
    plan, kernel, largs, constexprs = launches[0]
    return compile_launch(kernel, largs, constexprs, plan.block_t, plan.num_warps, plan.num_stages, arch)


def compile_all(arch: int = 90, log=print) -> bool:
    """Compile the launch of every shipped plan over head dims 64/80/128/256, 1-63 query rows (decode, GQA groups,
    prefill continuations) and TurboQuant widths 1-4 bits, with and without the turning term; int8 and `exact_merge`
    too. A compiler that refuses one (as Triton 3.6 refused the centroid-pair tile under a 64-row dot) is reported.
    Run it with the GPU's Triton version: the compilers differ (3.9 compiled what 3.6 refused)."""
    ok = True
    for d in (64, 80, 128, 256):
        for rows in (1, 7, 32, 63):
            cases = [("tq", bits, turn) for bits in ((3, 2), (4, 4), (2, 4), (1, 3)) for turn in (False, True)]
            for kind, bits, turn in [*cases, ("int8", (8, 8), False), ("exact", (16, 16), False)]:
                try:
                    launch = shipped(kind, d, rows, tokens=512, turning=turn, anchors=turn, arch=arch, bits=bits)
                    status = "ok" if launch.fits else f"needs {launch.shared_bytes} bytes of shared memory"
                except Exception as e:  # a compiler error: reported, the sweep goes on
                    status = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                ok &= status == "ok"
                if status != "ok":
                    log(f"d={d} rows={rows} {kind} k{bits[0]}v{bits[1]}{' +turning' if turn else ''}: {status}")
    log("every shipped launch compiles" if ok else "some launches do not compile (above)")
    return ok


SHAPES = {"d64-gqa7": (64, 7), "d128-gqa4": (128, 4)}  # head dim, query rows per kv head (Qwen2.5-0.5B, Llama-3-8B)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--all", action="store_true",
                    help="compile every shipped launch over head dims, query rows and widths; exit 1 if one fails")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="replace plan attributes (integers; 0/1 for flags), e.g. --set pairs=0 words=0 block_t=64 num_stages=1")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            ap.error(f"--set takes NAME=INTEGER, got {item!r}")
        overrides[name] = int(value)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    if not available():
        ap.error("this Triton has no NVIDIA backend tools (ptxas, cuobjdump) to compile with")
    if args.all:
        raise SystemExit(0 if compile_all(args.arch) else 1)
    rows = []
    for shape, (d, group) in SHAPES.items():
        for kind, turning, anchors in (("tq", True, True), ("tq", False, False), ("int8", False, False)):
            launch = shipped(kind, d, group, turning=turning, anchors=anchors, arch=args.arch, overrides=overrides)
            row = {"shape": shape, "segment": kind + ("+turning+anchors" if turning else ""), **asdict(launch)}
            rows.append(row)
            print(f"{shape:10s} {row['segment']:20s} t{launch.block_t:<3d} w{launch.num_warps} s{launch.num_stages}  "
                  f"shared {launch.shared_bytes / 1024:6.1f} KB{'' if launch.fits else ' (does not fit)'}  regs {launch.registers:3d}  "
                  f"stack {launch.stack_bytes:3d}  loop {launch.loop_instructions:5d} ins = {launch.per_code:.3f} per code", flush=True)
    if args.json:
        from .env import environment

        args.json.write_text(json.dumps({"environment": environment("python -m kvpack.bench.kernel_code"), "arch": args.arch,
                                         "overrides": overrides, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
