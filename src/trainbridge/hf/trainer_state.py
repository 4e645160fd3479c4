"""``TrainerStateMirror``: the ``transformers.TrainerState`` of a run, kept as ``Trainer`` keeps its own.

Refreshed from the ``TrainingContext`` before every hook: ``global_step``, ``epoch``, ``max_steps``,
``num_input_tokens_seen`` under ``include_num_input_tokens_seen`` as Trainer counts it, ``total_flos`` from
``TrainingContext.total_flos``, ``best_metric``/``best_global_step`` from the native best-checkpoint tracker
(which runs after user callbacks as Trainer's ``_determine_best_metric`` runs after ``on_evaluate``).  Logs
are appended to ``log_history`` as ``Trainer.log`` appends them.  Saved into every checkpoint as
``trainer_state.json`` and in the checkpoint's callback states; on resume the whole state comes back, as
``Trainer._init_training_state`` restores it (``log_history``, best metric and checkpoint, ``total_flos``,
``num_input_tokens_seen``) and, under ``restore_callback_states``, the ``ExportableState`` callbacks and
``TrainerControl`` (``restore_callbacks``).

Differences from Trainer: callback states are restored in place (Trainer removes the restored callbacks
and appends them at the end of the list); several callbacks of one class store their current states
(Trainer appends to the stored list on every save and so restores the oldest ones).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import speed_metrics

from trainbridge.core.context import TrainingContext
from trainbridge.core.run_dir import checkpoint_dir

logger = logging.getLogger(__name__)


class TrainerStateMirror:
    """One run's ``TrainerState`` (``state``), fresh as Trainer's ``__init__`` builds it until ``begin``."""

    def __init__(self, context: TrainingContext, stateful: list[Any]) -> None:
        self.state = TrainerState(
            is_local_process_zero=context.is_local_process_zero,
            is_world_process_zero=context.is_world_process_zero,
            stateful_callbacks=stateful,
        )
        self._tokens_at_train_begin = 0

    def begin(
        self, context: TrainingContext, args: TrainingArguments, stateful: list[Any], saved: Mapping[str, Any] | None
    ) -> None:
        """Start the state as ``Trainer._init_training_state``: ``saved`` (a resumed state) or fresh."""
        if saved is not None:
            self.state = restored_state(saved)
        else:
            self.state = TrainerState(stateful_callbacks=stateful)
            # the searched size under auto_find_batch_size (the run's), as Trainer's _train_batch_size
            self.state.train_batch_size = context.args.per_device_batch_size or args.train_batch_size
            self.state.compute_steps(args, context.max_steps)
        self.state.trial_name = None
        self.state.trial_params = None
        self.state.is_local_process_zero = context.is_local_process_zero
        self.state.is_world_process_zero = context.is_world_process_zero
        self._tokens_at_train_begin = self.state.num_input_tokens_seen

    def sync(self, context: TrainingContext) -> None:
        """Mirror the context's counters and best metric into the state."""
        state = self.state
        state.global_step = context.global_step
        if context.global_step > 0 or context.resumed_from is not None:
            state.epoch = context.epoch  # Trainer's state.epoch stays the int 0 until the first step
        state.max_steps = context.max_steps
        state.num_train_epochs = context.num_epochs
        state.num_input_tokens_seen = self.tokens_seen(context)
        state.total_flos = context.total_flos
        if context.best_metric is not None:
            state.best_metric = context.best_metric
        if context.best_global_step is not None:
            state.best_global_step = context.best_global_step

    def tokens_seen(self, context: TrainingContext) -> int:
        """``num_input_tokens_seen`` under ``include_num_input_tokens_seen``, as Trainer counts it: left as it
        is (``no``: 0 or restored), every input position of every rank, padding included (``all``), or real
        tokens (``non_padding``)."""
        counting = context.args.include_num_input_tokens_seen
        if counting == "no":
            return self.state.num_input_tokens_seen
        return context.input_tokens_seen if counting == "all" else context.tokens_seen

    def record_log(self, context: TrainingContext, logs: dict[str, Any]) -> None:
        """Complete ``logs`` and append them to ``log_history`` as ``Trainer.log`` does (``epoch``; with counted
        tokens ``num_input_tokens_seen`` and, for a training log, ``train_tokens_per_second``)."""
        state = self.state
        logs["epoch"] = state.epoch
        if context.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = state.num_input_tokens_seen
            if "loss" in logs and context.train_start_time is not None:  # a training log: Trainer's start_time
                logs.update(
                    speed_metrics(
                        "train",
                        context.train_start_time,
                        num_tokens=state.num_input_tokens_seen - self._tokens_at_train_begin,
                    )
                )
        state.log_history.append({**logs, "step": state.global_step})

    def stamp_metrics(self, context: TrainingContext, metrics: dict[str, Any]) -> None:
        """What ``Trainer.log(metrics)`` sets on the very dict ``on_evaluate`` then receives."""
        metrics["epoch"] = self.state.epoch
        if context.args.include_num_input_tokens_seen != "no":
            metrics["num_input_tokens_seen"] = self.state.num_input_tokens_seen

    def update_best_model_checkpoint(self, context: TrainingContext) -> None:
        """As ``Trainer._save_checkpoint``: the best checkpoint is ``checkpoint-{best_global_step}`` once it
        exists (the one being written counts)."""
        state, train_args = self.state, context.args
        if train_args.save_strategy == "no" or not state.best_global_step:
            return
        best_dir = checkpoint_dir(train_args.ckpt_output_dir, state.best_global_step)
        if state.best_global_step == context.global_step or best_dir.is_dir():
            state.best_model_checkpoint = str(best_dir)

    def update_stateful_callbacks(self, stateful: list[Any]) -> None:
        """Current states of ``stateful`` (the ``ExportableState`` callbacks and control), in TrainerState's
        format, as ``Trainer._save_checkpoint`` records them."""
        self.state.stateful_callbacks = TrainerState(stateful_callbacks=stateful).stateful_callbacks

    def as_dict(self) -> dict[str, Any]:
        """The state as a JSON-ready dict (a copy)."""
        return json.loads(json.dumps(dataclasses.asdict(self.state)))

    def to_json(self) -> str:
        """``trainer_state.json`` as ``TrainerState.save_to_json`` writes it."""
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"


