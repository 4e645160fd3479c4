"""A script's own optimizer objects as the engine's optimizer (``RunPlan.optimizer_factory``).

``ClassAndKwargs`` is Trainer's ``optimizer_cls_and_kwargs=(cls, kwargs)``: ``cls(groups, **kwargs)`` over the two
weight-decay groups.  ``InPlace`` is ``optimizers=(optimizer, scheduler)``: the loop trains the script's model
object and the script's optimizer and scheduler objects step it.  The engine wraps the model first (DDP keeps its
parameters; FSDP2 replaces them by sharded ones), then each parameter group is pointed at the model's parameters
of the same names, as accelerate does for FSDP2: the script's ``optimizer.param_groups`` and ``optimizer.state``
are the live ones.  ``script_optimizer`` picks one from the two arguments.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ModalOptimizer(Protocol):
    """An optimizer with train and eval modes (``schedulefree``'s): Trainer's ``evaluation_loop`` calls its
    ``eval()`` and its ``training_step`` its ``train()``."""

    def train(self) -> Any: ...

    def eval(self) -> Any: ...


def back_to_training(optimizer: object) -> None:
    """``optimizer`` in train mode again after an evaluation put it in eval mode (a ``ModalOptimizer``), as
    Trainer's next ``training_step`` puts it."""
    if isinstance(optimizer, ModalOptimizer):
        optimizer.train()


class ClassAndKwargs:
    """``optimizer_cls_and_kwargs``: ``cls(groups, **kwargs)``; the schedule is ``lr_scheduler_type``'s."""

    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls, self.kwargs = cls, dict(kwargs)

    def optimizer(
        self, model: nn.Module, groups: list[dict[str, Any]], default: Any, total_steps: int
    ) -> torch.optim.Optimizer:
        return self.cls(groups, **self.kwargs)  # type: ignore[no-any-return]

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int, default: Any) -> Any:
        return None


def group_parameter_names(model: Any, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names in ``model`` of each parameter group's parameters; refused, saying what to do, when a
    parameter is not one of the model's."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            "optimizers=: the optimizer's parameters are matched to the Trainer's model by name; pass model="
        )
    names = {id(p): n for n, p in model.named_parameters()}
    found = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                f"optimizers=: {len(unknown)} parameter(s) of the optimizer's groups are not parameters of the "
                "Trainer's model (build the optimizer on trainer's model, e.g. model.parameters(), after any "
                "change to it such as get_peft_model)"
            )
        found.append([names[id(p)] for p in group["params"]])
    return found


class InPlace:
    """``optimizers=(optimizer, scheduler)`` under the script's launcher: the script's own objects, stepping
    the script's own model (see the module doc).  Never leaves the script's process."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any) -> None:
        if optimizer is None:
            raise ValueError(
                "optimizers=(None, scheduler): a scheduler needs the optimizer it drives; pass both, or set "
                "lr_scheduler_type in the TrainingArguments"
            )
        self.model = model
        self.names = group_parameter_names(model, optimizer)
        self.script_optimizer = optimizer
        self.script_scheduler = scheduler

    def model_init(self) -> nn.Module:
        """The job's model: the script's own object (``RunPlan.model_init`` of the in-place train job)."""
        return self.model

    def optimizer(
        self, model: nn.Module, groups: list[dict[str, Any]], default: Any, total_steps: int
    ) -> torch.optim.Optimizer:
        """The script's optimizer, each group pointed at ``model``'s parameters of the same names (the same
        objects under DDP and on one process; FSDP2's sharded ones)."""
        params = dict(model.named_parameters())
        optimizer = self.script_optimizer
        for group, names in zip(optimizer.param_groups, self.names, strict=True):
            missing = [n for n in names if n not in params]
            if missing:
                raise RuntimeError(
                    f"optimizers=: the trained model has no parameter(s) {missing[:3]} that the script's optimizer "
                    "holds (was the model changed after the optimizer was built, e.g. by peft_config?)"
                )
            moved = [p for n, p in zip(names, group["params"], strict=True) if params[n] is not p]
            if any(p in optimizer.state for p in moved):
                raise RuntimeError(
                    "optimizers=: the script's optimizer already holds state for parameters that the engine "
                    "replaced (FSDP2 shards them); pass an optimizer that has not stepped yet"
                )
            group["params"] = [params[n] for n in names]
        return optimizer

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int, default: Any) -> Any:
        """The script's scheduler (None: ``lr_scheduler_type``'s over the script's optimizer)."""
        return self.script_scheduler

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "optimizers=: the script's optimizer is used in place under the script's launcher and cannot be "
            "sent to other processes"
        )


def script_optimizer(
    model: Any, optimizers: tuple[Any, Any] | None, optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None
) -> InPlace | ClassAndKwargs | None:
    """The factory of Trainer's ``optimizers=`` (``InPlace`` on ``model``) or ``optimizer_cls_and_kwargs=``
    (``ClassAndKwargs``); None when neither is given."""
    optimizer, scheduler = tuple(optimizers or (None, None))
    if optimizer is not None or scheduler is not None:
        if optimizer_cls_and_kwargs is not None:
            raise ValueError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
        return InPlace(model, optimizer, scheduler)
    if optimizer_cls_and_kwargs is not None:
        cls, kwargs = optimizer_cls_and_kwargs
        return ClassAndKwargs(cls, kwargs)
    return None
