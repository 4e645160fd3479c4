"""A Trainer subclass's overrides, run in the workers on the real model and batches.

``script_trainer(trainer)`` is the one worker-side stand-in of a facade's Trainer (a ``ScriptTrainer``,
picklable, the same object for every part of a job): it holds the script's Trainer class (sent by value
when the script defines it, as callbacks travel), the arguments a typical override reads and the
attributes the script's ``__init__`` set (``self.alpha = alpha``), carried by value.  In each worker it
builds, once, an instance of that class without running its ``__init__``: the script's attributes, then
``args``, ``model`` (unwrapped), ``state`` (the run's live ``TrainerState``, once ``bind_state`` gave it the
job's ``HuggingFaceCallbacks``), ``processing_class``, ``compute_loss_func``, ``label_smoother``,
``label_names``, ``model_accepts_loss_kwargs`` and ``accelerator`` (``worker_methods.WorkerAccelerator``).

What runs there:

- ``training_step`` on each micro-batch and ``prediction_step`` on each validation batch
  (``RunPlan.trainer_methods`` -> ``step.trainer_methods``) when the class overrides one of them or
  ``compute_loss``, or has a ``compute_loss_func``; ``super()`` runs Trainer's (``worker_methods``);
- ``log`` on every rank where Trainer calls it (``ScriptTrainerEvents``: training, evaluation and the final
  logs), before the other callbacks see the logs, so what the override adds lands;
- ``create_optimizer`` / ``create_scheduler`` / ``create_optimizer_and_scheduler``
  (``trainer.optimizers.SubclassOptimizer``);
- ``_save`` / ``save_model`` / ``_save_checkpoint`` at each checkpoint (``trainer.save_overrides``).

Overrides of the methods in ``UNHONOURED`` are refused at construction (``unhonoured_overrides``).
"""

from __future__ import annotations

import dis
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext

UNHONOURED = (
    "evaluation_loop",
    "get_eval_dataloader",
    "get_test_dataloader",
    "_get_eval_sampler",
    "_maybe_log_save_evaluate",
    "_inner_training_loop",
    "_prepare_inputs",
    "get_batch_samples",
    "compute_loss_context_manager",
    "_load_from_checkpoint",
    "_load_best_model",
    "_wrap_model",
)
"""Trainer methods that Trainer calls during training and trainbridge's loop does not: overriding one in a
script's subclass is refused at construction, naming it."""

HINTS = {
    "get_eval_dataloader": (
        "get_eval_dataloader(): validation batches are formed in the workers from eval_dataset with "
        "per_device_eval_batch_size and the data_collator; set those, or evaluate with your own loader after train()"
    ),
}
"""What to do instead, for the refused overrides a script most often has."""

STEP_METHODS = ("compute_loss", "training_step", "prediction_step")
"""Overrides that make the workers step through the script's ``training_step`` (``step.trainer_methods``)."""


def _script_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that are the script's (before trainbridge's own)."""
    found = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("trainbridge.") or klass is object:
            break
        found.append(klass)
    return found


def unhonoured_overrides(cls: type) -> list[str]:
    """The methods of ``UNHONOURED`` that a class of the script's (not trainbridge's own) defines."""
    found: list[str] = []
    for klass in _script_classes(cls):
        found += [name for name in UNHONOURED if name in vars(klass) and name not in found]
    return found


def override_hints(names: list[str]) -> str:
    """``HINTS`` of the refused ``names``, as sentences to append to the refusal (empty when none has one)."""
    return "".join(f" {HINTS[name]}." for name in names if name in HINTS)


def overrides(cls: type, names: tuple[str, ...]) -> bool:
    """Whether a class of the script's (not trainbridge's own) defines one of ``names``."""
    return any(name in vars(klass) for klass in _script_classes(cls) for name in names)


def overrides_compute_loss(cls: type) -> bool:
    """Whether a class of the script's (not trainbridge's own) defines ``compute_loss``."""
    return overrides(cls, ("compute_loss",))


@functools.cache
def facade_attribute_names(cls: Any) -> frozenset[str]:
    """The attributes trainbridge's own classes in ``cls``'s MRO assign on ``self`` (any method): the rest of a
    facade instance's attributes are the script's."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("trainbridge."):
            continue
        for member in vars(klass).values():
            function = member.fget if isinstance(member, property) else member
            code = getattr(function, "__code__", None)
            if code is not None:
                names |= _stored_attributes(code)
    return frozenset(names)


