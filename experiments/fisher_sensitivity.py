"""How well does the Fisher calibration (`kvpack calibrate --mode fisher`) predict what the probes measure?

    python experiments/fisher_sensitivity.py --model smollm2-135m --json bench/results/fisher-sensitivity-smollm2-135m.json

Reads a Fisher profile made on the probe profile's own prompt (same text, prefix, scored tokens: the defaults of
both modes) and compares, per (layer, side, width), its raw second-order prediction and its final sensitivity (after
the per-layer key probe and the measured totals) with the probe profile's measured KL: Spearman's rho over all cells and per
(side, width), and the ratio of the raw predictions' sum to the measured sum (below 1: the diagonal Fisher leaves
out how a code's errors correlate within a vector and across tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime_sensitivity import parse, spearman

ROOT = Path(__file__).resolve().parents[1]


def compare(probe: dict, fisher: dict) -> dict:
    """rho and ratio of the Fisher profile's raw predictions ('fisher') and sensitivities ('kl') against the probes' KL."""
    measured = {(r["layer"], r["side"], r["bits"]): r["kl"] for r in probe["sensitivity"]}
    rows = {(r["layer"], r["side"], r["bits"]): r for r in fisher["sensitivity"]}
    cells = sorted(measured)
    out = {"rho_raw": {"all": spearman([rows[c]["fisher"] for c in cells], [measured[c] for c in cells])},
           "rho_profile": {"all": spearman([rows[c]["kl"] for c in cells], [measured[c] for c in cells])}, "ratio_raw": {}}
    for side in ("key", "value"):
        for bits in probe["bits"]:
            sub = [c for c in cells if c[1:] == (side, bits)]
            name = f"{side[0]}{bits}"
            out["rho_raw"][name] = spearman([rows[c]["fisher"] for c in sub], [measured[c] for c in sub])
            out["rho_profile"][name] = spearman([rows[c]["kl"] for c in sub], [measured[c] for c in sub])
            out["ratio_raw"][name] = sum(rows[c]["fisher"] for c in sub) / max(sum(measured[c] for c in sub), 1e-30)
    worst = {"fisher": sorted(probe["layers"], key=lambda lay: -rows[(lay, "key", 2)]["kl"])[:5],
             "probe": sorted(probe["layers"], key=lambda lay: -measured[(lay, "key", 2)])[:5]}
    return out | {"worst_keys_at_2_bits": worst}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from kvpack.bench.env import environment

    args = parse(__doc__, argv, threads=2, fisher={"help": "Fisher profile (default: bench/results/profiles-fisher/<model>.json)"})
    results = ROOT / "bench" / "results"
    probe = json.loads(Path(args.profile or results / "profiles" / f"{args.model}.json").read_text())
    fisher = json.loads(Path(args.fisher or results / "profiles-fisher" / f"{args.model}.json").read_text())
    same = ("text", "prefix", "tokens", "offset", "dtype")
    if any(probe["calibration"][k] != fisher["calibration"][k] for k in same) or probe["bits"] != fisher["bits"]:
        raise SystemExit(f"the two profiles were calibrated on different prompts or widths (compare {same} and bits); make the Fisher one with "
                         f"kvpack calibrate --model {args.model} --mode fisher and the probe profile's --text/--prefix/--tokens/--offset")
    result = compare(probe, fisher)
    seconds = {mode: {"seconds": p["calibration"]["seconds"], "threads": p["calibration"]["torch_threads"]} for mode, p in (("probes", probe), ("fisher", fisher))}
    print(f"{args.model}: Fisher calibration {seconds['fisher']}, probes {seconds['probes']}")
    for key in ("rho_raw", "rho_profile", "ratio_raw"):
        print(f"  {key}: " + ", ".join(f"{c} {v:.2f}" for c, v in result[key].items()))
    print(f"  worst keys at 2 bits: Fisher {result['worst_keys_at_2_bits']['fisher']}, probes {result['worst_keys_at_2_bits']['probe']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment("python experiments/fisher_sensitivity.py", argv), "config": vars(args),
                                               "seconds": seconds, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
