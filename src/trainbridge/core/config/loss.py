"""The loss seam (``RunPlan.loss``): what each step trains on, one typed object chosen at build time.

- ``TokenLoss``: the summed token cross entropy on padding-free token-budget batches (causal LMs);
- ``ForwardLoss``: the loss the model's forward returns, on Trainer's sample batches (any model with a head);
- ``LossFunction``: a ``compute_loss`` function of the run's on those batches;
- ``InstanceStep``: a Trainer instance's own ``training_step`` / ``prediction_step`` on those batches;
- ``OwnStep``: a step forming its own batches and loss (trl's DPO, KTO, ORPO/CPO).

``RunPlan.loss`` None: ``TrainingArgs.training_step`` names it (``declared_loss``); ``auto`` leaves the choice to
the build, which knows the model (``loop.build.choose_step``: the token loss for causal LMs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainbridge.core.config.plan import RunPlan
    from trainbridge.core.config.training import TrainingArgs


class ComputeLoss(Protocol):
    """``fn(model, inputs, return_outputs=False, num_items_in_batch=None) -> loss`` as ``Trainer.compute_loss``."""

    def __call__(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any: ...


class TrainerMethods(Protocol):
    """The script's Trainer methods as a worker runs them (``trainer.subclass.ScriptTrainer``)."""

    @property
    def counts_items(self) -> bool:
        """Whether the step's items are counted whatever the model (Trainer counts them for a
        ``compute_loss_func``)."""
        ...

    @property
    def counts_step(self) -> bool:
        """Whether the loader's batches carry loss items and input tokens to sum over the ranks at each step;
        False (trl's GRPO/RLOO: raw prompt rows, a loss that reads trl's own counts): no per-step collective."""
        ...

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Any,
        backward: Callable[[torch.Tensor], None],
        accumulation: int,
    ) -> torch.Tensor:
        """``Trainer.training_step`` on this worker's instance (``accumulation`` micro-batches per step); its
        ``accelerator.backward(loss)`` calls ``backward(loss)``; returns the (detached) loss it reports."""
        ...

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, num_items_in_batch: Any
    ) -> tuple[Any, Any, Any]:
        """``Trainer.prediction_step`` on this worker's instance: ``(loss, logits, labels)``; ``super()`` passes
        ``num_items_in_batch`` (the batch's items over every rank, or None) to ``compute_loss``."""
        ...


class StepFactory(Protocol):
    """``factory(model, tokenizer, args, env, plan) -> TrainStep`` (``step.base``): a step forming its own batches
    and loss (trl's DPO) for the run of ``plan`` (its script data, model and callbacks); called once the model is
    loaded, before the engine wraps it."""

    def __call__(self, model: Any, tokenizer: Any, args: Any, env: Any, plan: RunPlan) -> Any: ...


@dataclass(frozen=True)
class TokenLoss:
    """The summed token cross entropy on padding-free (or padded) token-budget batches (``step.token_ce``);
    causal LMs only (``training_step='token_cross_entropy'``)."""

    metrics: bool = False
    """Also log trl's SFT metrics ``entropy``, ``mean_token_accuracy`` (means over the micro-batches since the
    last log, each reduced over ranks) and ``num_tokens``, from each micro-batch's full logits (no chunked /
    Liger loss head then): ``SFTTrainer``'s."""


@dataclass(frozen=True)
class ForwardLoss:
    """The loss the model's forward returns, on Trainer's sample batches (``step.model_loss``;
    ``training_step='model_loss'``)."""


@dataclass(frozen=True)
class LossFunction:
    """The run's ``compute_loss`` on each micro-batch of Trainer's sample batches (``step.custom_loss``)."""

    fn: ComputeLoss


@dataclass(frozen=True)
class InstanceStep:
    """A Trainer instance's ``training_step`` / ``prediction_step`` on Trainer's sample batches
    (``step.trainer_methods``)."""

    methods: TrainerMethods


@dataclass(frozen=True)
class OwnStep:
    """A step forming its own batches and loss (``factory``; trl's DPO, KTO, ORPO/CPO)."""

    factory: StepFactory


Loss: TypeAlias = TokenLoss | ForwardLoss | LossFunction | InstanceStep | OwnStep
LOSSES = (TokenLoss, ForwardLoss, LossFunction, InstanceStep, OwnStep)

_NAMED: dict[str, Loss] = {"token_cross_entropy": TokenLoss(), "model_loss": ForwardLoss()}


def declared_loss(args: TrainingArgs, plan: RunPlan) -> Loss | None:
    """The run's loss as declared before the model is known: ``plan.loss``, else the one ``args.training_step``
    names; None (``auto``): the build chooses from the model.  A ``ValueError`` naming the field when the two
    disagree."""
    named = _NAMED.get(args.training_step)
    if plan.loss is None or named is None:
        return plan.loss or named
    if isinstance(named, TokenLoss) and not isinstance(plan.loss, TokenLoss):
        raise ValueError(
            f"training_step: 'token_cross_entropy' computes its own loss, but the run's code brings "
            f"{type(plan.loss).__name__} (RunPlan.loss: a compute_loss, a Trainer's step or a step factory); leave "
            "training_step 'auto'"
        )
    if isinstance(named, ForwardLoss) and isinstance(plan.loss, TokenLoss | OwnStep):
        raise ValueError(
            f"training_step: 'model_loss' trains on Trainer's sample batches, but the run's loss is "
            f"{type(plan.loss).__name__}, which forms its own batches; leave training_step 'auto'"
        )
    return plan.loss


def trains_on_items(loss: Loss | None) -> bool:
    """Whether ``loss`` trains on the dataset's items as they are (Trainer's sample batches)."""
    return isinstance(loss, ForwardLoss | LossFunction | InstanceStep)
