"""Validation batches and their loss as ``transformers.Trainer`` evaluates on several ranks: accelerate's
``even_batches`` sharding (``SampleEvalBatches``) and ``prediction_step``'s loss (``ModelLoss.eval_batch``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

from trainbridge.core.distributed import DistributedEnv
from trainbridge.data.sample_batches import SampleEvalBatches
from trainbridge.step.model_loss import ModelLoss


def _rows(count: int, per_device: int, world: int, rank: int) -> list[list[int]]:
    """The item indices of each batch rank ``rank`` gets from Trainer's prepared evaluation DataLoader."""
    sampler = BatchSampler(SequentialSampler(range(count)), per_device, drop_last=False)
    return [list(b) for b in BatchSamplerShard(sampler, num_processes=world, process_index=rank, even_batches=True)]


@pytest.mark.parametrize(("count", "per_device", "world"), [(37, 4, 2), (21, 5, 2), (3, 4, 2), (40, 4, 2), (9, 2, 3)])
def test_each_rank_gets_the_batches_trainer_gives_it_and_every_item_counts_once(count, per_device, world):
    seen: list[int] = []
    for rank in range(world):
        batches = SampleEvalBatches(
            list(range(count)), lambda items: {"ids": list(items)}, per_device=per_device, world_size=world, rank=rank
        )
        got = list(batches.indexed())
        assert [batch["ids"] for _, batch in got] == _rows(count, per_device, world, rank)
        for real, batch in got:
            assert batch["ids"][: len(real)] == real  # the real items lead the batch; the rest completes it
        seen += [i for real, _ in got for i in real]
        assert batches.num_samples_local == sum(len(real) for real, _ in got)
    assert sorted(seen) == list(range(count))


class _TwoRanks(DistributedEnv):
    """Rank 0 of two, whose other rank's batch holds ``other_items`` labelled items."""

    def __init__(self, other_items: float) -> None:
        super().__init__(rank=0, world_size=2)
        self.other_items = other_items

    def sum_floats(self, values: Any) -> list[float]:
        return [v + self.other_items for v in values]


class _Counting(torch.nn.Module):
    """A classifier whose loss is a mean over its rows, whatever ``num_items_in_batch`` (BERT-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []
        self.weight = torch.nn.Parameter(torch.zeros(3, 2))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        self.seen.append(kwargs.get("num_items_in_batch"))
        logits = self.weight[input_ids]
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_eval_loss_of_a_batch_is_trainers_with_the_items_of_every_rank_and_the_world_size_scale():
    model = _Counting()

    class Batches:
        accumulation, world_size, collate = 1, 2, None

    step = ModelLoss(Batches(), model, _TwoRanks(other_items=5.0))  # type: ignore[arg-type]
    batch = {"input_ids": torch.tensor([0, 1, 2]), "labels": torch.tensor([0, 1, 1])}
    out = step.eval_batch(model, batch, batch, outputs=True, rows=3)
    mean = torch.nn.functional.cross_entropy(torch.zeros(3, 2), torch.tensor([0, 1, 1]))
    # Trainer.compute_loss: loss *= num_processes when the model accepts loss kwargs (num_items_in_batch given)
    assert float(out.loss_sum) == pytest.approx(float(mean) * 2 * 3)
    assert out.units == 3.0
    assert float(model.seen[-1]) == 8.0  # 3 items here + 5 on the other rank, as Trainer gathers them
