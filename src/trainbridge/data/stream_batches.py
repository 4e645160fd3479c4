"""Trainer's sample batches from a stream: a ``torch.utils.data.IterableDataset``, a ``datasets``
``IterableDataset`` (``load_dataset(..., streaming=True)``) or any re-iterable of items, with no length.

A stream has no epoch plan, so the run needs ``max_steps`` (as under Trainer); one "epoch" is one pass
over the stream, of at most ``max_steps`` steps (``steps_per_epoch``, Trainer's ``steps_in_epoch``).  Items
are grouped ``per_device`` at a time into micro-batches in stream order and micro-batch ``i`` goes to rank
``i % world_size`` (as accelerate's dispatching of iterable datasets under Trainer), so ranks see disjoint
items.  A step takes ``accumulation`` micro-batches per rank; a pass ends where the stream runs out: its last
rounds, fewer than a step takes, are one ``carried`` step (trained without an optimizer step, their
gradients and loss carried into the next pass's first step, as Trainer's ``_inner_training_loop``), and a round
the stream runs out in is given as Trainer's loader gives it (``_last_round``).  ``unsized``: the loop
then starts the next epoch, a fresh pass (the stream's ``set_epoch`` twice as it begins, Trainer's own call and
accelerate's loader's), until ``max_steps``; a pass with no optimizer step ends the run.  Resume: the
loop walks ``set_epoch(epoch).steps[step_in_epoch:]``, and slicing the plan skips the micro-batches of the
steps already taken, so a resumed run trains on exactly the items an uninterrupted one would.

The stream is read through a ``DataLoader`` (no workers), as Trainer's is: each pass draws the loader's base
seed from torch's global generator, micro-batches are read and collated in stream order, one
round of ``world_size`` micro-batches ahead of the step (accelerate's ``DataLoaderDispatcher``), so dropout,
random transforms and a random collator draw torch's stream as under Trainer.  A pass resumed inside it puts
the RNG back once the step's micro-batches are read (Trainer's ``rng_to_sync``).  On several ranks rank 0 reads
the stream and collates every micro-batch, and each rank gets its own (``scatter``), as accelerate's
``dispatch_batches`` (its default for an iterable dataset under Trainer): the stream is read once, and random
transforms and collators draw from rank 0's stream as there.  Unlike accelerate, the micro-batches of a round are
not concatenated (accelerate's ``concatenate`` fails on micro-batches padded to different lengths) and each rank
receives only its own, not the whole round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

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
    """One optimizer step: this rank's micro-batches, collated (CPU)."""

    batches: tuple[dict[str, Any], ...]
    num_samples: int
    """Items in the step, every rank."""
    carried: bool = False
    """The pass's last micro-batches, fewer than a step takes: no optimizer step; the next step takes their
    gradients and loss with its own, as Trainer's (whose step count does not see them)."""


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
        scatter: Callable[[list[Any] | None], Any] | None = None,
    ) -> None:
        if per_device <= 0 or accumulation <= 0:
            raise ValueError(f"per_device ({per_device}) and accumulation ({accumulation}) must be positive")
        self.steps_per_epoch = require_max_steps(max_steps)
        self.dataset = dataset
        """The stream, as ``DataLoader.dataset`` gives it to callbacks."""
        self.collate = collate
        self.batch_size: int | None = per_device
        self.accumulation, self.world_size, self.rank, self.seed = accumulation, world_size, rank, seed
        self.scatter = scatter
        """On several ranks, the collective that hands each rank its part of rank 0's round
        (``DistributedEnv.scatter_objects``): rank 0 reads and collates, as accelerate dispatches under Trainer."""
        self.plan = StreamPlan(self, 0)

    def set_epoch(self, epoch: int) -> StreamPlan:
        """A fresh pass over the stream (its ``set_epoch`` is called as the pass begins: ``steps_from``)."""
        self.plan = StreamPlan(self, epoch)
        return self.plan

    def _rounds(self) -> Iterator[dict[str, Any]]:
        """This rank's collated micro-batch of each round of ``world_size`` micro-batches of the pass, read
        through a ``DataLoader`` (its base seed drawn at the first read, on every rank).  With ``scatter``, rank 0
        reads and collates every rank's micro-batch and sends each its own (collective per round); the pass ends
        on every rank after the round the stream runs out in (``_last_round``)."""
        from torch.utils.data import DataLoader

        size = self.batch_size or 1
        batches = iter(DataLoader(_TorchStream.of(self.dataset), batch_size=size, collate_fn=list))
        first: Any = None  # the pass's first world_size items (accelerate's ``first_batch``), for its last round
        while True:
            round_: list[Any] | None = None
            if self.scatter is None or self.rank == 0:
                round_, whole = self._read_round(batches, size)
                if whole and first is None and self.scatter is not None:
                    first = _joined(round_, slice(0, self.world_size))
                elif not whole:
                    round_ = self._last_round(round_, first)
            if self.scatter is not None:
                own = self.scatter(round_ or [None] * self.world_size)
            else:
                own = round_[self.rank] if round_ else None
            if own is None:
                return
            yield own

    def _read_round(self, batches: Iterator[list[Any]], size: int) -> tuple[list[Any], bool]:
        """The next ``world_size`` micro-batches, collated where they are used, and whether they are all there and
        full (else the stream ran out in them)."""
        round_: list[Any] = []
        for index in range(self.world_size):
            items = next(batches, None)
            if not items:
                return round_, False
            round_.append(self.collate(items) if self.scatter is not None or index == self.rank else None)
            if len(items) < size:
                return round_, False
        return round_, True

    def _last_round(self, round_: list[Any], first: Any) -> list[Any] | None:
        """The round the stream ran out in, as Trainer's loader gives it: on one rank, its shorter micro-batch; on
        several (``scatter``), its items split evenly over the ranks, completed from the pass's ``first`` items
        when they do not divide, as accelerate's ``DataLoaderDispatcher``; None when there is nothing, or (as
        where accelerate fails) when its micro-batches cannot be joined."""
        if not round_ or self.world_size == 1:
            return round_ or None
        if self.scatter is None:
            return None
        from accelerate.utils import find_batch_size

        joined = _joined(round_)
        if joined is not None and find_batch_size(joined) % self.world_size:
            joined = _joined([joined, first]) if first is not None else None
        if joined is None:
            return None
        per_rank = find_batch_size(joined) // self.world_size
        return [_joined([joined], slice(r * per_rank, (r + 1) * per_rank)) for r in range(self.world_size)]

    def steps_from(self, epoch: int, start: int) -> Iterator[StreamStep]:
        """The steps of ``epoch`` from step ``start`` on, the items of earlier steps read and dropped; each
        step's rounds are read with one more ahead of it."""
        if callable(set_epoch := getattr(self.dataset, "set_epoch", None)):
            set_epoch(epoch)  # as Trainer's _run_epoch (after on_epoch_begin): its call, then its loader's __iter__
            set_epoch(epoch)  # (a datasets stream's shuffle buffer is reseeded per epoch)
        resumed = torch.random.get_rng_state() if start > 0 else None
        rounds = self._rounds()
        accumulation, samples = self.accumulation, (self.batch_size or 1) * self.world_size * self.accumulation
        ahead = list(islice(rounds, start * accumulation, start * accumulation + 1))
        for _ in range(start, self.steps_per_epoch):
            group = ahead + list(islice(rounds, accumulation - len(ahead)))
            if not group:
                return
            ahead = list(islice(rounds, 1))  # one round ahead, as accelerate's DataLoaderDispatcher
            if resumed is not None:
                torch.random.set_rng_state(resumed)
                resumed = None
            if len(group) < accumulation:  # the stream ran out inside the step: carried into the next pass
                yield StreamStep(tuple(group), samples * len(group) // accumulation, carried=True)
                return
            yield StreamStep(tuple(group), samples)

    def micro_batches(self, step: StreamStep) -> list[dict[str, Any]]:
        """Collated micro-batches (CPU) of this rank in ``step``."""
        return list(step.batches)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in self.plan.steps[0:]:
            yield from self.micro_batches(step)


class _TorchStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A re-iterable of items as a torch ``IterableDataset`` (a ``DataLoader`` reads it as a stream)."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    @staticmethod
    def of(dataset: Iterable[Any]) -> Any:
        """``dataset`` itself when a ``DataLoader`` reads it as a stream, else wrapped."""
        return dataset if isinstance(dataset, torch.utils.data.IterableDataset) else _TorchStream(dataset)


def _joined(batches: list[Any], rows: slice | None = None) -> Any:
    """Collated micro-batches joined along their first dimension (accelerate's ``concatenate``), then ``rows`` of
    it; None when they cannot be (micro-batches padded to different lengths, values that are not tensors)."""
    from accelerate.utils import concatenate, slice_tensors

    try:
        joined = concatenate(batches, dim=0) if len(batches) > 1 else batches[0]
        return slice_tensors(joined, rows) if rows is not None else joined
    except (RuntimeError, TypeError, ValueError):
        return None
