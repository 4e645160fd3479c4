"""What one optimizer step hands to its agreement and bookkeeping: the values summed over ranks
(``StepSums``, with the step's named metric sums appended by ``with_metrics`` and read back by name by
``agreed_sums``), those each rank keeps (``StepOwn``), and the step's outcome before any device value is read
(``StepOutcome``); ``LossLog`` keeps the agreed losses for Trainer's training log and final summary."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from trainbridge.core.context import TrainingContext
from trainbridge.step.base import StepBatches
from trainbridge.step.finite import NOT_MEASURED


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


class LossLog:
    """The run's agreed losses: each step's into the context (``account``), their mean since the last log
    (``training_logs``) and over this run (``train_summary``), as Trainer logs them."""

    def __init__(self) -> None:
        self.since_log = 0.0
        self.last_logged_step = 0
        self.total = 0.0
        self.steps_this_run = 0

    def account(
        self, ctx: TrainingContext, outcome: StepOutcome, summed: StepSums, own: StepOwn, counted: bool
    ) -> None:
        """The step's agreed values into ``ctx`` and the running loss sums (``counted``: False leaves a
        non-finite step's loss out of them, under ``nonfinite_policy="skip"``)."""
        batches = outcome.batches
        ctx.local_loss = float(own.loss_sum) / max(sum(batches.micro_units), 1e-12)
        ctx.grad_norm = None if own.grad_norm == NOT_MEASURED else float(own.grad_norm)
        ctx.loss = float(summed.loss_sum) / max(batches.loss_units, 1e-12)
        ctx.loss_tokens_seen += int(batches.loss_units)
        ctx.input_tokens_seen += int(summed.input_tokens)
        ctx.step_time_s = time.perf_counter() - outcome.started
        ctx.tokens_per_second = batches.num_tokens / ctx.step_time_s
        ctx.samples_per_second = batches.num_samples / ctx.step_time_s
        if counted:
            self.since_log += ctx.loss
            self.total += ctx.loss
        self.steps_this_run += 1

    def training_logs(
        self, ctx: TrainingContext, current_lr: Callable[[], float], step_logs: Mapping[str, float]
    ) -> dict[str, float]:
        """Trainer's training log: mean loss since the last log, grad norm, learning rate (the step's, else
        ``current_lr()``), the step's own metrics (``step_logs``), epoch."""
        logs = {
            "loss": self.since_log / (ctx.global_step - self.last_logged_step),
            "grad_norm": ctx.grad_norm if ctx.grad_norm is not None else float("nan"),
            "learning_rate": ctx.learning_rate if ctx.learning_rate is not None else current_lr(),
            **step_logs,
            "epoch": ctx.epoch,
        }
        self.since_log = 0.0
        self.last_logged_step = ctx.global_step
        ctx.logs = dict(logs)
        return logs

    def train_summary(self, ctx: TrainingContext, runtime: float) -> dict[str, float]:
        """Trainer's final log: runtime, throughput, total flos and mean train loss of this run."""
        steps = self.steps_this_run
        logs = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(ctx.samples_seen / max(runtime, 1e-9), 3),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
            "total_flos": ctx.total_flos,
            "train_loss": self.total / max(steps, 0.001),
            "epoch": ctx.epoch,
        }
        ctx.logs = dict(logs)
        return logs
