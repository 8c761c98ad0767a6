"""The verifiable task: signed 3-digit addition/subtraction, and its character tokenizer.

A question is ``"042+917="`` or ``"042-917="`` (operands zero-padded to a fixed width, so every
prompt has the same length and batches need no padding); the answer is the exact integer
written plainly (``"959"``, ``"-875"``) followed by the end token. The reward is exact match.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+-="
VOCAB_SIZE = 3 + len(CHARS)
_ID = {c: i + 3 for i, c in enumerate(CHARS)}


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (characters of :data:`CHARS` only)."""
    try:
        return [_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {CHARS!r}") from None


def decode(ids) -> str:
    """Text up to (not including) the first end token; PAD and BOS are skipped."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i >= 3:
            out.append(CHARS[i - 3])
    return "".join(out)


@dataclass(frozen=True)
class Question:
    a: int
    b: int
    op: str

    @property
    def prompt(self) -> str:
        return f"{self.a:03d}{self.op}{self.b:03d}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)


PROMPT_LEN = 1 + len(Question(0, 0, "+").prompt)  # BOS + "aaa+bbb="
MAX_ANSWER_LEN = 5  # "-999" or "1998", then EOS


def make_splits(seed: int, n_train: int, n_dev: int, n_test: int):
    """Disjoint train / dev / test lists of distinct questions drawn from ``seed``."""
    total = n_train + n_dev + n_test
    if total > 2 * 1000 * 1000:
        raise ValueError(f"only 2,000,000 distinct questions exist, asked for {total}")
    rng = random.Random(seed)
    seen: set[Question] = set()
    questions = []
    while len(questions) < total:
        q = Question(rng.randrange(1000), rng.randrange(1000), rng.choice("+-"))
        if q not in seen:
            seen.add(q)
            questions.append(q)
    return (questions[:n_train], questions[n_train:n_train + n_dev],
            questions[n_train + n_dev:])


def prompt_ids(questions) -> torch.Tensor:
    """(n, PROMPT_LEN) int64: BOS then the prompt characters."""
    return torch.tensor([[BOS] + encode(q.prompt) for q in questions], dtype=torch.int64)


def answer_ids(questions) -> torch.Tensor:
    """(n, MAX_ANSWER_LEN) int64: answer characters, EOS, then PAD."""
    rows = []
    for q in questions:
        ids = encode(q.answer) + [EOS]
        rows.append(ids + [PAD] * (MAX_ANSWER_LEN - len(ids)))
    return torch.tensor(rows, dtype=torch.int64)


def rewards(questions, responses: torch.Tensor) -> torch.Tensor:
    """(n,) float32: 1 where the decoded response equals the answer exactly, else 0.

    responses: (n, T) int64 generated ids (an end token must close the answer).
    """
    out = []
    for q, ids in zip(questions, responses.tolist(), strict=True):
        out.append(float(EOS in ids and decode(ids) == q.answer))
    return torch.tensor(out, dtype=torch.float32)
