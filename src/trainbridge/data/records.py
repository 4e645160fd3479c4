"""Rows of a data file -> ``input_ids``/``labels`` columns (the function ``datasets.map`` runs).

A row is one of (first match wins, after ``DataOptions.columns`` renamed the user's columns):

* ``input_ids`` (pre-tokenized), optional ``labels`` (``-100`` = not trained on) and
  ``attention_mask``: without ``labels``, every attended token is trained on; tokens with
  ``attention_mask`` 0 get label ``-100``, and leading/trailing ones (padding) are removed; optional
  ``seq_lengths`` (trl's packed bins): the row is several sequences, one sample (``types.Sample``);
* ``messages``: a chat conversation, optional ``tools``; rendered with the chat template, loss on
  assistant tokens (``data.chat``);
* ``prompt`` + ``completion``: strings (tokenized with the tokenizer's special tokens, then the
  completion and EOS; loss on the completion) or message lists (rendered as one conversation; loss on
  the completion's assistant messages);
* ``text``: tokenized with special tokens, EOS appended; every token is trained on.

Every row gets a ``status`` (``STATUS_*``); a bad row gets ``STATUS_ERROR`` with a reason and a message
naming file and line (JSONL) or row, so one pass reports every bad row with counts by reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import numpy as np

from trainbridge.core.config import DataColumn
from trainbridge.data.chat import ChatEncoder, ChatTemplateError, ChatTrainOn, normalize_messages
from trainbridge.data.types import IGNORE_INDEX, OverlongPolicy, as_seq_lengths, loss_token_count

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STATUS_OK, STATUS_OVERLONG, STATUS_NO_LOSS, STATUS_BLANK, STATUS_ERROR = 0, 1, 2, 3, 4
"""A row's fate: a sample; dropped as longer than ``max_seq_len``; skipped without loss tokens; a blank
JSONL line; a bad row (``error``/``reason`` say why)."""

KNOWN_COLUMNS: tuple[str, ...] = get_args(DataColumn)
"""Column names rows are read from (``DataOptions.columns`` maps other names onto these)."""


@dataclass(frozen=True)
class DataOptions:
    """How rows become samples; every field is part of the tokenisation cache key."""

    max_seq_len: int
    overlong_policy: OverlongPolicy = "drop"
    columns: tuple[tuple[str, str], ...] = ()
    """``(ours, theirs)`` pairs: read column ``theirs`` of the file as ``ours`` (one of ``KNOWN_COLUMNS``)."""
    chat_train_on: ChatTrainOn = "all"
    system_prompt: str | None = None
    chat_template: str | None = None
    """A Jinja template overriding the tokenizer's (already read from a file if one was given)."""
    num_proc: int = 1
    vocab_size: int | None = None
    """The model's vocabulary size: a row with a token id at or above it is a bad row (None: not checked)."""
    cache_dir: Path | None = field(default=None, compare=False)

    def key(self) -> dict[str, Any]:
        """The fields that change the tokenised result (for the cache key)."""
        return {
            "max_seq_len": self.max_seq_len,
            "overlong_policy": self.overlong_policy,
            "columns": list(self.columns),
            "chat_train_on": self.chat_train_on,
            "system_prompt": self.system_prompt,
            "chat_template": self.chat_template,
            "vocab_size": self.vocab_size,
        }


