"""Reward of the short-answer chat task (``short_answers.jsonl``): 1 when the reply starts with the
answer, 0.5 when the answer appears later in the reply, 0 otherwise (case and punctuation ignored; a leading
"The capital of France is" style phrase is dropped)."""

from __future__ import annotations

import re

_LEAD = re.compile(r"^(the\s+)?[\w\s]*?(answer|capital|symbol|opposite)[^:]*?\bis\b\s*:?\s*", re.I)


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s'-]", " ", text.lower()).split())


def score(completion: str, answer: str, question: str) -> float:
    reply = _norm(_LEAD.sub("", completion.strip().splitlines()[0] if completion.strip() else ""))
    want = _norm(answer)
    if not want:
        return 0.0
    if reply == want or reply.startswith(want + " "):
        return 1.0
    return 0.5 if re.search(rf"\b{re.escape(want)}\b", _norm(completion)) else 0.0
