"""Caches by method name for the evaluation: kvpack methods through the registry, peers through `kvpack.peers`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers.cache_utils import Cache

from ..attention import disable, enable
from ..cache import KVCache
from ..peers import PeerUnavailable, build_peer, is_peer

BASELINE = "dynamic"  # the uncompressed reference every delta is taken against


class MethodUnavailable(RuntimeError):
    """A method that cannot run here; the runner reports it instead of crashing."""


def make_cache(model, method: str) -> Cache:
    """A fresh, empty cache for `method` on `model`."""
    if is_peer(method):
        try:
            return build_peer(model, method)
        except PeerUnavailable as err:
            raise MethodUnavailable(str(err)) from err
    return KVCache(model, method)


@contextmanager
def attention_for(model, method: str) -> Iterator[None]:
    """Run kvpack methods with kvpack's compressed-domain attention, peers with the model's own attention."""
    use_kvpack = not is_peer(method)
    if use_kvpack:
        enable(model)
    try:
        yield
    finally:
        if use_kvpack:
            disable(model)
