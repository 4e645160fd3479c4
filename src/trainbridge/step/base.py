"""The interface every training step implements: how a step's batches are formed and what its loss is.

The loop (``trainbridge.loop.loop``) runs one optimizer step the same way whatever the task: it asks the
step for this rank's micro-batches (``prepare``), and runs each micro-batch through ``micro_step``: by
default the loss *sum* (``micro_loss``) under the engine's forward context, then the loop's ``backward`` of
it, which scales it by ``world_size / loss_units`` (the engines average gradients over ranks). A step that
runs the backward itself (a Trainer subclass's ``training_step``) overrides ``micro_step``. The step's
logged loss is the sum over every rank and micro-batch divided by ``loss_units``: token cross entropy counts
loss tokens, the model's own loss counts what Trainer divides by (``num_items_in_batch``, or micro-batches).
A step may add values to the training log: after each optimizer step the loop takes its ``metric_sums``
(this rank's), sums them over ranks in the step's agreement (no collective of their own), hands them back
(``add_metric_sums``) and adds ``metric_logs`` to each training log. Evaluation asks ``eval_batch`` for a
batch's loss sum, its units and, for ``compute_metrics``, its outputs; a step may add its own evaluation
metrics (``eval_metric_sums``, reduced with the loss, then ``eval_metric_logs``).

Implementations: ``token_ce.TokenCrossEntropy`` (padding-free token-budget batches, the summed token cross
entropy; causal LMs' default), ``model_loss.ModelLoss`` (Trainer's sample batches, the loss the
model's forward returns) and ``trainer_methods.TrainerMethodsStep`` (a Trainer subclass's ``training_step``
and ``prediction_step``).  ``build_run`` chooses one at build time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch


class StepBatches(NamedTuple):
    """This rank's part of one optimizer step, on the CPU, with the counts the loop normalises by."""

    micro_batches: list[dict[str, Any]]
    """The collated micro-batches of this rank (the same number on every rank)."""
    micro_units: list[float]
    """Loss units of each micro-batch (tokens, items or 1): ``ctx.local_loss`` divides by them."""
    loss_units: float
    """Loss units of the whole step, every rank: the loss is normalised by it."""
    num_samples: int
    """Samples in the step, every rank."""
    num_tokens: int
    """Non-padding input tokens in the step, every rank."""
    carried: bool = False
    """A stream's last micro-batches of a pass (``StreamStep.carried``): trained without an optimizer step."""


class EvalOutput(NamedTuple):
    """One validation batch: its loss sum and units, and (when asked) what ``compute_metrics`` gets."""

    loss_sum: torch.Tensor
    units: float
    predictions: Any = None
    """Logits (a tensor, or a tuple of the model's outputs other than the loss); None when not asked."""
    labels: Any = None
    inputs_aligned: bool = True
    """Whether sequence-shaped predictions and labels run along the inputs (their padding is then dropped
    by the batch's ``attention_mask``); False for decoder-side outputs (an encoder-decoder's)."""


class BatchSource(Protocol):
    """A loader of one data set, as callbacks see ``train_dataloader`` / ``eval_dataloader``."""

    dataset: Any
    batch_size: int | None

    def __len__(self) -> int: ...


class EvalSource(BatchSource, Protocol):
    """Validation batches of this rank; every rank gets the same number."""

    num_samples_local: int

    def indexed(self) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """``(sample indices, batch)`` pairs; row ``r`` of the batch holds sample ``indices[r]``."""
        ...


class TrainSource(BatchSource, Protocol):
    """Training batches: a plan per epoch whose ``steps`` the loop walks."""

    steps_per_epoch: int

    def set_epoch(self, epoch: int) -> Any:
        """Plan ``epoch``; the result has ``steps``, a sequence of the epoch's step plans."""
        ...


class TrainStep(ABC):
    """One kind of optimizer step: its batches and its loss (see the module docstring)."""

    name: str = ""
    flops_input_positions: bool = False
    """Whether ``total_flos`` counts every input position, padding included (a step on Trainer's own batches,
    as Trainer counts them), rather than the real tokens (batches of trainbridge's own forming)."""
    train_batches: TrainSource
    """This rank's training batches (``train_dataloader`` for callbacks)."""

    @abstractmethod
    def prepare(self, step: Any) -> StepBatches:
        """This rank's micro-batches of ``step`` (an entry of ``train_batches``' epoch plan), on the CPU."""

    @abstractmethod
    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        """The loss sum of one micro-batch already on the device (autograd graph attached); ``units`` are
        its ``micro_units`` entry."""

    def micro_step(
        self,
        model: torch.nn.Module,
        batch: dict[str, Any],
        units: float,
        scale: float,
        forward: Callable[[], AbstractContextManager[Any]],
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch already on the device; returns its loss sum, detached.
        ``forward()`` is the context a forward runs in (the engine's autocast); ``backward(loss_sum)``
        backpropagates ``loss_sum * scale`` (with the backward events).  By default: ``micro_loss`` under
        ``forward``, then ``backward`` of it."""
        with forward():
            loss_sum = self.micro_loss(model, batch, units)
        backward(loss_sum)
        return loss_sum.detach()

    @abstractmethod
    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        """Loss sum and units of one validation batch (``outputs``: with predictions and labels); ``rows``
        is the number of validation samples it holds (0 for a rank's dummy batch)."""

    def metric_sums(self) -> dict[str, torch.Tensor | float]:
        """This rank's metric sums of the optimizer step just run by name (0-dim device tensors or floats; the
        same names on every rank: ``step.metric_rows``), summed over ranks in the step's agreement; none by
        default."""
        return {}

    def add_metric_sums(self, sums: Mapping[str, float]) -> None:
        """The step's ``metric_sums`` summed over every rank, by the same names."""
        return None

    def metric_logs(self) -> dict[str, float]:
        """What the next training log adds (the values since the last log); none by default."""
        return {}

    def own_eval_sets(self) -> tuple[EvalSource | None, dict[str, EvalSource]]:
        """Validation batches a step forms itself (a ``step_factory``'s step): the one set and the
        named sets; none by default (the loop's build forms them)."""
        return None, {}

    def eval_metric_sums(self) -> dict[str, float]:
        """This rank's metric sums of the evaluation just run by name (the same names on every rank), summed
        over ranks in the evaluation's one reduction; none by default."""
        return {}

    def eval_metric_logs(self, sums: Mapping[str, float]) -> dict[str, float]:
        """The evaluation's metrics (without the ``eval_`` prefix) from ``eval_metric_sums`` summed over
        every rank; none by default."""
        return {}

    def describe(self) -> str:
        """A few words for the start-up log."""
        return self.name

    @abstractmethod
    def describe_batches(self, effective_batch_size: int) -> str:
        """The run plan's "effective batch" line: samples, tokens and micro-batches of a step."""
