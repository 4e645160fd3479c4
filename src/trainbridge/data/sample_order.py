"""The order Trainer's training sampler gives an epoch's items in (``train_sampling_strategy``), and each
rank's micro-batches of it, as ``SampleBatches`` plans them: positions in the epoch's order, dealt to the ranks.

- ``random``: a permutation by a generator seeded with ``seed + epoch`` (``seed``: ``data_seed``, else
  ``seed``), as accelerate's ``SeedableRandomSampler`` under Trainer's ``DataLoader``;
- ``sequential``: the items in order (``SequentialSampler``);
- ``group_by_length``: transformers' own ``get_length_grouped_indices`` (mega-batches of ``per_device x
  accumulation x 50`` items, or a quarter of the epoch, each sorted by length, the longest item first), over
  the ``lengths`` Trainer's ``LengthGroupedSampler`` reads.  That sampler has no generator of its own: each
  epoch it draws its permutation from the global torch generator (``draws_at_pass_start``) as the epoch's
  ``DataLoader`` reads its first batch, after the loader's base seed and every draw of the earlier epochs
  (dropout, random transforms); each rank from its own.  ``SampleBatches`` draws it there too, and keeps the
  state it drew from (``core.random_state.SamplerDraw``) for a resume inside the epoch;
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` itself, as Trainer builds it (its default
  seed, 42; ``set_epoch``), one per rank: micro-batches of varying size, ``accumulation`` per step (item
  indices: its order is the items').

Validation items under ``group_by_length`` take Trainer's evaluation order (``eval_order``).  The first three
are cut into micro-batches of ``per_device`` and dealt to the ranks by accelerate's own
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
        """Every rank's micro-batches of ``epoch``: positions in the epoch's ``order``."""
        if self.strategy == "batch_rebalance":
            ranks = [_rebalance(self, per_device, accumulation, world_size, r, drop_last) for r in range(world_size)]
            for sampler in ranks:
                sampler.set_epoch(epoch)
            return [[tuple(batch) for batch in sampler] for sampler in ranks]
        return [_dealt(list(range(count)), per_device, world_size, r, drop_last) for r in range(world_size)]

    @property
    def draws_at_pass_start(self) -> bool:
        """The order is drawn from a torch generator as the epoch's pass starts (``group_by_length``)."""
        return self.strategy == "group_by_length"

    def order(self, epoch: int, count: int, group: int, generator: torch.Generator | None = None) -> list[int]:
        """The epoch's item order; ``group``: items per optimizer step on one rank; ``generator``: what a
        ``group_by_length`` order is drawn from (None: the global generator, as Trainer's sampler)."""
        if self.strategy in ("sequential", "batch_rebalance"):
            return list(range(count))
        if self.strategy == "group_by_length":
            from transformers.trainer_pt_utils import get_length_grouped_indices

            assert self.lengths is not None
            return list(get_length_grouped_indices(list(self.lengths), group, generator=generator))
        return torch.randperm(count, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()


def eval_order(args: TrainingArgs, lengths: Sequence[int], per_device: int) -> list[int] | None:
    """The validation items' order under ``group_by_length``, Trainer's evaluation sampler's (the same at every
    evaluation: a ``LengthGroupedSampler`` of ``per_device`` with a generator seeded by ``data_seed``, else
    ``seed``); None (dataset order) for every other strategy."""
    if args.train_sampling_strategy != "group_by_length" or not len(lengths):
        return None
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator().manual_seed(args.data_order_seed)
    return list(get_length_grouped_indices([int(n) for n in lengths], per_device, generator=generator))


def sample_order(args: TrainingArgs, dataset: Any, tokenizer: Any, keep: Collection[str] | None) -> SampleOrder:
    """The run's order of ``dataset``'s items (``train_sampling_strategy``); ``keep``: the columns the
    collator keeps for the model (None: all, ``remove_unused_columns=False``)."""
    strategy = args.train_sampling_strategy
    lengths = (
        sample_lengths(args, dataset, tokenizer, keep) if strategy in ("group_by_length", "batch_rebalance") else None
    )
    return SampleOrder(strategy, args.data_order_seed, lengths)


def sample_lengths(args: TrainingArgs, dataset: Any, tokenizer: Any, keep: Collection[str] | None) -> list[int]:
    """``dataset``'s item lengths as Trainer's samplers read them (``lengths_of``: ``length_column_name``, else
    the processing class's first model input)."""
    names = getattr(tokenizer, "model_input_names", None)
    column = args.length_column_name
    return lengths_of(dataset, column, names[0] if names else None, keep is None or column in keep)


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
