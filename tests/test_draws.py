"""`kvpack compare --draws N`: each method that draws at random runs at N rotation draws, reported as the mean with the
spread (kvpack/eval/report.py `draw_summaries`, kvpack/cli.py `expand_draws`)."""

import json
import math

import pytest

from kvpack import cli
from kvpack.eval.report import draw_summaries, format_draw_summaries

TINY = ["--model", "tiny-random", "--context", "192", "--ppl-tokens", "32", "--chunk", "16", "--no-needle",
        "--decode-tokens", "2", "--fidelity-steps", "2", "--quiet"]


def _row(method: str, delta: float | None, status: str = "ok", ratio: float = 5.0, found: int = 3) -> dict:
    return {"method": method, "status": status, "ppl_delta_pct": delta, "ratio_vs_fp16": ratio, "needle_found": found, "needle_total": 4}


def test_a_method_at_several_draws_is_summarized_as_its_mean_and_spread():
    rows = [
        _row("dynamic", 0.0),
        _row("turboquant:k3v2@seed=0", 1.0, ratio=4.0),
        _row("turboquant:k3v2@seed=1", 2.0, ratio=5.0, found=4),
        _row("turboquant:k3v2@seed=2", 4.0, ratio=6.0, found=2),
        _row("turboquant:k3v2@seed=3", None, status="error: out of memory"),  # a failed draw is not averaged in
        _row("kivi:2", 3.0),  # one run, no draws
        _row("turboquant:k4v4@seed=7", 0.5),  # one draw alone: nothing to summarize
        _row("turboquant:k3v2+ropemean@seed=0@window=32", 0.4),  # the seed need not be the last suffix
        _row("turboquant:k3v2+ropemean@seed=1@window=32", 0.8),
    ]
    by_method = {s["method"]: s for s in draw_summaries(rows)}
    assert set(by_method) == {"turboquant:k3v2", "turboquant:k3v2+ropemean@window=32"}
    s = by_method["turboquant:k3v2"]
    assert s["seeds"] == [0, 1, 2] and s["ppl_delta_pct"]["each"] == [1.0, 2.0, 4.0]
    d = s["ppl_delta_pct"]  # by hand: mean 7/3, sample variance ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3
    assert d["mean"] == pytest.approx(7 / 3) and d["sd"] == pytest.approx(math.sqrt(7 / 3)) and (d["min"], d["max"]) == (1.0, 4.0)
    assert s["ratio_vs_fp16"] == pytest.approx(5.0) and (s["needle_found"], s["needle_total"]) == (9, 12)
    assert by_method["turboquant:k3v2+ropemean@window=32"]["ppl_delta_pct"]["sd"] == pytest.approx(math.sqrt(0.08))
    table = format_draw_summaries(draw_summaries(rows))
    assert "turboquant:k3v2 " in table and "+2.33%" in table and "1.53" in table and "+1.00 to +4.00%" in table
    assert "+1.00 / +2.00 / +4.00" in table and "9/12" in table
    assert format_draw_summaries([]) == ""


def test_only_methods_that_draw_at_random_get_draws():
    methods = ["dynamic", "int8", "turboquant:k3v2", "turboquant:k3v2@seed=5", "hf-quanto:4", "auto:1%", "shard"]
    assert cli.expand_draws(methods, 3) == [
        "dynamic", "int8", "turboquant:k3v2@seed=0", "turboquant:k3v2@seed=1", "turboquant:k3v2@seed=2",
        "turboquant:k3v2@seed=5", "hf-quanto:4", "auto:1%", "shard@seed=0", "shard@seed=1", "shard@seed=2",
    ]
    assert cli.expand_draws(methods, 1) == methods


def test_compare_with_draws_runs_each_draw_and_writes_the_summary(tmp_path, capsys):
    out = tmp_path / "draws.json"
    assert cli.main(["compare", *TINY, "--methods", "int8,turboquant:k2v2", "--draws", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    names = [r["method"] for r in data["rows"]]
    assert names == ["dynamic", "int8", "turboquant:k2v2@seed=0", "turboquant:k2v2@seed=1"]
    draws = [r for r in data["rows"] if r["method"].startswith("turboquant")]
    assert draws[0]["ppl_delta_pct"] != draws[1]["ppl_delta_pct"]  # another rotation draw codes the cache differently
    (summary,) = data["draws"]
    assert summary["method"] == "turboquant:k2v2" and summary["seeds"] == [0, 1]
    assert summary["ppl_delta_pct"]["mean"] == pytest.approx(sum(r["ppl_delta_pct"] for r in draws) / 2)
    assert "method, over rotation draws" in printed and "turboquant:k2v2" in printed


def test_compare_refuses_fewer_than_one_draw(capsys):
    assert cli.main(["compare", *TINY, "--methods", "int8", "--draws", "0"]) == 2
    assert "--draws must be >= 1, got 0" in capsys.readouterr().err