def exportable(callbacks: list[Any], control: TrainerControl | None) -> list[Any]:
    """The callbacks whose state a checkpoint records: ``ExportableState`` ones, then ``control``."""
    return [cb for cb in [*callbacks, control] if isinstance(cb, ExportableState)]


def restored_state(saved: Mapping[str, Any]) -> TrainerState:
    """A ``TrainerState`` from a saved one (unknown keys dropped; a best checkpoint gone since, forgotten)."""
    known = {f.name for f in dataclasses.fields(TrainerState)}
    state = TrainerState(**{k: v for k, v in saved.items() if k in known})
    if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
        logger.warning(
            "the best checkpoint %s recorded in the resumed state does not exist anymore; ignoring it for this run",
            state.best_model_checkpoint,
        )
        state.best_model_checkpoint = None
    return state


def restore_callbacks(callbacks: list[Any], control: TrainerControl, stored: Any) -> TrainerControl:
    """``Trainer._load_callback_state``: rebuild each stored callback from its ``args`` and set its
    ``attributes`` (matched by class name, in order for several of one class), in place in ``callbacks``;
    returns the control (restored when stored)."""
    stored = stored if isinstance(stored, dict) else {}
    current: list[Any] = [*callbacks, control]
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
                control = restored
            else:
                position = next(i for i, cb in enumerate(callbacks) if cb is callback)
                callbacks[position] = restored
    if not_found:
        logger.warning(
            "checkpoint includes callback states for callbacks not configured now; ignoring them (%s)",
            ", ".join(not_found),
        )
    return control


def train_metrics(log_history: list[dict[str, Any]], disable_tqdm: bool) -> dict[str, Any]:
    """The metrics ``Trainer.train()`` returns: its final log entry without ``step``. ``total_flos`` stays in
    (``train_results.json`` of example scripts has it) unless ``disable_tqdm``: then Trainer's ``PrinterCallback``
    pops it in ``on_log`` from the very dict ``train()`` returns (``ProgressCallback`` pops from a copy)."""
    metrics = dict(next((e for e in reversed(log_history) if "train_runtime" in e), {}))
    metrics.pop("step", None)
    if disable_tqdm:
        metrics.pop("total_flos", None)
    return metrics