def _stored_attributes(code: Any) -> set[str]:
    names = {str(i.argval) for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _stored_attributes(const)
    return names


def script_attributes(trainer: Any) -> dict[str, Any]:
    """The attributes of ``trainer`` its script set (``self.alpha = alpha`` in a subclass's ``__init__``)."""
    own = facade_attribute_names(type(trainer)) | {"_script_trainer"}  # type: ignore[arg-type]
    return {name: value for name, value in vars(trainer).items() if name not in own}


class ScriptTrainer:
    """The worker-side stand-in of a facade's Trainer (see the module doc)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer_cls = type(trainer)
        self.args = trainer.args
        self.processing_class = trainer.processing_class
        self.compute_loss_func = trainer.compute_loss_func
        self.attributes: dict[str, Any] = {}
        """The script's attributes, taken when a job starts (``take_attributes``)."""
        self.state: Any = None
        """The script's ``TrainerState`` when the job started (the state of an evaluation job's instance)."""
        self._state_source: Callable[[], Any] | None = None
        self._instance: Any = None

    @property
    def counts_items(self) -> bool:
        """Whether the step counts ``num_items_in_batch`` whatever the model: Trainer counts them for a
        ``compute_loss_func``, whose loss is then a mean over those items."""
        return self.compute_loss_func is not None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_instance": None, "_state_source": None}

    def take_attributes(self, trainer: Any, check_transport: bool) -> None:
        """Take ``trainer``'s script attributes and state for a job; ``check_transport`` (a self-launched job):
        fail naming an attribute that cannot be pickled to the workers."""
        self.attributes = script_attributes(trainer)
        self.state = trainer.state
        if not check_transport:
            return
        import cloudpickle

        for name, value in self.attributes.items():
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                raise TypeError(
                    f"{self.trainer_cls.__name__}.{name} cannot be sent to the workers ({type(exc).__name__}: {exc}); "
                    f"the subclass travels by value with its attributes: create {name} lazily in the method that "
                    "uses it (it then runs in each worker), or run the script under torchrun"
                ) from exc

    def bind_state(self, source: Callable[[], Any]) -> None:
        """Read ``self.state`` from ``source`` (the run's ``HuggingFaceCallbacks.state``) once it has one."""
        self._state_source = source

    def trainer(self, model: Any) -> Any:
        """This worker's instance of the script's Trainer class (built once; ``__init__`` not run), its
        ``state`` the run's live one."""
        if self._instance is None:
            self._instance = self._build(model)
        live = self._state_source() if self._state_source is not None else None
        if live is not None:
            self._instance.__dict__["state"] = live
        return self._instance

    def _build(self, model: Any) -> Any:
        from transformers import TrainerState
        from transformers.trainer_pt_utils import LabelSmoother
        from transformers.utils import can_return_loss

        from trainbridge.modeling.load import unwrap_peft
        from trainbridge.step.model_loss import accepts_loss_kwargs, default_label_names
        from trainbridge.trainer.worker_methods import WorkerAccelerator

        instance: Any = object.__new__(self.trainer_cls)
        accelerator = WorkerAccelerator(model)
        smoothing = float(getattr(self.args, "label_smoothing_factor", 0.0) or 0.0)
        inner = accelerator.unwrap_model(model) if model is not None else None
        instance.__dict__.update(self.attributes)
        instance.__dict__.update(
            args=self.args,
            model=inner,
            state=self.state if self.state is not None else TrainerState(),
            processing_class=self.processing_class,
            compute_loss_func=self.compute_loss_func,
            model_accepts_loss_kwargs=accepts_loss_kwargs(inner) if inner is not None else False,
            label_smoother=LabelSmoother(epsilon=smoothing) if smoothing else None,
            label_names=list(getattr(self.args, "label_names", None) or [])
            or (default_label_names(inner) if inner is not None else ["labels"]),
            can_return_loss=can_return_loss(type(unwrap_peft(inner))) if inner is not None else False,
            loss_is_scaled_for_ga=None,
            current_gradient_accumulation_steps=1,  # the step's, set on each training_step
            optimizer=None,
            lr_scheduler=None,
            _worker_accelerator=accelerator,
            _env=None,
            callbacks=[],
            model_init=None,
        )
        return instance

    def evaluation(self, run: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``RunPlan.evaluation``: the script's ``evaluate`` override for each evaluation during training,
        its ``super().evaluate()`` being ``run`` (the loop's evaluation: logs, ``on_evaluate``)."""
        instance = self.trainer(None)
        instance.__dict__[LOOP_EVALUATION] = run
        try:
            return dict(instance.evaluate(ignore_keys=None))
        finally:
            instance.__dict__.pop(LOOP_EVALUATION, None)

    # ------------------------------------------------------------------ step.trainer_methods.TrainerMethods
    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Any,
        backward: Callable[[torch.Tensor], None],
        accumulation: int,
    ) -> torch.Tensor:
        instance = self.trainer(model)
        instance.current_gradient_accumulation_steps = accumulation
        accelerator = instance.__dict__["_worker_accelerator"]
        accelerator.backward_fn = backward
        try:
            return instance.training_step(model, inputs, num_items_in_batch)
        finally:
            accelerator.backward_fn = None

    def prediction_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, num_items_in_batch: Any
    ) -> tuple[Any, Any, Any]:
        instance = self.trainer(model)
        instance.__dict__["_eval_num_items"] = num_items_in_batch  # what super().prediction_step counts
        try:
            return tuple(instance.prediction_step(model, inputs, prediction_loss_only, ignore_keys=None))  # type: ignore[return-value]
        finally:
            instance.__dict__.pop("_eval_num_items", None)


class ScriptTrainerEvents(Callback):
    """The worker-side instance's part in the run's events, on every rank: ``optimizer`` and ``lr_scheduler``
    set at ``on_init_end``, and the script's ``log`` called on every log before the other callbacks, so what it
    adds to (or removes from) ``logs``, or the dict it hands to ``super().log``, is what is logged."""

    def __init__(self, worker: ScriptTrainer) -> None:
        self.worker = worker

    def on_init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        instance = self.worker.trainer(context.model)
        if instance.optimizer is None:
            instance.optimizer, instance.lr_scheduler = context.optimizer, context.lr_scheduler

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        logs = kwargs["logs"]
        instance = self.worker.trainer(context.model)
        instance.__dict__.pop("_logged", None)
        training = "loss" in logs and context.train_start_time is not None  # Trainer passes start_time then
        instance.__dict__[IN_LOG_EVENT] = True
        try:
            instance.log(logs, context.train_start_time if training else None)
        finally:
            instance.__dict__.pop(IN_LOG_EVENT, None)
        logged = instance.__dict__.pop("_logged", logs)
        if logged is not logs:
            logs.clear()
            logs.update(logged)


WORKER_METHODS = (
    "evaluate",
    "log",
    "create_optimizer",
    "create_scheduler",
    "create_optimizer_and_scheduler",
    "_save",
    "save_model",
    "_save_checkpoint",
)
"""Besides ``STEP_METHODS``, the overrides that run on the worker-side instance (``trainer.optimizers``,
``trainer.save_overrides``)."""


IN_LOG_EVENT = "_in_log_event"
"""Set on the worker-side instance while its ``log`` runs for one of the loop's logs."""

LOOP_EVALUATION = "_loop_evaluation"
"""The worker-side instance's attribute holding the loop's evaluation while its ``evaluate`` override runs."""


def evaluate_in_worker(instance: Any, eval_dataset: Any, metric_key_prefix: str) -> dict[str, float]:
    """``super().evaluate()`` of an ``evaluate`` override on the worker-side instance: the loop's evaluation
    of the run's validation sets (what Trainer's ``evaluate()`` does during training)."""
    run = vars(instance).get(LOOP_EVALUATION)
    if run is None:
        raise RuntimeError("evaluate() runs in the workers only as the loop's evaluation during train()")
    if eval_dataset is not None or metric_key_prefix != "eval":
        raise ValueError(
            "evaluate(eval_dataset=..., metric_key_prefix=...) inside train(): the workers evaluate the Trainer's "
            "eval_dataset only; give extra sets as a dict eval_dataset (each evaluated in turn, eval_<name>_ "
            "metrics), or evaluate them after train()"
        )
    return run()


def subclass_evaluation(trainer: Any) -> Callable[..., Any] | None:
    """The ``RunPlan.evaluation`` of ``trainer``'s training jobs: its ``ScriptTrainer``'s ``evaluation``
    when its class overrides ``evaluate``, else None."""
    worker = script_trainer(trainer) if overrides(type(trainer), ("evaluate",)) else None
    return worker.evaluation if worker is not None else None


def script_trainer(trainer: Any) -> ScriptTrainer | None:
    """``trainer``'s ``ScriptTrainer`` (one per facade instance) when its class runs a method in the workers or
    it has a ``compute_loss_func``, else None."""
    cls = type(trainer)
    if not overrides(cls, (*STEP_METHODS, *WORKER_METHODS)):
        if trainer.compute_loss_func is None:
            return None
    worker = trainer.__dict__.get("_script_trainer")
    if worker is None:
        worker = trainer.__dict__["_script_trainer"] = ScriptTrainer(trainer)
    return worker


def subclass_loss(trainer: Any) -> ScriptTrainer | None:
    """The ``RunPlan.trainer_methods`` of ``trainer``'s jobs: its ``ScriptTrainer`` when its class
    overrides ``training_step``, ``prediction_step`` or ``compute_loss`` or it has a ``compute_loss_func`` (the
    workers then step through ``training_step``), else None (the model's own loss, or the token step)."""
    if not overrides(type(trainer), STEP_METHODS) and trainer.compute_loss_func is None:
        return None
    return script_trainer(trainer)


def script_events(trainer: Any) -> ScriptTrainerEvents | None:
    """The callback of ``trainer``'s ``ScriptTrainer`` in its jobs (``ScriptTrainerEvents``), or None."""
    worker = script_trainer(trainer)
    return ScriptTrainerEvents(worker) if worker is not None else None


def bind_state(args: Any, state_source: Callable[[], Any]) -> None:
    """Give the job's ``ScriptTrainer`` (``args.plan.trainer_methods``, its callback's, the optimizer factory's) the
    run's live state."""
    candidates = [args.plan.trainer_methods, getattr(args.plan.optimizer_factory, "worker", None)]
    candidates.append(getattr(args.plan.checkpoint_model_files, "worker", None))
    candidates += [getattr(c, "worker", None) for c in args.plan.callbacks]
    for candidate in candidates:
        if isinstance(candidate, ScriptTrainer):
            candidate.bind_state(state_source)
