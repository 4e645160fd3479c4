"""Trainer's sample batches from a stream: a ``torch.utils.data.IterableDataset``, a ``datasets``
``IterableDataset`` (``load_dataset(..., streaming=True)``) or any re-iterable of items, with no length.

A stream has no epoch plan, so the run needs ``max_steps`` (as under Trainer); one "epoch" is one pass
over the stream, of at most ``max_steps`` steps (``steps_per_epoch``, Trainer's ``steps_in_epoch``).  Items
are grouped ``per_device`` at a time into micro-batches in stream order and micro-batch ``i`` goes to rank
``i % world_size`` (every rank reads the stream and keeps its share, as accelerate's dispatching of iterable
datasets does under Trainer), so ranks see disjoint items.  A step takes ``accumulation`` micro-batches per
rank; a pass ends at the first step the stream cannot fill (its last items are dropped, as accelerate
drops a round it cannot give every rank).  ``unsized``: the loop then starts the next epoch, a fresh pass
(``set_epoch`` first, as Trainer does), until ``max_steps``; a pass with no step ends the run.  Resume: the
loop walks ``set_epoch(epoch).steps[step_in_epoch:]``, and slicing the plan skips the micro-batches of the
steps already taken, so a resumed run trains on exactly the items an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

STREAM_NEEDS_MAX_STEPS = (
    "max_steps: a streaming (iterable) dataset has no length, so the number of steps cannot be derived from "
    "epochs; set max_steps to a positive number (as Trainer requires)"
)


def is_stream(data: Any) -> bool:
    """Whether ``data`` is an iterable dataset without a length (torch's or ``datasets``')."""
    import torch

    if isinstance(data, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(data, datasets.IterableDataset)


def require_max_steps(max_steps: int | None) -> int:
    """``max_steps`` when positive; otherwise a ``ValueError`` naming the field and the fix."""
    if max_steps is None or max_steps <= 0:
        raise ValueError(STREAM_NEEDS_MAX_STEPS)
    return max_steps


@dataclass(frozen=True)
class StreamStep:
    """One optimizer step: this rank's micro-batches of items (not yet collated)."""

    items: tuple[tuple[Any, ...], ...]
    num_samples: int
    """Items in the step, every rank."""


class StreamPlan:
    """The steps of one pass over the stream; ``steps[k:]`` skips the first ``k`` steps' items."""

    def __init__(self, source: StreamBatches, epoch: int) -> None:
        self.source, self.epoch = source, epoch
        self.steps = self

    def __len__(self) -> int:
        return self.source.steps_per_epoch

    def __getitem__(self, index: slice) -> Iterator[StreamStep]:
        if not isinstance(index, slice) or index.step not in (None, 1) or index.stop is not None:
            raise TypeError("a stream plan is walked from a start step: plan.steps[start:]")
        return self.source.steps_from(self.epoch, index.start or 0)

    def __iter__(self) -> Iterator[StreamStep]:
        return self[0:]


class StreamBatches:
    """This rank's micro-batches of a stream, ``accumulation`` per optimizer step (see module doc)."""

    unsized = True
    """No length: passes repeat until ``max_steps`` (``RunComponents.num_epochs``)."""

    def __init__(
        self,
        dataset: Iterable[Any],
        collate: Callable[[list[Any]], dict[str, Any]],
        *,
        per_device: int,
        accumulation: int,
        world_size: int,
        rank: int,
        max_steps: int | None,
        seed: int = 0,
    ) -> None:
        if per_device <= 0 or accumulation <= 0:
            raise ValueError(f"per_device ({per_device}) and accumulation ({accumulation}) must be positive")
        self.steps_per_epoch = require_max_steps(max_steps)
        self.dataset = dataset
        """The stream, as ``DataLoader.dataset`` gives it to callbacks."""
        self.collate = collate
        self.batch_size: int | None = per_device
        self.accumulation, self.world_size, self.rank, self.seed = accumulation, world_size, rank, seed
        self.plan = StreamPlan(self, 0)

    def set_epoch(self, epoch: int) -> StreamPlan:
        """A fresh pass over the stream (a ``datasets`` stream's shuffle buffer is reseeded per epoch)."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self.plan = StreamPlan(self, epoch)
        return self.plan

    def _rounds(self) -> Iterator[list[tuple[Any, ...]]]:
        """The stream as rounds of ``world_size x accumulation`` full micro-batches (one step, every rank)."""
        size = self.batch_size or 1
        need = size * self.world_size * self.accumulation
        items = iter(self.dataset)
        while True:
            chunk = tuple(islice(items, need))
            if len(chunk) < need:
                return
            yield [chunk[i : i + size] for i in range(0, need, size)]

    def steps_from(self, epoch: int, start: int) -> Iterator[StreamStep]:
        """The steps of ``epoch`` from step ``start`` on, the items of earlier steps read and dropped."""
        del epoch  # the pass is set up by set_epoch
        for round_ in islice(self._rounds(), start, self.steps_per_epoch):
            mine = tuple(round_[i] for i in range(self.rank, len(round_), self.world_size))
            yield StreamStep(mine, sum(len(micro) for micro in round_))

    def micro_batches(self, step: StreamStep) -> list[dict[str, Any]]:
        """Collated micro-batches (CPU) of this rank in ``step``."""
        return [self.collate(list(items)) for items in step.items]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in self.plan.steps[0:]:
            yield from self.micro_batches(step)
