"""Text tables and PNG plots from runner rows."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable

from ..registry import SEED_SUFFIX

_SEED = re.compile(re.escape(SEED_SUFFIX) + r"(\d+)")


def _number(key: str, fmt: str) -> Callable[[dict], str]:
    def cell(row: dict) -> str:
        value = row.get(key)
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)

    return cell


def _ppl_delta(row: dict) -> str:
    """"+1.27% [+0.8, +1.7]": the delta and its paired bootstrap 95% interval (rows from older runs have no interval)."""
    text = _number("ppl_delta_pct", "{:+.2f}%")(row)
    ci = row.get("ppl_delta_ci")
    return f"{text} [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci and text != "-" else text


def _recall(found: int, total: int, ci: list[float] | None) -> str:
    """"58/60 [89-99%]": found/total and the Wilson 95% interval of the recall, in percent."""
    return f"{found}/{total}" + (f" [{100 * ci[0]:.0f}-{100 * ci[1]:.0f}%]" if ci else "")


def _needle(row: dict) -> str:
    return _recall(row["needle_found"], row["needle_total"], row.get("needle_ci")) if row.get("needle_total") else "-"


# (header, cell, the row key whose interval the cell shows: the header says "[95% CI]" once a row has one)
COLUMNS: list[tuple[str, Callable[[dict], str], str | None]] = [
    ("method", lambda row: row["method"], None),
    ("bytes/token", _number("bytes_per_token", "{:,.0f}"), None),
    ("x fp16", _number("ratio_vs_fp16", "{:.2f}x"), None),
    # a method with older tiers: its oldest tier's own ratio (codec state included), beside the whole cache's
    ("archive x fp16", _number("archive_ratio_vs_fp16", "{:.2f}x"), None),
    ("ppl", _number("ppl", "{:.3f}"), None),
    ("ppl delta", _ppl_delta, "ppl_delta_ci"),
    ("needle", _needle, "needle_ci"),
    ("attn cos (min)", _number("cosine_min", "{:.4f}"), None),
    ("prefill tok/s", _number("prefill_tok_s", "{:,.0f}"), None),
    ("decode tok/s", _number("decode_tok_s", "{:.1f}"), None),
    # No speed ratio here: these methods were timed one after another, not interleaved step by step, so machine
    # noise between them would read as a speed difference (ratios: `python -m kvpack.bench.decode`, docs/notes/speed.md).
]


# Columns shown only when some row has their key: a table of methods without older tiers has no archive column.
OPTIONAL = {"archive x fp16": "archive_ratio_vs_fp16"}


def _columns(rows: list[dict]) -> list[tuple[str, Callable[[dict], str], str | None]]:
    return [c for c in COLUMNS if c[0] not in OPTIONAL or any(OPTIONAL[c[0]] in r for r in rows)]


def _headers(rows: list[dict]) -> list[str]:
    return [name + (" [95% CI]" if ci and any(r.get(ci) for r in rows) else "") for name, _, ci in _columns(rows)]


def _fixed(cells: list[list[str]]) -> list[str]:
    """Fixed-width lines: the first column left-aligned, the others right-aligned, a rule under the header."""
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in cells]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def format_table(rows: list[dict]) -> str:
    """A fixed-width table; unavailable methods get one line with the reason; then the needle recall per cell and kind."""
    ok = [r for r in rows if r.get("status") == "ok"]
    lines = _fixed([_headers(ok)] + [[cell(r) for _, cell, _ in _columns(ok)] for r in ok])
    lines += [f"{r['method']}: {r['status']}" for r in rows if r.get("status") != "ok"]
    needles = format_needle_cells(ok)
    return "\n".join(lines) + ("\n\n" + needles if needles else "")


def format_needle_cells(rows: list[dict]) -> str:
    """Needle recall of every (length, depth) cell, found/total over all kinds and trials, then recall per kind; "" without cells."""
    rows = [r for r in rows if r.get("needle_cells")]
    if not rows:
        return ""
    depths = sorted({c["depth"] for r in rows for c in r["needle_cells"]})
    cells = [["needle recall per cell", "length", *(f"depth {d:.2f}" for d in depths)]]
    for row in rows:
        by_cell = {(c["length"], c["depth"]): f"{c['found']}/{c['total']}" for c in row["needle_cells"]}
        for n in sorted({c["length"] for c in row["needle_cells"]}):
            cells.append([row["method"], str(n), *(by_cell.get((n, d), "-") for d in depths)])
    kinds = list(dict.fromkeys(k for r in rows for k in r.get("needle_kinds", {})))
    per_kind = [["needle recall per kind", *kinds]] + [
        [r["method"], *(_recall(**r["needle_kinds"][k]) if k in r.get("needle_kinds", {}) else "-" for k in kinds)] for r in rows
    ]
    return "\n".join(_fixed(cells) + [""] + _fixed(per_kind))


def markdown_table(rows: list[dict]) -> str:
    """Markdown of the ok rows; a row merged in from a later run (scripts/merge_rows.py) is marked `*`."""
    ok = [{**r, "method": r["method"] + " *"} if r.get("merged_from") else r for r in rows if r.get("status") == "ok"]
    head = "| " + " | ".join(_headers(ok)) + " |"
    columns = _columns(ok)
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(cell(r) for _, cell, _ in columns) + " |" for r in ok]
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
    for row in rows:
        x, y, name = row["ratio_vs_fp16"], row["ppl_delta_pct"], row["method"]
        color = "tab:orange" if name.startswith("hf-") or name == "dynamic" else "tab:blue"
        if row.get("ppl_delta_ci"):  # the paired bootstrap 95% interval as a vertical bar
            lo, hi = row["ppl_delta_ci"]
            ax.errorbar([x], [y], yerr=[[max(0.0, y - lo)], [max(0.0, hi - y)]], color=color, lw=1, capsize=3)
        ax.scatter([x], [y], s=40, color=color)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    # Frontier: the methods no other method beats on both compression (higher) and perplexity delta (lower).
    frontier = [(x, y) for x, y, _ in points if not any(x2 >= x and y2 < y or x2 > x and y2 <= y for x2, y2, _ in points)]
    if len(frontier) > 1:
        ax.plot(*zip(*sorted(frontier), strict=True), "--", color="gray", lw=1)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("compression vs fp16 (x, higher is better)")
    ax.set_ylabel("perplexity delta vs uncompressed (%)")
    ax.set_yscale("symlog", linthresh=1.0)
    lowest = min([y for _, y, _ in points] + [r["ppl_delta_ci"][0] for r in rows if r.get("ppl_delta_ci")], default=0.0)
    ax.set_ylim(bottom=min(lowest * 1.5, -0.5))  # no empty negative decades when nothing beats the baseline
    ax.grid(alpha=0.3)


def _heatmap(ax, row: dict) -> None:
    """Recall per (length, depth) cell: the fraction of the cell's trials (all kinds) that found the needle."""
    lengths = sorted({t["target_length"] for t in row["needle"]})
    depths = sorted({t["depth"] for t in row["needle"]})
    found: dict[tuple[int, float], list[bool]] = {}
    for t in row["needle"]:
        found.setdefault((t["target_length"], t["depth"]), []).append(t["found"])
    data = [[sum(found.get((n, d), [])) / max(1, len(found.get((n, d), []))) for n in lengths] for d in depths]
    ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
    ax.set_xlabel("context (tokens)", fontsize=7)
    ax.set_ylabel("needle depth", fontsize=7)
    ax.set_title(f"{row['method']}: {row['needle_found']}/{row['needle_total']}", fontsize=9)


