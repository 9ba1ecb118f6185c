"""Reward of the word-facts chat task (``word_facts.jsonl``: past tenses, plurals, young animals, languages,
the next number; ``everyday_facts.jsonl`` is scored the same way): 1 when the reply's first words are the answer,
0.5 when the answer is a word of the reply, 0 otherwise. Case and punctuation are ignored, and so is a lead-in that
ends in "is", "are" or "called" ("The past tense of go is went", "A baby cat is called a kitten")."""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9]+")
_LEAD_END = {"is", "are", "called"}
_ARTICLES = {"a", "an", "the"}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def score(completion: str, answer: str, question: str) -> float:
    want = _words(answer)
    said = _words(completion)
    if not want or not said:
        return 0.0
    starts = [0] + [i + 1 for i, w in enumerate(said) if w in _LEAD_END]
    for start in starts:  # the reply itself, or what follows an "... is", "... are" or "... called"
        rest = said[start:]
        while rest and rest[0] in _ARTICLES:
            rest = rest[1:]
        if rest[:len(want)] == want:
            return 1.0
    text = " ".join(said)
    return 0.5 if re.search(rf"\b{re.escape(' '.join(want))}\b", text) else 0.0
