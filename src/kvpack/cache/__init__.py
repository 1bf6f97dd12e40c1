"""The drop-in transformers cache: per-layer segments of sinks, compressed blocks and a window."""

from .kvcache import KVCache
from .layer import KVPackLayer, Segment

__all__ = ["KVCache", "KVPackLayer", "Segment"]
