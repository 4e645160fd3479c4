"""`datasets` inputs, the tokenisation cache, and memory-mapped sample sources feeding the plans."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from trainbridge.data import (
    ArrowSamples,
    DataFormatError,
    DataInputError,
    InMemorySamples,
    Sample,
    open_dataset,
)
from trainbridge.data import cache as cache_module
from trainbridge.data.loader import EvalBatches, TrainBatches
from trainbridge.data.records import DataOptions
from trainbridge.demos.tiny_model import build_tokenizer

ROWS = {
    "input_ids": [[1, 5, 6, 7, 0, 0], [1, 8, 9], [1, 5, 5, 5, 5, 5, 5, 5, 5, 5]],
    "attention_mask": [[1, 1, 1, 1, 0, 0], [1, 1, 1], [1] * 10],
}
EXPECTED = [Sample((1, 5, 6, 7), (1, 5, 6, 7)), Sample((1, 8, 9), (1, 8, 9))]  # padding trimmed, row 3 too long


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def options(**kwargs: object) -> DataOptions:
    return DataOptions(**{"max_seq_len": 8, **kwargs})  # type: ignore[arg-type]


def every_sample(source: ArrowSamples) -> list[Sample]:
    return source.fetch(range(len(source)))


def write_inputs(tmp_path: Path) -> dict[str, Path]:
    dataset = datasets.Dataset.from_dict(ROWS)
    dataset.save_to_disk(str(tmp_path / "disk"))
    dataset.to_parquet(str(tmp_path / "rows.parquet"))
    arrow = next((tmp_path / "disk").glob("*.arrow"))
    records = [dict(zip(ROWS, values)) for values in zip(*ROWS.values())]
    (tmp_path / "rows.json").write_text(json.dumps(records))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return {
        "disk": tmp_path / "disk",
        "parquet": tmp_path / "rows.parquet",
        "arrow": arrow,
        "json": tmp_path / "rows.json",
        "jsonl": tmp_path / "rows.jsonl",
    }


def test_every_input_kind_gives_the_same_samples(tmp_path: Path) -> None:
    for kind, path in write_inputs(tmp_path).items():
        source, stats = open_dataset(path, None, options(), tmp_path / "cache")
        assert every_sample(source) == EXPECTED, kind
        assert (stats.lines, stats.samples, stats.dropped_overlong) == (3, 2, 1), kind
        assert source.lengths.tolist() == [4, 3] and source.loss_tokens.tolist() == [3, 2]


def test_attention_mask_zero_inside_a_row_is_not_trained_on(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"input_ids": [1, 2, 3, 4], "attention_mask": [1, 0, 1, 1]})
        + "\n"
        + json.dumps({"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "attention_mask": [0, 1, 1]})
    )
    source, _ = open_dataset(path, None, options(), tmp_path / "cache")
    assert every_sample(source) == [Sample((1, 2, 3, 4), (1, -100, 3, 4)), Sample((2, 3), (2, 3))]


def test_column_mapping_and_text_rows(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"body": ["1+1=2", "2+2=4"], "other": [0, 1]}).to_parquet(str(path))
    source, _ = open_dataset(path, tokenizer, options(columns=(("text", "body"),)), tmp_path / "cache")
    expected = tokenizer("1+1=2")["input_ids"] + [tokenizer.eos_token_id]
    assert every_sample(source)[0] == Sample(tuple(expected), tuple(expected))


def test_unknown_columns_and_bad_mappings_are_named(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"conversations": [[{"role": "user", "content": "hi"}]]}).to_parquet(str(path))
    with pytest.raises(DataFormatError, match=r"rows\.parquet: no usable column.*\['conversations'\].*data_columns"):
        open_dataset(path, None, options(), tmp_path / "cache")
    with pytest.raises(DataFormatError, match=r"data_columns maps 'messages' to column 'convs'.*'conversations'"):
        open_dataset(path, None, options(columns=(("messages", "convs"),)), tmp_path / "cache")


def test_datasetdict_folder_asks_for_a_split(tmp_path: Path) -> None:
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataInputError, match=r"DatasetDict folder with splits \['train'\].*dd/train"):
        open_dataset(tmp_path / "dd", None, options(), tmp_path / "cache")
    source, _ = open_dataset(tmp_path / "dd" / "train", None, options(), tmp_path / "cache")
    assert every_sample(source) == EXPECTED


def test_bad_rows_are_all_counted_by_reason_and_the_first_named_by_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [1, -2], [3, 4], [1, -1]]}).to_parquet(str(path))
    with pytest.raises(DataFormatError, match=r"rows\.parquet row 1: 'input_ids' must be non-negative") as info:
        open_dataset(path, None, options(), tmp_path / "cache")
    assert info.value.counts == {"bad tokens": 2}
    assert "rows.parquet row 3" in str(info.value)
    assert not list((tmp_path / "cache").glob("*/meta.json")), "no cache is written for a file with bad rows"


def test_jsonl_bad_lines_are_named_by_line_with_blank_lines_counted(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n\n{"input_ids": [1, 2]\n{"text": 5}\n')
    with pytest.raises(DataFormatError, match=r"data\.jsonl:3: invalid JSON") as info:
        open_dataset(path, None, options(), tmp_path / "cache")
    assert info.value.counts == {"invalid JSON": 1, "bad text": 1}
    assert "data.jsonl:4: 'text' must be a string" in str(info.value)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_second_open_hits_the_cache_without_tokenising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    path = write_inputs(tmp_path)[kind]
    first, stats = open_dataset(path, None, options(), tmp_path / "cache")
    assert not stats.cache_hit

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenised again")

    def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("a column was read to open the cache")

    monkeypatch.setattr(cache_module, "_build", no_build)
    monkeypatch.setattr(cache_module, "_column", no_scan)  # lengths and counts come from the index and meta
    second, stats = open_dataset(path, None, options(), tmp_path / "cache")
    assert (stats.cache_hit, stats.samples, stats.dropped_overlong, stats.lines) == (True, 2, 1, 3)
    assert every_sample(second) == every_sample(first)
    assert second.lengths.tolist() == [4, 3] and second.loss_tokens.tolist() == [3, 2]
    if kind != "jsonl":
        return
    # another option, or a changed file, is another key: built again
    with pytest.raises(AssertionError, match="tokenised again"):
        open_dataset(path, None, options(max_seq_len=16), tmp_path / "cache")
    path.write_text(path.read_text() + json.dumps({"input_ids": [1, 2]}) + "\n")
    with pytest.raises(AssertionError, match="tokenised again"):
        open_dataset(path, None, options(), tmp_path / "cache")


def test_cache_key_notices_content_changes_that_keep_size_and_mtime(tmp_path: Path) -> None:
    """The input fingerprint hashes a bounded sample of the file: an edit inside a hashed block is noticed
    even when size and modification time are restored; a large file is not read whole."""
    from trainbridge.data import inputs

    path = tmp_path / "big.jsonl"
    line = json.dumps({"input_ids": [1, 2, 3]}) + "\n"
    path.write_text(line * (2 * inputs.SAMPLE_BLOCKS * inputs.SAMPLE_BLOCK_BYTES // len(line)))
    stat = path.stat()
    base = cache_module.cache_key(path, None, None, options())
    data = bytearray(path.read_bytes())
    data[-4] = ord("4")  # the last block is always hashed: [1, 2, 3] -> [1, 2, 4] on the last line
    path.write_bytes(bytes(data))
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert cache_module.cache_key(path, None, None, options()) != base
    # bounded: a file of 2 x 1 MiB has at most SAMPLE_BLOCKS x SAMPLE_BLOCK_BYTES of it read
    read: list[int] = []
    real_open = Path.open

    class Counting:
        def __init__(self, handle: object) -> None:
            self.handle = handle

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()  # type: ignore[attr-defined]

        def seek(self, offset: int) -> int:
            return self.handle.seek(offset)  # type: ignore[attr-defined,no-any-return]

        def read(self, size: int = -1) -> bytes:
            data: bytes = self.handle.read(size)  # type: ignore[attr-defined]
            read.append(len(data))
            return data

    def counting_open(self: Path, *args: object, **kwargs: object) -> Counting:
        return Counting(real_open(self, *args, **kwargs))  # type: ignore[call-overload]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "open", counting_open)
        inputs.fingerprint(path)
    assert read and all(0 < n <= inputs.SAMPLE_BLOCK_BYTES for n in read)
    assert sum(read) <= inputs.SAMPLE_BLOCKS * inputs.SAMPLE_BLOCK_BYTES


def test_arrow_samples_fetch_rows_across_chunks() -> None:
    """``fetch`` reads rows out of every chunk of a multi-chunk table (as multi-process tokenisation writes)."""
    import pyarrow as pa

    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 50, size=int(n)).tolist() for n in rng.integers(1, 9, size=30)]
    batches = [
        pa.record_batch(
            {
                "input_ids": pa.array(rows[a:b], pa.list_(pa.int32())),
                "labels": pa.array([[-100, *r[1:]] for r in rows[a:b]], pa.list_(pa.int32())),
            }
        )
        for a, b in ((0, 7), (7, 8), (8, 20), (20, 30))
    ]
    table = pa.Table.from_batches(batches)
    kept = np.array([0, 6, 7, 8, 19, 20, 29, 3])
    source = ArrowSamples(table, kept, np.array([len(rows[i]) for i in kept]), np.zeros(len(kept)))
    expected = [Sample(tuple(rows[i]), (-100, *rows[i][1:])) for i in kept]
    assert source.fetch(range(len(kept))) == expected
    assert source.fetch([7, 0, 7]) == [expected[7], expected[0], expected[7]]
    assert source.subset(np.array([6, 2])).fetch([0, 1]) == [expected[6], expected[2]]
    assert source.fetch([]) == []


def test_cache_key_covers_the_tokenizer_and_template(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_inputs(tmp_path)["jsonl"]
    base = cache_module.cache_key(path, tokenizer, None, options())
    assert base == cache_module.cache_key(path, tokenizer, None, options(num_proc=4))
    assert base != cache_module.cache_key(path, None, None, options())
    assert base != cache_module.cache_key(path, tokenizer, "{{ messages }}", options())
    assert base != cache_module.cache_key(path, tokenizer, None, options(overlong_policy="truncate"))
    for changed in (
        {"max_seq_len": 9},
        {"columns": (("messages", "conversations"),)},
        {"chat_train_on": "last"},
        {"system_prompt": "Be brief."},
        {"chat_template": "{{ messages }}"},
    ):
        assert base != cache_module.cache_key(path, tokenizer, None, options(**changed)), changed


def test_arrow_source_feeds_the_same_batches_as_in_memory_samples(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rows = [[1, *rng.integers(4, 70, size=int(n)).tolist()] for n in rng.integers(1, 30, size=40)]
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"input_ids": rows}).to_parquet(str(path))
    arrow, _ = open_dataset(path, None, options(max_seq_len=32), tmp_path / "cache")
    memory = InMemorySamples([Sample(tuple(r), tuple(r)) for r in rows])
    for rank in (0, 1):
        kwargs = dict(world_size=2, rank=rank, max_batch_len=64, padded=False)
        a = TrainBatches(arrow, list, effective_batch_size=8, seed=3, **kwargs)  # type: ignore[arg-type]
        b = TrainBatches(memory, list, effective_batch_size=8, seed=3, **kwargs)  # type: ignore[arg-type]
        assert list(a) == list(b)
        assert [a.micro_batch_loss_tokens(s) for s in a.plan.steps] == [
            b.micro_batch_loss_tokens(s) for s in b.plan.steps
        ]
        assert list(EvalBatches(arrow, list, **kwargs)) == list(EvalBatches(memory, list, **kwargs))  # type: ignore[arg-type]
    held = arrow.subset(np.array([3, 1]))
    assert held.fetch([0, 1]) == [memory[3], memory[1]]


def test_yaml_chat_template_file_and_data_folder_paths(tmp_path: Path) -> None:
    from trainbridge.core.config import TrainingArgs
    from trainbridge.data.sources import data_options

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "disk"))
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    (tmp_path / "run.yaml").write_text(
        "model_path: model\ndata_path: disk\nckpt_output_dir: out\n"
        "chat_template: chat.jinja\ndata_columns: {messages: conversations}\n"
    )
    args = TrainingArgs.from_yaml(tmp_path / "run.yaml")
    options = data_options(args)
    assert options.chat_template == "{{ messages }}"
    assert options.columns == (("messages", "conversations"),)
    with pytest.raises(ValueError, match="data_columns"):
        TrainingArgs.from_yaml(tmp_path / "run.yaml", data_columns={"msgs": "conversations"})


def test_loaders_give_callbacks_the_dataset_as_tokenised_rows(tmp_path: Path) -> None:
    """``train_dataloader.dataset`` / ``eval_dataloader.dataset`` (read by Trainer callbacks): every sample as a
    ``{"input_ids", "labels"}`` row, from the arrow cache as from memory; ``batch_size`` None (token budget)."""
    rows = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"input_ids": rows}).to_parquet(str(path))
    arrow, _ = open_dataset(path, None, options(max_seq_len=32), tmp_path / "cache")
    memory = InMemorySamples([Sample(tuple(r), (-100, *r[1:])) for r in rows])
    for source in (arrow, memory):
        train = TrainBatches(
            source,
            list,
            effective_batch_size=2,
            seed=3,
            world_size=2,
            rank=1,  # type: ignore[arg-type]
            max_batch_len=64,
            padded=False,
        )
        evaluation = EvalBatches(source, list, world_size=2, rank=1, max_batch_len=64, padded=False)  # type: ignore[arg-type]
        for loader in (train, evaluation):
            assert loader.batch_size is None
            dataset = loader.dataset
            assert len(dataset) == 3
            assert [row["input_ids"] for row in dataset] == rows
            assert dataset[-1] == {"input_ids": rows[2], "labels": list(source.fetch([2])[0].labels)}
            assert dataset[0:2] == [dataset[0], dataset[1]]
            with pytest.raises(IndexError):
                dataset[3]
