"""Needle in a haystack: a sentence hidden at a depth of real news text, retrieved by greedy generation.

Two kinds of needle (KINDS), each asked about after the document, the reply started for the model:
- passkey: "The secret passkey is 73914. Remember it." -> found when the 5 digits appear as a whole number;
- fact:    "The secret ingredient in Marta's soup is cardamom." -> found when the reply contains "cardamom"
           as a word. Ordinary words, like the text around them, where the passkey's digits stand out.

Placement is on token ids: the haystack's ids are cut at the sentence start nearest to `depth` and the
needle's ids inserted there, so depth 0.0 puts the needle on the very first document tokens (right after
the chat template's opening) and 1.0 on the very last, just before the question; the prompt is exactly
`length` tokens. The document is prefilled into the cache first and the question fed as a second block,
so every question and answer token reads the document from the compressed cache.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..text import token_stream
from .generate import eos_ids, forward, greedy
from .stats import wilson_interval

KINDS = ("passkey", "fact")
# Key words and names absent from the news and pydoc corpora (a needle whose answer the haystack already
# holds measures nothing; make_needles also skips any that the haystack in use contains).
FACT_NAMES = ("Marta", "Tomasz", "Ingrid", "Lucia", "Ravi", "Anneke", "Hiroshi", "Dalia", "Emeka", "Sven", "Noor", "Bettina")
FACT_WORDS = ("cardamom", "turmeric", "fenugreek", "tarragon", "sumac", "paprika", "coriander", "oregano", "cumin", "galangal",
              "lemongrass", "wasabi")
_PASSKEYS = range(10_000, 100_000)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")  # a token after which a new sentence may start
_DOCUMENT = "<<kvpack-document>>"  # stands for the document while the chat template is rendered


@dataclass(frozen=True)
class Needle:
    """The sentence hidden in the text, the question about it, and the key the reply must contain."""

    kind: str  # one of KINDS
    key: str  # passkey digits, or the fact's key word
    sentence: str
    question: str
    answer_prefix: str  # starts the reply, so a verbose model spends its tokens on the answer

    def found(self, answer: str) -> bool:
        return passkey_found(answer, self.key) if self.kind == "passkey" else word_found(answer, self.key)


def passkey(key: str) -> Needle:
    return Needle("passkey", key, f"The secret passkey is {key}. Remember it.",
                  "What is the secret passkey mentioned in the text above? Answer with the number only.", "The secret passkey is")


def fact(name: str, word: str) -> Needle:
    subject = f"secret ingredient in {name}'s soup"
    return Needle("fact", word, f"The {subject} is {word}.", f"What is the {subject}?",
                  f"The {subject} is")


def make_needles(kind: str, count: int, seed: int = 0, avoid: str = "") -> list[Needle]:
    """`count` distinct needles of one kind, reproducible from the seed, none of whose keys `avoid` (the haystack) holds."""
    if kind not in KINDS:
        raise ValueError(f"needle kind must be one of {', '.join(KINDS)}; got {kind!r}")
    pool = len(_PASSKEYS) if kind == "passkey" else len(FACT_NAMES) * len(FACT_WORDS)
    rng, seen, needles = random.Random(f"{kind}:{seed}"), set(), []
    while len(needles) < count:
        if len(seen) == pool:
            raise ValueError(f"only {len(needles)} distinct {kind} needles are possible here, {count} asked")
        i = rng.randrange(pool)
        if i not in seen:
            seen.add(i)
            needle = passkey(str(_PASSKEYS[i])) if kind == "passkey" else fact(FACT_NAMES[i // len(FACT_WORDS)], FACT_WORDS[i % len(FACT_WORDS)])
            needles += [] if needle.found(avoid) else [needle]
    return needles


def passkey_found(generated: str, key: str) -> bool:
    """Exact match of the key digits: the key must appear as a whole digit run ('739140' does not match '73914')."""
    return key in re.findall(r"\d+", generated)


def word_found(generated: str, word: str) -> bool:
    """The word as a whole word, any case ('Cardamom.' matches 'cardamom'; 'cardam' does not)."""
    return re.search(rf"\b{re.escape(word)}\b", generated, flags=re.IGNORECASE) is not None


def _ids(tokenizer, text: str, special: bool = False) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=special).input_ids, dtype=torch.long)


def prompt_parts(tokenizer, needle: Needle) -> tuple[torch.Tensor, torch.Tensor]:
    """(head [H], tail [Q]) token ids around the document: the chat template's user turn when the model has one, else BOS
    and a plain "Question: ... Answer:" suffix. Either way the tail ends with the start of the answer (needle.answer_prefix)."""
    if getattr(tokenizer, "chat_template", None):
        content = _DOCUMENT + "\n\n" + needle.question
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        head, _, tail = rendered.partition(_DOCUMENT)
        return _ids(tokenizer, head), _ids(tokenizer, tail + needle.answer_prefix)
    return _ids(tokenizer, "", special=True), _ids(tokenizer, f"\n\nQuestion: {needle.question}\nAnswer: {needle.answer_prefix}")


def sentence_start(tokenizer, haystack: torch.Tensor, depth: float) -> int:
    """The position in haystack ([N] ids) where a sentence starts (or 0, or N) nearest to depth * N; ties go earlier."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    pieces = tokenizer.batch_decode(haystack.view(-1, 1).tolist())
    starts = [0, len(pieces)] + [i + 1 for i, piece in enumerate(pieces[:-1]) if _SENTENCE_END.search(piece)]
    target = depth * len(pieces)
    return min(starts, key=lambda s: (abs(s - target), s))


