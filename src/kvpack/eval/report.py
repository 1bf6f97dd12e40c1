"""Text tables and PNG plots from runner rows."""

from __future__ import annotations

import math

COLUMNS = [
    ("method", "method", "{}"),
    ("bytes/token", "bytes_per_token", "{:,.0f}"),
    ("x fp16", "ratio_vs_fp16", "{:.2f}x"),
    ("ppl", "ppl", "{:.3f}"),
    ("ppl delta", "ppl_delta_pct", "{:+.2f}%"),
    ("needle", None, None),
    ("attn cos (min)", "cosine_min", "{:.4f}"),
    ("prefill tok/s", "prefill_tok_s", "{:,.0f}"),
    ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("decode x dyn", "decode_ratio", "{:.2f}x"),
]


def _cell(row: dict, key: str | None, fmt: str | None) -> str:
    if key is None:
        return f"{row['needle_found']}/{row['needle_total']}" if row.get("needle_total") else "-"
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_table(rows: list[dict]) -> str:
    """A fixed-width table; unavailable methods get one line with the reason."""
    ok = [r for r in rows if r.get("status") == "ok"]
    cells = [[name for name, _, _ in COLUMNS]] + [[_cell(r, k, f) for _, k, f in COLUMNS] for r in ok]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"{r['method']}: {r['status']}" for r in rows if r.get("status") != "ok"]
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """Markdown of the ok rows; a row merged in from a later run (scripts/merge_rows.py) is marked `*`."""
    ok = [{**r, "method": r["method"] + " *"} if r.get("merged_from") else r for r in rows if r.get("status") == "ok"]
    head = "| " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"
    body = ["| " + " | ".join(_cell(r, k, f) for _, k, f in COLUMNS) + " |" for r in ok]
    return "\n".join([head, sep, *body])


def plot(rows: list[dict], path: str) -> None:
    """One PNG: the quality-vs-compression Pareto plot, then a needle heatmap (length x depth) per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    with_needle = [r for r in ok if r.get("needle")]
    cols = max(1, min(4, len(with_needle)))
    heat_rows = math.ceil(len(with_needle) / cols) if with_needle else 0
    fig = plt.figure(figsize=(3.2 * max(cols, 3), 4.2 + 2.6 * heat_rows))
    grid = fig.add_gridspec(1 + heat_rows, cols, height_ratios=[1.6] + [1] * heat_rows)
    _pareto(fig.add_subplot(grid[0, :]), ok)
    for i, row in enumerate(with_needle):
        _heatmap(fig.add_subplot(grid[1 + i // cols, i % cols]), row)
    title = f"{ok[0]['model']}, {ok[0]['context']}-token context, {ok[0].get('text', 'news')} text" if ok else "no results"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pareto(ax, rows: list[dict]) -> None:
    points = sorted((r["ratio_vs_fp16"], r["ppl_delta_pct"], r["method"]) for r in rows)
    for x, y, name in points:
        ax.scatter([x], [y], s=40, color="tab:orange" if name.startswith("hf-") or name == "dynamic" else "tab:blue")
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    # Frontier: the methods no other method beats on both compression (higher) and perplexity delta (lower).
    frontier = [(x, y) for x, y, _ in points if not any(x2 >= x and y2 < y or x2 > x and y2 <= y for x2, y2, _ in points)]
    if len(frontier) > 1:
        ax.plot(*zip(*sorted(frontier), strict=True), "--", color="gray", lw=1)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("compression vs fp16 (x, higher is better)")
    ax.set_ylabel("perplexity delta vs uncompressed (%)")
    ax.set_yscale("symlog", linthresh=1.0)
    lowest = min(y for _, y, _ in points) if points else 0.0
    ax.set_ylim(bottom=min(lowest * 1.5, -0.5))  # no empty negative decades when nothing beats the baseline
    ax.grid(alpha=0.3)


def _heatmap(ax, row: dict) -> None:
    lengths = sorted({t["target_length"] for t in row["needle"]})
    depths = sorted({t["depth"] for t in row["needle"]})
    found = {(t["target_length"], t["depth"]): t["found"] for t in row["needle"]}
    data = [[1.0 if found.get((n, d)) else 0.0 for n in lengths] for d in depths]
    ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
    ax.set_xlabel("context (tokens)", fontsize=7)
    ax.set_ylabel("needle depth", fontsize=7)
    ax.set_title(f"{row['method']}: {row['needle_found']}/{row['needle_total']}", fontsize=9)
