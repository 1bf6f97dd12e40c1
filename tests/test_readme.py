"""The README is what scripts/build_readme.py builds, its install block keeps the shape CI reads, every
method has a row, and the quick start runs as printed (slow: it loads the real SmolLM2)."""

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


def _section(heading: str) -> str:
    start = README.index(f"\n{heading}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


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


def test_every_method_has_a_row_in_the_methods_table():
    rows = {m[1] for m in re.finditer(r"^\| `([^`]+)`", _section("## Methods"), flags=re.M)}
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
