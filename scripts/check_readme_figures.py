"""Check that every README figure comes from a result file and every README and docs link resolves.

    python scripts/check_readme_figures.py          # exit 1, naming each problem, if any check fails
    python scripts/check_readme_figures.py --list   # every figure: its value, result file and the command that wrote it

Figures: docs/readme/README.md writes each measured number as {{fig:ID}}, {{results:ID}} or {{attention:ID}}, and
docs/readme/figures.toml names the result file, rows and field of each (scripts/build_readme.py). This fails when
- a figure's result file is missing, or no row of it matches, or the file records no command;
- README.md shows a figure other than what its file gives now (a stale or hand-edited README);
- a number that reads as a measurement (a decimal followed by x, %, ms, s, MB or GB) is written into the README
  source by hand, outside code; integers (targets such as "+1%" or "5x", counts) are not taken as measurements;
- a figure is quoted twice (each figure appears once; the rest of the README refers to it).
Links: every relative link of README.md and of every page under docs/ names a file that exists, and an anchor
(`page.md#heading`) a heading of that page (GitHub's heading ids).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_readme  # noqa: E402

ROOT = build_readme.ROOT
# A decimal with a unit: what a measurement looks like in prose. Thousands separators and signs included.
MEASURED = re.compile(r"[+\-−~]?\d[\d,]*\.\d+\s?(?:x|%|ms|s|MB|GB)(?![\w])")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"\{\{(fig|results|attention):([\w.\-]+)\}\}")


def prose(markdown: str) -> str:
    """The text outside fenced code blocks, inline code, HTML comments and link targets."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figure_problems(source: str, readme: str, figures: dict, results: Path = build_readme.RESULTS) -> list[str]:
    """What is wrong with the README's figures: a missing file or row, a stale value, a hand-written number, a repeat."""
    problems = []
    used = [(m[1], m[2]) for m in PLACEHOLDER.finditer(source)]
    kinds = {"fig": "fig", "results": "table", "attention": "attention"}
    for (kind, fig_id), count in Counter(used).items():
        if count > 1:
            problems.append(f"{{{{{kind}:{fig_id}}}}} is quoted {count} times: quote a figure once and refer to it")
    for kind, fig_id in dict.fromkeys(used):
        spec = figures.get(kinds[kind], {}).get(fig_id)
        if spec is None:
            problems.append(f"{{{{{kind}:{fig_id}}}}} is not defined in docs/readme/figures.toml")
            continue
        files = spec["file"] if isinstance(spec["file"], list) else [spec["file"]]
        for name in files:
            path = results / name
            if not path.exists():
                problems.append(f"{{{{{kind}:{fig_id}}}}}: result file bench/results/{name} does not exist")
            elif not command_of(json.loads(path.read_text())):
                problems.append(f"{{{{{kind}:{fig_id}}}}}: bench/results/{name} records no command (environment.command)")
    for kind, fig_id in dict.fromkeys(used):
        try:
            text = build_readme.render_readme(f"{{{{{kind}:{fig_id}}}}}", figures, results)
        except (ValueError, KeyError) as e:
            problems.append(f"{{{{{kind}:{fig_id}}}}}: {e}")
            continue
        if text not in readme:
            problems.append(f"{{{{{kind}:{fig_id}}}}} reads {text.splitlines()[0]!r}... from its file, which README.md does not show: "
                            "run python scripts/build_readme.py")
    masked = build_readme.render_readme(source, figures, results, mask=True)
    for line in prose(masked).splitlines():
        for m in MEASURED.finditer(line):
            problems.append(f"docs/readme/README.md: {m[0].strip()!r} ({line.strip()[:70]!r}) is written by hand: "
                            "make it a {{fig:ID}} read from its result file")
    return problems


def command_of(data: dict) -> str | None:
    """The command a result file records: its environment's, or for a file that merges reruns (scripts/merge_rows.py),
    those runs' files, each of which records its own."""
    if data.get("environment", {}).get("command"):
        return data["environment"]["command"]
    merged = [name for name, env in data.get("merged_environment", {}).items() if env.get("command")]
    return f"rows merged from {', '.join(merged)} (each file records its command)" if merged else None


def heading_ids(markdown: str) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    ids, seen = set(), Counter()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", m[1].lower().replace("`", "")).replace(" ", "-")
        ids.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return ids


def link_problems(pages: list[Path]) -> list[str]:
    """Every relative link (and anchor) of these markdown pages that does not resolve."""
    problems = []
    for page in pages:
        text = page.read_text()
        for m in LINK.finditer(re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)):
            target = m[1] or m[2]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: link {target!r}"
            if not dest.exists():
                problems.append(f"{where}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
                problems.append(f"{where}: {dest.relative_to(ROOT)} has no heading #{anchor}")
    return problems


def doc_pages() -> list[Path]:
    """README.md, CONTRIBUTING.md and every page under docs/ that a reader opens (not the README's own sources)."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    pages += [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.parent.name not in ("readme", "templates")]
    return [p for p in pages if p.exists()]


def list_figures(figures: dict) -> None:
    for kind, section in (("fig", "fig"), ("results", "table"), ("attention", "attention")):
        for fig_id, spec in figures.get(section, {}).items():
            files = spec["file"] if isinstance(spec["file"], list) else [spec["file"]]
            value = build_readme.render_readme(f"{{{{{kind}:{fig_id}}}}}", figures).splitlines()
            print(f"{{{{{kind}:{fig_id}}}}} = {value[0] if len(value) == 1 else f'a table of {len(value) - 2} rows'}")
            for name in files:
                path = build_readme.RESULTS / name
                command = command_of(json.loads(path.read_text())) if path.exists() else "(missing)"
                print(f"    bench/results/{name}: {command}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every figure with its file and command, check nothing")
    args = parser.parse_args(argv)
    figures = build_readme.load_figures()
    if args.list:
        list_figures(figures)
        return 0
    source = build_readme.README_SOURCE.read_text()
    problems = figure_problems(source, (ROOT / "README.md").read_text(), figures) + link_problems(doc_pages())
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(problems)} problems" if problems else "README figures and links: all resolve")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
