"""Micro-batches from a ``DataLoader`` a script builds: a Trainer subclass's ``get_train_dataloader`` (or
Trainer's own, with the subclass's ``_get_train_sampler``), called in each worker (``RunPlan.train_loader``).

The loader is this rank's already: Trainer's is prepared by accelerate (sharded across ranks) and so is one
the script prepares with ``self.accelerator``; one it leaves unprepared is read whole on every rank, as under
Trainer.  Each optimizer step takes ``accumulation`` batches in the loader's order.  An epoch is one pass:
``ceil(len(loader) / accumulation)`` steps, the last one possibly with fewer batches (Trainer's remainder);
a loader with no length (over an iterable dataset) makes passes of at most ``max_steps`` steps, repeated until
``max_steps`` (``unsized``), as Trainer does.  ``set_epoch`` reaches the loader's samplers and dataset, as
Trainer's ``set_epoch`` does.  Resume: ``plan.steps[k:]`` reads and drops the first ``k`` steps' batches
(Trainer's ``skip_first_batches``) and puts the RNG back, so a resumed run trains on the batches an
uninterrupted one would, with the same random state, when the loader's order is reproducible (a fixed or
seeded sampler, or one following ``set_epoch``: Trainer's own ``RandomSampler`` is seeded this way).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from trainbridge.data.stream_batches import require_max_steps

OPAQUE_BATCH = "__loader_batch__"
"""The key a batch that is not a dict travels under: the loop moves and counts nothing of it, and the
instance's ``training_step`` gets it as the loader gave it (``step.trainer_methods``)."""


@dataclass(frozen=True)
class LoaderStep:
    """One optimizer step: this rank's batches as the loader gave them."""

    batches: tuple[Any, ...]
    num_samples: int
    """Items in the step, every rank (this rank's rows times the world size: the ranks' shares are even)."""


class LoaderPlan:
    """The steps of one pass over the loader; ``steps[k:]`` skips the first ``k`` steps' batches."""

    def __init__(self, source: LoaderBatches) -> None:
        self.source = source
        self.steps = self

    def __len__(self) -> int:
        return self.source.steps_per_epoch

    def __getitem__(self, index: slice) -> Iterator[LoaderStep]:
        if not isinstance(index, slice) or index.step not in (None, 1) or index.stop is not None:
            raise TypeError("a loader plan is walked from a start step: plan.steps[start:]")
        return self.source.steps_from(index.start or 0)

    def __iter__(self) -> Iterator[LoaderStep]:
        return self[0:]


class LoaderBatches:
    """This rank's batches of a script's ``DataLoader``, ``accumulation`` per optimizer step (see module doc)."""

    def __init__(self, loader: Any, *, accumulation: int, world_size: int, max_steps: int | None) -> None:
        if accumulation <= 0:
            raise ValueError(f"accumulation ({accumulation}) must be positive")
        self.loader = loader
        self.dataset = getattr(loader, "dataset", None)
        """The loader's dataset, as ``DataLoader.dataset`` gives it to callbacks."""
        self.batch_size: int | None = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None
        )
        self.collate = getattr(loader, "collate_fn", None)
        self.accumulation, self.world_size = accumulation, world_size
        length = loader_length(loader)
        self.unsized = length is None
        """No length: passes repeat until ``max_steps`` (``RunComponents.num_epochs``)."""
        if length is None:
            self.batches_per_epoch = None
            self.steps_per_epoch = require_max_steps(max_steps)
        elif length == 0:
            raise ValueError("get_train_dataloader: the DataLoader has no batches on this rank")
        else:
            self.batches_per_epoch = length
            self.steps_per_epoch = math.ceil(length / accumulation)
        self.plan = LoaderPlan(self)

    def set_epoch(self, epoch: int) -> LoaderPlan:
        """A fresh pass; ``set_epoch(epoch)`` on the loader, its (batch) samplers and dataset that have one."""
        done: set[int] = set()
        for follower in _epoch_followers(self.loader):
            if id(follower) not in done and callable(getattr(follower, "set_epoch", None)):
                done.add(id(follower))
                follower.set_epoch(epoch)
        self.plan = LoaderPlan(self)
        return self.plan

    def steps_from(self, start: int) -> Iterator[LoaderStep]:
        """The pass's steps from step ``start`` on, the batches of earlier steps read and dropped.  Resuming
        (``start > 0``), the torch RNG is put back as it was after the skipping (Trainer's ``rng_to_sync``): a
        resumed run continues from the checkpoint's RNG state, as an uninterrupted one does."""
        rng = torch.random.get_rng_state() if start > 0 else None
        batches = iter(self.loader)  # (a DataLoader draws its base seed here)
        for _ in islice(batches, start * self.accumulation):
            pass
        if rng is not None:
            torch.random.set_rng_state(rng)
        for _ in range(start, self.steps_per_epoch):
            group = tuple(islice(batches, self.accumulation))
            if not group:
                return
            yield LoaderStep(group, sum(_rows(batch) for batch in group) * self.world_size)

    def micro_batches(self, step: LoaderStep) -> list[dict[str, Any]]:
        """This rank's batches of ``step`` as dicts of the model's inputs (CPU); a batch that is not a dict
        (trl's GRPO/RLOO loaders give lists of raw rows, for the instance's own ``training_step``) travels
        whole under ``OPAQUE_BATCH``."""
        return [dict(batch) if isinstance(batch, Mapping) else {OPAQUE_BATCH: batch} for batch in step.batches]

    def __len__(self) -> int:
        return (
            self.batches_per_epoch if self.batches_per_epoch is not None else self.steps_per_epoch * self.accumulation
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in self.plan.steps[0:]:
            yield from self.micro_batches(step)


def loader_length(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without one (over an iterable dataset)."""
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def _epoch_followers(loader: Any) -> list[Any]:
    """What Trainer's ``set_epoch`` reaches: the loader, its batch sampler (and the one it wraps), the
    samplers inside, and the dataset."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "batch_sampler", None)
    found = [loader, batch_sampler, inner, getattr(batch_sampler, "sampler", None), getattr(inner, "sampler", None)]
    found += [getattr(loader, "sampler", None), getattr(loader, "dataset", None)]
    return [f for f in found if f is not None]


def _rows(batch: Any) -> int:
    """Rows of a batch: the first dimension of its first tensor (else the length of its first list)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    for value in values:
        if isinstance(value, list | tuple):
            return len(value)
    return len(batch) if isinstance(batch, list | tuple) else 0  # a list of raw rows (trl's GRPO batches)
