"""JSONL training data -> ``Sample`` objects.

Each non-blank line of the file is one JSON object, in one of two forms:

* pre-tokenized: ``{"input_ids": [...], "labels": [...]}``; ``labels`` is optional (default: the
  ``input_ids``) and uses ``-100`` for tokens that are not trained on (prompts, system text);
* plain text: ``{"text": "..."}``, tokenized with the run's tokenizer (special tokens as the tokenizer
  adds them, then EOS appended when the tokenizer has one); every token is trained on.

Other keys are ignored, so instructlab-style files (``input_ids``, ``labels``, ``len``, ...) load as they
are.  A record with both ``input_ids`` and ``text`` uses ``input_ids``.

Loss tokens follow the shifted causal-LM loss (``data.loss``): the logit at position ``t`` predicts the
token at ``t + 1``, so position 0 is never predicted and a sample's loss tokens are the positions
``t >= 1`` whose label is not ``-100``.  A sample with no loss token teaches nothing and is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label value of a token that is not trained on (the ``ignore_index`` of the cross entropy)."""

OverlongPolicy = Literal["drop", "truncate", "error"]

_TOKENIZE_CHUNK = 1024
"""Text lines tokenized per tokenizer call (fast tokenizers batch them in parallel)."""


class DataFormatError(ValueError):
    """A line of a data file is not a valid record; the message starts with ``file:line:``."""

    def __init__(self, path: str | Path, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}")
        self.path = str(path)
        self.line = line
        self.problem = problem


