"""Codec benchmark: real bits per value, distortion next to theory, throughput, inner-product error.

    python -m kvpack.bench.codecs [--out bench/results] [--vectors 8192]

For each codec setting at head_dim 64 and 128: bits/value and bytes/vector from the packed
tensors' real sizes; mean ||x - x̂||² on unit vectors uniform on the sphere and the relative
error ||x - x̂||² / ||x||² on Gaussian vectors; the theoretical optimum where one is defined;
encode / decode / scores throughput (vectors/s, one CPU thread, best of 3 after a warm-up);
and the inner-product error on correlated unit pairs: the RMS error and the slope of the
estimate on the truth (1 = unbiased; the MSE quantizers shrink, slope ≈ 1 - MSE).
Writes JSON rows to `<out>/codecs.json`, a plot to `<out>/codecs.png`, and prints a table.

With the optional peer `turbokv` installed (`pip install "kvpack[peers]"`), `--peer` also times kvpack's
TurboQuant encode against turbokv's `TurboQuantizer.quantize` on the same vectors (head_dim 128, 2 and
4 bits, `--threads` threads), interleaved call by call (A B A B ...) in this process, and writes
`<out>/codecs-encode.json` with the environment stamp. `--trellis` measures bitshift trellis-coded quantization
(a vector quantizer, `kvpack.primitives.trellis`) against the scalar Lloyd-Max optimum and the Shannon bound on the
same unit vectors, to `<out>/codecs-trellis.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from ..primitives import trellis
from ..primitives.lloyd_max import expected_mse
from ..registry import CodecSpec
from .env import environment

# (label, codec, options): the settings the registry's methods use, plus TurboQuant's full range.
SETTINGS: list[tuple[str, str, dict[str, Any]]] = [
    ("fp16", "fp16", {}),
    ("int8", "int8", {}),
    *[(f"turboquant b={b}", "turboquant", {"bits": b}) for b in (1, 2, 3, 4)],
    *[(f"turboquant b={b}+qjl", "turboquant", {"bits": b, "qjl": True}) for b in (2, 3, 4)],
    ("turboquant b=3 hadamard", "turboquant", {"bits": 3, "rotation": "hadamard"}),
    ("polarquant-int4", "polarquant-int4", {}),
    *[(f"qjl r={r}", "qjl", {"sketch_ratio": r}) for r in (1, 2)],
    *[(f"kivi {b}-bit {a}", "kivi", {"bits": b, "axis": a}) for b in (2, 4) for a in ("channel", "token")],
]
PUBLISHED_LARGE_D = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}  # TurboQuant §3.1 (Gaussian Lloyd-Max)


def theory_mse(codec: str, options: dict[str, Any], d: int) -> float | None:
    """Expected ||x - x̂||² on the unit sphere where theory gives it; None otherwise."""
    if codec == "turboquant":
        if not options.get("qjl"):
            return expected_mse(d, options["bits"], "beta")
        # QJL on the residual with a d x d orthogonalized sketch: E||r - r̂||² = (pi/2 - 1) ||r||².
        mse_bits = options["bits"] - 1
        return (math.pi / 2 - 1) * (expected_mse(d, mse_bits, "beta") if mse_bits else 1.0)
    if codec == "polarquant-int4":
        return expected_mse(d, 4, "gaussian")  # before renormalization, which changes it by < 1%
    if codec == "fp16":
        return 0.0
    return None


def _best_seconds(fn, repeats: int = 3) -> float:
    fn()  # warm-up: builds rotations, sketches, codebooks
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _unit(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    return x / x.norm(dim=-1, keepdim=True)


def measure(label: str, codec_name: str, options: dict[str, Any], d: int, n: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(d)
    heads = 8
    codec = CodecSpec(codec_name, options).build(d, heads, layer_idx=0)
    unit = _unit((1, heads, n // heads, d), gen)
    gauss = torch.randn(1, heads, n // heads, d, generator=gen)
    if codec_name == "qjl":
        codec.fit(gauss)
    packed = codec.encode(unit)
    nbytes = codec.nbytes(packed)
    mse_sphere = (codec.decode(packed) - unit).pow(2).sum(-1).mean().item()
    rel_gauss = ((codec.decode(codec.encode(gauss)) - gauss).pow(2).sum(-1) / gauss.pow(2).sum(-1)).mean().item()

    # Inner products on unit pairs with <q, k> spread over [-0.9, 0.9]: scores on the diagonal.
    pairs = 1024
    k = _unit((1, heads, pairs // heads, d), gen)
    u = _unit((1, heads, pairs // heads, d), gen)
    u = u - (u * k).sum(-1, keepdim=True) * k
    u = u / u.norm(dim=-1, keepdim=True)
    rho = torch.empty(1, heads, pairs // heads, 1).uniform_(-0.9, 0.9, generator=gen)
    q = rho * k + (1 - rho**2).sqrt() * u
    est = torch.diagonal(codec.scores(q, codec.encode(k)), dim1=-2, dim2=-1).flatten()
    true = rho.flatten()
    ip_rmse = (est - true).pow(2).mean().sqrt().item()
    ip_slope = ((est * true).sum() / true.pow(2).sum()).item()

    query = torch.randn(1, heads * 4, 1, d, generator=gen)  # one decode step, GQA 4
    t_enc = _best_seconds(lambda: codec.encode(gauss))
    enc = codec.encode(gauss)
    t_dec = _best_seconds(lambda: codec.decode(enc))
    t_scores = _best_seconds(lambda: codec.scores(query, enc))
    theory = theory_mse(codec_name, options, d)
    return {
        "codec": label,
        "name": codec_name,
        "options": options,
        "head_dim": d,
        "bits_per_value": 8 * nbytes / (n * d),
        "bytes_per_vector": nbytes / n,
        "mse_sphere": mse_sphere,
        "theory_mse": theory,
        "mse_vs_theory": mse_sphere / theory if theory else None,
        "rel_mse_gaussian": rel_gauss,
        "ip_rmse": ip_rmse,
        "ip_slope": ip_slope,
        "encode_vec_per_s": n / t_enc,
        "decode_vec_per_s": n / t_dec,
        "scores_keys_per_s": n / t_scores,
        "vectors": n,
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| codec | d | bits/value | B/vector | MSE (sphere) | optimum | rel. MSE (Gauss) | IP RMSE | IP slope "
        "| encode vec/s | decode vec/s | scores keys/s |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        theory = "—" if r["theory_mse"] is None else f"{r['theory_mse']:.4f}"
        lines.append(
            f"| {r['codec']} | {r['head_dim']} | {r['bits_per_value']:.2f} | {r['bytes_per_vector']:.0f} "
            f"| {r['mse_sphere']:.4f} | {theory} | {r['rel_mse_gaussian']:.4f} | {r['ip_rmse']:.4f} | {r['ip_slope']:.3f} "
            f"| {r['encode_vec_per_s']:.3g} | {r['decode_vec_per_s']:.3g} | {r['scores_keys_per_s']:.3g} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, d in zip(axes, (64, 128), strict=True):
        bits = torch.arange(1, 5)
        overhead = 16 / d  # the fp16 norm every rotation codec stores
        ax.plot(bits + overhead, [expected_mse(d, int(b)) for b in bits], "k-", label="Lloyd-Max optimum (b bits + fp16 norm)")
        ax.plot(
            bits + overhead,
            [math.sqrt(3) * math.pi / 2 * 4.0 ** -int(b) for b in bits],
            "k--",
            label="TurboQuant upper bound √3π/2·4^-b",
        )
        ax.plot(bits + overhead, [4.0 ** -int(b) for b in bits], "k:", label="lower bound 4^-b")
        for family, marker in (("turboquant", "o"), ("polarquant-int4", "s"), ("qjl", "^"), ("kivi", "D")):
            pts = [r for r in rows if r["head_dim"] == d and r["name"] == family]
            for r in pts:
                ax.scatter(r["bits_per_value"], r["mse_sphere"], marker=marker, s=40)
                below = "token" in r["codec"] or "hadamard" in r["codec"] or "polarquant" in r["codec"]
                offset = (3, -9) if below else (3, 3)
                ax.annotate(
                    r["codec"], (r["bits_per_value"], r["mse_sphere"]), fontsize=6, xytext=offset, textcoords="offset points"
                )
        ax.set_yscale("log")
        ax.set_xlim(0.8, 5.6)
        ax.set_xlabel("real bits per value (from nbytes)")
        ax.set_title(f"head_dim {d}, unit-sphere vectors (fp16/int8 off-scale)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean ||x - x̂||²")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def encode_vs_turbokv(vectors: int, reps: int = 30, d: int = 128) -> list[dict[str, Any]]:
    """Encode throughput (vectors/s) of kvpack's TurboQuant codec and turbokv's quantizer, interleaved.

    Both get the same float32 vectors (`vectors` x d, Gaussian: neither assumes unit norm) and return
    packed codes plus a norm; kvpack's codec runs as the cache runs it (fit once, then `encode`)."""
    from turboquant import TurboQuantizer

    x = torch.randn(1, 1, vectors, d, generator=torch.Generator().manual_seed(0))
    rows = []
    # The plain codec is turbokv's algorithm; the default method's key codec adds centering and channel scales.
    variants = (("turboquant", {}), ("turboquant, default key codec", {"center": True, "channel_scale": 0.5}))
    for bits, (label, extra) in ((b, v) for b in (2, 4) for v in variants):
        codec = CodecSpec("turboquant", {"bits": bits, **extra}).build(d, 1)
        codec.encode(x[:, :, :256])  # fits its statistics, as a prefill would
        peer = TurboQuantizer(dim=d, bits=bits, device="cpu", seed=0)
        contenders = {"kvpack": lambda c=codec: c.encode(x), "turbokv": lambda q=peer: q.quantize(x[0, 0])}
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for rep in range(reps + 3):
            for name, fn in contenders.items():
                t0 = time.perf_counter()
                fn()
                if rep >= 3:  # warm-up calls untimed
                    times[name].append(time.perf_counter() - t0)
        rate = {k: vectors / (sum(v) / len(v)) for k, v in times.items()}
        p50 = {k: vectors / sorted(v)[len(v) // 2] for k, v in times.items()}
        rows.append({"codec": label, "options": {"bits": bits, **extra}, "head_dim": d, "vectors": vectors, "reps": reps,
                     "kvpack_vec_per_s": rate["kvpack"], "turbokv_vec_per_s": rate["turbokv"], "kvpack_p50_vec_per_s": p50["kvpack"],
                     "turbokv_p50_vec_per_s": p50["turbokv"], "ratio": rate["kvpack"] / rate["turbokv"]})
        print(f"  encode d={d} {bits}-bit {label}: kvpack {rate['kvpack']:,.0f} vec/s, turbokv {rate['turbokv']:,.0f} vec/s, "
              f"{rows[-1]['ratio']:.2f}x", flush=True)
    return rows


TRELLIS = ((2, 8), (2, 10), (3, 9), (3, 11))  # (bits per coordinate k, state bits L)


def trellis_rows(vectors: int, dims: tuple[int, ...] = (64, 128), train: int = 2048) -> list[dict[str, Any]]:
    """Bitshift trellis-coded quantization (`primitives.trellis`) next to the scalar Lloyd-Max codebook at the same k:
    mean ||x - x̂||² of unit vectors uniform on the sphere (the coordinates TurboQuant codes after its rotation), each
    coded as one trellis sequence of d coordinates scaled by sqrt(d) (so ~N(0, 1): the codebook is fitted once on
    Gaussian sequences, not on the test vectors, as a Lloyd-Max table is), against the Lloyd-Max optimum at k bits
    (`expected_mse`) and the Shannon bound 4^-bits at the trellis's own stored bits per value."""
    rows = []
    for k, state_bits in TRELLIS:
        book = trellis.train_codebook(torch.randn(train, 64, generator=torch.Generator().manual_seed(1)), k, state_bits)
        for d in dims:
            unit = _unit((vectors, d), torch.Generator().manual_seed(d))
            start = time.perf_counter()
            states, _ = trellis.viterbi(unit * math.sqrt(d), book, k)
            seconds = time.perf_counter() - start
            rec = trellis.decode(trellis.to_bits(states, k, state_bits), book, k) / math.sqrt(d)
            bits = trellis.bits_per_value(d, k, state_bits)
            mse = (rec - unit).pow(2).sum(-1).mean().item()
            # The tail-biting path a cache stores (TurboQuantConfig.trellis): exactly k bits per value (L a multiple of k).
            mse_tb = math.nan
            if state_bits % k == 0:
                circle = trellis.decode_symbols(trellis.encode_symbols(unit * math.sqrt(d), book, k), book, k) / math.sqrt(d)
                mse_tb = (circle - unit).pow(2).sum(-1).mean().item()
            lloyd = expected_mse(d, k)
            rows.append({"codec": f"trellis k={k} L={state_bits}", "head_dim": d, "bits_per_value": bits, "mse_sphere": mse,
                         "lloyd_max_mse_at_k_bits": lloyd, "vs_lloyd_max": mse / lloyd, "shannon_bound_at_bits": 4.0**-bits,
                         "vs_shannon": mse / 4.0**-bits, "encode_vec_per_s": vectors / seconds, "vectors": vectors,
                         "tail_biting_bits_per_value": k, "tail_biting_mse_sphere": None if math.isnan(mse_tb) else mse_tb, "tail_biting_vs_lloyd_max": None if math.isnan(mse_tb) else mse_tb / lloyd,
                         "tail_biting_vs_shannon": None if math.isnan(mse_tb) else mse_tb / 4.0**-k})
            print(f"  trellis k={k} L={state_bits} d={d}: {bits:.3f} bits/value, MSE {mse:.4f} (Lloyd-Max at {k} bits {lloyd:.4f}, "
                  f"{mse / lloyd:.2f}x; Shannon bound {4.0**-bits:.4f}, {mse / 4.0**-bits:.2f}x); tail-biting at {k} bits {mse_tb:.4f} "
                  f"({mse_tb / lloyd:.2f}x Lloyd-Max, {mse_tb / 4.0**-k:.2f}x the bound)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results", help="folder for codecs.json and codecs.png")
    parser.add_argument("--vectors", type=int, default=8192, help="vectors per measurement (multiple of 256)")
    parser.add_argument("--peer", action="store_true", help="only the encode comparison with turbokv (codecs-encode.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the encode comparison; the codec table uses 1)")
    parser.add_argument("--trellis", action="store_true", help="only trellis-coded quantization vs Lloyd-Max (codecs-trellis.json)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.trellis:
        torch.set_num_threads(args.threads)
        rows = trellis_rows(args.vectors)
        (out / "codecs-trellis.json").write_text(json.dumps({"environment": environment("python -m kvpack.bench.codecs"), "rows": rows}, indent=1))
        return rows
    if args.peer:
        torch.set_num_threads(args.threads)
        rows = encode_vs_turbokv(args.vectors)
        (out / "codecs-encode.json").write_text(json.dumps({"environment": environment("python -m kvpack.bench.codecs"), "rows": rows}, indent=1))
        return rows
    torch.set_num_threads(1)
    rows = []
    for d in (64, 128):
        for label, name, options in SETTINGS:
            rows.append(measure(label, name, options, d, args.vectors))
            print(f"  {label} d={d}: {rows[-1]['bits_per_value']:.2f} bits/value, MSE {rows[-1]['mse_sphere']:.4f}", flush=True)
    (out / "codecs.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "codecs.png")
    print(markdown_table(rows))
    return rows


if __name__ == "__main__":
    main()
