"""A Trainer subclass's own ``create_optimizer`` / ``create_scheduler``: ``RunPlan.optimizer_factory`` of
``train()``, over the script's ``optimizers=`` objects (``parallel.script_optimizer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainbridge.parallel.script_optimizer import ClassAndKwargs, InPlace, script_optimizer

if TYPE_CHECKING:
    from trainbridge.core.config.plan import OptimizerFactory
    from trainbridge.trainer.facade import LoopTrainer
    from trainbridge.trainer.subclass import ScriptTrainer


class SubclassOptimizer:
    """A subclass's ``create_optimizer`` / ``create_scheduler`` / ``create_optimizer_and_scheduler``, called on
    the instance with the model being trained; the script's ``optimizers=`` objects (``inner``) are
    ``self.optimizer`` / ``self.lr_scheduler`` when the override runs, as under Trainer.
    ``create_optimizer_and_scheduler`` runs when the engine builds the optimizer, with the run's steps."""

    def __init__(self, worker: ScriptTrainer, inner: InPlace | ClassAndKwargs | None, both: bool = False) -> None:
        self.worker, self.inner, self.both = worker, inner, both

    def optimizer(
        self, model: nn.Module, groups: list[dict[str, Any]], default: Any, total_steps: int
    ) -> torch.optim.Optimizer:
        with self.worker.call(model) as instance:
            instance.optimizer, instance.lr_scheduler = None, None
            if isinstance(self.inner, InPlace):
                instance.optimizer = self.inner.optimizer(model, groups, default, total_steps)
                instance.lr_scheduler = self.inner.script_scheduler
            if self.both:
                instance.create_optimizer_and_scheduler(num_training_steps=total_steps)
            else:
                instance.create_optimizer()
        if not isinstance(instance.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(instance).__name__}.create_optimizer() left self.optimizer as "
                f"{type(instance.optimizer).__name__}; it must set a torch.optim.Optimizer, as under Trainer"
            )
        return instance.optimizer

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int, default: Any) -> Any:
        with self.worker.call() as instance:
            if not self.both:
                instance.create_scheduler(num_training_steps=total_steps, optimizer=optimizer)
        return instance.lr_scheduler


def optimizer_factory(
    trainer: LoopTrainer,
    optimizers: tuple[Any, Any] | None,
    optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None,
) -> OptimizerFactory | None:
    """The ``RunPlan.optimizer_factory`` of ``optimizers=`` / ``optimizer_cls_and_kwargs=`` and a subclass's
    ``create_*`` overrides, or None when it has none of them."""
    from trainbridge.trainer.subclass import overrides

    inner = script_optimizer(trainer.model, optimizers, optimizer_cls_and_kwargs)
    both = overrides(type(trainer), ("create_optimizer_and_scheduler",))
    if not both and not overrides(type(trainer), ("create_optimizer", "create_scheduler")):
        return inner
    return SubclassOptimizer(trainer._script, inner, both)


def script_model(factory: OptimizerFactory | None) -> Callable[[], nn.Module] | None:
    """The ``model_init`` of a train job whose ``optimizer_factory`` is ``factory``: the script's model object
    when the script's optimizer steps it in place (``InPlace``, also under a ``SubclassOptimizer``), else None."""
    inner = factory.inner if isinstance(factory, SubclassOptimizer) else factory
    return inner.model_init if isinstance(inner, InPlace) else None
