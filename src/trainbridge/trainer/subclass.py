"""The loop's calls into the script's Trainer instance (in place, on every rank).

``ScriptTrainer`` holds the ``RunPlan`` seams that call the instance, each inside ``ScriptTrainer.call`` (a
``LoopScope``, ``trainer.scope``): ``training_step`` / ``prediction_step`` (``InstanceStep``), ``evaluate`` at
each evaluation point (``LoopTrainer._evaluation``), ``log`` before the other callbacks (``ScriptTrainerEvents``)
and ``get_train_dataloader``; ``trainer.optimizers`` and ``trainer.save_overrides`` call its optimizer and saves.
Overrides of ``UNHONOURED`` (Trainer's own loop) are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext
from trainbridge.data.script_data import column_items
from trainbridge.hf.stand_in_handlers import EvaluationEvents, LogCapture
from trainbridge.parallel.script_optimizer import back_to_training
from trainbridge.trainer.scope import LoopScope

if TYPE_CHECKING:
    from trainbridge.core.config.loss import StepFactory
    from trainbridge.core.config.plan import EvaluationRun
    from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks
    from trainbridge.trainer.facade import LoopTrainer

UNHONOURED = (
    "_inner_training_loop",
    "_run_epoch",
    "_maybe_log_save_evaluate",
    "get_batch_samples",
    "_load_from_checkpoint",
    "_load_best_model",
)
"""Parts of Trainer's own training loop, which trainbridge's replaces: overriding one in a script's subclass
is refused at construction, naming it."""

STEP_METHODS = (
    "compute_loss",
    "training_step",
    "prediction_step",
    "_prepare_inputs",
    "_prepare_input",
    "compute_loss_context_manager",
)
"""Overrides that make the loop step through the instance's ``training_step`` (``step.trainer_methods``)."""

EVALUATION_METHODS = ("evaluate", "evaluation_loop", "get_eval_dataloader", "_get_eval_sampler")
"""Overrides that make each evaluation during training the instance's ``evaluate()`` (Trainer's own code)."""

LOADER_METHODS = ("get_train_dataloader", "_get_train_sampler", "_set_signature_columns_if_needed")
"""Overrides whose ``DataLoader`` gives the training batches (``ScriptTrainer.train_loader``); the columns Trainer's
loader keeps are the signature columns (trl's reward trainer keeps its ``chosen_ids``/``rejected_ids``)."""


