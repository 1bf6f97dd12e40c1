"""scripts/check_readme_figures.py: every README figure reads its result file, none is typed by hand, each is quoted
once, and every README and docs link resolves. Small result files in tmp_path stand in for bench/results/."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build_readme  # noqa: E402
import check_readme_figures as check  # noqa: E402

DRAWS = [0.83, 2.08, 1.38]  # three draws' perplexity changes, %


@pytest.fixture
def results(tmp_path: Path) -> Path:
    rows = [{"method": "dynamic", "ppl_delta_pct": 0.0, "context": 2048}]
    rows += [{"method": f"m@seed={i}", "ppl_delta_pct": d, "context": 2048} for i, d in enumerate(DRAWS)]
    rows += [{"method": "m@seed=9", "ppl_delta_pct": 50.0, "context": 8192}]
    (tmp_path / "draws.json").write_text(json.dumps({"environment": {"command": "python make_draws.py"}, "rows": rows}))
    return tmp_path


FIGURES = {"fig": {"ppl": {"file": "draws.json", "method": "m@seed=*", "where": {"context": 2048}, "field": "ppl_delta_pct",
                           "format": "{mean:+.2f}% ({min:+.2f} to {max:+.2f}%), {n} draws"}}}


def test_a_figure_is_the_statistics_of_the_rows_it_selects(results):
    stats = build_readme.fig_stats(FIGURES["fig"]["ppl"], results)
    assert stats["n"] == 3 and stats["min"] == 0.83 and stats["max"] == 2.08  # the 8K row and the baseline left out
    assert stats["mean"] == pytest.approx(sum(DRAWS) / 3)
    assert build_readme.render_readme("{{fig:ppl}}", FIGURES, results) == "+1.43% (+0.83 to +2.08%), 3 draws"


def test_value_needs_exactly_one_row(results):
    figures = {"fig": {"one": FIGURES["fig"]["ppl"] | {"format": "{value:+.2f}%"}}}
    with pytest.raises(ValueError, match="value needs one"):
        build_readme.render_readme("{{fig:one}}", figures, results)


def test_the_readme_as_built_passes(results):
    source = "The default moves by {{fig:ppl}} over draws."
    readme = build_readme.render_readme(source, FIGURES, results)
    assert check.figure_problems(source, readme, FIGURES, results) == []


def test_a_stale_readme_fails(results):
    source = "The default moves by {{fig:ppl}} over draws."
    problems = check.figure_problems(source, "The default moves by +0.50% (+0.83 to +2.08%), 3 draws over draws.", FIGURES, results)
    assert len(problems) == 1 and "{{fig:ppl}}" in problems[0] and "build_readme" in problems[0]


def test_a_figure_without_its_file_fails(results):
    (results / "draws.json").unlink()
    problems = check.figure_problems("{{fig:ppl}}", "", FIGURES, results)
    assert any("bench/results/draws.json does not exist" in p for p in problems), problems


def test_a_file_without_its_command_fails(results):
    data = json.loads((results / "draws.json").read_text())
    del data["environment"]
    (results / "draws.json").write_text(json.dumps(data))
    source = "{{fig:ppl}}"
    problems = check.figure_problems(source, build_readme.render_readme(source, FIGURES, results), FIGURES, results)
    assert any("records no command" in p for p in problems), problems


def test_an_undefined_figure_fails(results):
    assert any("not defined" in p for p in check.figure_problems("{{fig:nope}}", "", FIGURES, results))


@pytest.mark.parametrize("typed", ["5.49x smaller", "at +1.52% on average", "a 52.3 ms step", "189.0 MB", "−0.56% on Qwen"])
def test_a_number_typed_into_the_source_fails(results, typed):
    source = f"{{{{fig:ppl}}}} and {typed}."
    problems = check.figure_problems(source, build_readme.render_readme(source, FIGURES, results), FIGURES, results)
    assert len(problems) == 1 and "written by hand" in problems[0], problems


@pytest.mark.parametrize("fine", ["within +1% on every model", "about 5x smaller", "1,789 tests", "`@anchors=0.5%`",
                                  "```bash\nkvpack eval --ratio 2.5x\n```", "[a link](results-0.5x.md)"])
def test_targets_counts_code_and_link_targets_are_not_measurements(results, fine):
    assert check.figure_problems(fine, fine, FIGURES, results) == []


def test_a_figure_quoted_twice_fails(results):
    source = "{{fig:ppl}} and again {{fig:ppl}}"
    problems = check.figure_problems(source, build_readme.render_readme(source, FIGURES, results), FIGURES, results)
    assert len(problems) == 1 and "quoted 2 times" in problems[0]


def test_links_and_anchors_must_resolve(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "ROOT", tmp_path)
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "a.md").write_text("# A page\n\n## The `+tcq` codes (2026-11-26)\n\ntext\n")
    page = tmp_path / "index.md"
    page.write_text("[ok](guide/a.md) [ok](guide/a.md#the-tcq-codes-2026-11-26) [ok](#top) [ok](https://x.org/y)\n\n# Top\n"
                    "```\n[in code](nowhere.md)\n```\n[gone](guide/b.md) [bad anchor](guide/a.md#nothing)\n")
    problems = check.link_problems([page])
    assert len(problems) == 2, problems
    assert "guide/b.md does not exist" in problems[0] and "has no heading #nothing" in problems[1]


def test_the_readme_and_the_docs_pass_the_check():
    assert check.main([]) == 0
