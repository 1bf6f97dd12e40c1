"""Needle in a haystack: a passkey sentence hidden at a depth of real news text, retrieved by greedy generation.

The document (haystack + needle) is prefilled into the cache first; the question is fed as a second
block, so every question and answer token reads the document from the compressed cache. A trial
counts as found when the generated text contains the key as a whole number (exact digits).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..text import token_stream
from .generate import eos_ids, forward, greedy

NEEDLE = "The secret passkey is {key}. Remember it."
QUESTION = "What is the secret passkey mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The secret passkey is"  # starts the reply, so the next tokens are the digits
BASE_QUESTION = "\n\nQuestion: What is the secret passkey mentioned in the text above?\nAnswer: " + ANSWER_PREFIX


@dataclass(frozen=True)
class NeedleTrial:
    length: int  # prompt tokens actually fed
    target_length: int
    depth: float
    key: str
    answer: str
    found: bool

    def as_dict(self) -> dict:
        return asdict(self)


def make_key(seed: int) -> str:
    """A 5-digit passkey, reproducible from the seed."""
    return str(random.Random(seed).randrange(10_000, 100_000))


def passkey_found(generated: str, key: str) -> bool:
    """Exact match of the key digits: the key must appear as a whole digit run ('739140' does not match '73914')."""
    return key in re.findall(r"\d+", generated)


def insert_at_depth(text: str, needle: str, depth: float) -> str:
    """Insert `needle` at the sentence boundary nearest to `depth` (0 = start, 1 = end) of `text`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    target = round(depth * len(text))
    boundaries = [0, len(text)] + [m.end() for m in re.finditer(r"[.!?]\s+", text)]
    cut = min(boundaries, key=lambda b: (abs(b - target), b))
    before, after = text[:cut].rstrip(), text[cut:].lstrip()
    return " ".join(part for part in (before, needle, after) if part)


def split_prompt(tokenizer, document: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, question ids): the chat template's user turn when the model has one, else a plain Q/A suffix.

    Either way the question ends with the start of the answer ("The secret passkey is"), as in the
    passkey-retrieval protocol, so a verbose model spends its tokens on the digits.
    """
    if getattr(tokenizer, "chat_template", None):
        content = document + "\n\n" + QUESTION
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        cut = rendered.index(document) + len(document)
        head, tail = rendered[:cut], rendered[cut:] + ANSWER_PREFIX
        head_ids = tokenizer(head, add_special_tokens=False).input_ids
    else:
        tail = BASE_QUESTION
        head_ids = tokenizer(document, add_special_tokens=True).input_ids
    tail_ids = tokenizer(tail, add_special_tokens=False).input_ids
    return torch.tensor(head_ids), torch.tensor(tail_ids)


def build_prompt(tokenizer, filler_ids: torch.Tensor, length: int, depth: float, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A document of news text sized so that document + question is about `length` tokens, the needle at `depth`."""
    needle = NEEDLE.format(key=key)
    head, tail = split_prompt(tokenizer, needle)
    budget = length - len(head) - len(tail)
    if budget < 1:
        raise ValueError(f"length {length} is too short for the needle prompt ({len(head) + len(tail)} tokens)")
    if budget > len(filler_ids):
        raise ValueError(f"need {budget} filler tokens, the text has {len(filler_ids)}")
    haystack = tokenizer.decode(filler_ids[:budget], skip_special_tokens=True)
    return split_prompt(tokenizer, insert_at_depth(haystack, needle, depth))


@torch.no_grad()
def needle_trial(model, tokenizer, cache, filler_ids, length: int, depth: float, key: str, max_new_tokens: int = 10) -> NeedleTrial:
    document, question = build_prompt(tokenizer, filler_ids, length, depth, key)
    forward(model, document, cache)
    tokens = greedy(model, cache, forward(model, question, cache), max_new_tokens, eos_ids(tokenizer, model))
    answer = tokenizer.decode(tokens, skip_special_tokens=True)
    return NeedleTrial(len(document) + len(question), length, depth, key, answer, passkey_found(answer, key))


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
) -> list[NeedleTrial]:
    """One trial per (length, depth), each with a fresh cache and its own key (seeded by the grid position)."""
    filler = token_stream(tokenizer, text, max(lengths))
    grid = [(n, d) for n in lengths for d in depths]
    trials = []
    for i, (n, d) in enumerate(tqdm(grid, desc="needle", unit="trial", disable=not progress, leave=False)):
        trials.append(needle_trial(model, tokenizer, new_cache(), filler, n, d, make_key(seed * 1000 + i), max_new_tokens))
    return trials


def recall(trials: list[NeedleTrial]) -> tuple[int, int]:
    """(found, total)."""
    return sum(t.found for t in trials), len(trials)
