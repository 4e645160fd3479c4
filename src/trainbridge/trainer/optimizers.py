"""A script's own optimizer and schedule, rebuilt in the workers: ``TrainingArgs.optimizer_factory`` of a facade job.

``ClassAndKwargs`` is ``optimizer_cls_and_kwargs=(cls, kwargs)``: ``cls(groups, **kwargs)`` over Trainer's two
weight-decay groups.  ``Rebuilt`` is ``optimizers=(optimizer, scheduler)``: the optimizer's class, its
``defaults`` and each parameter group's hyperparameters, the group's parameters matched to the worker model's
by name; the scheduler's class called with the constructor arguments read back from its attributes
(``LambdaLR``'s lambdas travel by value, with cloudpickle).  Both are built fresh in every worker, in both
launch styles, so optimizer state starts empty as it does under Trainer at step 0.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

# Constructor arguments a scheduler is rebuilt without: the optimizer is the worker's, the count starts at 0.
_SCHEDULER_SKIP = {"self", "optimizer", "last_epoch", "verbose"}


class ClassAndKwargs:
    """``optimizer_cls_and_kwargs``: ``cls(groups, **kwargs)``; the schedule is ``lr_scheduler_type``'s."""

    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls, self.kwargs = cls, dict(kwargs)

    def optimizer(self, model: nn.Module, groups: list[dict[str, Any]], default: Any) -> torch.optim.Optimizer:
        return self.cls(groups, **self.kwargs)  # type: ignore[no-any-return]

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int, default: Any) -> Any:
        return None


class Rebuilt:
    """``optimizers=(optimizer, scheduler)``, as data: see the module doc."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any) -> None:
        if optimizer is None:
            raise ValueError(
                "optimizers=(None, scheduler): a scheduler needs the optimizer it drives; pass both, or set "
                "lr_scheduler_type in the TrainingArguments"
            )
        if not isinstance(model, nn.Module):
            raise ValueError(
                "optimizers=: the optimizer's parameters are matched to the Trainer's model by name; pass model="
            )
        names = {id(p): n for n, p in model.named_parameters()}
        self.cls = type(optimizer)
        self.defaults = dict(optimizer.defaults)
        self.groups: list[tuple[list[str], dict[str, Any]]] = []
        for group in optimizer.param_groups:
            unknown = [p for p in group["params"] if id(p) not in names]
            if unknown:
                raise ValueError(
                    f"optimizers=: {len(unknown)} parameter(s) of the optimizer's groups are not parameters of the "
                    "Trainer's model (build the optimizer on trainer's model, e.g. model.parameters(), after any "
                    "change to it such as get_peft_model)"
                )
            hyper = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
            if "initial_lr" in group:  # a scheduler already scaled 'lr': the worker's scheduler does it again
                hyper["lr"] = group["initial_lr"]
            self.groups.append(([names[id(p)] for p in group["params"]], hyper))
        self.scheduler_cls: type | None = None
        self.scheduler_kwargs: dict[str, Any] = {}
        if scheduler is not None:
            self.scheduler_cls, self.scheduler_kwargs = _scheduler_spec(scheduler)

    def optimizer(self, model: nn.Module, groups: list[dict[str, Any]], default: Any) -> torch.optim.Optimizer:
        params = dict(model.named_parameters())
        missing = sorted({n for names, _ in self.groups for n in names} - set(params))
        if missing:
            raise RuntimeError(
                f"optimizers=: the worker's model has no parameter(s) {missing[:3]} (of {len(missing)}) that the "
                "script's optimizer holds; its parameter names differ from the Trainer's model"
            )
        rebuilt = [{"params": [params[n] for n in names], **hyper} for names, hyper in self.groups]
        return self.cls(rebuilt, **self.defaults)  # type: ignore[no-any-return]

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int, default: Any) -> Any:
        if self.scheduler_cls is None:
            return None
        return self.scheduler_cls(optimizer, **self.scheduler_kwargs)


def _scheduler_spec(scheduler: Any) -> tuple[type, dict[str, Any]]:
    """The scheduler's class and its constructor arguments, read back from its attributes (``lr_lambda``
    from ``lr_lambdas``); refused naming the argument when one cannot be read back."""
    cls = type(scheduler)
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name in _SCHEDULER_SKIP or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        for attr in (name, name + "s", "_" + name):
            if attr in vars(scheduler):
                kwargs[name] = vars(scheduler)[attr]
                break
        else:
            if param.default is inspect.Parameter.empty:
                raise ValueError(
                    f"optimizers=: the scheduler {cls.__name__} cannot be rebuilt in the workers: its argument "
                    f"{name!r} is not kept on the object; use a torch.optim.lr_scheduler class, LambdaLR, or "
                    "lr_scheduler_type in the TrainingArguments"
                )
    return cls, kwargs


class SubclassOptimizer:
    """A Trainer subclass overriding ``create_optimizer`` / ``create_scheduler``: called in each worker on the
    worker-side instance (``trainer.subclass``) with ``self.model`` the worker's model; ``super()`` builds
    what ``optim`` / ``lr_scheduler_type`` (or the script's ``optimizers=``, ``inner``) would."""

    def __init__(self, worker: Any, inner: Any) -> None:
        self.worker, self.inner = worker, inner

    def optimizer(self, model: nn.Module, groups: list[dict[str, Any]], default: Any) -> torch.optim.Optimizer:
        instance = self.worker.trainer(model)
        instance.optimizer, instance.lr_scheduler = None, None
        if self.inner is not None:
            instance._default_optimizer = lambda: self.inner.optimizer(model, groups, default)
        else:
            instance._default_optimizer = default
        instance.create_optimizer()
        if not isinstance(instance.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(instance).__name__}.create_optimizer() left self.optimizer as "
                f"{type(instance.optimizer).__name__}; it must set a torch.optim.Optimizer, as under Trainer"
            )
        return instance.optimizer

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int, default: Any) -> Any:
        instance = self.worker.trainer(None)
        if self.inner is not None:
            instance._default_scheduler = lambda chosen: (
                self.inner.scheduler(chosen, total_steps, default) or default(chosen)
            )
        else:
            instance._default_scheduler = default
        instance.create_scheduler(num_training_steps=total_steps, optimizer=optimizer)
        return instance.lr_scheduler


def optimizer_factory(trainer: Any, optimizers: Any, optimizer_cls_and_kwargs: Any) -> Any:
    """The ``TrainingArgs.optimizer_factory`` of a facade's ``optimizers=`` / ``optimizer_cls_and_kwargs=``
    and a subclass's ``create_optimizer`` / ``create_scheduler``, or None when it has none of them."""
    from trainbridge.trainer.subclass import overrides, script_trainer

    inner = _script_objects(trainer, optimizers, optimizer_cls_and_kwargs)
    if not overrides(type(trainer), ("create_optimizer", "create_scheduler")):
        return inner
    return SubclassOptimizer(script_trainer(trainer), inner)


def _script_objects(trainer: Any, optimizers: Any, optimizer_cls_and_kwargs: Any) -> Any:
    optimizer, scheduler = tuple(optimizers or (None, None))
    if optimizer is not None or scheduler is not None:
        if optimizer_cls_and_kwargs is not None:
            raise ValueError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
        return Rebuilt(trainer.model, optimizer, scheduler)
    if optimizer_cls_and_kwargs is not None:
        cls, kwargs = optimizer_cls_and_kwargs
        return ClassAndKwargs(cls, kwargs)
    return None