def _script_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that are neither trainbridge's nor transformers' own (the script's, and
    a library's Trainer subclass such as trl's)."""
    return [
        klass
        for klass in cls.__mro__
        if klass is not object
        and not klass.__module__.startswith("trainbridge.")
        and not klass.__module__.startswith("transformers.")
    ]


def unhonoured_overrides(cls: type) -> list[str]:
    """The methods of ``UNHONOURED`` that a class of the script's (not trainbridge's own) defines."""
    found: list[str] = []
    for klass in _script_classes(cls):
        found += [name for name in UNHONOURED if name in vars(klass) and name not in found]
    return found


def overrides(cls: type[LoopTrainer], names: tuple[str, ...], stood_in: tuple[str, ...] | None = None) -> bool:
    """Whether a class of the script's (``_script_classes``) defines one of ``names``.  A library's method that
    trainbridge stands in for on this run (``stood_in``, default ``stands_in_for``) counts only when defined
    below the class declaring ``stands_in_for`` (in the script's subclass)."""
    owner = next((klass for klass in cls.__mro__ if "stands_in_for" in vars(klass)), object)
    stood_in = cls.stands_in_for if stood_in is None else stood_in
    return any(
        name in vars(klass) and not (name in stood_in and klass in owner.__mro__)
        for klass in _script_classes(cls)
        for name in names
    )


@dataclass(frozen=True)
class StandIn:
    """What trainbridge's own code stands in for on one ``train()`` (``LoopTrainer._stand_in``, in ``run_plan()``)."""

    methods: tuple[str, ...] = ()
    """The library's methods (trl's) it stands in for: defined there, they are not the script's (``overrides``)."""
    step: StepFactory | None = None
    """trainbridge's step for the library's loss (``OwnStep``: DPO, KTO, ORPO/CPO); None: no such step."""

    @property
    def loss(self) -> bool:
        """Whether trainbridge's step stands in for the library's loss, micro-batch step and collator."""
        return "compute_loss" in self.methods


def items_are_columns(trainer: LoopTrainer, name: str) -> bool:
    """``script_data.column_items`` of the instance's ``train_dataset`` or ``eval_dataset`` (``name``), looked
    at once per dataset object (a stream's first item is read from a fresh iterator)."""
    data = getattr(trainer, name, None)
    seen = trainer._column_items
    if name not in seen or seen[name][0] is not data:
        seen[name] = (data, column_items(data))
    return bool(seen[name][1])


class ScriptTrainer:
    """The seams that call the script's instance (see the module doc); every call goes through ``call``."""

    def __init__(self, trainer: LoopTrainer) -> None:
        self.instance = trainer
        self._hf: HuggingFaceCallbacks | None = None

    @property
    def counts_items(self) -> bool:
        """Whether the step counts ``num_items_in_batch`` whatever the model: Trainer counts them for a
        ``compute_loss_func``, whose loss is then a mean over those items."""
        return self.instance.compute_loss_func is not None

    @property
    def counts_step(self) -> bool:
        """Whether the loader's batches carry counts to sum over the ranks (``LoopTrainer.counts_step``)."""
        return self.instance.counts_step

    def bind_state(self, hf: HuggingFaceCallbacks) -> None:
        """The run's ``HuggingFaceCallbacks``: their state, handler and control are the instance's in each call."""
        self._hf = hf

    def train_loader(self, dataset: object, collate: object, model: object) -> Iterable[Any]:
        """``RunPlan.train_loader``: the instance's own ``get_train_dataloader()`` (this rank's share, as Trainer's)."""
        return self.instance.get_train_dataloader()

    def _around(self, outer: LoopScope | None) -> LoopScope:
        """The scope around a new call: ``outer`` (the one of the call under way), else the run's live state."""
        if outer is not None:
            return outer
        hf = self._hf
        if hf is None or hf.state is None:
            return LoopScope()
        return LoopScope(state=hf.state, handler=hf.handler, control=hf.control)

    @contextmanager
    def call(self, model: torch.nn.Module | None = None, **within: Any) -> Iterator[LoopTrainer]:
        """The instance inside a ``LoopScope``: the scope around with ``within`` (``LoopScope``'s fields) and
        ``model`` (the engine's); afterwards the scope around (and its handler) is back."""
        instance = self.instance
        outer = instance._in_loop
        around = self._around(outer)
        scope = replace(around, model=model if model is not None else around.model, **within)
        handler = instance.callback_handler
        instance._in_loop = scope
        if scope.state is not None:
            instance.state = scope.state
        if scope.handler is not None:
            instance.callback_handler = scope.handler
        if scope.control is not None:
            instance.control = scope.control
        if scope.model is not None:
            instance.model_wrapped = scope.model
        try:
            yield instance
        finally:
            instance._in_loop = outer
            instance.callback_handler = around.handler if around.handler is not None else handler

    def evaluation(self, run: EvaluationRun, trainers_own: bool = False) -> dict[str, float]:
        """``RunPlan.evaluation``: the instance's ``evaluate()`` on the engine's model in its precision; Trainer's
        own ``evaluate`` there is ``run`` (the loop's evaluation) unless ``trainers_own``.  What it logs and
        evaluates through its ``callback_handler`` goes to the loop (``EvaluationEvents``)."""
        loop_evaluation = None if trainers_own else run
        handler = self._around(self.instance._in_loop).handler or self.instance.callback_handler
        events = EvaluationEvents(handler, run, partial(self.call, routed=True), self._hf)
        with self.call(run.model, evaluation=loop_evaluation, handler=events) as instance, run.autocast():
            try:
                return dict(instance.evaluate(ignore_keys=None))
            finally:
                back_to_training(instance.optimizer)  # a schedule-free one: Trainer's evaluation_loop called eval()

    # ------------------------------------------------------------------ step.trainer_methods.TrainerMethods
    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Any,
        backward: Callable[[torch.Tensor], None],
        accumulation: int,
    ) -> torch.Tensor:
        with self.call(model) as instance:
            instance.current_gradient_accumulation_steps = accumulation
            accelerator = instance.accelerator
            accelerator.backward = lambda loss, **kwargs: backward(loss)  # type: ignore[method-assign]
            try:
                return instance.training_step(model, inputs, num_items_in_batch)
            finally:
                del accelerator.backward

    def prediction_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, num_items_in_batch: Any
    ) -> tuple[Any, Any, Any]:
        with self.call(model) as instance:
            return tuple(instance.prediction_step(model, inputs, prediction_loss_only, ignore_keys=None))  # type: ignore[return-value]


class ScriptTrainerEvents(Callback):
    """The instance's part in the run's events, on every rank: ``optimizer`` and ``lr_scheduler`` set at
    ``on_init_end``, and the script's ``log`` called on every log before the other callbacks, so what it adds to
    (or removes from) ``logs``, or the dict it hands to ``super().log``, is what is logged."""

    def __init__(self, worker: ScriptTrainer) -> None:
        self.worker = worker

    def on_init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        with self.worker.call(context.model) as instance:
            if instance.optimizer is None:
                instance.optimizer, instance.lr_scheduler = context.optimizer, context.lr_scheduler

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        logs = kwargs["logs"]
        around = self.worker.instance._in_loop
        if around is not None and around.routed:
            return  # logged by the instance's own log (EvaluationEvents)
        training = "loss" in logs and context.train_start_time is not None  # Trainer passes start_time then
        capture = LogCapture(None)
        with self.worker.call(context.model, log=capture) as instance:
            instance.log(logs, context.train_start_time if training else None)
        logged = capture.logs if capture.logs is not None else logs
        if logged is not logs:
            logs.clear()
            logs.update(logged)


OWN_METHODS = (
    "evaluate",
    "log",
    "create_optimizer",
    "create_scheduler",
    "create_optimizer_and_scheduler",
    "_save",
    "save_model",
    "_save_checkpoint",
)
"""Besides ``STEP_METHODS``, the overrides the loop calls on the instance (``trainer.optimizers``,
``trainer.save_overrides``)."""


INSTANCE_STEP_HONOURS = ("label_smoothing_factor",)
"""``TrainingArguments`` fields Trainer's own ``compute_loss`` applies when the loop steps through the instance
(``InstanceStep``): not reported ignored then."""
