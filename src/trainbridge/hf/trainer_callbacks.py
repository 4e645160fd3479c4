"""``HuggingFaceCallbacks``: one native callback that runs ``transformers.TrainerCallback``s unchanged.

It owns what ``transformers.Trainer`` would own for its callbacks: a real ``TrainingArguments``
(``hf.arguments``), the ``TrainerState`` (``hf.trainer_state``), a ``TrainerControl`` and the callback handler
(``hf.handler``: transformers' own ``CallbackHandler``, so the flag resets before each hook, the keyword
arguments and ``add_callback``'s duplicate-class warning are Trainer's).  The callback list is built as
Trainer builds it: ``DefaultFlowCallback``, then ``report_to``'s integration callbacks, then the user's, then
``ProgressCallback`` (``PrinterCallback`` when ``disable_tqdm``).  This module is the dispatch and control.

Dispatch: it ``handles`` every event with a Hugging Face twin (``core.events.HF_EVENTS``) and ``run_event``
calls the handler's hook of the same name; only init end, train begin, log, evaluate, save and train end
have code of their own.  With ``load_best_model_at_end`` the loop has loaded the best weights before
``on_train_end``, as ``Trainer._finalize_training``.  Keyword arguments are Trainer's: at ``on_init_end`` the
optimizer, scheduler and dataloaders are ``None`` (Trainer creates them in ``train()``), and
``eval_dataloader`` is ``None`` until the first evaluation.  ``args`` is a real ``TrainingArguments``; when the
settings were ported from one (``RunPlan.hf_args``: trl's ``SFTConfig``...), an instance of that class
with all its fields, only the fields this run owns replaced.

Isolation per callback: each HF callback (``report_to`` integrations included) is isolated on its own under
the run's policy (``callback_error_policy``, ``callback_max_consecutive_errors``): an error is logged once,
counted, and after that many errors in a row in hooks it implements that callback alone is switched off;
``RunResult.callback_errors`` names its class.  Under ``fatal`` its error stops every rank.  An error in
``on_init_end`` or ``on_train_begin`` fails the run before the first step, as any callback's does.

Control, both ways:

- *In*: before a hook, the last agreed decision (``context.agreed``) is OR-ed into ``control`` once per
  decision, so every rank's HF callbacks see the flags every rank acts on.
- *Out*: a flag a callback turns on becomes the native request, with a reason naming that callback.  Flags
  set by the stock ``DefaultFlowCallback`` are *not* forwarded: the native ``ScheduleCallback`` applies the
  same rules to ``TrainingArgs`` and is the one schedule (a subclass of it is forwarded).

Differences from Trainer (deliberate):

- A flag turned *off* by a callback does not cancel a native request (requests are "any rank, any callback
  asks"); a stop requested in ``on_step_begin``/``on_substep_end`` takes effect at the end of the optimizer
  step (the next decision point) rather than after the current micro-batch.
- ``on_log`` receives a copy of the native ``logs`` (shared by every HF callback, as under Trainer), so
  ``PrinterCallback`` popping ``total_flos`` does not change what native callbacks see; ``on_evaluate``
  receives the native ``metrics`` dict itself, so an HF callback that rewrites a metric changes best-model
  tracking, as it does under Trainer.
- ``include_num_input_tokens_seen``: Trainer gathers the count per micro-batch.  ``non_padding`` comes from
  the plan and includes the whole step from ``on_pre_optimizer_step`` on; ``all`` (padding included) is
  summed over ranks in the step's one collective, after ``on_step_end``, so hooks up to ``on_step_end`` see
  the previous step's count and every later hook the current one.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from transformers import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.integrations import (
    get_available_reporting_integrations,
    get_reporting_integration_callbacks,
)
from transformers.integrations.integration_utils import TensorBoardCallback

from trainbridge.checkpoint.layout import TRAINER_STATE_FILE, TRAINING_ARGS_FILE
from trainbridge.core.agreement import ControlFlag
from trainbridge.core.callback import Callback
from trainbridge.core.callback_errors import CallbackErrorLedger, CallbackErrorReport
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.events import HF_EVENTS, Event
from trainbridge.hf.accelerate_state import SharedAccelerateState, share_accelerate_state
from trainbridge.hf.arguments import build_training_arguments
from trainbridge.hf.handler import AttributingCallbackHandler, callback_class, implements, is_hf_callback
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.hf.trainer_state import TrainerStateMirror, exportable, restore_callbacks

CONTROL_FLAG_REQUESTS: dict[str, ControlFlag] = {
    "should_training_stop": ControlFlag.STOP_TRAINING,
    "should_epoch_stop": ControlFlag.STOP_EPOCH,
    "should_save": ControlFlag.SAVE,
    "should_evaluate": ControlFlag.EVALUATE,
    "should_log": ControlFlag.LOG,
}
"""``TrainerControl`` flag -> the native request it becomes."""

AGREED_CONTROL_FLAGS: dict[ControlFlag, str] = {
    **{flag: name for name, flag in CONTROL_FLAG_REQUESTS.items()},
    ControlFlag.ABORT: "should_training_stop",
}
"""Agreed native flag -> the ``TrainerControl`` flag every rank's HF callbacks then see."""


