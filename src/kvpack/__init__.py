"""kvpack: compressed KV caches for transformers, with attention on the compressed data."""

from . import metrics
from .attention import disable, enable
from .cache import KVCache
from .cache.budget import MemoryBudget
from .cache.tracker import AdaptiveThresholds, QualityTracker
from .registry import DEFAULT_METHOD, CodecSpec, MethodConfig, Tier, get_method, list_methods

__all__ = [
    "DEFAULT_METHOD", "AdaptiveThresholds", "CodecSpec", "KVCache", "MemoryBudget", "MethodConfig", "QualityTracker", "Tier", "disable", "enable",
    "get_method", "list_methods", "load_model", "metrics",
]
__version__ = "0.1.0"


def load_model(name_or_path: str = "smollm2-135m", **kwargs):
    """Load a real model offline (see `kvpack.models`): returns (model, tokenizer)."""
    from .models import load_model as _load

    return _load(name_or_path, **kwargs)
