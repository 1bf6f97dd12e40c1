"""Where a model loses under compression: the per-layer K and V sensitivity of `kvpack calibrate` profiles, plotted and summarized.

    python -m kvpack.bench.profile_plot bench/results/profiles/*.json --plot bench/results/profiles.png

One panel per profile: each full-attention layer's KL (nats per scored token, log scale) when only that layer's keys
or only its values are stored by TurboQuant at 2 and 3 bits (everything else lossless). The summary printed per model
names the layers that carry most of the loss at 2 bits and the share of keys in it: a uniform method such as the
default loses where these curves peak, and `auto:<target>` spends its bits there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIDES = ("key", "value")


def table(profile: dict) -> dict[tuple[str, int], list[float]]:
    """{(side, bits): KL per layer in profile["layers"] order} of one profile."""
    out: dict[tuple[str, int], list[float]] = {}
    index = {layer: i for i, layer in enumerate(profile["layers"])}
    for rec in profile["sensitivity"]:
        out.setdefault((rec["side"], rec["bits"]), [0.0] * len(index))[index[rec["layer"]]] = rec["kl"]
    return out


def describe(profile: dict, bits: int = 2, top: int = 3) -> dict:
    """At `bits`: the share of the summed KL that keys carry, and the `top` (layer, side)s with their shares."""
    kl = table(profile)
    cells = [(kl[(side, bits)][i], layer, side) for side in SIDES for i, layer in enumerate(profile["layers"])]
    total = sum(c[0] for c in cells)
    keys = sum(c[0] for c in cells if c[2] == "key")
    worst = sorted(cells, reverse=True)[:top]
    return {"model": profile["model"], "bits": bits, "total_kl": total, "key_share": keys / total if total else float("nan"),
            "layers": len(profile["layers"]), "top": [{"layer": layer, "side": side, "kl": v, "share": v / total} for v, layer, side in worst]}


def plot(profiles: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 3.8), squeeze=False)
    for ax, profile in zip(axes[0], profiles, strict=True):
        kl = table(profile)
        for (side, bits), values in sorted(kl.items()):
            if bits not in sorted(profile["bits"])[:2]:
                continue  # the wider rungs sit near the floor of the measurement; the two narrowest show the shape
            ax.semilogy(profile["layers"], [max(v, 1e-6) for v in values], "o-" if side == "key" else "s--", ms=3,
                        color="tab:blue" if side == "key" else "tab:orange", alpha=1.0 if bits == min(profile["bits"]) else 0.45,
                        label=f"{side}s at {bits} bits")
        cal = profile["calibration"]
        ax.set_title(f"{profile['model']} ({cal['prefix']}-token {cal['text']} prompt)", fontsize=9)
        ax.set_xlabel("layer (full attention)")
        ax.set_ylabel("KL per token, nats (one layer's K or V compressed)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpack.bench.profile_plot", description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", help="profile JSON files written by kvpack calibrate")
    p.add_argument("--plot", help="PNG path")
    p.add_argument("--bits", type=int, default=2, help="width whose losses the summary ranks")
    args = p.parse_args(argv)
    profiles = [json.loads(Path(f).read_text()) for f in args.profiles]
    for profile in profiles:
        if args.bits not in profile["bits"]:
            raise SystemExit(f"{profile['model']}'s profile measured {profile['bits']} bits, not {args.bits}: pass one of them to --bits")
        d = describe(profile, args.bits)
        worst = ", ".join(f"layer {t['layer']} {t['side']}s {100 * t['share']:.0f}%" for t in d["top"])
        print(f"{d['model']}: at {d['bits']} bits everywhere the probes sum to {d['total_kl']:.4f} nats; keys carry {100 * d['key_share']:.0f}%; "
              f"of {d['layers']} layers the largest shares: {worst}")
    if args.plot:
        plot(profiles, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
