"""One file per compression scheme behind the `Codec` interface in `base.py`."""

from .base import Codec, Packed, concat_packed, slice_packed

__all__ = ["Codec", "Packed", "concat_packed", "slice_packed"]
