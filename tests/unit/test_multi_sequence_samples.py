"""Multi-sequence samples (``Sample.seq_lengths``: trl's ``bfd`` bins): one sample to the plan and the batch
counts, laid out as trl's padding-free collator lays a bin out, attending within each sequence only; kept
through the data files and the tokenisation cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit.test_collate_loss import VOCAB, tiny_llama
from trainbridge.data import collate_padded, collate_padding_free, token_loss_sum
from trainbridge.data.loader import EvalBatches, TrainBatches, sequences
from trainbridge.data.sources import load_jsonl
from trainbridge.data.types import DataFormatError, Sample
from trainbridge.modeling import enable_varlen_sdpa, sample_segments


def _bins() -> list[dict[str, list[int]]]:
    """trl's own ``bfd`` packing of eight sequences (of 3 to 10 tokens) into bins of 16 tokens."""
    datasets = pytest.importorskip("datasets")
    from trl.data_utils import pack_dataset

    rows = []
    for k, length in enumerate([7, 3, 10, 5, 9, 4, 6, 8]):
        ids = [(7 * k + 3 * t) % (VOCAB - 1) + 1 for t in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] * (k % 3) + ids[k % 3 :]})
    packed = pack_dataset(datasets.Dataset.from_list(rows), seq_length=16, strategy="bfd")
    return [dict(row) for row in packed]


def _sample(row: dict[str, list[int]]) -> Sample:
    lengths = tuple(row["seq_lengths"])
    return Sample(tuple(row["input_ids"]), tuple(row["labels"]), lengths if len(lengths) > 1 else None)


def test_a_bin_is_laid_out_as_trls_padding_free_collator() -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = _bins()
    assert any(len(row["seq_lengths"]) > 1 for row in rows)
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows[:3])
    ours = collate_padding_free(sequences([_sample(row) for row in rows[:3]]))
    for key in ("input_ids", "labels", "position_ids"):
        assert ours[key].tolist() == theirs[key].tolist(), key
    assert ours.seq_lens == ((*[n for row in rows[:3] for n in row["seq_lengths"]],),)
    loss_tokens = sum(_sample(row).loss_tokens for row in rows[:3])
    assert loss_tokens == int((theirs["labels"] != -100).sum())  # trl's label mask: each sequence's first is out


def test_a_packed_bins_logits_equal_each_sequence_alone() -> None:
    """Through the loop's attention for padding-free rows (``VARLEN_SDPA``, boundaries from ``seq_lens``)."""
    model = tiny_llama("sdpa").eval()
    assert enable_varlen_sdpa(model, max_seq_len=64)
    row = max(_bins(), key=lambda r: len(r["seq_lengths"]))
    sample = _sample(row)
    batch = collate_padding_free(sequences([sample]))
    with torch.no_grad(), sample_segments(batch):
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    start = 0
    for part in sample.sequences():
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([part.input_ids])).logits[0]
        torch.testing.assert_close(packed[start : start + part.length], alone, rtol=1e-4, atol=1e-5)
        start += part.length
    assert start == sample.length
    with torch.no_grad(), sample_segments(batch):
        loss, tokens = token_loss_sum(model, batch)
        one_by_one = [token_loss_sum(model, collate_padding_free([part])) for part in sample.sequences()]
    assert tokens == sample.loss_tokens == sum(n for _, n in one_by_one)
    assert loss.item() == pytest.approx(sum(x.item() for x, _ in one_by_one), rel=1e-5)


def test_the_plan_counts_bins_and_padded_rows_split_them() -> None:
    samples = [_sample(row) for row in _bins()]
    batches = TrainBatches(
        samples, collate_padding_free, effective_batch_size=2, world_size=1, rank=0, max_batch_len=32, seed=0,
        padded=False,
    )  # fmt: skip
    assert batches.steps_per_epoch == -(-len(samples) // 2)
    step = batches.plan.steps[0]
    assert step.num_samples == 2
    assert step.num_tokens == sum(samples[i].length for i in step.sample_indices())
    assert step.loss_tokens == sum(samples[i].loss_tokens for i in step.sample_indices())
    (micro,) = batches.micro_batches(step)
    assert sum(len(row) for row in micro.seq_lens) == sum(
        len(samples[i].seq_lengths or (1,)) for i in step.sample_indices()
    )
    row = batches.dataset[step.sample_indices()[0]]
    assert row["seq_lengths"] == list(samples[step.sample_indices()[0]].seq_lengths or [])
    padded = collate_padded(sequences(samples[:2]), pad_token_id=0)  # a model without packed rows: a row each
    assert padded["input_ids"].shape[0] == sum(len(s.sequences()) for s in samples[:2])


def test_data_files_and_the_cache_keep_seq_lengths(tmp_path: Path) -> None:
    path = tmp_path / "bins.jsonl"
    rows = [
        {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [5, 6, 7, 8, 9, 10], "seq_lengths": [2, 4]},
        {"input_ids": [11, 12, 13], "seq_lengths": [3]},
        {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "seq_lengths": [3, 3, 2]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    samples, _ = load_jsonl(path, None, max_seq_len=7, overlong_policy="truncate", cache_dir=tmp_path / "cache")
    assert [s.seq_lengths for s in samples] == [(2, 4), None, (3, 3, 1)]  # the last one truncated to 7 tokens
    assert [s.loss_tokens for s in samples] == [4, 2, 4]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1: 'seq_lengths' \[1, 1\] must be positive and sum"):
        load_jsonl(bad, None, max_seq_len=8, overlong_policy="error", cache_dir=tmp_path / "cache")


def test_trainers_validation_batches_and_packed_predictions() -> None:
    """``per_device``: batch ``i`` of ``per_device`` samples on rank ``i % world``, as accelerate deals them, the
    last round completed from the first samples (rows that are no validation sample of the batch)."""
    samples = [Sample((1, 2, 3), (1, 2, 3))] * 5
    ranks = [
        EvalBatches(samples, collate_padding_free, world_size=2, rank=r, max_batch_len=64, padded=False, per_device=2)
        for r in range(2)
    ]
    assert [b.groups for b in ranks] == [[[0, 1], [4, 0]], [[2, 3], [1, 2]]]
    assert [b.real for b in ranks] == [[[0, 1], [4]], [[2, 3], []]]
    assert [indices for indices, _ in ranks[0].indexed()] == [[0, 1], [4]]
    assert [b.num_samples_local for b in ranks] == [3, 2]
    packed = [Sample((1, 2, 3, 4), (1, 2, 3, 4), (2, 2))]
    predicted = EvalBatches(
        packed, collate_padded_zero, world_size=1, rank=0, max_batch_len=64, padded=True, row_per_sample=True
    )
    with pytest.raises(ValueError, match="eval_packing=False"):
        list(predicted.indexed())


def collate_padded_zero(samples: list[Sample]) -> dict[str, torch.Tensor]:
    return collate_padded(samples, pad_token_id=0)
