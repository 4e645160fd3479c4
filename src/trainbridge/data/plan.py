"""The global token-budget step plan of an epoch.

Every rank calls ``plan_epoch`` with the same inputs and gets the same ``EpochPlan``, with no
communication: for each optimizer step, the sample indices of every micro-batch of every rank.  So
each rank knows the step's *global* number of loss tokens and normalises its loss by it locally
(``data.loss``), and every rank runs the same number of micro-batches (shorter ranks are padded with
empty, dummy micro-batches) so the gradient collectives of DDP / FSDP / DeepSpeed line up.

Resuming mid-epoch: the plan is a pure function of ``(lengths, seed, epoch, ...)``, so a resumed run
rebuilds the epoch's plan and skips the steps already taken, ``plan.steps[k:]``; no sampler state is
saved.

The plan is built from two integer columns (``lengths``, ``loss_tokens``; numpy arrays read from the
memory-mapped dataset, or plain sequences) and is lazy: an epoch holds one shuffled order, and a step's
micro-batches are packed when the step is read, so planning a million-sample epoch costs one
permutation, not a million Python objects.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

MicroBatch = tuple[int, ...]
"""Sample indices of one micro-batch; empty means a dummy micro-batch (zero loss weight)."""


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step on all ranks.

    ``micro_batches[rank][i]`` holds the sample indices of micro-batch ``i`` of ``rank``; every rank
    has the same number of micro-batches, trailing ones possibly empty (a dummy forward/backward with
    zero loss weight).  ``num_samples``, ``loss_tokens`` and ``num_tokens`` (non-padding tokens) are
    totals over all ranks.
    """

    micro_batches: tuple[tuple[MicroBatch, ...], ...]
    num_samples: int
    loss_tokens: int
    num_tokens: int

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches each rank runs in this step (the same on every rank)."""
        return len(self.micro_batches[0])

    @property
    def world_size(self) -> int:
        """Number of ranks the step was planned for."""
        return len(self.micro_batches)

    def sample_indices(self) -> list[int]:
        """Every sample index of the step, all ranks, in plan order."""
        return [i for rank in self.micro_batches for micro in rank for i in micro]


class PlannedSteps(Sequence[StepPlan]):
    """The optimizer steps of an epoch, packed on access (a slice is another lazy view).

    Step ``k`` holds the samples ``order[k * batch : (k + 1) * batch]``, spread over ranks and packed
    into micro-batches within the token budget; the same inputs always give the same ``StepPlan``.
    """

    def __init__(
        self,
        order: np.ndarray,
        lengths: np.ndarray,
        loss_tokens: np.ndarray,
        *,
        effective_batch_size: int,
        world_size: int,
        max_batch_len: int,
        padded: bool,
        step_range: range | None = None,
    ):
        self._order, self._lengths, self._loss_tokens = order, lengths, loss_tokens
        self._batch, self._world_size = effective_batch_size, world_size
        self._max_batch_len, self._padded = max_batch_len, padded
        self._range = step_range if step_range is not None else range(math.ceil(len(order) / effective_batch_size))

    def __len__(self) -> int:
        return len(self._range)

    @overload
    def __getitem__(self, index: int) -> StepPlan: ...

    @overload
    def __getitem__(self, index: slice) -> PlannedSteps: ...

    def __getitem__(self, index: int | slice) -> StepPlan | PlannedSteps:
        if isinstance(index, slice):
            return PlannedSteps(
                self._order,
                self._lengths,
                self._loss_tokens,
                effective_batch_size=self._batch,
                world_size=self._world_size,
                max_batch_len=self._max_batch_len,
                padded=self._padded,
                step_range=self._range[index],
            )
        return self._plan_step(self._range[index])

    def __iter__(self) -> Iterator[StepPlan]:
        for k in self._range:
            yield self._plan_step(k)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def _plan_step(self, k: int) -> StepPlan:
        step_indices = self._order[k * self._batch : (k + 1) * self._batch].tolist()
        lengths = self._lengths
        step_lengths = {i: int(lengths[i]) for i in step_indices}
        pack = _pack_padded if self._padded else _pack_padding_free
        per_rank = [
            pack(rank_indices, step_lengths, self._max_batch_len)
            for rank_indices in _assign_to_ranks(step_indices, step_lengths, self._world_size)
        ]
        num_micro = max(len(micro) for micro in per_rank)
        return StepPlan(
            micro_batches=tuple(tuple(micro) + ((),) * (num_micro - len(micro)) for micro in per_rank),
            num_samples=len(step_indices),
            loss_tokens=int(sum(int(self._loss_tokens[i]) for i in step_indices)),
            num_tokens=sum(step_lengths.values()),
        )


@dataclass(frozen=True)
class EpochPlan:
    """The optimizer steps of one epoch, for all ranks (``steps`` packs each step when it is read)."""

    epoch: int
    steps: Sequence[StepPlan]

    @property
    def num_samples(self) -> int:
        """Samples in the epoch (all ranks)."""
        return sum(step.num_samples for step in self.steps)


def steps_per_epoch(num_samples: int, effective_batch_size: int) -> int:
    """Optimizer steps of one epoch: ``ceil(num_samples / effective_batch_size)``.

    The last step is partial (fewer than ``effective_batch_size`` samples) when the batch size does
    not divide the sample count; it is still a full optimizer step, normalised by its own tokens.
    """
    if effective_batch_size <= 0:
        raise ValueError(f"effective_batch_size must be positive, got {effective_batch_size}")
    return math.ceil(num_samples / effective_batch_size)


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator seeded from ``(seed, epoch)``: the same on every rank, different for every epoch."""
    digest = hashlib.sha256(f"trainbridge-epoch:{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _assign_to_ranks(indices: Sequence[int], lengths: dict[int, int], world_size: int) -> list[list[int]]:
    """Longest-first greedy: each sample goes to the rank with the fewest tokens so far.

    Ties go to the rank with fewer samples, then the lower rank, so the result is deterministic.
    """
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    heap = [(0, 0, rank) for rank in range(world_size)]
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for index in ordered:
        tokens, count, rank = heapq.heappop(heap)
        per_rank[rank].append(index)
        heapq.heappush(heap, (tokens + lengths[index], count + 1, rank))
    return per_rank


def _pack_padding_free(indices: Sequence[int], lengths: dict[int, int], max_batch_len: int) -> list[MicroBatch]:
    """First-fit decreasing: sum of lengths per micro-batch <= ``max_batch_len``."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        for b, load in enumerate(loads):
            if load + length <= max_batch_len:
                bins[b].append(index)
                loads[b] += length
                break
        else:
            bins.append([index])
            loads.append(length)
    return [tuple(b) for b in bins]


def _pack_padded(indices: Sequence[int], lengths: dict[int, int], max_batch_len: int) -> list[MicroBatch]:
    """Longest first, fill each micro-batch while rows x its longest row <= ``max_batch_len``."""
    batches: list[list[int]] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_len:
            batches[-1].append(index)
        else:
            batches.append([index])
    return [tuple(b) for b in batches]


def plan_epoch(
    lengths: Sequence[int] | np.ndarray,
    loss_tokens: Sequence[int] | np.ndarray,
    *,
    effective_batch_size: int,
    world_size: int,
    max_batch_len: int,
    seed: int,
    epoch: int,
    padded: bool,
    shuffle: bool = True,
    whole_batches_of: int | None = None,
) -> EpochPlan:
    """Plan every optimizer step of ``epoch`` for all ranks.

    ``lengths[i]`` and ``loss_tokens[i]`` describe sample ``i``.  The sample order is shuffled by a
    generator seeded from ``(seed, epoch)`` (unless ``shuffle=False``) and cut into steps of
    ``effective_batch_size`` samples (the last one may be partial).  Within a step, samples are spread
    over ranks balancing tokens (``whole_batches_of``: the order cut to a multiple of it first, as a
    ``DataLoader`` with ``drop_last`` drops its short batch), then packed into micro-batches within the token budget
    ``max_batch_len`` -- padding-free: sum of lengths; ``padded``: rows x longest row -- and each rank's
    list is padded with empty (dummy) micro-batches to the longest one.  Every sample appears exactly
    once.  Raises ``ValueError`` for a sample longer than ``max_batch_len``.
    """
    lengths_array = np.asarray(lengths, dtype=np.int64)
    loss_array = np.asarray(loss_tokens, dtype=np.int64)
    if len(lengths_array) != len(loss_array):
        raise ValueError(f"{len(lengths_array)} lengths but {len(loss_array)} loss_tokens")
    for name, value in (
        ("effective_batch_size", effective_batch_size),
        ("world_size", world_size),
        ("max_batch_len", max_batch_len),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if len(lengths_array):
        shortest = int(np.argmin(lengths_array))
        if lengths_array[shortest] <= 0:
            raise ValueError(
                f"sample {shortest} has length {lengths_array[shortest]}; samples must have at least one token"
            )
        longest = int(np.argmax(lengths_array))
        if lengths_array[longest] > max_batch_len:
            raise ValueError(
                f"sample {longest} has {lengths_array[longest]} tokens, more than max_batch_len={max_batch_len}; "
                "raise max_batch_len or lower max_seq_len"
            )
    count = len(lengths_array)
    if shuffle:
        order = torch.randperm(count, generator=_epoch_generator(seed, epoch)).numpy()
    else:
        order = np.arange(count, dtype=np.int64)
    if whole_batches_of is not None:
        order = order[: count // whole_batches_of * whole_batches_of]
    steps = PlannedSteps(
        order,
        lengths_array,
        loss_array,
        effective_batch_size=effective_batch_size,
        world_size=world_size,
        max_batch_len=max_batch_len,
        padded=padded,
    )
    return EpochPlan(epoch=epoch, steps=steps)
