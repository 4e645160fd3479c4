"""Batch iterables the loop and callbacks see as ``train_dataloader`` / ``eval_dataloader``.

``TrainBatches`` turns the global epoch plan (``data.plan.plan_epoch``, built from the source's length
columns) into this rank's micro-batch tensors, step by step, fetching each micro-batch's samples from
the ``SampleSource`` (``data.samples``) only when it is collated.  ``EvalBatches`` splits the validation
set across ranks and packs it to the token budget, padding with dummy micro-batches so every rank runs
the same number of forwards (sharded models all-gather parameters in forward); with ``per_device`` it
takes Trainer's validation batches instead (that many samples per rank, as accelerate shards them, the last
round completed from the first samples; ``order``: Trainer's evaluation sampler's, under ``group_by_length``).

A multi-sequence sample (``Sample.seq_lengths``: a packed bin) is one sample to the plan and the batch
counts, and reaches the collator as its sequences (``Sample.sequences``), so a padding-free row lays the
bin out as trl's padding-free collator does: ``position_ids`` restarting at each sequence, each
sequence's first label ``-100``, attention within each sequence (``modeling.varlen_attention`` reads the
boundaries from the row's ``seq_lens``).
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
        row = {"input_ids": list(sample.input_ids), "labels": list(sample.labels)}
        if sample.seq_lengths is not None:
            row["seq_lengths"] = list(sample.seq_lengths)
        return row


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
        whole_batches_of: int | None = None,
        shuffle: bool = True,
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
            whole_batches_of=whole_batches_of,
            shuffle=shuffle,
        )
        kept = len(self.samples)
        if whole_batches_of is not None:
            kept = kept // whole_batches_of * whole_batches_of
        if kept == 0:
            raise ValueError(
                f"dataloader_drop_last=True: {len(self.samples)} training samples make no whole batch of "
                f"{whole_batches_of} (all ranks); lower per_device_train_batch_size or set dataloader_drop_last=False"
            )
        self.steps_per_epoch = steps_per_epoch(kept, effective_batch_size)
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
        return [self.collate(sequences(self.samples.fetch(indices))) for indices in step.micro_batches[self.rank]]

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
        per_device: int | None = None,
        row_per_sample: bool = False,
        order: Sequence[int] | None = None,
    ):
        self.samples = as_source(samples)
        self.collate = collate
        count = len(self.samples)
        if per_device is not None:  # positions in the evaluation order, the rows' samples through it
            items = list(order) if order is not None else list(range(count))
            rows_by_rank = [
                [([items[p] for p in rows], real) for rows, real in batches]
                for batches in _trainer_batches(list(range(count)), per_device, world_size)
            ]
        else:
            packed = [
                _pack(range(r, count, world_size), self.samples.lengths, max_batch_len, padded)
                for r in range(world_size)
            ]
            rows_by_rank = [[(group, group) for group in groups] for groups in packed]
        most = max(len(groups) for groups in rows_by_rank)
        mine = rows_by_rank[rank] + [([], []) for _ in range(most - len(rows_by_rank[rank]))]
        self.groups: list[list[int]] = [rows for rows, _ in mine]
        """The sample indices of each batch's rows (a dummy batch: none)."""
        self.real: list[list[int]] = [real for _, real in mine]
        """The validation samples of each batch, its leading rows (the rest complete Trainer's last round), as
        positions in the evaluation order (``order``'s: Trainer's sampler's; else dataset indices), the order
        ``compute_metrics`` gets them in."""
        self.num_samples_local = sum(len(real) for real in self.real)
        self.row_per_sample = row_per_sample
        """Row ``r`` of a batch must hold sample ``r`` of its group (predictions for ``compute_metrics``)."""
        self.dataset = SampleRows(self.samples)
        """Every validation sample (all ranks'), as ``DataLoader.dataset`` gives it to callbacks."""
        self.batch_size: int | None = per_device
        """``per_device``; None when micro-batches follow the token budget (see ``TrainBatches.batch_size``)."""

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for _, batch in self.indexed():
            yield batch

    def indexed(self) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
        """``(sample positions, batch)`` pairs; row ``r`` of a padded batch holds the sample at position
        ``positions[r]`` of the evaluation order (``real``; rows past them complete the batch, counted nowhere)."""
        for group, real in zip(self.groups, self.real, strict=True):
            samples = self.samples.fetch(group)
            parts = sequences(samples)
            if len(parts) != len(samples) and self.row_per_sample:
                raise ValueError(
                    "compute_metrics: validation predictions need one row per validation sample, and these "
                    "samples are packed sequences (seq_lengths); evaluate unpacked samples (trl: eval_packing=False)"
                )
            yield real, self.collate(parts)


def sequences(samples: Sequence[Sample]) -> list[Sample]:
    """The sequences of ``samples`` in order (a multi-sequence sample gives each of its own)."""
    if all(sample.seq_lengths is None for sample in samples):
        return list(samples)
    return [part for sample in samples for part in sample.sequences()]


def _trainer_batches(order: list[int], per_device: int, world_size: int) -> list[list[tuple[list[int], list[int]]]]:
    """Trainer's validation batches of the samples in ``order`` on each rank, ``(rows, real samples)``:
    consecutive batches of ``per_device`` samples, batch ``i`` on rank ``i % world_size``; with several ranks
    the last round is completed from the first samples (cycled), as accelerate's even batches are."""
    count = len(order)
    if world_size > 1 and count:
        start = order[: per_device * world_size]
        order = order + [start[i % len(start)] for i in range(-count % (per_device * world_size))]
    batches = [
        (order[first : first + per_device], order[first : min(first + per_device, count)])
        for first in range(0, len(order), per_device)
    ]
    return [batches[rank::world_size] for rank in range(world_size)]


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
