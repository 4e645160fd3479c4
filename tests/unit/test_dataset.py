"""JSONL loading: record forms, error messages naming file:line, overlong policies, validation split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainbridge.data import DataFormatError, Sample, load_jsonl, split_validation

VOCAB = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3, "foo": 4, "bar": 5}


def write_lines(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def record(**fields: object) -> str:
    return json.dumps(fields)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]")


def test_sample_loss_tokens_skip_position_zero() -> None:
    assert Sample((1, 2, 3), (1, 2, 3)).loss_tokens == 2
    assert Sample((1, 2, 3, 4), (-100, -100, 3, 4)).loss_tokens == 2
    assert Sample((1, 2, 3), (1, -100, -100)).loss_tokens == 0
    assert Sample((1, 2, 3), (1, 2, 3)).length == 3


def test_pretokenized_records_with_and_without_labels(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        [
            record(input_ids=[5, 6, 7], labels=[-100, 6, 7], len=3),
            "",
            record(input_ids=[8, 9]),
            "   ",
        ],
    )
    samples, stats = load_jsonl(path, None, max_seq_len=16, overlong_policy="error")
    assert samples == [Sample((5, 6, 7), (-100, 6, 7)), Sample((8, 9), (8, 9))]
    assert (stats.lines, stats.samples, stats.dropped_overlong, stats.truncated, stats.empty_skipped) == (
        2,
        2,
        0,
        0,
        0,
    )
    assert stats.path == str(path)


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [record(input_ids=[1, 2]), "", '{"input_ids": [1, 2'])
    with pytest.raises(DataFormatError, match=r"data\.jsonl:3: invalid JSON") as info:
        load_jsonl(path, None, 16, "drop")
    assert info.value.line == 3
    assert info.value.path == str(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (record(input_ids="1 2 3"), r":2: 'input_ids' must be a list of ints, got str"),
        (record(input_ids=[1, "2"]), r":2: 'input_ids' must be a list of ints, got a list containing str"),
        (record(input_ids=[1, True]), r":2: 'input_ids' must be a list of ints"),
        (record(input_ids=[1, 2.0]), r":2: 'input_ids' must be a list of ints"),
        (record(input_ids=[1, -3]), r":2: 'input_ids' must be non-negative"),
        (record(input_ids=[1, 2], labels={"a": 1}), r":2: 'labels' must be a list of ints"),
        (
            record(input_ids=[1, 2, 3, 4, 5, 6, 7], labels=[1, 2, 3, 4, 5]),
            r":2: 'labels' length 5 != input_ids length 7",
        ),
        (record(input_ids=[1, 2], labels=[1, -5]), r":2: 'labels' must be token ids or -100"),
        (record(prompt="hi"), r":2: 'prompt' and 'completion' must both be strings"),
        (record(question="hi"), r":2: no usable column: expected 'input_ids', 'messages'"),
        ("[1, 2, 3]", r":2: expected a JSON object, got list"),
        (record(text=["a"]), r":2: 'text' must be a string"),
        (record(text="hello", labels=[1]), r":2: 'labels' needs pre-tokenized 'input_ids'"),
    ],
)
def test_malformed_records_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path, [record(input_ids=[1, 2]), line])
    with pytest.raises(DataFormatError, match=r"data\.jsonl" + message):
        load_jsonl(path, None, 16, "drop")


def test_text_records_are_tokenized_with_eos(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_lines(
        tmp_path, [record(text="hello world"), record(input_ids=[4, 5], labels=[-100, 5]), record(text="foo")]
    )
    samples, stats = load_jsonl(path, tokenizer, 16, "error")
    assert samples == [Sample((2, 3, 1), (2, 3, 1)), Sample((4, 5), (-100, 5)), Sample((4, 1), (4, 1))]
    assert stats.samples == 3


def test_text_record_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [record(input_ids=[1, 2]), record(text="hello")])
    with pytest.raises(DataFormatError, match=r"data\.jsonl:2: .*needs a tokenizer"):
        load_jsonl(path, None, 16, "drop")


def test_many_text_records_tokenized_in_order(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    words = ["hello", "world", "foo", "bar"]
    lines = [record(text=" ".join(words[: 1 + i % 4])) for i in range(2500)]
    samples, _ = load_jsonl(write_lines(tmp_path, lines), tokenizer, 16, "error")
    assert [s.length for s in samples] == [2 + i % 4 for i in range(2500)]
    assert samples[7].input_ids == (2, 3, 4, 5, 1)


def _overlong_file(tmp_path: Path) -> Path:
    return write_lines(
        tmp_path,
        [
            record(input_ids=[1, 2, 3]),
            record(input_ids=[1, 2, 3, 4, 5, 6], labels=[-100, -100, -100, -100, 5, 6]),
            record(input_ids=[1, 2, 3, 4, 5]),
        ],
    )


def test_overlong_drop_counts(tmp_path: Path) -> None:
    samples, stats = load_jsonl(_overlong_file(tmp_path), None, 4, "drop")
    assert samples == [Sample((1, 2, 3), (1, 2, 3))]
    assert (stats.lines, stats.samples, stats.dropped_overlong, stats.truncated) == (3, 1, 2, 0)


def test_overlong_truncate_counts_and_skips_samples_left_without_loss(tmp_path: Path) -> None:
    samples, stats = load_jsonl(_overlong_file(tmp_path), None, 4, "truncate")
    # line 2 truncated to [1, 2, 3, 4] keeps only -100 labels: no loss token left, skipped
    assert samples == [Sample((1, 2, 3), (1, 2, 3)), Sample((1, 2, 3, 4), (1, 2, 3, 4))]
    assert (stats.samples, stats.dropped_overlong, stats.truncated, stats.empty_skipped) == (2, 0, 2, 1)


def test_overlong_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"data\.jsonl:2: sample has 6 tokens > max_seq_len=4"):
        load_jsonl(_overlong_file(tmp_path), None, 4, "error")


def test_samples_without_loss_tokens_are_skipped(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        [
            record(input_ids=[1, 2, 3], labels=[1, -100, -100]),
            record(input_ids=[7]),
            record(input_ids=[]),
            record(input_ids=[4, 5]),
        ],
    )
    samples, stats = load_jsonl(path, None, 8, "drop")
    assert samples == [Sample((4, 5), (4, 5))]
    assert (stats.lines, stats.samples, stats.empty_skipped) == (4, 1, 3)


def test_empty_file_is_a_clear_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path, ["", ""], name="empty.jsonl")
    with pytest.raises(ValueError, match=r"no usable samples in .*empty\.jsonl: 0 lines"):
        load_jsonl(path, None, 8, "drop")


def test_all_dropped_is_a_clear_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [record(input_ids=[1, 2, 3, 4, 5]), record(input_ids=[1, 2, 3, 4, 5, 6])])
    with pytest.raises(ValueError, match=r"2 lines, 2 dropped as longer than max_seq_len=4"):
        load_jsonl(path, None, 4, "drop")


def _samples(count: int) -> list[Sample]:
    return [Sample((i, i + 1), (i, i + 1)) for i in range(count)]


def test_split_validation_is_deterministic_and_partitions() -> None:
    samples = _samples(50)
    train, val = split_validation(samples, 0.2, seed=3)
    assert (len(train), len(val)) == (40, 10)
    assert sorted(train + val, key=lambda s: s.input_ids) == samples
    assert split_validation(samples, 0.2, seed=3) == (train, val)
    assert split_validation(samples, 0.2, seed=4)[1] != val
    assert train == sorted(train, key=lambda s: s.input_ids)


def test_split_validation_edges() -> None:
    assert split_validation(_samples(5), 0.0, seed=0) == (_samples(5), [])
    train, val = split_validation(_samples(5), 0.01, seed=0)
    assert (len(train), len(val)) == (4, 1)
    with pytest.raises(ValueError, match="nothing left to train on"):
        split_validation(_samples(2), 0.9, seed=0)
    with pytest.raises(ValueError, match="nothing left to train on"):
        split_validation(_samples(1), 0.1, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        split_validation(_samples(5), 1.0, seed=0)
