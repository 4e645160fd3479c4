"""Reward functions with trl's signature for the arithmetic prompts (``tiny_model.write_prompt_dataset``).

Each takes the batch's ``completions`` (conversational: a list of messages; or text) and the dataset's
other columns as keywords, and returns one float per completion.  The tests and ``benchmarks/trl_grpo.py``
copy this file beside trl's ``grpo.py``/``rloo.py`` and name them by dotted path (``rewards.answer_reward``).
"""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return str(completion[-1]["content"] if isinstance(completion, list) else completion)


def answer_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion is the ``answer`` column's value, else 0.0."""
    return [1.0 if _text(c).strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def digit_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """The share of the completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in _text(c)) / max(len(_text(c)), 1) for c in completions]
