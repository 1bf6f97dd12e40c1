"""Fast paths for compressed-domain attention, each beside a pure-torch reference.

`available()` says whether the CPU kernels can run (built, and not disabled by
`KVPACK_KERNELS=torch`); codecs call them for CPU tensors and keep their torch math otherwise.
"""

from .cpu_lut import available, backend, int8_scores, int8_weighted_sum, lut_scores, lut_weighted_sum

# Query rows (GQA group x query tokens) up to which codecs call the kernels: decode steps. A prompt
# chunk of hundreds of rows is faster as one unpack + matmul (measured: 22 s vs ~1 s per
# 256-token chunk over 2K TurboQuant tokens on SmolLM2).
MAX_KERNEL_ROWS = 16
# Query rows per kv head (GQA group x query tokens) the fused decode kernels serve in one call.
MAX_FUSED_ROWS = 16

__all__ = ["MAX_FUSED_ROWS", "MAX_KERNEL_ROWS", "available", "backend", "int8_scores", "int8_weighted_sum", "lut_scores", "lut_weighted_sum"]
