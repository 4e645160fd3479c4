"""A streaming ``IterableDataset`` (``TrainingArgs.train_stream``) through run_training on 2 real gloo ranks:
it travels to the self-launched workers by value, trains ``max_steps`` steps, and the ranks see disjoint items
(rank 0 reads and collates them, one round of micro-batches ahead of the step, and sends each rank its own, as
accelerate dispatches a stream under Trainer)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.run_inputs import run_training, split_run
from tests.unit.test_model_loss import BERT, _save
from tests.unit.test_stream_batches import Numbers
from trainbridge import TorchrunArgs

pytestmark = pytest.mark.distributed


class RecordingCollator:
    """Pads the items and appends their ``idx`` to ``seen-<rank>.txt`` in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        with (self.folder / f"seen-{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write("".join(f"{item['idx']}\n" for item in items))
        longest = max(len(item["input_ids"]) for item in items)
        ids = [item["input_ids"] + [0] * (longest - len(item["input_ids"])) for item in items]
        mask = [[1] * len(item["input_ids"]) + [0] * (longest - len(item["input_ids"])) for item in items]
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor([item["labels"] for item in items]),
        }


def test_two_ranks_stream_disjoint_items_for_max_steps(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = _save(BertForSequenceClassification(BertConfig(**BERT, num_labels=2)), tmp_path / "model")
    placeholder = tmp_path / "unused.jsonl"
    placeholder.write_text('{"text": "x"}\n')
    seen = tmp_path / "seen"
    seen.mkdir()
    args = split_run(
        model_path=model,
        data_path=placeholder,
        train_stream=Numbers(),
        data_collator=RecordingCollator(seen),
        remove_unused_columns=False,
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        max_steps=5,
        save_strategy="no",
        disable_tqdm=True,
    )
    result = run_training(args, TorchrunArgs(nproc_per_node=2))
    assert result.global_step == 5
    # rank 0 reads the stream and collates every rank's micro-batch (accelerate's dispatch_batches under Trainer):
    # 5 steps x 2 micro-batches x 2 ranks of 2 items, and one round read ahead of the last step (as accelerate's
    # DataLoaderDispatcher); rank 1 collates none
    assert not (seen / "seen-1.txt").exists()
    items = [int(x) for x in (seen / "seen-0.txt").read_text().split()]
    assert len(items) == 5 * 8 + 4
    micro_batches = [items[i : i + 2] for i in range(0, 5 * 8, 2)]
    ranks = [[i for batch in micro_batches[rank::2] for i in batch] for rank in range(2)]  # micro-batch i: rank i
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(5 * 8))
