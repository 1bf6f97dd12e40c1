"""The README is what scripts/build_readme.py builds, a manual of at most 250 lines in the words of what kvpack is,
its install block keeps the shape CI reads, every method has a row in the guide, and the quick start runs as
printed (slow: it loads the real SmolLM2)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvpack
from kvpack import auto

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
METHODS_PAGE = (ROOT / "docs" / "guide" / "methods.md").read_text()
# Words about how the work was organised, not about what kvpack is: issue and design-record numbers and the like.
INTERNAL = re.compile(r"(?<![\w/&])#\d+\b|\bissue \d+|\bADR-?\d+|package mirror|\bsessions?\b|previous default|"
                      r"\b(?:first|second|third|fourth) pass\b", re.I)


def _section(heading: str, text: str = README) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _block(section: str, lang: str) -> str:
    """The first ```lang fenced block of a section, without its fences."""
    match = re.search(rf"^```{lang}\n(.*?)^```$", section, flags=re.S | re.M)
    assert match, f"no ```{lang} block"
    return match[1]


def test_readme_and_docs_are_built_from_their_parts():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_readme.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_install_block_has_the_two_commands_ci_runs():
    lines = _block(_section("## Install"), "bash").splitlines()
    commands = {line[:4]: lines[i + 1] for i, line in enumerate(lines) if line.startswith(("# 1.", "# 2."))}
    assert sorted(commands) == ["# 1.", "# 2."]
    for command in commands.values():
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && "), command
    assert commands["# 1."].endswith("kvpack demo") and commands["# 2."].endswith("bash scripts/test.sh")


def test_readme_is_a_manual_of_at_most_250_lines_that_says_where_it_is_generated_from():
    assert len(README.splitlines()) <= 250, len(README.splitlines())
    assert "docs/readme/README.md" in README.splitlines()[0] and "scripts/build_readme.py" in README.splitlines()[0]
    for heading in ("## Install", "## Quick start", "## Which method to use", "## Results", "## Speed", "## CLI",
                    "## Serving", "## Limits", "## Contributing"):
        assert f"\n{heading}\n" in README, heading


def test_which_method_table_has_at_most_six_rows_and_starts_with_the_default():
    rows = re.findall(r"^\| (?!you want|---).*\|$", _section("## Which method to use"), flags=re.M)
    assert 0 < len(rows) <= 6, rows
    assert f"`{kvpack.DEFAULT_METHOD}`" in rows[0]


def test_no_internal_words_in_the_readme_the_guide_or_contributing():
    pages = {"README.md": README, "CONTRIBUTING.md": (ROOT / "CONTRIBUTING.md").read_text()}
    pages |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs" / "guide").glob("*.md"))}
    found = [f"{name}: {m[0]!r} in {text[max(0, m.start() - 40) : m.end() + 40]!r}"
             for name, text in pages.items() for m in INTERNAL.finditer(text)]
    assert not found, "\n".join(found)


def test_internal_words_pattern_catches_what_it_is_for():
    for text in ("as in #14", "issue 39", "ADR-004's tiers", "the package mirror", "last session", "the previous default",
                 "after the second pass"):
        assert INTERNAL.search(text), text
    for text in ("see [Results](#results)", "a 2nd draw", "the default", "one pass over the values", "page.md#keys-13"):
        assert not INTERNAL.search(text), text


def test_every_method_has_a_row_in_the_guides_methods_table():
    rows = {m[1] for m in re.finditer(r"^\| `([^`]+)`", _section("## Every method", METHODS_PAGE), flags=re.M)}
    auto_rows = {r for r in rows if r.startswith("auto:")}  # a family of names, one per target, not a registry entry
    assert rows - auto_rows == set(kvpack.list_methods())
    for row in auto_rows:
        assert 0 < auto.parse_target(row.removeprefix("auto:")) <= 1


@pytest.mark.slow
def test_quick_start_compresses_and_prints_what_the_readme_shows(capsys):
    section = _section("## Quick start")
    namespace: dict = {}
    exec(compile(_block(section, "python"), "README.md:quick-start", "exec"), namespace)
    kvpack.disable(namespace["model"])
    report = namespace["cache"].memory_report()
    compressed = {k: v for k, v in report["segments"].items() if k not in ("sink", "window", "codec_state")}
    assert compressed and all(v > 0 for v in compressed.values()), report["segments"]
    assert report["ratio"] > 3, report
    assert _block(section, "text") in capsys.readouterr().out


def test_every_pattern_of_the_slow_list_names_a_test_that_exists():
    """The fast loop the README promises leaves out conftest.SLOW; a renamed test must not silently rejoin it."""
    from conftest import SLOW

    for pattern in SLOW:
        path, _, name = pattern.partition("::")
        assert (ROOT / path).exists(), pattern
        name = re.split(r"[*\[]", name)[0]
        assert not name or re.search(rf"^\s*def {re.escape(name)}\w*\(", (ROOT / path).read_text(), flags=re.M), pattern