def build_prompt(tokenizer, filler_ids: torch.Tensor, length: int, depth: float, needle: Needle | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(document [D], question [Q]) with D + Q == length: head, filler_ids[:cut], the needle, the rest of the haystack.

    `needle` may be a passkey string (the original API). The needle opens the document without a leading
    space at depth 0 and follows a sentence with one elsewhere; the haystack absorbs the token difference.
    """
    needle = passkey(needle) if isinstance(needle, str) else needle
    head, tail = prompt_parts(tokenizer, needle)
    spaced, bare = _ids(tokenizer, " " + needle.sentence), _ids(tokenizer, needle.sentence)
    room = length - len(head) - len(tail) - len(spaced)  # haystack tokens
    if room < 1:
        raise ValueError(f"length {length} is too short for the needle prompt ({length - room} tokens)")
    if room > len(filler_ids):
        raise ValueError(f"need {room} filler tokens, the text has {len(filler_ids)}")
    cut = sentence_start(tokenizer, filler_ids[:room], depth)
    inserted = bare if cut == 0 else spaced
    haystack = filler_ids[: room + len(spaced) - len(inserted)]
    return torch.cat([head, haystack[:cut], inserted, haystack[cut:]]), tail


@dataclass(frozen=True)
class NeedleTrial:
    length: int  # prompt tokens actually fed
    target_length: int
    depth: float
    key: str
    answer: str
    found: bool
    kind: str = "passkey"
    needle: str = ""  # the sentence hidden in the text

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def needle_trial(
    model, tokenizer, cache, filler_ids, length: int, depth: float, needle: Needle | str, max_new_tokens: int = 10
) -> NeedleTrial:
    """One retrieval through `cache`: prefill the document, feed the question, decode greedily. A string is a passkey."""
    needle = passkey(needle) if isinstance(needle, str) else needle
    document, question = build_prompt(tokenizer, filler_ids, length, depth, needle)
    forward(model, document, cache)
    tokens = greedy(model, cache, forward(model, question, cache), max_new_tokens, eos_ids(tokenizer, model))
    answer = tokenizer.decode(tokens, skip_special_tokens=True)
    return NeedleTrial(len(document) + len(question), length, depth, needle.key, answer, needle.found(answer), needle.kind, needle.sentence)


def needle_grid(
    model,
    tokenizer,
    new_cache: Callable[[], object],
    lengths: list[int],
    depths: list[float],
    text: str = "news",
    seed: int = 0,
    max_new_tokens: int = 10,
    progress: bool = True,
    trials: int = 1,
    kinds: Sequence[str] = ("passkey",),
) -> list[NeedleTrial]:
    """`trials` distinct needles of every kind per (length, depth) cell, each trial with a fresh cache.

    The needles are seeded by (seed, cell), so every method meets the same needles in the same places. The
    defaults (one passkey per cell) keep the original grid for existing callers; `kvpack eval` asks for more.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    filler = token_stream(tokenizer, text, max(lengths))
    avoid = tokenizer.decode(filler)
    grid = [(n, d, needle) for i, (n, d) in enumerate((n, d) for n in lengths for d in depths)
            for kind in kinds for needle in make_needles(kind, trials, seed * 1000 + i, avoid)]
    return [needle_trial(model, tokenizer, new_cache(), filler, n, d, needle, max_new_tokens)
            for n, d, needle in tqdm(grid, desc="needle", unit="trial", disable=not progress, leave=False)]


def recall(trials: list[NeedleTrial]) -> tuple[int, int]:
    """(found, total)."""
    return sum(t.found for t in trials), len(trials)


def _recall(trials: list[NeedleTrial], level: float) -> dict:
    found, total = recall(trials)
    return {"found": found, "total": total, "ci": list(wilson_interval(found, total, level)) if total else None}


def summarize(trials: list[NeedleTrial], level: float = 0.95) -> dict:
    """Recall overall, per kind and per (length, depth) cell, each with its Wilson interval ("ci": [lo, hi], fractions)."""
    cells = sorted({(t.target_length, t.depth) for t in trials})
    return {
        **_recall(trials, level),
        "kinds": {k: _recall([t for t in trials if t.kind == k], level) for k in dict.fromkeys(t.kind for t in trials)},
        "cells": [{"length": n, "depth": d, **_recall([t for t in trials if (t.target_length, t.depth) == (n, d)], level)} for n, d in cells],
    }
