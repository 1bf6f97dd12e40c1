"""Peer caches that kvpack is measured against, built by name.

dynamic       transformers `DynamicCache`: the uncompressed baseline (model dtype).
hf-quanto:N   transformers `QuantizedCache(backend="quanto", nbits=N)`, N in {2, 4}; needs `optimum-quanto`.
hf-hqq:N      transformers `QuantizedCache(backend="hqq", nbits=N)`, N in {2, 4}; needs `hqq`.

The quantized peers use transformers' defaults: group 64, residual window 128 tokens, axis 0 for keys
and values. (hqq with axis 1 fails whenever kv_heads x tokens is odd, e.g. SmolLM2's 3 kv heads.)
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicCache, QuantizedCache

from ._optional import missing_message

PEERS = ("dynamic", "hf-quanto:2", "hf-quanto:4", "hf-hqq:2", "hf-hqq:4")
_BACKENDS = {"hf-quanto": ("quanto", "optimum"), "hf-hqq": ("hqq", "hqq")}  # transformers backend, import name


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here (package missing, model unsupported); the message says why and what to install."""


def is_peer(method: str) -> bool:
    return method == "dynamic" or method.startswith("hf-")


def build_peer(model, method: str) -> Cache:
    """A fresh peer cache for `model`; raises PeerUnavailable when its backend or the model rules it out."""
    if method == "dynamic":
        return DynamicCache(config=model.config)
    name, _, bits = method.partition(":")
    if name not in _BACKENDS or bits not in ("2", "4"):
        raise ValueError(f"unknown peer {method!r}; available: {', '.join(PEERS)}")
    backend, module = _BACKENDS[name]
    try:
        return QuantizedCache(backend=backend, config=model.config, nbits=int(bits), axis_key=0, axis_value=0)
    except ImportError as err:
        raise PeerUnavailable(f"{method}: {missing_message(module, f'the peer {method}')} ({err})") from err
    except ValueError as err:
        raise PeerUnavailable(f"{method}: {err}") from err
