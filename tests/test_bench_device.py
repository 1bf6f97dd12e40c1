"""The benchmarks a GPU run uses, exercised on CPU: batched decode with random weights (`bench.decode`),
one layer's decode attention through the model's path (`bench.attention`), and the commit a copied tree
records (`bench.env`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from kvpack.bench import attention as bench_attention
from kvpack.bench import decode as bench_decode
from kvpack.bench.env import environment


@pytest.fixture
def tiny_config_dir(tmp_path):
    """A directory holding only a config.json: 2 Llama layers, 4 query / 2 kv heads of 64."""
    LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=1024).save_pretrained(tmp_path)
    return tmp_path


def test_batched_decode_with_random_weights_reports_tokens_and_bytes(tiny_config_dir, tmp_path):
    out = tmp_path / "decode.json"
    bench_decode.main(["--model", str(tiny_config_dir), "--random-weights", "--batch", "3", "--contexts", "300", "--steps", "3",
                       "--warmup", "1", "--methods", "dynamic,int8", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["random_weights"] and data["batch"] == 3
    rows = {r["method"]: r for r in data["rows"]}
    for r in rows.values():
        assert r["batch"] == 3 and r["context"] == 300 and len(r["step_ms"]) == 3
        assert r["tok_s"] == pytest.approx(3 / (r["mean_ms"] / 1e3))  # three sequences per step
    # Bytes held by tensors: 2 layers x K,V x 3 rows x 2 heads x 64 dims x 304 tokens in fp32 for DynamicCache.
    assert rows["dynamic"]["kv_bytes"] == 2 * 2 * 3 * 2 * 64 * 304 * 4
    assert rows["int8"]["kv_bytes"] < rows["dynamic"]["kv_bytes"] / 2


def test_random_weights_need_a_config(tmp_path):
    from kvpack.models import random_weights_model

    with pytest.raises(ValueError, match="config.json"):
        random_weights_model(tmp_path)


def test_layer_decode_attention_runs_the_models_path_and_matches_its_cache():
    row = bench_attention.bench_one("turboquant:k3v2", 600, "d64-gqa7", reps=2, batch=2)
    assert row["path"] == "fused" and row["batch"] == 2
    assert row["max_abs_err_vs_dequantized"] < 1e-4  # attention on the codes = attention over the decoded cache
    assert row["bf16_bytes"] / row["cache_bytes"] > 3
    assert row["speedup_vs_sdpa"] == pytest.approx(row["sdpa_ms"] / row["ours_ms"])


def test_synthetic_keys_are_low_rank_before_rope():
    """Shard's PCA finds a rank below full on the benchmark's keys (as on real keys), so its kernel does the
    work it does on a model."""
    kv, _, d = bench_attention.SHAPES["d64-gqa7"]
    layer = bench_attention.build_layer("shard", 1200, kv, d)
    codec = layer.segments[0].key_codec
    assert codec.rank < kv * d


def test_a_copied_tree_records_the_commit_it_names(monkeypatch):
    monkeypatch.setenv("KVPACK_GIT_SHA", "0123abc")
    assert environment("x")["git_sha"] == "0123abc"
    monkeypatch.delenv("KVPACK_GIT_SHA")
    assert environment("x")["git_sha"] != "0123abc"


def test_a_result_records_when_it_was_measured():
    import datetime

    stamped = datetime.datetime.fromisoformat(environment("x")["date"])
    assert stamped.tzinfo is not None
    assert abs(stamped - datetime.datetime.now(datetime.timezone.utc)) < datetime.timedelta(minutes=5)


def test_forward_takes_a_batch_of_rows(eval_tiny):
    from transformers import DynamicCache

    from kvpack.eval.generate import forward

    model, _ = eval_tiny
    ids = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    logits = forward(model, ids, DynamicCache(config=model.config))
    single = forward(model, ids[1], DynamicCache(config=model.config))
    assert logits.shape[:2] == (3, 1)
    torch.testing.assert_close(logits[1], single[0], atol=1e-5, rtol=1e-5)