def draw_summaries(rows: list[dict]) -> list[dict]:
    """One summary per method measured at more than one rotation draw (ok rows whose names differ only by `@seed=N`).

    A draw moves a 3-bit method's perplexity delta by more than its bootstrap interval is wide
    (docs/guide/evaluation.md, "One draw of the rotation"), so a method is its mean over draws, with the spread:
    `{"method", "seeds", "ppl_delta_pct": {"mean", "sd", "min", "max", "each"}, "ratio_vs_fp16", "needle_found",
    "needle_total"}` (sd: the sample standard deviation over draws; `ratio_vs_fp16`: the mean)."""
    groups: dict[str, list[tuple[int, dict]]] = {}
    for row in rows:
        match = _SEED.search(row.get("method", ""))
        if match and row.get("status") == "ok" and row.get("ppl_delta_pct") is not None:
            groups.setdefault(_SEED.sub("", row["method"], count=1), []).append((int(match[1]), row))
    summaries = []
    for method, draws in groups.items():
        if len(draws) < 2:
            continue
        deltas = [row["ppl_delta_pct"] for _, row in draws]
        ratios = [row["ratio_vs_fp16"] for _, row in draws if row.get("ratio_vs_fp16") is not None]
        summaries.append({
            "method": method, "seeds": [seed for seed, _ in draws],
            "ppl_delta_pct": {"mean": statistics.fmean(deltas), "sd": statistics.stdev(deltas), "min": min(deltas), "max": max(deltas),
                              "each": deltas},
            "ratio_vs_fp16": statistics.fmean(ratios) if ratios else None,
            "needle_found": sum(row.get("needle_found") or 0 for _, row in draws),
            "needle_total": sum(row.get("needle_total") or 0 for _, row in draws),
        })
    return summaries


def format_draw_summaries(summaries: list[dict]) -> str:
    """A fixed-width table of `draw_summaries`: the mean perplexity delta over draws, its spread and every draw."""
    if not summaries:
        return ""
    cells = [["method, over rotation draws", "draws", "x fp16", "ppl delta mean", "sd", "min to max", "each draw", "needle"]]
    for s in summaries:
        d = s["ppl_delta_pct"]
        cells.append([
            s["method"], str(len(s["seeds"])), "-" if s["ratio_vs_fp16"] is None else f"{s['ratio_vs_fp16']:.2f}x",
            f"{d['mean']:+.2f}%", f"{d['sd']:.2f}", f"{d['min']:+.2f} to {d['max']:+.2f}%", " / ".join(f"{x:+.2f}" for x in d["each"]),
            f"{s['needle_found']}/{s['needle_total']}" if s["needle_total"] else "-",
        ])
    return "\n".join(_fixed(cells))
