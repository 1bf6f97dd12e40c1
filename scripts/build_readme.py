"""Assemble README.md from docs/readme/*.md and the compare JSON rows in bench/results/.

    python scripts/build_readme.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["head.md", "results.md", "speed.md", "eval.md", "codecs.md", "shard.md", "shard_results.md", "tail.md"]


def table(path: Path) -> str:
    """Markdown rows from a `kvpack compare --json` file (the columns a user chooses by)."""
    from kvpack.eval.report import markdown_table

    return markdown_table(json.loads(path.read_text())["rows"])


def shard_rows(results: Path) -> str:
    """Shard's row of every compare table, with its run's uncompressed needle count beside it."""
    lines = ["| model | context | bytes/token | x fp16 | ppl delta | needles (shard / uncompressed) | attn cos (min) | decode x dyn |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for model in ("smollm2-135m", "qwen2.5-0.5b"):
        for ctx in ("2k", "8k"):
            path = results / f"compare-{model}-{ctx}.json"
            if not path.exists():
                continue
            rows = json.loads(path.read_text())["rows"]
            row = next((r for r in rows if r["method"] == "shard" and r.get("status") == "ok"), None)
            if row is None:
                continue
            base = rows[0]
            lengths = sorted({t["target_length"] for t in row["needle"]})
            lines.append(
                f"| {model} | {row['context']:,} | {row['bytes_per_token']:,.0f} | **{row['ratio_vs_fp16']:.2f}x** | **{row['ppl_delta_pct']:+.2f}%** | "
                f"{row['needle_found']}/{row['needle_total']} / {base['needle_found']}/{base['needle_total']} (at {', '.join(map(str, lengths))}) | "
                f"{row['cosine_min']:.3f} | {row['decode_ratio']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    """`{{table:NAME}}` in a part becomes the table of bench/results/compare-NAME.json (e.g. smollm2-135m-8k)."""
    docs, results = ROOT / "docs" / "readme", ROOT / "bench" / "results"
    text = []
    for part in PARTS:
        body = (docs / part).read_text().replace("{{shard_targets}}", shard_rows(results))
        body = re.sub(r"\{\{table:([\w.\-]+)\}\}", lambda m: table(results / f"compare-{m[1]}.json"), body)
        text.append(body.rstrip() + "\n")
    (ROOT / "README.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
