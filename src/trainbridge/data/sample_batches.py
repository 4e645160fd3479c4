"""Trainer's sample batches: ``per_device`` dataset items per micro-batch, ``accumulation`` micro-batches
per optimizer step, formed by a collator from the items exactly as the dataset's ``__getitem__`` returns
them (tensors stay tensors, extra keys stay).

Every rank computes the same epoch plan with no communication: positions in the epoch's order, cut into
micro-batches of ``per_device`` and dealt to the ranks by accelerate's own ``BatchSamplerShard``.  The order
is Trainer's (``order``, a ``data.sample_order.SampleOrder``: ``train_sampling_strategy``; by default a
permutation drawn by a generator seeded with ``seed + epoch``, as accelerate's ``SeedableRandomSampler``
under Trainer's ``DataLoader``); under ``group_by_length`` each rank draws it from the global generator as
the epoch's pass reads its first batch, as Trainer's ``LengthGroupedSampler`` (``drawn`` keeps the state it
drew from, for the checkpoint: a pass resumed inside the epoch draws from that state again).  Each
rank then has the same number of micro-batches, ``ceil(N / (per_device x world))`` per epoch, grouped
``accumulation`` at a time into optimizer steps (the last one may hold fewer).  ``drop_last``
(``dataloader_drop_last``): whole micro-batches only, ``N // per_device // world`` per rank, as Trainer's
``DataLoader`` drops its short batch.
``workers`` (``dataloader_num_workers``...): the items are read and collated by ``DataLoader`` worker processes
ahead of the step (``data.loader_workers``), in the same order.
``remove_unused_columns``: the keys the model's forward does not take are dropped from each item before
the collator sees it, as Trainer's ``RemoveColumnsCollator`` does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainbridge.core.random_state import SamplerDraw
from trainbridge.data.loader_workers import LoaderWorkers, WorkerFetch
from trainbridge.data.sample_order import SampleOrder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleStep:
    """One optimizer step on all ranks: ``micro_batches[rank][i]`` holds the positions in the epoch's order of
    the items of micro-batch ``i`` of ``rank`` (every rank has the same number)."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def num_samples(self) -> int:
        """Items in the step, every rank (the repeated padding items included, as Trainer counts them)."""
        return sum(len(micro) for rank in self.micro_batches for micro in rank)


@dataclass(frozen=True)
class SamplePlan:
    """The optimizer steps of one epoch."""

    epoch: int
    steps: Sequence[SampleStep]


class ItemCollator:
    """The collator called on a micro-batch's items, each first stripped of the keys the model does not take
    (``keep``; None keeps everything: ``remove_unused_columns=False``)."""

    def __init__(self, collator: Callable[[list[Any]], Any], keep: Collection[str] | None) -> None:
        self.collator = collator
        self.keep = set(keep) if keep is not None else None

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        if self.keep is not None:
            items = [
                {k: v for k, v in item.items() if k in self.keep} if isinstance(item, Mapping) else item
                for item in items
            ]
        batch = self.collator(items)
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"data_collator {type(self.collator).__name__} returned {type(batch).__name__}; "
                "it must return a dict of the model's inputs"
            )
        return dict(batch)