class RowEncoder:
    """Turns a batch of rows into output columns; picklable, so ``datasets.map(num_proc=...)`` can run it."""

    def __init__(
        self,
        source: str,
        jsonl: bool,
        tokenizer: PreTrainedTokenizerBase | None,
        options: DataOptions,
        chat_template: str | None,
    ):
        self.source = source
        self.jsonl = jsonl
        self.tokenizer = tokenizer
        self.options = options
        self.rename: dict[str, str] = {theirs: ours for ours, theirs in options.columns}
        self.chat_template = chat_template
        self._chat: ChatEncoder | None = None

    def where(self, row: int) -> str:
        """``file:line`` for a JSONL row, ``file row N`` otherwise."""
        return f"{self.source}:{row + 1}" if self.jsonl else f"{self.source} row {row}"

    def __call__(self, batch: Mapping[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in OUTPUT_COLUMNS}
        if self.jsonl:
            records: list[dict[str, Any] | _Bad | None] = [self._parse_line(line) for line in batch["text"]]
        else:
            names = list(batch)
            records = [{self.rename.get(n, n): batch[n][k] for n in names} for k in range(len(indices))]
        batched = {**self._tokenize_text_rows(records), **self._encode_chat_rows(records)}
        for position, (row, record) in enumerate(zip(indices, records)):
            try:
                if record is None:
                    self._emit(out, [], [], STATUS_BLANK)
                    continue
                if isinstance(record, _Bad):
                    raise _RowError(record.reason, record.problem)
                if position in batched:
                    result = batched[position]
                    if isinstance(result, _RowError):
                        raise result
                    self._finish(out, *result)
                else:
                    self._finish(out, *self._encode(record))
            except _RowError as exc:
                self._emit(out, [], [], STATUS_ERROR, exc.reason, f"{self.where(row)}: {exc.problem}")
        return out

    # ------------------------------------------------------------------ parsing
    def _parse_line(self, line: str) -> dict[str, Any] | _Bad | None:
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return _Bad("invalid JSON", f"invalid JSON: {exc}")
        except RecursionError:
            return _Bad("nested too deeply", "a value is nested too deeply to parse")
        except ValueError as exc:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
            return _Bad("value too large", f"a value is too large to parse: {str(exc).split(';')[0]}")
        if not isinstance(record, dict):
            return _Bad("not an object", f"expected a JSON object, got {type(record).__name__}")
        record = {str(k): v for k, v in record.items()}
        return {self.rename.get(k, k): v for k, v in record.items()}

    def _encode(self, record: dict[str, Any]) -> tuple[list[int], list[int], tuple[int, ...] | None]:
        if record.get("input_ids") is not None:
            return _pretokenized(record)
        if _is_chat(record):
            raise AssertionError("chat rows are encoded in batches")  # pragma: no cover
        if record.get("prompt") is not None or record.get("completion") is not None:
            return (*self._prompt_completion(record), None)
        if "text" in record and record["text"] is not None:
            raise AssertionError("text rows are tokenized in batches")  # pragma: no cover
        present = sorted(k for k, v in record.items() if v is not None)
        raise _RowError(
            "unknown columns",
            f"no usable column: expected 'input_ids', 'messages', 'prompt'+'completion' or 'text', found "
            f"{present}; map other names with data_columns (e.g. {{messages: {present[0] if present else 'col'}}})",
        )

    # ------------------------------------------------------------------ kinds
    def _need_tokenizer(self, kind: str) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise _RowError("no tokenizer", f"a {kind!r} record needs a tokenizer, but none was given")
        return self.tokenizer

    def _tokenize_text_rows(self, records: list[Any]) -> dict[int, tuple[list[int], list[int]]]:
        """Tokenize the batch's ``text`` rows in one tokenizer call (EOS appended): ``{position: ids}``."""
        positions = [
            k
            for k, r in enumerate(records)
            if isinstance(r, dict)
            and r.get("input_ids") is None
            and r.get("messages") is None
            and r.get("prompt") is None
            and r.get("completion") is None
            and r.get("text") is not None
        ]
        good = []
        result: dict[int, tuple[list[int], list[int]]] = {}
        for k in positions:
            record = records[k]
            if not isinstance(record["text"], str):
                records[k] = _Bad("bad text", f"'text' must be a string, got {_describe(record['text'])}")
            elif record.get("labels") is not None:
                records[k] = _Bad("bad text", "'labels' needs pre-tokenized 'input_ids', not 'text'")
            elif self.tokenizer is None:
                records[k] = _Bad("no tokenizer", "a 'text' record needs a tokenizer, but none was given")
            else:
                good.append(k)
        if good:
            assert self.tokenizer is not None
            eos = self.tokenizer.eos_token_id
            encoded = self.tokenizer([records[k]["text"] for k in good])["input_ids"]
            for k, ids in zip(good, encoded):
                ids = list(ids)
                if eos is not None and (not ids or ids[-1] != eos):
                    ids.append(eos)
                result[k] = (ids, ids)
        return result

    def _chat_encoder(self) -> ChatEncoder:
        tokenizer = self._need_tokenizer("messages")
        if self._chat is None:
            if not self.chat_template:
                raise _RowError(
                    "no chat template",
                    "the tokenizer has no chat template (tokenizer.chat_template "
                    "is empty); set chat_template to a Jinja template or a .jinja file",
                )
            self._chat = ChatEncoder(tokenizer, self.chat_template, self.options.chat_train_on)
        return self._chat

    def _encode_chat_rows(self, records: list[Any]) -> dict[int, tuple[list[int], list[int]] | _RowError]:
        """Encode the batch's chat rows (``messages``, or message-list ``prompt``/``completion``) together:
        ``{position: (input_ids, labels) or the row's error}`` (``ChatEncoder.encode_batch``)."""
        positions = [k for k, r in enumerate(records) if isinstance(r, dict) and _is_chat(r)]
        if not positions:
            return {}
        try:
            encoder = self._chat_encoder()
        except _RowError as exc:
            return {k: exc for k in positions}
        result: dict[int, tuple[list[int], list[int]] | _RowError] = {}
        items: list[tuple[list[dict[str, Any]], Any, int]] = []
        encoded_at: list[int] = []
        for k in positions:
            record = records[k]
            try:
                if record.get("messages") is not None:
                    messages, first = normalize_messages(record["messages"], self.options.system_prompt), 0
                else:  # prompt and completion message lists: one conversation, trained on the completion
                    completion = list(record["completion"])
                    messages = normalize_messages(list(record["prompt"]) + completion, self.options.system_prompt)
                    first = len(messages) - len(completion)
            except ChatTemplateError as exc:
                result[k] = _RowError(_chat_reason(str(exc)), str(exc))
                continue
            items.append((messages, record.get("tools"), first))
            encoded_at.append(k)
        for k, encoded in zip(encoded_at, encoder.encode_batch(items)):
            result[k] = (
                _RowError(_chat_reason(str(encoded)), str(encoded))
                if isinstance(encoded, ChatTemplateError)
                else encoded
            )
        return result

    def _prompt_completion(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            tokenizer = self._need_tokenizer("prompt")
            prompt_ids = list(tokenizer(prompt)["input_ids"])
            completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                completion_ids.append(tokenizer.eos_token_id)
            return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
        raise _RowError(
            "bad prompt/completion",
            "'prompt' and 'completion' must both be strings or both lists of "
            f"messages, got {_describe(prompt)} and {_describe(completion)}",
        )

    # ------------------------------------------------------------------ output
    def _finish(
        self,
        out: dict[str, list[Any]],
        input_ids: list[int],
        labels: list[int],
        seq_lengths: tuple[int, ...] | None = None,
    ) -> None:
        top = max(max(input_ids, default=0), max(labels, default=0))
        vocab = self.options.vocab_size
        if vocab is not None and top >= vocab:
            raise _RowError(
                "token id out of vocabulary", f"token id {top} is not below the model's vocabulary size {vocab}"
            )
        if top > TOKEN_ID_MAX:
            raise _RowError("value too large", f"token id {top} does not fit the cache's int32 token columns")
        max_len = self.options.max_seq_len
        truncated = False
        if len(input_ids) > max_len:
            if self.options.overlong_policy == "error":
                raise _RowError(
                    "longer than max_seq_len", f"sample has {len(input_ids)} tokens > max_seq_len={max_len}"
                )
            if self.options.overlong_policy == "drop":
                self._emit(out, [], [], STATUS_OVERLONG)
                return
            input_ids, labels, truncated = input_ids[:max_len], labels[:max_len], True
            seq_lengths = _cut(seq_lengths, max_len)
        status = STATUS_OK if loss_token_count(labels, seq_lengths) else STATUS_NO_LOSS
        self._emit(out, input_ids, labels, status, truncated=truncated, seq_lengths=seq_lengths)

    @staticmethod
    def _emit(
        out: dict[str, list[Any]],
        input_ids: list[int],
        labels: list[int],
        status: int,
        reason: str = "",
        error: str = "",
        truncated: bool = False,
        seq_lengths: tuple[int, ...] | None = None,
    ) -> None:
        out["input_ids"].append(input_ids)
        out["labels"].append(labels)
        out["seq_lengths"].append(list(seq_lengths or ()))
        out["length"].append(len(input_ids))
        out["loss_tokens"].append(loss_token_count(labels, seq_lengths))
        out["status"].append(status)
        out["truncated"].append(truncated)
        out["reason"].append(reason)
        out["error"].append(error)


TOKEN_ID_MAX = 2**31 - 1
"""The largest token id the tokenised cache holds (int32 columns)."""

OUTPUT_COLUMNS = (
    "input_ids",
    "labels",
    "seq_lengths",
    "length",
    "loss_tokens",
    "status",
    "truncated",
    "reason",
    "error",
)


def output_features() -> Any:
    """The ``datasets.Features`` of the tokenised cache (int32 token columns)."""
    from datasets import Features, List, Value

    return Features(
        {
            "input_ids": List(Value("int32")),
            "labels": List(Value("int32")),
            "seq_lengths": List(Value("int32")),
            "length": Value("int32"),
            "loss_tokens": Value("int32"),
            "status": Value("int8"),
            "truncated": Value("bool"),
            "reason": Value("string"),
            "error": Value("string"),
        }
    )


def _cut(seq_lengths: tuple[int, ...] | None, length: int) -> tuple[int, ...] | None:
    """``seq_lengths`` of a row truncated to its first ``length`` tokens."""
    if seq_lengths is None:
        return None
    kept, total = [], 0
    for n in seq_lengths:
        if total >= length:
            break
        kept.append(min(n, length - total))
        total += kept[-1]
    return as_seq_lengths(kept, length)


def _is_chat(record: dict[str, Any]) -> bool:
    """Whether a (non pre-tokenized) row is a conversation: ``messages``, or message-list prompt/completion."""
    return record.get("input_ids") is None and (
        record.get("messages") is not None
        or (isinstance(record.get("prompt"), list) and isinstance(record.get("completion"), list))
    )


class _RowError(Exception):
    def __init__(self, reason: str, problem: str):
        super().__init__(problem)
        self.reason, self.problem = reason, problem


@dataclass(frozen=True)
class _Bad:
    reason: str
    problem: str


def _chat_reason(message: str) -> str:
    for needle, reason in (
        ("no assistant message", "no assistant message"),
        ("roles out of order", "roles out of order"),
        ("has role", "unknown role"),
        ("renders", "template re-renders earlier turns"),
        ("chat template failed", "chat template failed"),
        ("no chat template", "no chat template"),
    ):
        if needle in message:
            return reason
    return "bad messages"


def _describe(value: Any) -> str:
    if isinstance(value, list):
        bad = next((x for x in value if type(x) is not int), None)
        return f"a list containing {type(bad).__name__} {bad!r}"
    return f"{type(value).__name__}"


def _token_list(record: dict[str, Any], key: str) -> list[int]:
    value = record[key]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise _RowError("bad tokens", f"{key!r} must be a list of ints, got {_describe(value)}")
    return value


def _pretokenized(record: dict[str, Any]) -> tuple[list[int], list[int], tuple[int, ...] | None]:
    input_ids = _token_list(record, "input_ids")
    if input_ids and min(input_ids) < 0:
        raise _RowError("bad tokens", "'input_ids' must be non-negative token ids")
    labels = _token_list(record, "labels") if record.get("labels") is not None else None
    if labels is not None and len(labels) != len(input_ids):
        raise _RowError("bad tokens", f"'labels' length {len(labels)} != input_ids length {len(input_ids)}")
    if labels and min(set(labels) - {IGNORE_INDEX}, default=0) < 0:
        raise _RowError("bad tokens", f"'labels' must be token ids or {IGNORE_INDEX}")
    if record.get("attention_mask") is not None:
        mask = _token_list(record, "attention_mask")
        if len(mask) != len(input_ids) or not set(mask) <= {0, 1}:
            raise _RowError("bad tokens", f"'attention_mask' must be {len(input_ids)} zeros and ones")
        if labels is None:
            labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, mask)]
        attended = [k for k, m in enumerate(mask) if m]
        if not attended:
            return [], [], None
        start, stop = attended[0], attended[-1] + 1  # padding at either end goes; the model never saw it
        input_ids, labels = input_ids[start:stop], labels[start:stop]
    seq_lengths = None
    if record.get("seq_lengths") is not None:  # a packed row (trl's bin): one sample of several sequences
        try:
            seq_lengths = as_seq_lengths(_token_list(record, "seq_lengths"), len(input_ids))
        except ValueError as exc:
            raise _RowError("bad seq_lengths", str(exc)) from None
    return input_ids, labels if labels is not None else input_ids, seq_lengths
