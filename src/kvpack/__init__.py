"""kvpack: compressed KV caches for transformers, with attention on the compressed data."""

from .registry import DEFAULT_METHOD, CodecSpec, MethodConfig, get_method, list_methods

__all__ = ["DEFAULT_METHOD", "CodecSpec", "MethodConfig", "get_method", "list_methods"]
__version__ = "0.1.0"
