"""A script's own optimizer and schedule in the workers: ``RunPlan.optimizer_factory`` of a facade job.

``ClassAndKwargs`` is ``optimizer_cls_and_kwargs=(cls, kwargs)``: ``cls(groups, **kwargs)`` over Trainer's two
weight-decay groups.  ``optimizers=(optimizer, scheduler)`` takes one of two forms, chosen when the Trainer
is built:

- ``InPlace`` under the script's launcher (``torchrun script.py``: the job runs in this process): the job
  trains the script's model object itself (``model_init``) and the script's optimizer and scheduler objects
  step it, as under Trainer.  The engine wraps the model first (DDP keeps its parameters; FSDP2 replaces them
  by sharded ones), then each parameter group is pointed at the model's parameters of the same names, as
  accelerate does for FSDP2: the script's ``optimizer.param_groups`` and ``optimizer.state`` are the live ones.
- ``Rebuilt`` in a self-launched run (plain ``python``): the optimizer's class, its ``defaults`` and each
  parameter group's hyperparameters, the group's parameters matched to the worker model's by name; the
  scheduler's class called with the constructor arguments read back from its attributes (``LambdaLR``'s
  lambdas travel by value, with cloudpickle).  Built fresh in every worker, so optimizer state starts empty
  as it does under Trainer at step 0.

``SubclassOptimizer`` runs a subclass's ``create_optimizer``/``create_scheduler`` (or
``create_optimizer_and_scheduler``) in each worker, over any of the above.
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

    def optimizer(
        self, model: nn.Module, groups: list[dict[str, Any]], default: Any, total_steps: int
    ) -> torch.optim.Optimizer:
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
        self.cls = type(optimizer)
        self.defaults = dict(optimizer.defaults)
        self.groups: list[tuple[list[str], dict[str, Any]]] = []
        for group, names in zip(optimizer.param_groups, group_parameter_names(model, optimizer), strict=True):
            hyper = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
            if "initial_lr" in group:  # a scheduler already scaled 'lr': the worker's scheduler does it again
                hyper["lr"] = group["initial_lr"]
            self.groups.append((names, hyper))
        self.scheduler_cls: type | None = None
        self.scheduler_kwargs: dict[str, Any] = {}
        if scheduler is not None:
            self.scheduler_cls, self.scheduler_kwargs = _scheduler_spec(scheduler)

    def optimizer(
        self, model: nn.Module, groups: list[dict[str, Any]], default: Any, total_steps: int
    ) -> torch.optim.Optimizer:
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
    """A Trainer subclass overriding ``create_optimizer`` / ``create_scheduler`` or
    ``create_optimizer_and_scheduler``: called on the instance itself (``trainer.subclass``), whose ``model``
    is the model being trained; ``super()`` is Trainer's own (``optim``, ``lr_scheduler_type``...).  The
    script's ``optimizers=`` objects (``inner``, in place) are ``self.optimizer`` / ``self.lr_scheduler`` when
    the override runs, as under Trainer.  ``create_optimizer_and_scheduler`` runs when the engine builds the
    optimizer, with the run's optimizer steps."""

    def __init__(self, worker: Any, inner: Any, both: bool = False) -> None:
        self.worker, self.inner, self.both = worker, inner, both

    def optimizer(
        self, model: nn.Module, groups: list[dict[str, Any]], default: Any, total_steps: int
    ) -> torch.optim.Optimizer:
        instance = self.worker.trainer(model)
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
        instance = self.worker.trainer(None)
        if not self.both:
            instance.create_scheduler(num_training_steps=total_steps, optimizer=optimizer)
        return instance.lr_scheduler


def optimizer_factory(trainer: Any, optimizers: Any, optimizer_cls_and_kwargs: Any, in_place: bool) -> Any:
    """The ``RunPlan.optimizer_factory`` of a facade's ``optimizers=`` / ``optimizer_cls_and_kwargs=``
    and a subclass's ``create_optimizer`` / ``create_scheduler`` / ``create_optimizer_and_scheduler``, or
    None when it has none of them.  ``in_place``: the Trainer runs under the script's launcher."""
    from trainbridge.trainer.subclass import overrides, script_trainer

    inner = _script_objects(trainer, optimizers, optimizer_cls_and_kwargs, in_place)
    both = overrides(type(trainer), ("create_optimizer_and_scheduler",))
    if not both and not overrides(type(trainer), ("create_optimizer", "create_scheduler")):
        return inner
    return SubclassOptimizer(script_trainer(trainer), inner, both)


def script_model(factory: Any) -> Any:
    """The ``model_init`` of a train job whose ``optimizer_factory`` is ``factory``: the script's model object
    when the script's optimizer steps it in place (``InPlace``, also under a ``SubclassOptimizer``), else None."""
    inner = factory.inner if isinstance(factory, SubclassOptimizer) else factory
    return inner.model_init if isinstance(inner, InPlace) else None


def _script_objects(trainer: Any, optimizers: Any, optimizer_cls_and_kwargs: Any, in_place: bool) -> Any:
    optimizer, scheduler = tuple(optimizers or (None, None))
    if optimizer is not None or scheduler is not None:
        if optimizer_cls_and_kwargs is not None:
            raise ValueError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
        return (
            InPlace(trainer.model, optimizer, scheduler) if in_place else Rebuilt(trainer.model, optimizer, scheduler)
        )
    if optimizer_cls_and_kwargs is not None:
        cls, kwargs = optimizer_cls_and_kwargs
        return ClassAndKwargs(cls, kwargs)
    return None
