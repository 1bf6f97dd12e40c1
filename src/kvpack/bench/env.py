"""The environment stamp every result JSON carries: code version, library versions, hardware, command."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch


def _git_sha() -> str:
    # A copy of the tree run elsewhere (a GPU machine) names its commit: its own .git, if any, may be stale.
    if os.environ.get("KVPACK_GIT_SHA"):
        return os.environ["KVPACK_GIT_SHA"]
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        # Result files do not make the code dirty: a benchmark rerun rewrites its own committed file (some write per stage).
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(prog: str | None = None, argv: list[str] | None = None) -> dict:
    """The date (UTC), git SHA, versions, CPU model, thread count and the command line (`prog` replaces argv[0], e.g.
    "python -m kvpack.bench.decode"; `argv` replaces sys.argv[1:] when the caller parsed its own)."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": _git_sha(),
        "kvpack": _version("kvpack"),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "command": " ".join([prog or (Path(sys.argv[0]).name if sys.argv else "python"), *(sys.argv[1:] if argv is None else argv)]),
    }


def write_json(path, data: dict) -> None:
    """Write a result (`{config, environment, ...}`) to `path` as indented JSON, making its directory; None: nothing."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
