"""What one optimizer step hands to its agreement and bookkeeping: the values summed over ranks
(``StepSums``, with the step's named metric sums appended by ``with_metrics`` and read back by name by
``agreed_sums``), those each rank keeps (``StepOwn``), and the step's outcome before any device value is read
(``StepOutcome``)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from trainbridge.step.base import StepBatches


class StepSums(NamedTuple):
    """The step's values summed over ranks in its agreement."""

    loss_sum: float | torch.Tensor
    """The step's loss sum (``TrainStep.micro_loss`` summed over micro-batches), every rank."""
    input_tokens: float
    """Input positions of the step's micro-batches (``input_tokens_seen``)."""
    checkpoint_unwritten: float
    """Ranks whose background checkpoint write is still going on."""


class StepOwn(NamedTuple):
    """The step's values each rank keeps as its own in the agreement."""

    loss_sum: float | torch.Tensor
    """This rank's loss sum."""
    grad_norm: float | torch.Tensor
    """The global gradient norm before clipping (the same on every rank; ``NOT_MEASURED`` when the engine
    reports none)."""


class StepOutcome(NamedTuple):
    """What one optimizer step returns for its agreement and bookkeeping (device values not yet read)."""

    batches: StepBatches
    loss_sum: torch.Tensor
    grad_norm: torch.Tensor | float
    input_tokens: int
    started: float
    """``time.perf_counter()`` at the step's start."""


@functools.cache
def sums_type(metrics: int) -> Any:
    """``StepSums`` followed by ``metrics`` values (a ``NamedTuple`` type, as the agreement takes)."""
    return collections.namedtuple("StepSumsAndMetrics", [*StepSums._fields, *(f"metric_{i}" for i in range(metrics))])


def with_metrics(sums: StepSums, metric_sums: Mapping[str, torch.Tensor | float]) -> Any:
    """``sums`` and the step's metric sums (by name) as one row of the step's agreement."""
    return sums_type(len(metric_sums))(*sums, *metric_sums.values()) if metric_sums else sums


def agreed_sums(summed: Any, metric_names: Mapping[str, object]) -> tuple[StepSums, dict[str, float]]:
    """The agreed row of ``with_metrics``: the loop's ``StepSums`` and the step's metric sums by name."""
    loop = StepSums(*summed[: len(StepSums._fields)])
    return loop, dict(zip(metric_names, summed[len(StepSums._fields) :], strict=True))
