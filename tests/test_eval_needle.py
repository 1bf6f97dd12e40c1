"""Needle-in-a-haystack: scoring, needles, exact placement on token ids, the grid; retrieval on the real default model."""

import re

import pytest
import torch

from kvpack import cli
from kvpack.eval.methods import make_cache
from kvpack.eval.needle import (
    FACT_WORDS,
    KINDS,
    NeedleTrial,
    build_prompt,
    fact,
    make_needles,
    needle_grid,
    passkey,
    passkey_found,
    prompt_parts,
    recall,
    sentence_start,
    summarize,
    word_found,
)
from kvpack.eval.stats import wilson_interval
from kvpack.text import token_stream

HAYSTACK = " ".join(f"Sentence number {i} is here." for i in range(100))


@pytest.mark.parametrize(
    "answer, found",
    [(" 73914.", True), ("The passkey is 73914", True), ("73914 and 12345", True), ("739140", False), ("7391", False), ("73 914", False), ("", False)],
)
def test_exact_match_of_key_digits(answer, found):
    assert passkey_found(answer, "73914") is found
    assert passkey("73914").found(answer) is found


@pytest.mark.parametrize(
    "answer, found",
    [(" cardamom.", True), ("Cardamom", True), ("it is CARDAMOM, I think", True), (" cardam", False), ("cardamoms", False), ("", False)],
)
def test_fact_is_found_by_its_key_word_as_a_whole_word(answer, found):
    assert word_found(answer, "cardamom") is found
    assert fact("Marta", "cardamom").found(answer) is found


def test_fact_needle_reads_as_the_issue_states_it():
    needle = fact("Marta", "cardamom")
    assert needle.sentence == "The secret ingredient in Marta's soup is cardamom."
    assert needle.question == "What is the secret ingredient in Marta's soup?"
    assert needle.answer_prefix == "The secret ingredient in Marta's soup is" and needle.key == "cardamom"


@pytest.mark.parametrize("kind", KINDS)
def test_make_needles_is_reproducible_distinct_and_of_its_kind(kind):
    needles = make_needles(kind, 8, seed=3)
    assert needles == make_needles(kind, 8, seed=3) and needles != make_needles(kind, 8, seed=4)
    assert len({n.sentence for n in needles}) == 8 and {n.kind for n in needles} == {kind}
    assert all(n.key in n.sentence and n.found(n.sentence) for n in needles)
    if kind == "passkey":
        assert all(re.fullmatch(r"\d{5}", n.key) for n in needles)


def test_make_needles_skips_keys_the_haystack_already_holds():
    haystack = "A story about " + ", ".join(FACT_WORDS[1:]) + "."  # every key word but the first
    needles = make_needles("fact", 12, seed=0, avoid=haystack)
    assert {n.key for n in needles} == {FACT_WORDS[0]}  # 12 names x the one word left
    with pytest.raises(ValueError, match="only 12 distinct fact needles"):
        make_needles("fact", 13, seed=0, avoid=haystack)
    with pytest.raises(ValueError, match="passkey, fact"):
        make_needles("riddle", 1)


def test_fact_key_words_are_absent_from_the_corpora():
    from kvpack.text import load_text

    for name in ("news", "pydoc"):
        words = set(re.findall(r"[a-z]+", load_text(name).lower()))
        assert not words & set(FACT_WORDS), name


def _tiny_tokenizer_with_chat_template(tok):
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="</s>")
    tok.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    return tok


def _filler(tok):
    return torch.tensor(tok(HAYSTACK * 3, add_special_tokens=False).input_ids)


def _find(ids: torch.Tensor, part: torch.Tensor) -> list[int]:
    return [i for i in range(len(ids) - len(part) + 1) if torch.equal(ids[i : i + len(part)], part)]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("needle", [passkey("55555"), fact("Marta", "cardamom")], ids=["passkey", "fact"])
def test_depth_0_is_the_first_document_token_and_1_the_last_before_the_question(eval_tiny, chat, needle):
    tok = _tiny_tokenizer_with_chat_template(eval_tiny[1]) if chat else eval_tiny[1]
    head, tail = prompt_parts(tok, needle)
    bare = torch.tensor(tok(needle.sentence, add_special_tokens=False).input_ids)
    spaced = torch.tensor(tok(" " + needle.sentence, add_special_tokens=False).input_ids)
    filler = _filler(tok)

    document, question = build_prompt(tok, filler, 600, 0.0, needle)
    assert torch.equal(document[: len(head)], head) and torch.equal(question, tail)
    assert torch.equal(document[len(head) : len(head) + len(bare)], bare)  # the very first document tokens
    assert torch.equal(document[len(head) + len(bare) :], filler[: len(document) - len(head) - len(bare)])
    assert len(document) + len(question) == 600

    document, question = build_prompt(tok, filler, 600, 1.0, needle)
    assert torch.equal(document[-len(spaced) :], spaced) and torch.equal(question, tail)  # the very last, then the question
    assert torch.equal(document[len(head) : -len(spaced)], filler[: len(document) - len(head) - len(spaced)])
    assert len(document) + len(question) == 600


