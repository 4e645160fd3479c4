"""Batch iterables the loop and callbacks see as ``train_dataloader`` / ``eval_dataloader``.

``TrainBatches`` turns the global epoch plan (``data.plan.plan_epoch``, built from the source's length
columns) into this rank's micro-batch tensors, step by step, fetching each micro-batch's samples from
the ``SampleSource`` (``data.samples``) only when it is collated.  ``EvalBatches`` splits the validation
set across ranks and packs it to the token budget, padding with dummy micro-batches so every rank runs
the same number of forwards (sharded models all-gather parameters in forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from trainbridge.data.plan import EpochPlan, StepPlan, plan_epoch, steps_per_epoch
from trainbridge.data.samples import SampleSource, as_source
from trainbridge.data.types import Sample

Collate = Callable[[Sequence[Sample]], dict[str, torch.Tensor]]


class SampleRows(Sequence[dict[str, list[int]]]):
    """The samples of a loader as rows of a tokenised dataset (``{"input_ids": [...], "labels": [...]}``),
    as ``train_dataloader.dataset[i]`` reads under Trainer; each row is fetched when it is read."""

    def __init__(self, samples: SampleSource) -> None:
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = int(index) + len(self) if int(index) < 0 else int(index)
        if not 0 <= position < len(self):
            raise IndexError(f"sample {index} out of range ({len(self)} samples)")
        sample = self._samples.fetch([position])[0]
        return {"input_ids": list(sample.input_ids), "labels": list(sample.labels)}


class TrainBatches:
    """This rank's micro-batches for each optimizer step of an epoch (same plan on every rank)."""

    def __init__(
        self,
        samples: SampleSource | Sequence[Sample],
        collate: Collate,
        *,
        effective_batch_size: int,
        world_size: int,
        rank: int,
        max_batch_len: int,
        seed: int,
        padded: bool,
    ):
        self.samples = as_source(samples)
        self.collate = collate
        self.rank = rank
        self._plan_kwargs: dict[str, Any] = dict(
            effective_batch_size=effective_batch_size,
            world_size=world_size,
            max_batch_len=max_batch_len,
            seed=seed,
            padded=padded,
        )
        self.steps_per_epoch = steps_per_epoch(len(self.samples), effective_batch_size)
        self.plan: EpochPlan = self.set_epoch(0)
        self.dataset = SampleRows(self.samples)
        """Every training sample (all ranks'), as ``DataLoader.dataset`` gives it to callbacks."""
        self.batch_size: int | None = None
        """None, as for a ``DataLoader`` driven by a batch sampler: micro-batches follow a token budget."""

    def set_epoch(self, epoch: int) -> EpochPlan:
        """Plan ``epoch`` (deterministic from the seed and the epoch number)."""
        self.plan = plan_epoch(self.samples.lengths, self.samples.loss_tokens, epoch=epoch, **self._plan_kwargs)
        return self.plan

    def micro_batches(self, step: StepPlan) -> list[dict[str, torch.Tensor]]:
        """Collated tensors (CPU) of this rank's micro-batches in ``step``."""
        return [self.collate(self.samples.fetch(indices)) for indices in step.micro_batches[self.rank]]

    def micro_batch_loss_tokens(self, step: StepPlan) -> list[int]:
        """Loss tokens of each of this rank's micro-batches in ``step`` (from the length columns)."""
        loss_tokens = self.samples.loss_tokens
        return [int(loss_tokens[list(group)].sum()) for group in step.micro_batches[self.rank]]

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        for step in self.plan.steps:
            yield self.micro_batches(step)


class EvalBatches:
    """Validation micro-batches of this rank; every rank gets the same number."""

    def __init__(
        self,
        samples: SampleSource | Sequence[Sample],
        collate: Collate,
        *,
        world_size: int,
        rank: int,
        max_batch_len: int,
        padded: bool,
    ):
        self.samples = as_source(samples)
        self.collate = collate
        count = len(self.samples)
        mine = range(rank, count, world_size)
        counts = []
        groups_by_rank = []
        lengths = self.samples.lengths
        for r in range(world_size):
            groups = _pack(range(r, count, world_size), lengths, max_batch_len, padded)
            groups_by_rank.append(groups)
            counts.append(len(groups))
        self.groups: list[list[int]] = groups_by_rank[rank] + [[] for _ in range(max(counts) - counts[rank])]
        self.num_samples_local = len(mine)
        self.dataset = SampleRows(self.samples)
        """Every validation sample (all ranks'), as ``DataLoader.dataset`` gives it to callbacks."""
        self.batch_size: int | None = None
        """None: micro-batches follow the token budget (see ``TrainBatches.batch_size``)."""

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for _, batch in self.indexed():
            yield batch

    def indexed(self) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
        """``(sample indices, batch)`` pairs; row ``r`` of a padded batch holds sample ``indices[r]``."""
        for group in self.groups:
            yield group, self.collate(self.samples.fetch(group))


def _pack(indices: Sequence[int], lengths: np.ndarray, budget: int, padded: bool) -> list[list[int]]:
    """Greedy in-order packing of ``indices`` into groups within the token budget."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in indices:
        n = int(lengths[i])
        cost = max(longest, n) * (len(current) + 1) if padded else total + n
        if current and cost > budget:
            groups.append(current)
            current, longest, total = [], 0, 0
        current.append(i)
        longest = max(longest, n)
        total += n
    if current:
        groups.append(current)
    return groups