class HuggingFaceCallbacks(Callback):
    """Drives ``transformers.TrainerCallback``s (instances or classes) as ``transformers.Trainer`` would.

    Args:
        callbacks: the user's HF callbacks, instances or ``TrainerCallback`` subclasses (instantiated
            without arguments, as ``Trainer(callbacks=[...])`` does).
        report_to: reporting integrations (``"tensorboard"``, ``"mlflow"``, ``"wandb"``...), added as
            Trainer adds them.
        progress: add transformers' ``ProgressCallback`` (``PrinterCallback`` when ``disable_tqdm``) last, unless
            ``callbacks`` holds one.

    The constructor only stores its arguments (it travels to the workers with cloudpickle);
    ``TrainingArguments``, ``TrainerState``, ``TrainerControl`` and the handler are built at ``on_init_end``
    in each worker.
    """

    always_restore_state = True  # TrainerState always; inner callbacks gated by restore_callback_states

    def __init__(
        self,
        callbacks: Sequence[TrainerCallback | type[TrainerCallback]] = (),
        report_to: Sequence[str] = (),
        progress: bool = True,
    ):
        for cb in callbacks:
            if not is_hf_callback(cb):
                raise TypeError(f"{cb!r} is not a transformers.TrainerCallback instance or subclass")
        self.callbacks = list(callbacks)
        self.report_to = list(report_to)
        self.progress = progress
        self.args: TrainingArguments | None = None
        self.mirror: TrainerStateMirror | None = None
        self.control: TrainerControl | None = None
        self.handler: AttributingCallbackHandler | None = None
        self._resume_state: dict[str, Any] | None = None
        self._folded_agreed: object | None = None
        self._errors = CallbackErrorLedger()
        self._switched_off: set[int] = set()
        self._context: TrainingContext | None = None
        self._evaluated = False
        self._accelerate: SharedAccelerateState | None = None
        """accelerate's shared state as filled for the run (released by ``close``)."""
        self.init_end_fired = False
        """``on_init_end`` was fired on these callbacks already (by ``transformers.Trainer``'s constructor, for
        ``trainbridge.Trainer``): the loop's init end does not fire it again."""

    @property
    def state(self) -> TrainerState | None:
        """The ``TrainerState`` the callbacks see (None before ``on_init_end``)."""
        return self.mirror.state if self.mirror is not None else None

    # ------------------------------------------------------------------ dispatch: the event map routes
    def handles(self, event: Event) -> bool:
        """Every event with a ``TrainerCallback`` twin (``trainbridge.core.events.HF_EVENTS``)."""
        return event in HF_EVENTS

    def run_event(self, event: Event, context: TrainingContext, **kwargs: Any) -> None:
        """Call the HF hook of the same name; the hooks that do more than that have a method of their own
        (``_init_end``, ``_train_begin``, ``_log``, ``_evaluate``, ``_save``, ``_train_end``)."""
        special = self._SPECIAL.get(event)
        if special is not None:
            special(self, context, **kwargs)
        else:
            if event is Event.PREDICTION_STEP:  # the loop's own evaluation (not the instance's: loop.evaluation_point)
                self._evaluated = True  # Trainer hands the handler its eval dataloader before predicting
            self._call(context, event.value)

    # ------------------------------------------------------------------ configuration
    def validate(self, args: TrainingArgs) -> None:
        """Fail before launch on what would fail in the workers: unknown or missing integrations, and
        ``EarlyStoppingCallback`` without ``metric_for_best_model`` or evaluation."""
        integrations = self._integrations()
        try:
            get_reporting_integration_callbacks(integrations)
        except ValueError as exc:
            raise ValueError(f"report_to: {exc}") from None
        available = set(get_available_reporting_integrations())
        missing = [name for name in integrations if name not in available]
        if missing:
            raise ValueError(f"report_to: {', '.join(missing)} requested but not installed")
        saving = sorted({callback_class(cb).__name__ for cb in self.callbacks if implements(cb, "on_save")})
        if args.checkpoint_async and saving:
            warnings.warn(
                f"checkpoint_async=True: on_save of {', '.join(saving)} fires when the checkpoint is published, "
                "at the first step end after its background write finished, so later than under Trainer: "
                "state.global_step is then past the checkpoint's step; read the folder from the "
                "checkpoint's own step (checkpoint_path / the newest checkpoint-N), not from "
                "state.global_step, or set checkpoint_async=False",
                HFPortingWarning,
                stacklevel=2,
            )
        if any(callback_class(cb) is EarlyStoppingCallback for cb in self.callbacks):
            if args.metric_for_best_model is None and not args.load_best_model_at_end:
                raise ValueError("callbacks: EarlyStoppingCallback requires metric_for_best_model to be set")
            if args.eval_strategy == "no":
                raise ValueError("callbacks: EarlyStoppingCallback requires eval_strategy 'steps' or 'epoch'")

    def close(self, context: TrainingContext) -> None:
        """Empty accelerate's shared state again if this run filled it (``hf.accelerate_state``)."""
        shared, self._accelerate = self._accelerate, None
        if shared is not None:
            shared.release()

    def error_reports(self, rank: int) -> list[CallbackErrorReport]:
        """The errors of each HF callback, isolated and counted on its own (named by its class)."""
        return self._errors.reports(rank)

    # ------------------------------------------------------------------ the hooks that differ
    def _init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """Build TrainingArguments, the callback handler, TrainerState and TrainerControl (as Trainer's
        ``__init__`` does), then call ``on_init_end``."""
        self._context = context
        self._errors = CallbackErrorLedger(
            context.args.callback_error_policy, context.args.callback_max_consecutive_errors
        )
        self.args = build_training_arguments(context.args, context.env, context.hf_args)
        # as Trainer's Accelerator leaves it: PartialState() / AcceleratorState() describe this run
        self._accelerate = share_accelerate_state(context.env, context.args)
        model = context.unwrapped_model if context.unwrapped_model is not None else context.model
        self.args.report_to = self._integrations()
        defaults: list[Any] = [DefaultFlowCallback, *get_reporting_integration_callbacks(self.args.report_to)]
        self.handler = AttributingCallbackHandler(defaults + self.callbacks, model, context.tokenizer, None, None)
        printing = (PrinterCallback, ProgressCallback)
        if self.progress and not any(callback_class(cb) in printing for cb in self.callbacks):
            # last, as Trainer adds it; one the script's Trainer holds stays where it is (a callback added after
            # it then sees the logs its ``on_log`` changed: PrinterCallback pops ``total_flos``)
            self.handler.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        self.handler.on_error = self._on_callback_error
        self.handler.on_success = self._errors.succeeded
        self._switched_off = set()
        self.handler.switched_off = self._switched_off
        _point_tensorboard_at(self.handler.callbacks, context.args)
        self.control = TrainerControl()
        self.mirror = TrainerStateMirror(context, self._stateful())
        # Trainer calls on_init_end with a fresh TrainerState (max_steps etc. still 0): no sync here.
        if not self.init_end_fired:
            self._call(context, "on_init_end", sync_state=False)

    def _train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        """Start the TrainerState as ``Trainer._init_training_state`` does (restored on resume, with the
        callbacks' states under ``restore_callback_states``)."""
        args, handler, mirror = self._require()
        saved, self._resume_state = self._resume_state, None
        mirror.begin(context, args, self._stateful(), saved)
        if saved is not None and context.args.restore_callback_states:
            self.control = restore_callbacks(handler.callbacks, self._control(), mirror.state.stateful_callbacks)
        self._call(context, "on_train_begin")

    def _log(self, context: TrainingContext, **kwargs: Any) -> None:
        """Complete the logs and append them to ``log_history`` as ``Trainer.log`` does, then ``on_log``."""
        logs = dict(kwargs["logs"])
        self._sync(context)
        self._require()[2].record_log(context, logs)
        self._call(context, "on_log", sync_state=False, logs=logs)

    def _evaluate(self, context: TrainingContext, **kwargs: Any) -> None:
        metrics = kwargs["metrics"]
        self._require()[2].stamp_metrics(context, metrics)
        self._call(context, "on_evaluate", metrics=metrics)

    def _save(self, context: TrainingContext, **kwargs: Any) -> None:
        self._sync(context)
        self._require()[2].update_best_model_checkpoint(context)
        self._call(context, "on_save", sync_state=False)

    def _train_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """``on_train_end``; the loop has already loaded the best model (``load_best_model_at_end``), as
        ``Trainer._finalize_training`` does before this hook."""
        self._call(context, "on_train_end")

    _SPECIAL: ClassVar[dict[Event, Callable[..., None]]] = {
        Event.INIT_END: _init_end,
        Event.TRAIN_BEGIN: _train_begin,
        Event.LOG: _log,
        Event.EVALUATE: _evaluate,
        Event.SAVE: _save,
        Event.TRAIN_END: _train_end,
    }

    # ------------------------------------------------------------------ checkpoint and resume
    def checkpoint_files(self, context: TrainingContext) -> Mapping[str, str | bytes]:
        """``trainer_state.json`` as ``Trainer._save_checkpoint`` writes it (best checkpoint and the states of
        ``ExportableState`` callbacks and of ``TrainerControl`` brought up to date) and, when the run's
        settings came from a ``TrainingArguments`` (``RunPlan.hf_args``: the facade, a ported script),
        ``training_args.bin`` as ``Trainer._save`` writes it (``torch.save`` of the arguments the callbacks
        see)."""
        if self.mirror is None:
            return {}
        mirror = self.mirror
        self._sync(context)
        self._fold_agreed(context)  # the agreed SAVE is part of the control state Trainer saves
        mirror.update_best_model_checkpoint(context)
        mirror.update_stateful_callbacks(self._stateful())
        files: dict[str, str | bytes] = {TRAINER_STATE_FILE: mirror.to_json()}
        if context.hf_args is not None and context.is_world_process_zero:  # rank 0 writes the checkpoint
            buffer = io.BytesIO()
            torch.save(self._require()[0], buffer)
            files[TRAINING_ARGS_FILE] = buffer.getvalue()
        return files

    def state_dict(self) -> Mapping[str, Any] | None:
        """The TrainerState as a dict (with up-to-date callback states); None before ``on_init_end``."""
        if self.mirror is None:
            return self._resume_state
        self.mirror.update_stateful_callbacks(self._stateful())
        return self.mirror.as_dict()

    def trainer_state(self) -> dict[str, Any] | None:
        """The TrainerState as a JSON-ready dict, as ``trainer.state`` holds it after ``train()``: its
        ``stateful_callbacks`` as the last checkpoint saved them; None before ``on_init_end``."""
        return self.mirror.as_dict() if self.mirror is not None else None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep a saved TrainerState; it replaces the fresh one at ``on_train_begin`` (and, when
        ``restore_callback_states``, restores ``ExportableState`` callbacks and ``TrainerControl``)."""
        self._resume_state = dict(state)

    # ------------------------------------------------------------------ control and internals
    def _call(self, context: TrainingContext, hook: str, sync_state: bool = True, **kwargs: Any) -> None:
        """Refresh state, fold the agreed decision into control, call ``hook`` on the handler, and turn
        flags the callbacks switched on into native requests."""
        args, handler, mirror = self._require()
        if sync_state:
            self._sync(context)
        self._fold_agreed(context)
        self.control = getattr(handler, hook)(args, mirror.state, self.control, **kwargs)
        self._forward_requests(context, hook)

    def _sync(self, context: TrainingContext) -> None:
        """Mirror the context into TrainerState and the handler's live references."""
        _, handler, mirror = self._require()
        mirror.sync(context)
        handler.model = context.unwrapped_model if context.unwrapped_model is not None else context.model
        handler.processing_class = context.tokenizer
        handler.optimizer = context.optimizer
        handler.lr_scheduler = context.lr_scheduler
        handler.train_dataloader = context.train_dataloader
        # Trainer hands its eval dataloader to the callbacks when it first evaluates; the instance's own evaluate
        # (a trl trainer's, an override's) sets the handler's in Trainer's evaluation_loop: kept
        if self._evaluated:
            handler.eval_dataloader = context.eval_dataloader

    def _fold_agreed(self, context: TrainingContext) -> None:
        """OR the latest agreed decision into control, once per decision."""
        agreed = context.agreed
        if agreed is self._folded_agreed or self.control is None:
            return
        self._folded_agreed = agreed
        for flag in agreed.flags:
            name = AGREED_CONTROL_FLAGS.get(flag)
            if name is not None:
                setattr(self.control, name, True)

    def _forward_requests(self, context: TrainingContext, hook: str) -> None:
        """Each flag a callback (not the stock ``DefaultFlowCallback``) switched on, as a native request."""
        for name, callback in self._require()[1].flag_setters.items():
            if type(callback) is DefaultFlowCallback or not getattr(self.control, name):
                continue
            context.request(CONTROL_FLAG_REQUESTS[name], f"{type(callback).__name__} set control.{name} in {hook}")

    def _on_callback_error(self, position: int, callback: TrainerCallback, hook: str, exc: Exception) -> None:
        """The run's failure policy applied to one HF callback: logged once, counted, switched off on its own
        after ``callback_max_consecutive_errors`` in a row; under ``fatal`` every rank stops (ABORT)."""
        context = self._context
        name = type(callback).__name__
        rank = context.rank if context is not None else 0
        action = self._errors.failed(position, name, hook, exc, rank)
        if action == "abort" and context is not None:
            context.request(ControlFlag.ABORT, f"transformers callback {name} raised in {hook}: {exc}")
        elif action == "disable":
            self._switched_off.add(position)

    def _integrations(self) -> list[str]:
        """``report_to`` normalised as ``TrainingArguments`` does: ``"all"`` expanded, ``"none"`` dropped."""
        if "all" in self.report_to:
            return list(get_available_reporting_integrations())
        return [name for name in self.report_to if name != "none"]

    def _require(self) -> tuple[TrainingArguments, AttributingCallbackHandler, TrainerStateMirror]:
        if self.args is None or self.handler is None or self.mirror is None:
            raise RuntimeError("HuggingFaceCallbacks: on_init_end has not run on this rank")
        return self.args, self.handler, self.mirror

    def _control(self) -> TrainerControl:
        if self.control is None:
            raise RuntimeError("HuggingFaceCallbacks: on_init_end has not run on this rank")
        return self.control

    def _stateful(self) -> list[Any]:
        return exportable(self.handler.callbacks if self.handler is not None else [], self.control)


def with_trainer_state(callbacks: list[Any]) -> tuple[list[Any], HuggingFaceCallbacks]:
    """``callbacks`` and the ``HuggingFaceCallbacks`` among them, whose ``TrainerState`` is the job's state
    (restored on resume as Trainer restores it); a run without HF callbacks gets one driving none (no printer)."""
    hf = next((cb for cb in callbacks if isinstance(cb, HuggingFaceCallbacks)), None)
    if hf is None:
        hf = HuggingFaceCallbacks(progress=False)
        callbacks = [*callbacks, hf]
    return callbacks, hf


def _point_tensorboard_at(callbacks: list[Any], train_args: TrainingArgs) -> None:
    """transformers 5 reads TensorBoard's directory from ``TENSORBOARD_LOGGING_DIR`` (default
    ``output_dir/runs/<time>_<host>``); an explicit ``TrainingArgs.logging_dir`` wins over the default."""
    if train_args.logging_dir is None:
        return
    for cb in callbacks:
        # transformers >= 5 keeps the directory on the callback (None: not set by the environment)
        if isinstance(cb, TensorBoardCallback) and "logging_dir" in vars(cb) and cb.logging_dir is None:
            cb.logging_dir = str(train_args.logging_dir)
