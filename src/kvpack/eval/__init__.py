"""Evaluation: perplexity through the compressed cache, needle recall, attention fidelity, memory, speed."""

from .fidelity import attention_fidelity, capture_attention, compare_outputs
from .memory import memory_report, tensor_bytes
from .methods import BASELINE, MethodUnavailable, make_cache
from .needle import needle_grid, needle_trial, passkey_found
from .perplexity import PerplexityResult, perplexity
from .runner import EvalConfig, run
from .speed import SpeedResult, measure_speed

__all__ = [
    "BASELINE", "EvalConfig", "MethodUnavailable", "PerplexityResult", "SpeedResult", "attention_fidelity", "capture_attention",
    "compare_outputs", "make_cache", "measure_speed", "memory_report", "needle_grid", "needle_trial", "passkey_found",
    "perplexity", "run", "tensor_bytes",
]