@dataclass(frozen=True)
class Sample:
    """One training sequence: token ids and their labels (``-100`` = not trained on)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def length(self) -> int:
        """Number of tokens."""
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        """Tokens that contribute to the shifted causal-LM loss: positions ``t >= 1`` with a label.

        Position 0 is never predicted (nothing precedes it), so its label does not count; this is
        exactly the count ``data.loss.token_loss_sum`` reports for the sample.
        """
        return len(self.labels) - 1 - self.labels[1:].count(IGNORE_INDEX) if self.labels else 0


@dataclass
class LoadStats:
    """What ``load_jsonl`` read and skipped.

    ``lines`` counts records (non-blank lines); every record ends up in exactly one of ``samples``,
    ``dropped_overlong`` and ``empty_skipped`` (``truncated`` samples are also counted in ``samples``
    or, if truncation left no loss token, in ``empty_skipped``).
    """

    path: str
    lines: int = 0
    samples: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    empty_skipped: int = 0


def _token_list(path: Path, line: int, record: dict[str, Any], key: str) -> list[int]:
    value = record[key]
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise DataFormatError(path, line, f"{key!r} must be a list of ints, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, list):
        bad = next((x for x in value if type(x) is not int), None)
        return f"a list containing {type(bad).__name__} {bad!r}"
    return f"{type(value).__name__}"


def _pretokenized(path: Path, line: int, record: dict[str, Any]) -> tuple[list[int], list[int]]:
    input_ids = _token_list(path, line, record, "input_ids")
    if input_ids and min(input_ids) < 0:
        raise DataFormatError(path, line, "'input_ids' must be non-negative token ids")
    if "labels" not in record or record["labels"] is None:
        return input_ids, input_ids
    labels = _token_list(path, line, record, "labels")
    if len(labels) != len(input_ids):
        raise DataFormatError(
            path, line, f"'labels' length {len(labels)} != input_ids length {len(input_ids)}"
        )
    if labels and min(set(labels) - {IGNORE_INDEX}, default=0) < 0:
        raise DataFormatError(path, line, f"'labels' must be token ids or {IGNORE_INDEX}")
    return input_ids, labels


def _parse_line(path: Path, line: int, raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataFormatError(path, line, f"invalid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise DataFormatError(path, line, f"expected a JSON object, got {type(record).__name__}")
    return record


def _tokenize_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    out: list[list[int]] = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        encoded = tokenizer(texts[start : start + _TOKENIZE_CHUNK])["input_ids"]
        for ids in encoded:
            ids = list(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            out.append(ids)
    return out


def load_jsonl(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None,
    max_seq_len: int,
    overlong_policy: OverlongPolicy,
) -> tuple[list[Sample], LoadStats]:
    """Read a JSONL data file into samples of at most ``max_seq_len`` tokens.

    ``tokenizer`` is needed only for ``text`` records.  A sample longer than ``max_seq_len`` is dropped
    (``"drop"``), cut to ``max_seq_len`` tokens (``"truncate"``) or rejected (``"error"``, a
    ``DataFormatError`` naming file and line).  Samples left without loss tokens are skipped.  Raises
    ``DataFormatError`` for a malformed line and ``ValueError`` when no usable sample remains.
    """
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if overlong_policy not in ("drop", "truncate", "error"):
        raise ValueError(f"overlong_policy must be 'drop', 'truncate' or 'error', got {overlong_policy!r}")
    path = Path(path)
    stats = LoadStats(path=str(path))
    # (line number, input_ids, labels) in file order; text records are tokenized in batches below.
    records: list[tuple[int, list[int] | None, list[int] | None]] = []
    texts: list[str] = []
    text_slots: list[int] = []
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            stats.lines += 1
            record = _parse_line(path, line_number, raw)
            if record.get("input_ids") is not None:
                records.append((line_number, *_pretokenized(path, line_number, record)))
            elif "text" in record:
                text = record["text"]
                if not isinstance(text, str):
                    raise DataFormatError(
                        path, line_number, f"'text' must be a string, got {_describe(text)}"
                    )
                if record.get("labels") is not None:
                    raise DataFormatError(
                        path, line_number, "'labels' needs pre-tokenized 'input_ids', not 'text'"
                    )
                if tokenizer is None:
                    raise DataFormatError(
                        path, line_number, "a 'text' record needs a tokenizer, but none was given"
                    )
                text_slots.append(len(records))
                texts.append(text)
                records.append((line_number, None, None))
            else:
                raise DataFormatError(path, line_number, "neither 'input_ids' nor 'text' in the record")
    if texts:
        assert tokenizer is not None
        for slot, ids in zip(text_slots, _tokenize_texts(texts, tokenizer)):
            records[slot] = (records[slot][0], ids, ids)

    samples: list[Sample] = []
    for line_number, input_ids, labels in records:
        assert input_ids is not None and labels is not None
        if len(input_ids) > max_seq_len:
            if overlong_policy == "error":
                raise DataFormatError(
                    path, line_number, f"sample has {len(input_ids)} tokens > max_seq_len={max_seq_len}"
                )
            if overlong_policy == "drop":
                stats.dropped_overlong += 1
                continue
            input_ids, labels = input_ids[:max_seq_len], labels[:max_seq_len]
            stats.truncated += 1
        sample = Sample(tuple(input_ids), tuple(labels))
        if sample.loss_tokens == 0:
            stats.empty_skipped += 1
            continue
        samples.append(sample)
    stats.samples = len(samples)
    if not samples:
        raise ValueError(
            f"no usable samples in {path}: {stats.lines} lines, {stats.dropped_overlong} dropped as longer "
            f"than max_seq_len={max_seq_len}, {stats.empty_skipped} without loss tokens"
        )
    return samples, stats


def split_validation(
    samples: Sequence[Sample], fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """Hold out ``fraction`` of the samples (at least one when ``fraction > 0``) for validation.

    The choice depends only on ``seed`` and the number of samples; both parts keep file order.
    Raises ``ValueError`` when nothing would be left to train on.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return list(samples), []
    count = len(samples)
    num_val = max(1, round(count * fraction))
    if num_val >= count:
        raise ValueError(
            f"validation split {fraction} of {count} samples holds out {num_val}: nothing left to train on"
        )
    generator = torch.Generator().manual_seed(seed)
    held_out = set(torch.randperm(count, generator=generator)[:num_val].tolist())
    train = [s for i, s in enumerate(samples) if i not in held_out]
    val = [s for i, s in enumerate(samples) if i in held_out]
    return train, val