@pytest.mark.parametrize("depth", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_middle_depths_land_on_the_sentence_start_nearest_the_depth(eval_tiny, depth):
    tok = eval_tiny[1]
    needle, filler = passkey("12345"), _filler(tok)
    head, tail = prompt_parts(tok, needle)
    spaced = torch.tensor(tok(" " + needle.sentence, add_special_tokens=False).input_ids)
    document, question = build_prompt(tok, filler, 1000, depth, needle)
    assert len(document) + len(question) == 1000
    (pos,) = _find(document, spaced)
    haystack = torch.cat([document[len(head) : pos], document[pos + len(spaced) :]])
    assert torch.equal(haystack, filler[: len(haystack)])  # the haystack is intact around the needle
    cut = pos - len(head)
    assert tok.decode(haystack[:cut]).endswith(".")  # after a full stop, never mid-sentence
    assert abs(cut - depth * len(haystack)) <= len(tok(" Sentence number 99 is here.").input_ids) / 2 + 1  # nearest start


def test_depth_out_of_range_raises(eval_tiny):
    with pytest.raises(ValueError, match="depth"):
        sentence_start(eval_tiny[1], _filler(eval_tiny[1]), 1.5)


def test_chat_template_wraps_the_document_and_starts_the_answer(eval_tiny):
    tok = _tiny_tokenizer_with_chat_template(eval_tiny[1])
    head, tail = prompt_parts(tok, passkey("12345"))
    assert tok.decode(head) == "<user>"
    assert tok.decode(tail).startswith("\n\nWhat is the secret passkey")
    assert tok.decode(tail).endswith("</user><bot>The secret passkey is")
    _, tail = prompt_parts(tok, fact("Marta", "cardamom"))
    assert tok.decode(tail).endswith("</user><bot>The secret ingredient in Marta's soup is")


def test_prompt_too_short_for_the_needle_raises(eval_tiny):
    with pytest.raises(ValueError, match="too short"):
        build_prompt(eval_tiny[1], _filler(eval_tiny[1]), 40, 0.5, fact("Marta", "cardamom"))


def test_grid_has_every_cell_kind_and_trial_with_distinct_needles_paired_across_runs(eval_tiny):
    model, tok = eval_tiny
    new_cache = lambda: make_cache(model, "dynamic")  # noqa: E731
    args = (model, tok, new_cache, [300, 400], [0.0, 1.0], "news", 0, 2)
    trials = needle_grid(*args, progress=False, trials=3, kinds=KINDS)
    assert len(trials) == 2 * 2 * 2 * 3
    for n in (300, 400):
        for d in (0.0, 1.0):
            for kind in KINDS:
                cell = [t for t in trials if (t.target_length, t.depth, t.kind) == (n, d, kind)]
                assert len(cell) == 3 and len({t.needle for t in cell}) == 3, cell
                assert all(t.key in t.needle for t in cell)
                assert all(t.length == n for t in cell)
    again = needle_grid(*args, progress=False, trials=3, kinds=KINDS)
    assert [(t.kind, t.needle) for t in again] == [(t.kind, t.needle) for t in trials]  # every method meets the same needles


def test_summary_counts_cells_and_kinds_with_wilson_intervals():
    def trial(n, d, kind, found):
        return NeedleTrial(n, n, d, "k", "", found, kind)

    trials = [trial(512, 0.0, "passkey", True), trial(512, 0.0, "fact", False), trial(512, 1.0, "passkey", True),
              trial(512, 1.0, "fact", True), trial(1024, 0.0, "passkey", False), trial(1024, 0.0, "fact", False)]
    summary = summarize(trials)
    assert (summary["found"], summary["total"]) == recall(trials) == (3, 6)
    assert summary["ci"] == list(wilson_interval(3, 6))
    assert {k: (v["found"], v["total"]) for k, v in summary["kinds"].items()} == {"passkey": (2, 3), "fact": (1, 3)}
    assert [(c["length"], c["depth"], c["found"], c["total"]) for c in summary["cells"]] == [(512, 0.0, 1, 2), (512, 1.0, 2, 2), (1024, 0.0, 0, 2)]
    assert summary["cells"][1]["ci"] == list(wilson_interval(2, 2))


@pytest.mark.parametrize(
    "flags, match",
    [(["--needle-kinds", "passkey,riddle"], r"--needle-kinds must be comma-separated names from passkey, fact, got 'passkey,riddle'"),
     (["--needle-trials", "0"], r"--needle-trials must be >= 1, got 0")],
)
def test_needle_flags_are_checked_before_the_model_loads(capsys, flags, match):
    assert cli.main(["eval", "--model", "tiny-random", *flags]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_demo_keeps_a_small_grid_and_eval_the_full_one():
    demo, ev = cli.parse_args(["demo"]), cli.parse_args(["eval"])
    assert (cli._list(demo.needle_depths, float), demo.needle_trials) == ([0.0, 0.5, 1.0], 1)
    assert (cli._list(ev.needle_depths, float), ev.needle_trials, cli._list(ev.needle_kinds)) == ([0.0, 0.25, 0.5, 0.75, 1.0], 2, list(KINDS))


@pytest.mark.slow
def test_real_default_model_finds_both_kinds_at_both_ends_uncompressed(eval_smollm2):
    model, tok = eval_smollm2
    needle, filler = fact("Marta", "cardamom"), token_stream(tok, "news", 1024)
    head, tail = prompt_parts(tok, needle)
    bare, spaced = (torch.tensor(tok(s, add_special_tokens=False).input_ids) for s in (needle.sentence, " " + needle.sentence))
    start, _ = build_prompt(tok, filler, 1024, 0.0, needle)  # placement on the real BPE and chat template
    end, question = build_prompt(tok, filler, 1024, 1.0, needle)
    assert torch.equal(start[len(head) : len(head) + len(bare)], bare) and torch.equal(end[-len(spaced) :], spaced)
    assert torch.equal(question, tail) and len(end) + len(question) == 1024
    trials = needle_grid(model, tok, lambda: make_cache(model, "dynamic"), [1024], [0.0, 1.0], progress=False, kinds=KINDS)
    assert recall(trials) == (4, 4), [(t.kind, t.depth, t.answer) for t in trials]
