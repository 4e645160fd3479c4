"""``HuggingFaceCallbackAdapter``: one native callback that runs ``transformers.TrainerCallback``s unchanged.

The adapter owns what ``transformers.Trainer`` would own for its callbacks: a real
``TrainingArguments`` (``trainbridge.hf.arguments``), a ``TrainerState``, a ``TrainerControl`` and
transformers' own ``CallbackHandler`` (so the flag resets before each hook, the keyword arguments, and
``add_callback``'s duplicate-class warning are Trainer's).  The callback list is built as Trainer builds
it: ``DefaultFlowCallback``, then ``report_to``'s integration callbacks, then the user's, then
``ProgressCallback`` (``PrinterCallback`` when ``disable_tqdm``).

Event mapping: the adapter ``handles`` every event with a Hugging Face twin
(``trainbridge.core.events.HF_EVENTS``) and ``run_event`` calls the handler's hook of the same name; only
init end, train begin, log, evaluate, save and train end have code of their own.  ``TrainerState`` is
refreshed from the ``TrainingContext`` before every hook (``global_step``, ``epoch``, ``max_steps``,
``num_input_tokens_seen`` under ``include_num_input_tokens_seen`` as Trainer counts it, ``total_flos``
from ``TrainingContext.total_flos``, ``best_metric``/``best_global_step``
from the native best-checkpoint tracker, which runs after user callbacks as Trainer's
``_determine_best_metric`` runs after ``on_evaluate``).  ``on_log`` appends ``{**logs, "step":
global_step}`` to ``state.log_history`` as ``Trainer.log`` does (with ``num_input_tokens_seen`` and, for
training logs, ``train_tokens_per_second`` when tokens are counted).  With ``load_best_model_at_end`` the
loop has loaded the best weights before ``on_train_end``, as ``Trainer._finalize_training``.

Keyword arguments are Trainer's: at ``on_init_end`` the optimizer, scheduler and dataloaders are ``None``
(Trainer creates them in ``train()``), and ``eval_dataloader`` is ``None`` until the first evaluation.

``args`` is a real ``TrainingArguments``; when the settings were ported from one (``TrainingArgs.hf_args``:
trl's ``SFTConfig``, ``DPOConfig``...), an instance of that class with all its fields, only the fields
this run owns replaced (``trainbridge.hf.arguments``).

Isolation per callback: each HF callback (the ``report_to`` integrations included) is isolated on its own
under the run's policy (``callback_error_policy``, ``callback_max_consecutive_errors``): an error is
logged once, counted, and after that many errors in a row in hooks it implements that callback alone is
switched off, while the others keep receiving every hook; ``RunResult.callback_errors`` names its class.
Under ``fatal`` its error stops every rank and fails the run.  An error in ``on_init_end`` or
``on_train_begin`` fails the run before the first step, as any callback's does.

Control, both ways:

- *In*: before a hook, the last agreed decision (``context.agreed``) is OR-ed into ``control`` once per
  decision, so every rank's HF callbacks see the flags every rank acts on (rank 1 asked to stop ->
  rank 0's ``control.should_training_stop`` is True at ``on_epoch_end``/``on_train_end``).
- *Out*: a flag a callback turns on (``should_training_stop``, ``should_epoch_stop``, ``should_save``,
  ``should_evaluate``, ``should_log``) becomes the native request, with a reason naming that callback.
  Flags set by the stock ``DefaultFlowCallback`` are *not* forwarded: the native ``ScheduleCallback``
  applies the same rules to ``TrainingArgs`` and is the one schedule; ``DefaultFlowCallback`` stays so
  that HF callbacks see the flags it sets, as under Trainer.  A subclass of it is forwarded.

Differences from Trainer (documented, deliberate):

- A flag turned *off* by a callback does not cancel a native request (requests are "any rank, any
  callback asks"); a stop requested in ``on_step_begin``/``on_substep_end`` takes effect at the end of
  the optimizer step (the next decision point) rather than after the current micro-batch.
- ``on_log`` receives a copy of the native ``logs`` (shared by every HF callback, as under Trainer),
  so ``PrinterCallback`` popping ``total_flos`` does not change what native callbacks see;
  ``on_evaluate`` receives the native ``metrics`` dict itself, so an HF callback that rewrites a
  metric changes best-model tracking, as it does under Trainer.
- ``include_num_input_tokens_seen``: Trainer gathers the count per micro-batch.  ``non_padding`` comes
  from the plan and includes the whole step from ``on_pre_optimizer_step`` on (at ``on_substep_end`` it
  does not include the step's earlier micro-batches yet); ``all`` (padding included) is summed over ranks
  in the step's one collective, after ``on_step_end``, so hooks up to ``on_step_end`` see the previous
  step's count and every later hook the current one.
- Resume: callback states are restored in place (Trainer removes the restored callbacks and appends
  them at the end of the list); several callbacks of one class store their current states (Trainer
  appends to the stored list on every save and so restores the oldest ones).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
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
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import speed_metrics

from trainbridge.checkpoint.layout import TRAINER_STATE_FILE, TRAINING_ARGS_FILE
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.control import ControlFlag
from trainbridge.core.errors import CallbackErrorLedger, CallbackErrorReport
from trainbridge.core.events import HF_EVENTS, Event
from trainbridge.core.run_dir import checkpoint_dir
from trainbridge.hf.accelerate_state import SharedAccelerateState, share_accelerate_state
from trainbridge.hf.arguments import build_training_arguments
from trainbridge.hf.porting import HFPortingWarning

logger = logging.getLogger(__name__)


# TrainerControl flag -> the native request it becomes.
CONTROL_FLAG_REQUESTS: dict[str, ControlFlag] = {
    "should_training_stop": ControlFlag.STOP_TRAINING,
    "should_epoch_stop": ControlFlag.STOP_EPOCH,
    "should_save": ControlFlag.SAVE,
    "should_evaluate": ControlFlag.EVALUATE,
    "should_log": ControlFlag.LOG,
}

# Agreed native flag -> the TrainerControl flag every rank's HF callbacks then see.
AGREED_CONTROL_FLAGS: dict[ControlFlag, str] = {
    ControlFlag.STOP_TRAINING: "should_training_stop",
    ControlFlag.ABORT: "should_training_stop",
    ControlFlag.STOP_EPOCH: "should_epoch_stop",
    ControlFlag.SAVE: "should_save",
    ControlFlag.EVALUATE: "should_evaluate",
    ControlFlag.LOG: "should_log",
}


def trainer_tokens_seen(context: TrainingContext, untouched: int = 0) -> int:
    """``TrainerState.num_input_tokens_seen`` as Trainer counts it under ``include_num_input_tokens_seen``:
    ``untouched`` (``no``: Trainer leaves it, 0 or restored), every input position of every rank, padding
    included (``all``), or real tokens (``non_padding``)."""
    counting = context.args.include_num_input_tokens_seen
    if counting == "no":
        return untouched
    return context.input_tokens_seen if counting == "all" else context.tokens_seen

class HuggingFaceCallbackError(RuntimeError):
    """A ``transformers.TrainerCallback`` raised; the message names the callback and the hook."""


SETUP_HOOKS = frozenset({"on_init_end", "on_train_begin"})
"""Hooks where an HF callback's error fails the run before the first step (as any callback's does)."""


class AttributingCallbackHandler(CallbackHandler):
    """transformers' ``CallbackHandler`` that isolates each callback and records who turned a flag on.

    Only ``call_event`` is replaced (the per-hook flag resets of ``CallbackHandler.on_*`` are inherited);
    it calls each callback with the same arguments as transformers' ``call_event`` and notes, per flag,
    the first callback that switched it from False to True (``flag_setters``, reset at every event).

    Isolation: an exception of one callback is handed to ``on_error(position, callback, event, exc)`` (the
    adapter applies the run's failure policy) and the next callbacks still run; a callback at a position
    in ``switched_off`` is skipped; ``on_success(position)`` follows a hook a callback implements and ran
    without error (ending its run of consecutive errors).  Without ``on_error`` the exception propagates
    as a ``HuggingFaceCallbackError``, as does one raised in ``on_init_end``/``on_train_begin``.
    """

    flag_setters: dict[str, TrainerCallback]
    on_error: Callable[[int, TrainerCallback, str, Exception], None] | None = None
    on_success: Callable[[int], None] | None = None
    switched_off: AbstractSet[int] = frozenset()

    def call_event(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.flag_setters = {}
        switched_off = self.switched_off
        for position, callback in enumerate(self.callbacks):
            if position in switched_off:
                continue
            before = _control_flags(control)
            try:
                result = getattr(callback, event)(
                    args,
                    state,
                    control,
                    model=self.model,
                    processing_class=self.processing_class,
                    optimizer=self.optimizer,
                    lr_scheduler=self.lr_scheduler,
                    train_dataloader=self.train_dataloader,
                    eval_dataloader=self.eval_dataloader,
                    **kwargs,
                )
            except Exception as exc:
                if self.on_error is None or event in SETUP_HOOKS:
                    raise HuggingFaceCallbackError(
                        f"transformers callback {type(callback).__name__}.{event} raised "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                self.on_error(position, callback, event, exc)
                continue
            if self.on_success is not None and _implements(callback, event):
                self.on_success(position)
            # A callback can skip returning `control` if it doesn't change it.
            if result is not None:
                control = result
            for name, value in _control_flags(control).items():
                if value and not before[name]:
                    self.flag_setters.setdefault(name, callback)
        return control


class HuggingFaceCallbackAdapter(Callback):
    """Drives ``transformers.TrainerCallback``s (instances or classes) as ``transformers.Trainer`` would.

    Args:
        callbacks: the user's HF callbacks, instances or ``TrainerCallback`` subclasses (instantiated
            without arguments, as ``Trainer(callbacks=[...])`` does).
        report_to: reporting integrations (``"tensorboard"``, ``"mlflow"``, ``"wandb"``...), added as
            Trainer adds them.
        progress: add transformers' ``ProgressCallback`` (``PrinterCallback`` when ``disable_tqdm``).

    The constructor only stores its arguments (the adapter travels to the workers with cloudpickle);
    ``TrainingArguments``, ``TrainerState``, ``TrainerControl`` and the handler are built at
    ``on_init_end`` in each worker.
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
        self.state: TrainerState | None = None
        self.control: TrainerControl | None = None
        self.handler: AttributingCallbackHandler | None = None
        self._train_args: TrainingArgs | None = None
        self._resume_state: dict[str, Any] | None = None
        self._folded_agreed: object | None = None
        self._errors = CallbackErrorLedger()
        self._context: TrainingContext | None = None
        self._evaluated = False
        self._tokens_at_train_begin = 0
        self._accelerate: SharedAccelerateState | None = None
        """accelerate's shared state as this adapter filled it for the run (released by ``close``)."""

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
            if event is Event.PREDICTION_STEP:
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
        saving = sorted({_callback_class(cb).__name__ for cb in self.callbacks if _implements(cb, "on_save")})
        if args.checkpoint_async and saving:
            warnings.warn(
                f"checkpoint_async=True: on_save of {', '.join(saving)} fires when the checkpoint is published, "
                "at the first step end after its background write finished, so later than under Trainer: "
                "state.global_step is then past the checkpoint's step; read the folder from the "
                "checkpoint's own step (checkpoint_path / the newest checkpoint-N), not from "
                "state.global_step, or set checkpoint_async=False", HFPortingWarning, stacklevel=2)
        if any(_callback_class(cb) is EarlyStoppingCallback for cb in self.callbacks):
            if args.metric_for_best_model is None and not args.load_best_model_at_end:
                raise ValueError("callbacks: EarlyStoppingCallback requires metric_for_best_model to be set")
            if args.eval_strategy == "no":
                raise ValueError("callbacks: EarlyStoppingCallback requires eval_strategy 'steps' or 'epoch'")

    def close(self, context: TrainingContext) -> None:
        """Empty accelerate's shared state again if this adapter filled it (``hf.accelerate_state``)."""
        shared, self._accelerate = self._accelerate, None
        if shared is not None:
            shared.release()

    def error_reports(self, rank: int) -> list[CallbackErrorReport]:
        """The errors of each HF callback, isolated and counted on its own (named by its class)."""
        return self._errors.reports(rank)

    # ------------------------------------------------------------------ the hooks that differ
    def _init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """Build TrainingArguments, the callback handler, TrainerState and TrainerControl (as Trainer's
        ``__init__`` does), then call ``on_init_end``.  As under Trainer, the optimizer, scheduler and
        dataloaders are not handed to the callbacks yet (``None``): Trainer creates them in ``train()``."""
        self._train_args = context.args
        self._context = context
        self._errors = CallbackErrorLedger(context.args.callback_error_policy,
                                           context.args.callback_max_consecutive_errors)
        self.args = build_training_arguments(context.args, context.env)
        # as Trainer's Accelerator leaves it: PartialState() / AcceleratorState() describe this run
        self._accelerate = share_accelerate_state(context.env, context.args)
        model = context.unwrapped_model if context.unwrapped_model is not None else context.model
        self.args.report_to = self._integrations()
        defaults: list[Any] = [DefaultFlowCallback, *get_reporting_integration_callbacks(self.args.report_to)]
        self.handler = AttributingCallbackHandler(defaults + self.callbacks, model, context.tokenizer, None, None)
        if self.progress:
            self.handler.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        self.handler.on_error = self._on_callback_error
        self.handler.on_success = self._errors.succeeded
        self._switched_off: set[int] = set()
        self.handler.switched_off = self._switched_off
        self._point_tensorboard_at(context.args)
        self.control = TrainerControl()
        self.state = TrainerState(
            is_local_process_zero=context.is_local_process_zero,
            is_world_process_zero=context.is_world_process_zero,
            stateful_callbacks=self._exportable_callbacks(),
        )
        # Trainer calls on_init_end with a fresh TrainerState (max_steps etc. still 0): no sync here.
        self._call(context, "on_init_end", sync_state=False)

    def _train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        """Start the TrainerState as ``Trainer._init_training_state`` does (restored on resume)."""
        args = self._require()[0]
        if self._resume_state is not None:
            self.state = self._restored_state(self._resume_state)
            self._resume_state = None
        else:
            self.state = TrainerState(stateful_callbacks=self._exportable_callbacks())
            self.state.train_batch_size = args.train_batch_size
            self.state.compute_steps(args, context.max_steps)
        self.state.trial_name = None
        self.state.trial_params = None
        self.state.is_local_process_zero = context.is_local_process_zero
        self.state.is_world_process_zero = context.is_world_process_zero
        self._tokens_at_train_begin = self.state.num_input_tokens_seen
        self._call(context, "on_train_begin")

    def _log(self, context: TrainingContext, **kwargs: Any) -> None:
        """Complete the logs and append them to ``log_history`` as ``Trainer.log`` does, then ``on_log``."""
        logs = dict(kwargs["logs"])
        if any(key.startswith("eval_") for key in logs):
            self._evaluated = True
        self._sync_state(context)
        state = self._state()
        logs["epoch"] = state.epoch  # as Trainer.log does
        if context.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = state.num_input_tokens_seen
            if "loss" in logs and context.train_start_time is not None:  # a training log: Trainer's start_time
                logs.update(speed_metrics("train", context.train_start_time,
                                          num_tokens=state.num_input_tokens_seen - self._tokens_at_train_begin))
        state.log_history.append({**logs, "step": state.global_step})
        self._call(context, "on_log", logs=logs)

    def _evaluate(self, context: TrainingContext, **kwargs: Any) -> None:
        metrics = kwargs["metrics"]
        self._evaluated = True
        # Trainer.log(metrics) sets these on the very dict on_evaluate receives
        metrics["epoch"] = self._state().epoch
        if context.args.include_num_input_tokens_seen != "no":
            metrics["num_input_tokens_seen"] = self._state().num_input_tokens_seen
        self._call(context, "on_evaluate", metrics=metrics)

    def _save(self, context: TrainingContext, **kwargs: Any) -> None:
        self._sync_state(context)
        self._update_best_model_checkpoint(context)
        self._call(context, "on_save")

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
        """``trainer_state.json`` as ``Trainer._save_checkpoint`` writes it (best checkpoint and the
        states of ``ExportableState`` callbacks and of ``TrainerControl`` brought up to date) and, when the
        run's settings came from a ``TrainingArguments`` (``TrainingArgs.hf_args``: the facade, a ported
        script), ``training_args.bin`` as ``Trainer._save`` writes it into every checkpoint (``torch.save``
        of the arguments the callbacks see)."""
        if self.state is None:
            return {}
        self._sync_state(context)
        self._fold_agreed(context)  # the agreed SAVE is part of the control state Trainer saves
        self._update_best_model_checkpoint(context)
        self._update_stateful_callbacks()
        files: dict[str, str | bytes] = {
            TRAINER_STATE_FILE: json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"}
        if context.args.hf_args is not None and context.is_world_process_zero:  # rank 0 writes the checkpoint
            buffer = io.BytesIO()
            torch.save(self._require()[0], buffer)
            files[TRAINING_ARGS_FILE] = buffer.getvalue()
        return files

    def state_dict(self) -> Mapping[str, Any] | None:
        """The TrainerState as a dict (with up-to-date callback states); None before ``on_init_end``."""
        if self.state is None:
            return self._resume_state
        self._update_stateful_callbacks()
        return json.loads(json.dumps(dataclasses.asdict(self.state)))

    def trainer_state(self) -> dict[str, Any] | None:
        """The TrainerState as a JSON-ready dict, as ``trainer.state`` holds it after ``train()``: its
        ``stateful_callbacks`` as the last checkpoint saved them; None before ``on_init_end``."""
        if self.state is None:
            return None
        return json.loads(json.dumps(dataclasses.asdict(self.state)))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep a saved TrainerState; it replaces the fresh one at ``on_train_begin`` (and, when
        ``restore_callback_states``, restores ``ExportableState`` callbacks and ``TrainerControl``)."""
        self._resume_state = dict(state)

    # ------------------------------------------------------------------ internals
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

    def _require(self) -> tuple[TrainingArguments, AttributingCallbackHandler]:
        if self.args is None or self.handler is None:
            raise RuntimeError("HuggingFaceCallbackAdapter: on_init_end has not run on this rank")
        return self.args, self.handler

    def _state(self) -> TrainerState:
        if self.state is None:
            raise RuntimeError("HuggingFaceCallbackAdapter: on_init_end has not run on this rank")
        return self.state

    def _call(self, context: TrainingContext, hook: str, sync_state: bool = True, **kwargs: Any) -> None:
        """Refresh state, fold the agreed decision into control, call ``hook`` on the handler, and turn
        flags the callbacks switched on into native requests.  ``_on_callback_error`` records the
        errors of each callback; the others still run."""
        args, handler = self._require()
        if sync_state:
            self._sync_state(context)
        self._fold_agreed(context)
        self.control = getattr(handler, hook)(args, self._state(), self.control, **kwargs)
        self._forward_requests(context, hook)

    def _sync_state(self, context: TrainingContext) -> None:
        """Mirror the context into TrainerState and the handler's live references."""
        state, handler = self._state(), self._require()[1]
        state.global_step = context.global_step
        if context.global_step > 0 or context.resumed_from is not None:
            state.epoch = context.epoch  # Trainer's state.epoch stays the int 0 until the first step
        state.max_steps = context.max_steps
        state.num_train_epochs = context.num_epochs
        state.num_input_tokens_seen = self._num_input_tokens_seen(context)
        state.total_flos = context.total_flos
        if context.best_metric is not None:
            state.best_metric = context.best_metric
        if context.best_global_step is not None:
            state.best_global_step = context.best_global_step
        handler.model = context.unwrapped_model if context.unwrapped_model is not None else context.model
        handler.processing_class = context.tokenizer
        handler.optimizer = context.optimizer
        handler.lr_scheduler = context.lr_scheduler
        handler.train_dataloader = context.train_dataloader
        # Trainer hands its eval dataloader to the callbacks when it first evaluates
        handler.eval_dataloader = context.eval_dataloader if self._evaluated else None

    def _num_input_tokens_seen(self, context: TrainingContext) -> int:
        """``TrainerState.num_input_tokens_seen`` under ``include_num_input_tokens_seen``, as Trainer counts:
        0 (``no``), every input position of every rank, padding included (``all``), or real tokens
        (``non_padding``)."""
        return trainer_tokens_seen(context, untouched=self._state().num_input_tokens_seen)

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
        handler = self._require()[1]
        for name, callback in handler.flag_setters.items():
            if type(callback) is DefaultFlowCallback or not getattr(self.control, name):
                continue
            context.request(
                CONTROL_FLAG_REQUESTS[name], f"{type(callback).__name__} set control.{name} in {hook}"
            )

    def _exportable_callbacks(self) -> list[Any]:
        handler = self._require()[1]
        return [cb for cb in [*handler.callbacks, self.control] if isinstance(cb, ExportableState)]

    def _update_stateful_callbacks(self) -> None:
        """Current states of every ExportableState callback and of control, in TrainerState's format."""
        self._state().stateful_callbacks = TrainerState(
            stateful_callbacks=self._exportable_callbacks()
        ).stateful_callbacks

    def _update_best_model_checkpoint(self, context: TrainingContext) -> None:
        """As ``Trainer._save_checkpoint``: the best checkpoint is ``checkpoint-{best_global_step}``
        once it exists (the one being written counts)."""
        state, train_args = self._state(), context.args
        if train_args.save_strategy == "no" or not state.best_global_step:
            return
        best_dir = checkpoint_dir(train_args.ckpt_output_dir, state.best_global_step)
        if state.best_global_step == context.global_step or best_dir.is_dir():
            state.best_model_checkpoint = str(best_dir)

    def _restored_state(self, saved: Mapping[str, Any]) -> TrainerState:
        """A TrainerState from ``saved``; restores callback states when ``restore_callback_states``."""
        known = {f.name for f in dataclasses.fields(TrainerState)}
        state = TrainerState(**{k: v for k, v in saved.items() if k in known})
        if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
            logger.warning("the best checkpoint %s recorded in the resumed state does not exist anymore; "
                           "ignoring it for this run", state.best_model_checkpoint)
            state.best_model_checkpoint = None
        if self._train_args is not None and self._train_args.restore_callback_states:
            stored = state.stateful_callbacks
            self._load_callback_states(stored if isinstance(stored, dict) else {})
        return state

    def _load_callback_states(self, stored: Mapping[str, Any]) -> None:
        """``Trainer._load_callback_state``: rebuild each stored callback from its ``args`` and set its
        ``attributes`` (matched by class name, in order for several of one class), in place."""
        handler = self._require()[1]
        current: list[Any] = [*handler.callbacks, self.control]
        not_found = []
        for class_name, data in stored.items():
            entries = data if isinstance(data, list) else [data]
            same_class = [cb for cb in current if type(cb).__name__ == class_name]
            if not same_class:
                not_found.append(class_name)
                continue
            for callback, entry in zip(same_class, entries):
                restored = type(callback)(**entry.get("args", {}))
                for attribute, value in entry.get("attributes", {}).items():
                    setattr(restored, attribute, value)
                if isinstance(callback, TrainerControl):
                    self.control = restored
                else:
                    position = next(i for i, cb in enumerate(handler.callbacks) if cb is callback)
                    handler.callbacks[position] = restored
        if not_found:
            logger.warning("checkpoint includes callback states for callbacks not configured now; ignoring "
                           "them (%s)", ", ".join(not_found))

    def _point_tensorboard_at(self, train_args: TrainingArgs) -> None:
        """transformers 5 reads TensorBoard's directory from ``TENSORBOARD_LOGGING_DIR`` (default
        ``output_dir/runs/<time>_<host>``); an explicit ``TrainingArgs.logging_dir`` wins over the default."""
        if train_args.logging_dir is None:
            return
        for cb in self._require()[1].callbacks:
            # transformers >= 5 keeps the directory on the callback (None: not set by the environment)
            if isinstance(cb, TensorBoardCallback) and "logging_dir" in vars(cb) and cb.logging_dir is None:
                cb.logging_dir = str(train_args.logging_dir)


def is_hf_callback(obj: Any) -> bool:
    """A ``transformers.TrainerCallback`` instance or subclass."""
    return isinstance(obj, TrainerCallback) or (isinstance(obj, type) and issubclass(obj, TrainerCallback))


_IMPLEMENTS: dict[tuple[type, str], bool] = {}


def _implements(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s class (or ``callback``, a class) implements ``hook`` itself (not
    ``TrainerCallback``'s no-op)."""
    cls = _callback_class(callback)
    key = (cls, hook)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = getattr(cls, hook, None) is not getattr(TrainerCallback, hook, None)
    return known


def _callback_class(cb: Any) -> type:
    return cb if isinstance(cb, type) else type(cb)


def _control_flags(control: TrainerControl) -> dict[str, bool]:
    return {name: bool(getattr(control, name)) for name in CONTROL_FLAG_REQUESTS}
