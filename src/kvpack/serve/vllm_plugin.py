"""vLLM's `vllm.general_plugins` entry point for kvpack's compressed KV pool (`kvpack.serve.vllm_backend`).

Kept apart from the backend so that loading the plugin, which vLLM does in every process of every engine, imports
nothing but vLLM's backend registry: the backend module (and kvpack's codecs) load only when vLLM resolves the CPU
attention backend's class path.
"""

from __future__ import annotations

BACKEND = "kvpack.serve.vllm_backend.KVPackAttentionBackend"


def register() -> None:
    """Route the CPU platform's attention backend (`CPU_ATTN`) to kvpack's subclass, which behaves as vLLM's own unless
    the engine's `additional_config` names kvpack. Safe to call repeatedly."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
