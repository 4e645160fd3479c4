"""The order Trainer's training sampler gives an epoch's items in (``train_sampling_strategy``), and each
rank's micro-batches of it, as ``SampleBatches`` plans them.

- ``random``: a permutation by a generator seeded with ``seed + epoch`` (``seed``: ``data_seed``, else
  ``seed``), as accelerate's ``SeedableRandomSampler`` under Trainer's ``DataLoader``;
- ``sequential``: the items in order (``SequentialSampler``);
- ``group_by_length``: transformers' own ``get_length_grouped_indices`` (mega-batches of ``per_device x
  accumulation x 50`` items, or a quarter of the epoch, each sorted by length, the longest item first), over
  the ``lengths`` Trainer's ``LengthGroupedSampler`` reads.  That sampler draws its permutation from the
  global torch generator as the epoch's ``DataLoader`` starts: seeded by ``set_seed(seed)`` in Trainer's
  constructor, after the ``DataLoader`` drew its base seed (one int64).  Epoch 0 draws exactly that (a
  generator seeded with ``seed``, one int64, the permutation), on every rank; epoch ``e`` the same from
  ``seed + e``.  Trainer's later epochs draw after everything the earlier ones drew from the global generator
  (dropout...), which no seeded order repeats and a resume could not (Trainer's own resume does not);
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` itself, as Trainer builds it (its default
  seed, 42; ``set_epoch``), one per rank: micro-batches of varying size, ``accumulation`` per step.

The first three are cut into micro-batches of ``per_device`` and dealt to the ranks by accelerate's own
``BatchSamplerShard`` (batch ``j`` to rank ``j % world``, the last round completed from the epoch's first
items; ``drop_last``: whole micro-batches only).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs

Strategy = Literal["random", "sequential", "group_by_length", "batch_rebalance"]
"""Trainer's ``train_sampling_strategy`` values (transformers 5)."""


@dataclass(frozen=True)
class SampleOrder:
    """How an epoch's items are ordered and dealt to the ranks (see the module doc)."""

    strategy: Strategy = "random"
    seed: int = 42
    """The data order's seed (``random``: ``data_seed``, else ``seed``)."""
    global_seed: int = 42
    """``group_by_length``: the run's ``seed``, which seeds the global generator Trainer's sampler draws from."""
    lengths: Sequence[int] | None = None
    """``group_by_length`` / ``batch_rebalance``: each item's length (``lengths_of``)."""

    def __post_init__(self) -> None:
        if self.strategy in ("group_by_length", "batch_rebalance") and self.lengths is None:
            raise ValueError(f"train_sampling_strategy={self.strategy!r} needs the items' lengths")

    def batches_per_rank(self, count: int, per_device: int, accumulation: int, world_size: int, drop_last: bool) -> int:
        """Micro-batches of one rank in an epoch of ``count`` items."""
        if self.strategy == "batch_rebalance":
            return len(_rebalance(self, per_device, accumulation, world_size, 0, drop_last))
        if drop_last:
            return count // per_device // world_size
        return math.ceil(math.ceil(count / world_size) / per_device)

    def rank_batches(
        self, epoch: int, count: int, per_device: int, accumulation: int, world_size: int, drop_last: bool
    ) -> list[list[tuple[int, ...]]]:
        """Every rank's micro-batches (item indices) of ``epoch``."""
        if self.strategy == "batch_rebalance":
            ranks = [_rebalance(self, per_device, accumulation, world_size, r, drop_last) for r in range(world_size)]
            for sampler in ranks:
                sampler.set_epoch(epoch)
            return [[tuple(batch) for batch in sampler] for sampler in ranks]
        order = self.order(epoch, count, per_device * accumulation)
        return [_dealt(order, per_device, world_size, r, drop_last) for r in range(world_size)]

    def order(self, epoch: int, count: int, group: int) -> list[int]:
        """The epoch's item order (not ``batch_rebalance``); ``group``: items per optimizer step on one rank."""
        if self.strategy == "sequential":
            return list(range(count))
        if self.strategy == "group_by_length":
            from transformers.trainer_pt_utils import get_length_grouped_indices

            assert self.lengths is not None
            generator = torch.Generator().manual_seed(self.global_seed + epoch)
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # the DataLoader's base seed
            return list(get_length_grouped_indices(list(self.lengths), group, generator=generator))
        return torch.randperm(count, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()


def sample_order(args: TrainingArgs, dataset: Any, tokenizer: Any, keep: Collection[str] | None) -> SampleOrder:
    """The run's order of ``dataset``'s items (``train_sampling_strategy``); ``keep``: the columns the
    collator keeps for the model (None: all, ``remove_unused_columns=False``)."""
    strategy = args.train_sampling_strategy
    lengths = None
    if strategy in ("group_by_length", "batch_rebalance"):
        names = getattr(tokenizer, "model_input_names", None)
        column = args.length_column_name
        lengths = lengths_of(dataset, column, names[0] if names else None, keep is None or column in keep)
    return SampleOrder(strategy, args.data_order_seed, args.seed, lengths)


def lengths_of(dataset: Any, column: str, model_input_name: str | None, kept: bool) -> list[int]:
    """Each item's length as Trainer's length-aware samplers read it: the ``column`` of a ``datasets.Dataset``
    that has one and keeps it for the model (``kept``: ``remove_unused_columns=False``, or a column the
    forward takes), else the length of each item's ``model_input_name`` (the processing class's first model
    input, else ``input_ids``)."""
    names = getattr(dataset, "column_names", None)
    if kept and isinstance(names, list) and column in names:
        return [int(n) for n in dataset[column]]
    key = model_input_name or "input_ids"
    first = dataset[0]
    if not isinstance(first, dict) or key not in first:
        raise ValueError(
            f"train_sampling_strategy needs the items' lengths: the items have no {key!r} key and the dataset "
            f"no {column!r} column (length_column_name) it keeps; add that column (with "
            "remove_unused_columns=False) or set train_sampling_strategy='random'"
        )
    return [len(dataset[i][key]) for i in range(len(dataset))]


def _dealt(order: list[int], size: int, world_size: int, rank: int, drop_last: bool) -> list[tuple[int, ...]]:
    """Rank ``rank``'s micro-batches of ``order``, as accelerate deals a ``DataLoader``'s batches to the ranks
    under Trainer (``BatchSamplerShard``, ``even_batches``)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    sampler = BatchSampler(order, size, drop_last)
    return [tuple(batch) for batch in BatchSamplerShard(sampler, world_size, rank, even_batches=True)]


def _rebalance(
    order: SampleOrder, per_device: int, accumulation: int, world_size: int, rank: int, drop_last: bool
) -> Any:
    """Trainer's ``BatchRebalanceSampler`` of rank ``rank`` (``Trainer._get_train_sampler`` builds it so)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    assert order.lengths is not None
    return BatchRebalanceSampler(
        lengths=list(order.lengths),
        effective_batch_size=per_device * accumulation * world_size,
        dp_size=world_size,
        grad_accum=accumulation,
        rank=rank,
        drop_last=drop_last,
    )
