"""Serving integrations. `blocks`: KV blocks <-> safetensors files through a kvpack method (no serving
framework). `vllm_connector`: a vLLM KV connector on top of it, imported only by vLLM (by module path)."""
