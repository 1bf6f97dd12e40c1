"""Draw the README's plot: perplexity change against compression for the methods of one results table.

    python scripts/plot_readme.py                       # the SmolLM2 8K table -> bench/results/pareto-smollm2-135m-8k.png
    python scripts/plot_readme.py --table qwen-8k --out /tmp/qwen.png

The methods and the result file are those of the README's table (`[table.ID]` in docs/readme/figures.toml), so
the plot and the table read the same rows. The default is a star with a bold label; each label is placed where it
overlaps no other label and no point (the first free spot of a ring of offsets around its point).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_readme  # noqa: E402

from kvpack import DEFAULT_METHOD as DEFAULT  # noqa: E402  (the star: the default's row of the table)

PEER, OURS, BASE, STAR = "tab:orange", "tab:blue", "gray", "tab:red"
# Label offsets in points, tried in order: right, left, above, below, then the diagonals further out.
OFFSETS = [(8, -4), (-8, -4), (0, 9), (0, -15), (8, 8), (-8, 8), (8, -16), (-8, -16), (14, 16), (-14, 16), (14, -24), (-14, -24),
           (24, -4), (-24, -4), (0, 22), (0, -28)]


def _label(method: str) -> str:
    return {"dynamic": "uncompressed", DEFAULT: "default"}.get(method, method)


def _color(method: str) -> str:
    return BASE if method == "dynamic" else PEER if method.startswith("hf-") else OURS


def place_labels(ax, points: list[tuple[float, float, str, dict]]) -> None:
    """Annotate each (x, y, text, style) at the first offset whose box overlaps no placed label and no point."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    taken = [Bbox.from_extents(px - 5, py - 5, px + 5, py + 5) for px, py in (to_px((x, y)) for x, y, _, _ in points)]
    frame = ax.get_window_extent(renderer)
    for x, y, text, style in points:
        best = None
        for dx, dy in OFFSETS:
            ha = "left" if dx > 0 else "right" if dx < 0 else "center"
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8, **style)
            box = note.get_window_extent(renderer).expanded(1.05, 1.15)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(t) for t in taken):
                best = (note, box)
                break
            note.remove()
        if best is None:  # nowhere free: the first spot, with a leader line so it still points at its dot
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(12, 18), fontsize=8,
                               arrowprops={"arrowstyle": "-", "color": "gray", "lw": 0.5}, **style)
            best = (note, note.get_window_extent(renderer))
        taken.append(best[1])


def plot(rows: list[dict], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8.5, 5.0))
    for r in rows:
        x, y, m = r["ratio_vs_fp16"], r["ppl_delta_pct"], r["method"]
        if r.get("ppl_delta_ci") and m != "dynamic":
            lo, hi = r["ppl_delta_ci"]
            ax.errorbar([x], [y], yerr=[[max(0.0, y - lo)], [max(0.0, hi - y)]], color=_color(m), lw=0.8, capsize=2, alpha=0.5)
        if m == DEFAULT:
            ax.scatter([x], [y], s=260, marker="*", color=STAR, edgecolor="black", linewidth=0.6, zorder=5)
        else:
            ax.scatter([x], [y], s=36, color=_color(m), zorder=4)
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(1, color=STAR, lw=0.8, ls=":")
    ax.set_yscale("symlog", linthresh=1.0)
    top = max(r["ppl_delta_pct"] for r in rows)
    ax.set_yticks([t for t in (-1, -0.5, 0, 0.5, 1, 2, 5, 10, 20, 50, 100) if t <= top * 2])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("times smaller than fp16 (higher is better)")
    ax.set_ylabel("perplexity change vs uncompressed (%, lower is better)")
    ax.set_xlim(0, max(r["ratio_vs_fp16"] for r in rows) * 1.12)
    ax.set_ylim(min(-1.5, min(r["ppl_delta_pct"] for r in rows) * 1.5), top * 2)
    ax.grid(alpha=0.25)
    ax.set_title(title, fontsize=10)
    # The default first, so that it gets the first free spot.
    order = sorted(rows, key=lambda r: r["method"] != DEFAULT)
    place_labels(ax, [(r["ratio_vs_fp16"], r["ppl_delta_pct"], _label(r["method"]),
                       {"fontweight": "bold", "color": STAR} if r["method"] == DEFAULT else {"color": "black"}) for r in order])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="smollm2-8k", help="a [table.ID] of docs/readme/figures.toml")
    parser.add_argument("--out", type=Path, default=build_readme.RESULTS / "pareto-smollm2-135m-8k.png")
    args = parser.parse_args(argv)
    spec = build_readme.load_figures()["table"][args.table]
    data = json.loads((build_readme.RESULTS / spec["file"]).read_text())
    by_method = {r["method"]: r for r in data["rows"] if r.get("status") == "ok"}
    rows = [by_method[m] for m in spec["methods"]]
    first = rows[0]
    plot(rows, f"{first['model']}, {first['context']:,} tokens of {first.get('text', 'news')} text, one rotation draw per method", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
