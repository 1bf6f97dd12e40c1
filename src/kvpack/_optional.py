"""Optional dependencies: import them where they are needed, and name the install line when one is missing.

kvpack's core needs only torch and transformers. The evaluation (progress bars, plots, GGUF models)
and the peer caches live in extras; a missing one raises `MissingDependency`, an `ImportError`
whose message is the exact command to run, instead of `No module named 'tqdm'`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# import name -> (pip distribution, kvpack extra that carries it)
OPTIONAL: dict[str, tuple[str, str]] = {
    "tqdm": ("tqdm", "eval"),
    "matplotlib": ("matplotlib", "eval"),
    "gguf": ("gguf", "eval"),
    "accelerate": ("accelerate", "eval"),
    "numpy": ("numpy", "eval"),
    "tomli": ("tomli", "eval"),
    "optimum": ("optimum-quanto", "peers"),
    "hqq": ("hqq", "peers"),
}


class MissingDependency(ImportError):
    """An optional package kvpack needs for what was asked; the message holds the install line."""


def install_line(extra: str) -> str:
    return f'pip install "kvpack[{extra}]"  (from a source checkout: pip install -e ".[{extra}]")'


def missing_message(module: str, purpose: str) -> str:
    package, extra = OPTIONAL[module.split(".")[0]]
    return f"{purpose} needs the optional package {package!r}, which is not installed; install it with: {install_line(extra)}"


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` (a key of OPTIONAL, or a submodule of one) or raise MissingDependency naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependency(missing_message(module, purpose)) from err


@contextmanager
def install_hint(purpose: str) -> Iterator[None]:
    """Reword a `ModuleNotFoundError` for a known optional package raised inside the block (e.g. deep in transformers)."""
    try:
        yield
    except ModuleNotFoundError as err:
        root = (err.name or "").split(".")[0]
        if root not in OPTIONAL:
            raise
        raise MissingDependency(missing_message(root, purpose)) from err
