"""Assemble README.md from docs/readme/*.md and the compare JSON rows in bench/results/.

    python scripts/build_readme.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["head.md", "results.md", "speed.md", "eval.md", "codecs.md", "shard.md", "shard_results.md", "tail.md"]


def table(path: Path) -> str:
    """Markdown rows from a `kvpack compare --json` file (the columns a user chooses by)."""
    from kvpack.eval.report import markdown_table

    return markdown_table(json.loads(path.read_text())["rows"])


def main() -> None:
    docs = ROOT / "docs" / "readme"
    text = []
    for part in PARTS:
        body = (docs / part).read_text()
        for name in ("smollm2-135m", "qwen2.5-0.5b"):
            marker = f"{{{{table:{name}}}}}"
            if marker in body:
                body = body.replace(marker, table(ROOT / "bench" / "results" / f"compare-{name}-2k.json"))
        text.append(body.rstrip() + "\n")
    (ROOT / "README.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
