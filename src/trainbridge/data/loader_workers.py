"""``WorkerFetch``: Trainer's ``dataloader_num_workers`` on the sample-batch path.

The epoch's plan says which items form each of this rank's micro-batches; with workers, a
``torch.utils.data.DataLoader`` over those index lists (``batch_sampler``) reads the items
(``dataset[i]``: where images or audio are decoded, random transforms drawn) and collates them in worker
processes, ``prefetch_factor`` micro-batches ahead each, while the step trains, as Trainer's ``DataLoader``.
The lists are asked for as the pass reads its first batch (``IndexLists``), after the loader's base seed,
where Trainer's sampler draws its order.
Batches arrive in the plan's order (``in_order=False``: as the workers finish them, as Trainer's
``dataloader_in_order=False``).  A step asked out of turn (the first after a resume) starts a fresh pass
there.  ``persistent_workers`` keeps the processes from one pass to the next (the index lists are the
sampler's, read at each pass).  Workers are daemonic children of the rank: they end with it.

Without workers (``num_workers=0``) the same ``DataLoader`` reads the items in the rank's process, so torch's
random stream is drawn as under Trainer, where dropout and random transforms share it: each pass draws the
``DataLoader``'s base seed (``_BaseDataLoaderIter``; the workers' seeds, then Trainer's ``seed_worker``), and
the pass reads one micro-batch ahead of the step, as accelerate's ``DataLoaderShard`` does.  A pass started
out of turn puts the RNG back once the step's micro-batches are read (Trainer's ``rng_to_sync`` on resume).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs


@dataclass(frozen=True)
class LoaderWorkers:
    """The ``DataLoader`` worker settings (``TrainingArgs.dataloader_*``, Trainer's names)."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    multiprocessing_context: str | None = None
    in_order: bool = True

    @classmethod
    def of(cls, args: TrainingArgs) -> LoaderWorkers:
        """The run's settings: ``dataloader_num_workers``, ``_prefetch_factor``, ``_persistent_workers`` and
        ``_multiprocessing_context`` and ``_in_order``."""
        return cls(
            args.dataloader_num_workers,
            args.dataloader_prefetch_factor,
            args.dataloader_persistent_workers,
            args.dataloader_multiprocessing_context,
            args.dataloader_in_order,
        )


IndexLists = Callable[[int], Sequence[Sequence[int]]]
"""A pass's micro-batches (item indices) from a position on: called as the pass reads its first batch, after
the ``DataLoader`` drew its base seed, where a sampler draws its order."""


class _IndexLists:
    """A ``batch_sampler`` yielding the index lists of the current pass from ``start`` (set before each pass),
    resolved when the pass reads its first batch."""

    def __init__(self) -> None:
        self.resolve: IndexLists = lambda start: []
        self.start = self.count = 0

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.resolve(self.start):  # a generator: runs at the pass's first read
            yield list(indices)

    def __len__(self) -> int:
        return self.count


class WorkerFetch:
    """Collated micro-batches of ``dataset`` items, read by a ``DataLoader`` (in worker processes with
    ``num_workers``) in the plan's order, one ahead of the step (see the module doc)."""

    def __init__(
        self, dataset: Any, collate: Callable[[list[Any]], Any], workers: LoaderWorkers, rank: int = 0
    ) -> None:
        from torch.utils.data import DataLoader
        from transformers.trainer_utils import seed_worker

        self._lists = _IndexLists()
        self.loader = DataLoader(
            dataset,
            batch_sampler=self._lists,
            collate_fn=collate,
            num_workers=workers.num_workers,
            prefetch_factor=workers.prefetch_factor,
            persistent_workers=workers.persistent_workers,
            multiprocessing_context=workers.multiprocessing_context,
            in_order=workers.in_order,
            worker_init_fn=partial(seed_worker, num_workers=workers.num_workers, rank=rank),
        )
        self._batches: Iterator[Any] | None = None
        self._ahead: list[Any] = []
        """The micro-batch read ahead of the step (none at the end of a pass)."""
        self._next: tuple[int, int] | None = None
        """``(pass key, position)`` of the micro-batch the running pass yields next."""

    def fetch(self, key: int, position: int, index_lists: IndexLists, total: int, count: int) -> list[Any]:
        """The ``count`` micro-batches from ``position`` of the pass ``key`` of ``total`` micro-batches, whose
        index lists from a position are ``index_lists``: the running pass's next ones, else a fresh pass from
        ``position``."""
        resumed = None
        if self._batches is None or self._next != (key, position):
            resumed = torch.random.get_rng_state() if position > 0 else None
            self._lists.resolve, self._lists.start, self._lists.count = index_lists, position, total - position
            self._batches = iter(self.loader)  # draws the pass's base seed, as Trainer's DataLoader
            self._ahead = []
        batches = self._ahead + [next(self._batches) for _ in range(count - len(self._ahead))]
        self._ahead = list(islice(self._batches, 1))  # accelerate's DataLoaderShard reads one batch ahead
        self._next = (key, position + count)
        if resumed is not None:
            torch.random.set_rng_state(resumed)
        return batches
