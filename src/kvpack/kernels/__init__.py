"""Fast paths for compressed-domain attention, each beside a pure-torch reference.

`available()` says whether the CPU kernels can run (built, and not disabled by
`KVPACK_KERNELS=torch`); codecs call them for CPU tensors and keep their torch math otherwise.
"""

from .cpu_lut import available, backend, int8_scores, int8_weighted_sum, lut_scores, lut_weighted_sum

__all__ = ["available", "backend", "int8_scores", "int8_weighted_sum", "lut_scores", "lut_weighted_sum"]
