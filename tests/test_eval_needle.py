"""Needle-in-a-haystack: scoring and placement on synthetic strings, retrieval on the real default model."""

import pytest

from kvpack.eval.methods import make_cache
from kvpack.eval.needle import NEEDLE, build_prompt, insert_at_depth, make_key, needle_grid, passkey_found, recall, split_prompt

HAYSTACK = " ".join(f"Sentence number {i} is here." for i in range(100))


@pytest.mark.parametrize(
    "answer, found",
    [(" 73914.", True), ("The passkey is 73914", True), ("73914 and 12345", True), ("739140", False), ("7391", False), ("73 914", False), ("", False)],
)
def test_exact_match_of_key_digits(answer, found):
    assert passkey_found(answer, "73914") is found


def test_make_key_is_reproducible_five_digits():
    assert make_key(3) == make_key(3) and len(make_key(3)) == 5 and make_key(3).isdigit()
    assert len({make_key(i) for i in range(20)}) > 15


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_needle_lands_at_the_sentence_boundary_nearest_the_depth(depth):
    needle = NEEDLE.format(key="12345")
    text = insert_at_depth(HAYSTACK, needle, depth)
    pos = text.index(needle)
    assert text.replace(needle + " ", "").replace(" " + needle, "") == HAYSTACK
    assert abs(pos - depth * len(HAYSTACK)) <= len("Sentence number 99 is here. ")  # within one sentence
    assert pos == 0 or text[pos - 2] == "."  # after a full stop, never mid-sentence


def test_depth_out_of_range_raises():
    with pytest.raises(ValueError, match="depth"):
        insert_at_depth(HAYSTACK, "x", 1.5)


def test_prompt_length_and_needle_position(eval_tiny):
    _, tok = eval_tiny
    filler = tok(HAYSTACK * 3, add_special_tokens=False, return_tensors="pt").input_ids[0]
    document, question = build_prompt(tok, filler, 1000, 0.25, "55555")
    assert abs(len(document) + len(question) - 1000) <= 4
    text = tok.decode(document)
    assert abs(text.index("55555") / len(text) - 0.25) < 0.05
    assert tok.decode(question).endswith("The secret passkey is")


def test_chat_template_splits_after_the_document(eval_tiny):
    _, tok = eval_tiny
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="</s>")
    tok.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    document, question = split_prompt(tok, "The document.")
    assert tok.decode(document) == "<user>The document."
    assert tok.decode(question).startswith("\n\nWhat is the secret passkey")
    assert tok.decode(question).endswith("</user><bot>The secret passkey is")


@pytest.mark.slow
def test_real_default_model_finds_the_needle_uncompressed(eval_smollm2):
    model, tok = eval_smollm2
    trials = needle_grid(model, tok, lambda: make_cache(model, "dynamic"), [1024], [0.2, 0.8], progress=False)
    assert recall(trials) == (2, 2), [t.answer for t in trials]
