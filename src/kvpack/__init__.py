"""kvpack: compressed KV caches for transformers, with attention on the compressed data."""

from . import metrics
from .attention import disable, enable
from .cache import KVCache
from .cache.adaptive import AdaptiveThresholds
from .cache.budget import MemoryBudget
from .cache.tracker import QualityTracker
from .models import load_model
from .registry import DEFAULT_METHOD, CodecSpec, MethodConfig, Tier, get_method, list_methods
from .support import VERSION

__all__ = [
    "DEFAULT_METHOD", "AdaptiveThresholds", "CodecSpec", "KVCache", "MemoryBudget", "MethodConfig", "QualityTracker", "Tier", "disable", "enable",
    "get_method", "list_methods", "load_model", "metrics",
]
__version__ = VERSION