class SampleBatches:
    """This rank's micro-batches of dataset items for each optimizer step of an epoch (see module doc)."""

    def __init__(
        self,
        dataset: Any,
        collate: Callable[[list[Any]], dict[str, Any]],
        *,
        per_device: int,
        accumulation: int,
        world_size: int,
        rank: int,
        seed: int,
        order: SampleOrder | None = None,
        drop_last: bool = False,
        workers: LoaderWorkers | None = None,
        drawn: SamplerDraw | None = None,
    ) -> None:
        if per_device <= 0 or accumulation <= 0:
            raise ValueError(f"per_device ({per_device}) and accumulation ({accumulation}) must be positive")
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        self.dataset = dataset
        """The items, as ``DataLoader.dataset`` gives them to callbacks."""
        self.collate = collate
        self.batch_size: int | None = per_device
        """Items per micro-batch on one rank (``per_device_train_batch_size``)."""
        self.accumulation = accumulation
        self.world_size, self.rank = world_size, rank
        self.order = order or SampleOrder(seed=seed)
        """The epoch's order and its dealing (``train_sampling_strategy``)."""
        self.batches_per_epoch = self.order.batches_per_rank(
            len(dataset), per_device, accumulation, world_size, drop_last
        )
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"dataloader_drop_last=True: {len(dataset)} training items make no whole batch of "
                f"{per_device} on each of {world_size} ranks; lower per_device_train_batch_size or set "
                "dataloader_drop_last=False"
            )
        self.drop_last = drop_last
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / accumulation)
        reading = workers if workers is not None and workers.num_workers > 0 else LoaderWorkers()
        self._fetch = WorkerFetch(dataset, collate, reading, rank)
        """The items read and collated by a ``DataLoader`` (``data.loader_workers``): torch's RNG drawn as under
        Trainer; ``dataloader_num_workers``: in worker processes."""
        self.drawn = drawn if drawn is not None else SamplerDraw()
        """The state this rank drew the running epoch's order from (``group_by_length``), for checkpoints."""
        self._order: list[int] | None = None
        """The running epoch's item order (None: drawn as its pass starts)."""
        self._passes = 0
        """Plans made so far (``set_epoch`` calls): the key of the current plan's pass."""
        self._index_lists: list[tuple[int, ...]] = []
        self._first: dict[int, int] = {}
        """Position in ``_index_lists`` of each step's first micro-batch (by the step's id)."""
        self.plan = self.set_epoch(0)

    def set_epoch(self, epoch: int) -> SamplePlan:
        """Plan ``epoch`` (the same on every rank); its order is drawn now, or as its pass starts."""
        size, accumulation, count = self.batch_size or 1, self.accumulation, len(self.dataset)
        batches = self.order.rank_batches(epoch, count, size, accumulation, self.world_size, self.drop_last)
        self._order = None if self.order.draws_at_pass_start else self.order.order(epoch, count, size * accumulation)
        steps = [
            SampleStep(tuple(tuple(rank_batches[k : k + accumulation]) for rank_batches in batches))
            for k in range(0, self.batches_per_epoch, accumulation)
        ]
        self.plan = SamplePlan(epoch, steps)
        self._passes += 1
        self._index_lists = [indices for step in steps for indices in step.micro_batches[self.rank]]
        counts = [len(step.micro_batches[self.rank]) for step in steps]
        self._first = {id(step): sum(counts[:k]) for k, step in enumerate(steps)}
        return self.plan

    def micro_batches(self, step: SampleStep) -> list[dict[str, Any]]:
        """Collated micro-batches (CPU) of this rank in ``step`` (a step of the current ``plan``)."""
        own = step.micro_batches[self.rank]
        if id(step) in self._first:
            lists = self._items_from
            return self._fetch.fetch(self._passes, self._first[id(step)], lists, len(self._index_lists), len(own))
        order = self._epoch_order(resumed=True)
        return [self.collate([self.dataset[order[p]] for p in positions]) for positions in own]

    def _items_from(self, start: int) -> list[list[int]]:
        """This rank's micro-batches (item indices) of the running pass from micro-batch ``start`` on."""
        order = self._epoch_order(resumed=start > 0)
        return [[order[p] for p in positions] for positions in self._index_lists[start:]]

    def _epoch_order(self, resumed: bool) -> list[int]:
        """The running epoch's order; under ``group_by_length`` drawn now (the pass reads its first batch) from
        the global generator, or, for a pass ``resumed`` inside the epoch, from the state it was drawn from."""
        if self._order is None:
            epoch, count, group = self.plan.epoch, len(self.dataset), (self.batch_size or 1) * self.accumulation
            generator = None
            if resumed and self.drawn.state is not None:
                generator = torch.Generator()
                generator.set_state(self.drawn.state)
            elif resumed:
                logger.warning(
                    "train_sampling_strategy='group_by_length': epoch %d resumes without the state its order "
                    "was drawn from (a checkpoint without it): its remaining items follow a new order",
                    epoch,
                )
            self.drawn.state = torch.get_rng_state() if generator is None else self.drawn.state
            self._order = self.order.order(epoch, count, group, generator)
        return self._order

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in self.plan.steps:
            yield from self.micro_batches(step)


class SampleEvalBatches:
    """Validation micro-batches of items as Trainer's evaluation ``DataLoader`` (prepared by accelerate,
    ``even_batches``) gives them: the items in order, cut into batches of ``per_device``, batch ``j`` on rank
    ``j % world``; with several ranks the tail is completed with the data set's first items (cycled) up to a
    multiple of ``per_device x world``, so every rank runs the same number of full batches.  The completing
    rows run through the model (they are in the batch's mean loss, as under Trainer) but are not samples:
    ``indexed`` yields only the real items (as positions in the evaluation order), which lead each batch
    (``order``: the items' order, Trainer's evaluation sampler's under ``group_by_length``; None: dataset
    order), and a batch's loss counts once per real item (Trainer repeats it ``eval_batch_size`` times and
    drops the gathered copies past the data set's end, which is the same weight)."""

    def __init__(
        self,
        dataset: Any,
        collate: Callable[[list[Any]], dict[str, Any]],
        *,
        per_device: int,
        world_size: int,
        rank: int,
        order: Sequence[int] | None = None,
    ) -> None:
        self.dataset = dataset
        self.collate = collate
        self.batch_size: int | None = per_device
        count = len(dataset)
        order = list(order) if order is not None else list(range(count))
        if world_size > 1 and count:
            start = order[: per_device * world_size]
            order += [start[i % len(start)] for i in range(-count % (per_device * world_size))]
        batches = [order[i : i + per_device] for i in range(0, len(order), per_device)]
        self.groups: list[tuple[list[int], list[int]]] = []
        """``(item indices of the batch's rows, positions of its real items in the evaluation order)`` of this
        rank's batches (``compute_metrics`` gets the items in that order, as Trainer's evaluation sampler's)."""
        for number in range(rank, len(batches), world_size):
            rows = batches[number]
            first = number * per_device
            self.groups.append((rows, list(range(first, first + max(0, min(len(rows), count - first))))))
        self.num_samples_local = sum(len(real) for _, real in self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for _, batch in self.indexed():
            yield batch

    def indexed(self) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """``(real items' positions in the evaluation order, batch)`` pairs; rows past them complete the batch
        (counted nowhere)."""
        for rows, real in self.groups:
            yield real, self.collate([self.dataset[i] for i in rows])
