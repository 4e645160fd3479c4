"""The data layer's common types: ``Sample``, ``LoadStats``, ``DataFormatError``, the validation split.

Loss tokens follow the shifted causal-LM loss (``data.loss``): the logit at position ``t`` predicts the
token at ``t + 1``, so position 0 is never predicted and a sample's loss tokens are the positions
``t >= 1`` whose label is not ``-100``.  A sample with no loss token teaches nothing and is skipped.
Reading files and tokenising rows: ``data.inputs``, ``data.records``, ``data.cache``, ``data.sources``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label value of a token that is not trained on (the ``ignore_index`` of the cross entropy)."""

OverlongPolicy = Literal["drop", "truncate", "error"]


class DataFormatError(ValueError):
    """Bad rows in a data file.  The message starts with the first one, ``file:line: problem`` (JSONL) or
    ``file row N: problem``, then the counts by reason and a few more examples when there are several."""

    def __init__(
        self,
        path: str | Path,
        line: int | None,
        problem: str,
        *,
        row: int | None = None,
        counts: dict[str, int] | None = None,
        examples: Sequence[str] = (),
    ) -> None:
        where = f"{path}:{line}" if line is not None else f"{path} row {row}" if row is not None else str(path)
        message = f"{where}: {problem}"
        if counts and sum(counts.values()) > 1:
            total = sum(counts.values())
            message += f"\n{total} bad rows in {path} ({', '.join(f'{n} {r}' for r, n in counts.items())})"
            message += "".join(f"\n  {e}" for e in examples)
        super().__init__(message)
        self.path = str(path)
        self.line = line
        self.row = row
        self.problem = problem
        self.counts = dict(counts or {})


@dataclass(frozen=True)
class Sample:
    """One training sample: token ids and their labels (``-100`` = not trained on).

    A sample is one sequence, or several packed into one (``seq_lengths``: the length of each, in order,
    summing to ``length``), as trl's ``bfd`` packing makes a bin: the planner counts it as one sample,
    and its sequences are batched apart (``sequences``), each attending to itself only and starting with
    an unpredicted token, as trl's padding-free collator lays a bin out.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    seq_lengths: tuple[int, ...] | None = None
    """Lengths of the packed sequences (two or more); None for a sample of one sequence."""

    @property
    def length(self) -> int:
        """Number of tokens."""
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        """Tokens that contribute to the shifted causal-LM loss: positions ``t >= 1`` of each sequence with
        a label.

        A sequence's first position is never predicted (nothing of it precedes it), so its label does
        not count; this is exactly the count ``data.loss.token_loss_sum`` reports for the sample.
        """
        return loss_token_count(self.labels, self.seq_lengths)

    def sequences(self) -> list[Sample]:
        """The sample's sequences, each a one-sequence ``Sample`` (itself when it is one)."""
        if self.seq_lengths is None:
            return [self]
        out, start = [], 0
        for length in self.seq_lengths:
            out.append(Sample(self.input_ids[start : start + length], self.labels[start : start + length]))
            start += length
        return out


def loss_token_count(labels: Sequence[int], seq_lengths: Sequence[int] | None = None) -> int:
    """Loss tokens of ``labels``: positions with a label other than each sequence's first (the whole row is
    one sequence without ``seq_lengths``)."""
    if not labels:
        return 0
    starts = [0] if not seq_lengths else [0, *itertools.accumulate(seq_lengths[:-1])]
    return (
        len(labels)
        - sum(1 for t in labels if t == IGNORE_INDEX)
        - sum(1 for s in starts if s < len(labels) and labels[s] != IGNORE_INDEX)
    )


def as_seq_lengths(value: Sequence[int] | None, length: int) -> tuple[int, ...] | None:
    """``seq_lengths`` as a ``Sample`` keeps them: None for one sequence (none given, empty, or one entry);
    raises ``ValueError`` unless they are positive and sum to ``length``."""
    if value is None or len(value) == 0:
        return None
    lengths = tuple(int(n) for n in value)
    if min(lengths) <= 0 or sum(lengths) != length:
        raise ValueError(f"'seq_lengths' {list(lengths)} must be positive and sum to the {length} tokens")
    return lengths if len(lengths) > 1 else None


@dataclass
class LoadStats:
    """What reading one data file found.

    ``lines`` counts records (rows; non-blank lines of JSONL); every record ends up in exactly one of
    ``samples``, ``dropped_overlong`` and ``empty_skipped`` (``truncated`` samples are also counted in
    ``samples`` or, if truncation left no loss token, in ``empty_skipped``).  ``cache`` is the tokenised
    cache folder; ``cache_hit`` says it was reused (nothing tokenised); ``seconds`` is the time to build
    or open it.
    """

    path: str
    lines: int = 0
    samples: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    empty_skipped: int = 0
    tokens: int = 0
    cache: str | None = None
    cache_hit: bool = False
    seconds: float = 0.0

    def describe(self, max_seq_len: int) -> str:
        """One line for the start-up summary."""
        skipped = [
            f"{n} {what}"
            for n, what in (
                (self.dropped_overlong, f"dropped as longer than max_seq_len={max_seq_len}"),
                (self.truncated, "truncated"),
                (self.empty_skipped, "without loss tokens skipped"),
            )
            if n
        ]
        source = f"cache hit {self.cache}" if self.cache_hit else f"tokenised into {self.cache or 'memory'}"
        return (
            f"{self.path}: {self.lines} rows -> {self.samples} samples, {self.tokens} tokens"
            f"{' (' + ', '.join(skipped) + ')' if skipped else ''}; {source} in {self.seconds:.1f} s"
        )


def split_validation(samples: Sequence[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Hold out ``fraction`` of the samples (at least one when ``fraction > 0``) for validation.

    The choice depends only on ``seed`` and the number of samples; both parts keep file order.
    Raises ``ValueError`` when nothing would be left to train on.
    """
    train, val = validation_indices(len(samples), fraction, seed)
    return [samples[i] for i in train], [samples[i] for i in val]


def validation_indices(count: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, held out)`` of ``split_validation`` for ``count`` samples, both in order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return np.arange(count, dtype=np.int64), np.zeros(0, dtype=np.int64)
    num_val = max(1, round(count * fraction))
    if num_val >= count:
        raise ValueError(
            f"validation split {fraction} of {count} samples holds out {num_val}: nothing left to train on"
        )
    generator = torch.Generator().manual_seed(seed)
    held = np.zeros(count, dtype=bool)
    held[torch.randperm(count, generator=generator)[:num_val].numpy()] = True
    return np.flatnonzero(~held), np.flatnonzero(held)
