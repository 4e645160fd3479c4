"""The HuggingFaceCallbacks driven by the real training loop, in process on one rank: hook order, control both
ways, state, checkpoints and resume.

Each test builds the run's components (``trainbridge.loop.build.build_run``: a tiny local Llama, a few
4-token samples, 2 micro-batches per optimizer step) and runs ``trainbridge.loop.loop.TrainingLoop`` on
one rank (world size 1, no process group) with the native ``ScheduleCallback`` and
``BestCheckpointTracker`` around the user's callbacks, as the worker orders them.  Tests of a single
hook fire it through the loop's own callback manager and context.  The reference for "what Trainer
does" is a real ``transformers.Trainer`` run on a tiny model with the same schedule.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.integrations.integration_utils import TensorBoardCallback

from tests.run_inputs import as_run, split_run
from trainbridge.callbacks import BestCheckpointTracker, ScheduleCallback
from trainbridge.core.agreement import AgreedControl, ControlFlag
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.dispatch import CallbackFatalError
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.events import Event
from trainbridge.hf import HuggingFaceCallbacks, split_callbacks
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop

FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
HOOKS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_prediction_step",
    "on_evaluate",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)


# ============================================================================ helpers
class Recorder(TrainerCallback):
    """Records (hook, global_step, epoch, control flags) and the arguments of every hook."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.seen: list[tuple[str, Any, Any, Any, dict[str, Any]]] = []

    def _record(self, hook: str, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        flags = tuple(name for name in FLAGS if getattr(control, name))
        self.calls.append((hook, state.global_step, round(float(state.epoch or 0), 6), flags))
        self.seen.append((hook, args, state, control, kwargs))

    def on_init_end(self, args, state, control, **kw):
        self._record("on_init_end", args, state, control, kw)

    def on_train_begin(self, args, state, control, **kw):
        self._record("on_train_begin", args, state, control, kw)

    def on_epoch_begin(self, args, state, control, **kw):
        self._record("on_epoch_begin", args, state, control, kw)

    def on_step_begin(self, args, state, control, **kw):
        self._record("on_step_begin", args, state, control, kw)

    def on_substep_end(self, args, state, control, **kw):
        self._record("on_substep_end", args, state, control, kw)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self._record("on_pre_optimizer_step", args, state, control, kw)

    def on_optimizer_step(self, args, state, control, **kw):
        self._record("on_optimizer_step", args, state, control, kw)

    def on_step_end(self, args, state, control, **kw):
        self._record("on_step_end", args, state, control, kw)

    def on_log(self, args, state, control, **kw):
        self._record("on_log", args, state, control, kw)

    def on_prediction_step(self, args, state, control, **kw):
        self._record("on_prediction_step", args, state, control, kw)

    def on_evaluate(self, args, state, control, **kw):
        self._record("on_evaluate", args, state, control, kw)

    def on_save(self, args, state, control, **kw):
        self._record("on_save", args, state, control, kw)

    def on_epoch_end(self, args, state, control, **kw):
        self._record("on_epoch_end", args, state, control, kw)

    def on_train_end(self, args, state, control, **kw):
        self._record("on_train_end", args, state, control, kw)

    def hooks(self) -> list[str]:
        return [call[0] for call in self.calls]


class ScriptedEvalLoss(TrainerCallback):
    """Overwrites ``metrics["eval_loss"]`` with the next scripted value (placed before EarlyStopping)."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)
        self.calls = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_loss"] = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1


class SetFlagAt(TrainerCallback):
    """Sets ``control.<flag>`` in ``hook`` when ``state.global_step == step``."""

    def __init__(self, hook: str, flag: str, step: int) -> None:
        self.hook, self.flag, self.step = hook, flag, step
        setattr(self, hook, self._maybe_set)

    def _maybe_set(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            setattr(control, self.flag, True)
        return control


class Crash(BaseException):
    """Raised by ``CrashAt`` to cut a run short (like a killed job).  A ``BaseException``, as the loop's
    ``TrainingInterrupted``: callback isolation does not swallow it."""


class CrashAt(Callback):
    """Crashes the run when step ``step + 1`` begins, after step ``step``'s log, evaluation and save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.global_step == self.step:
            raise Crash(f"crash after step {context.global_step}")


class AtStepEnd(Callback):
    """Records ``probe(context)`` at every ``on_step_end`` (placed after the callback it watches)."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.seen: list[Any] = []

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        self.seen.append(self.probe(context))


def write_samples(path: Path, n: int) -> Path:
    """``n`` pre-tokenised 4-token samples (one micro-batch each under ``make_args``' token budget)."""
    path.write_text("".join(json.dumps({"input_ids": [1, 5 + i % 60, 6 + i % 60, 7]}) + "\n" for i in range(n)))
    return path


@pytest.fixture
def files(tmp_path: Path, tiny_llama: Path) -> dict[str, Path]:
    return {
        "model": tiny_llama,
        "data": write_samples(tmp_path / "train.jsonl", 8),
        "val": write_samples(tmp_path / "val.jsonl", 2),
        "out": tmp_path / "out",
    }


def make_args(files: dict[str, Path], **overrides: Any) -> TrainingArgs:
    """8 training samples, 2 per optimizer step, one per micro-batch: 4 steps of 2 micro-batches an
    epoch; 2 validation samples: 2 evaluation batches."""
    values: dict[str, Any] = dict(
        model_path=files["model"],
        data_path=files["data"],
        ckpt_output_dir=files["out"],
        val_data_path=files["val"],
        max_seq_len=4,
        max_batch_len=4,
        effective_batch_size=2,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1000,
    )
    values.update(overrides)
    return split_run(**values)


def make_loop(args: TrainingArgs, callbacks: list[Callback], builtins: bool = True) -> TrainingLoop:
    """The real loop on one rank, built from ``args``; the built-ins around ``callbacks`` as the worker
    orders them (``trainbridge.launch.assembly``) unless ``builtins=False``."""
    env = DistributedEnv()
    ordered = [ScheduleCallback(), *callbacks, BestCheckpointTracker()] if builtins else list(callbacks)
    return TrainingLoop(as_run(args).args, env, ordered, build_run(*as_run(args), env))


def fire(loop: TrainingLoop, event: Event, **kwargs: Any) -> None:
    """Fire one event through the loop's own callback manager and context."""
    loop.callbacks.fire(event, loop.context, **kwargs)


def hf_callbacks_context(files: dict[str, Path], hf_callbacks: HuggingFaceCallbacks, **overrides: Any) -> TrainingLoop:
    """A built loop whose hf_callbacks has had ``on_init_end`` and ``on_train_begin``."""
    loop = make_loop(make_args(files, **overrides), [hf_callbacks])
    fire(loop, Event.INIT_END)
    fire(loop, Event.TRAIN_BEGIN)
    return loop


def hf_callbacks_state(checkpoint: Path) -> dict[str, Any]:
    """The hf_callbacks's entry among the callback states of a checkpoint's ``training_state.json``."""
    states = json.loads((checkpoint / "training_state.json").read_text())["callbacks"]
    return next(state for key, state in states.items() if "HuggingFaceCallbacks" in key)


# ============================================================================ parity with Trainer
def transformers_trainer_calls(output_dir: Path) -> list[tuple[Any, ...]]:
    """The hooks a real ``transformers.Trainer`` fires: 2 epochs x 3 steps x 2 micro-batches,
    logging every 2 steps, evaluating every 3 (2 eval batches), saving every 4."""
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    sample = {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}
    recorder = Recorder()
    args = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
        save_only_model=True,
        report_to="none",
        disable_tqdm=True,
    )
    try:
        Trainer(
            model=LlamaForCausalLM(config),
            args=args,
            train_dataset=[sample] * 6,
            eval_dataset=[sample] * 2,
            callbacks=[recorder],
        ).train()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return recorder.calls


def expected_trainer_hooks() -> list[str]:
    """The same schedule derived by hand from Trainer's rules (docs/design.md)."""

    def step(n: int) -> list[str]:
        return ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]

    evaluation = ["on_prediction_step", "on_prediction_step", "on_log", "on_evaluate"]
    return [
        "on_init_end",
        "on_train_begin",
        "on_epoch_begin",
        *step(1),
        *step(2),
        "on_log",
        *step(3),
        *evaluation,
        "on_epoch_end",
        "on_epoch_begin",
        *step(4),
        "on_log",
        "on_save",
        *step(5),
        *step(6),
        "on_log",
        *evaluation,
        "on_save",
        "on_epoch_end",
        "on_log",
        "on_train_end",
    ]


def test_hooks_steps_epochs_and_control_flags_match_a_real_trainer(files, tmp_path):
    recorder = Recorder()
    args = make_args(
        files,
        data_path=write_samples(tmp_path / "six.jsonl", 6),
        num_epochs=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
    )
    loop = make_loop(args, [HuggingFaceCallbacks([recorder])])
    assert loop.context.steps_per_epoch == 3 and loop.eval_batches is not None and len(loop.eval_batches) == 2
    loop.run()
    assert loop.context.micro_steps_in_step == 2
    assert recorder.hooks() == expected_trainer_hooks()
    assert recorder.calls == transformers_trainer_calls(tmp_path / "trainer")


def test_hooks_get_real_trainer_objects_and_trainers_keyword_arguments(files):
    recorder = Recorder()
    loop = make_loop(
        make_args(files, max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=2),
        [HuggingFaceCallbacks([recorder])],
    )
    loop.run()
    ctx = loop.context
    common = {"model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"}
    evaluated = False
    for hook, args, state, control, kwargs in recorder.seen:
        assert isinstance(args, TrainingArguments) and isinstance(state, TrainerState)
        assert isinstance(control, TrainerControl)
        assert common <= set(kwargs), hook
        assert kwargs["model"] is ctx.unwrapped_model and kwargs["processing_class"] is ctx.tokenizer
        if hook == "on_init_end":  # Trainer.__init__: optimizer, scheduler and dataloaders do not exist yet
            assert all(kwargs[name] is None for name in common - {"model", "processing_class"}), kwargs
            continue
        assert kwargs["optimizer"] is ctx.optimizer and kwargs["lr_scheduler"] is ctx.lr_scheduler
        assert kwargs["train_dataloader"] is ctx.train_dataloader
        # Trainer hands its eval dataloader over in evaluate(): None before the first evaluation
        evaluated = evaluated or hook == "on_prediction_step" or "eval_loss" in (kwargs.get("logs") or {})
        assert kwargs["eval_dataloader"] is (ctx.eval_dataloader if evaluated else None), hook
    assert evaluated
    logs = [kw["logs"] for hook, *_, kw in recorder.seen if hook == "on_log"]
    assert set(logs[0]) == {"loss", "grad_norm", "learning_rate", "epoch"}
    assert "train_loss" in logs[-1]
    metrics = [kw["metrics"] for hook, *_, kw in recorder.seen if hook == "on_evaluate"]
    assert metrics and "eval_loss" in metrics[0]
    state = recorder.seen[-1][2]
    assert state.global_step == 2 and state.max_steps == 2 and state.num_train_epochs == 1
    assert state.logging_steps == 1 and state.eval_steps == 2
    num_parameters = ctx.unwrapped_model.num_parameters(exclude_embeddings=True)  # as Trainer
    assert ctx.tokens_seen == 2 * 2 * 4  # 2 steps x 2 samples x 4 tokens
    assert state.num_input_tokens_seen == 0  # include_num_input_tokens_seen="no", Trainer's default
    assert state.total_flos == 6 * num_parameters * ctx.tokens_seen
    assert state.is_world_process_zero and state.is_local_process_zero
    assert state.trial_name is None and state.trial_params is None
    assert [entry["step"] for entry in state.log_history] == [1, 2, 2, 2]
    assert state.log_history[-1]["train_loss"] == pytest.approx((logs[0]["loss"] + logs[1]["loss"]) / 2)


def test_callback_handler_builds_trainers_callback_list(files):
    pytest.importorskip("tensorboard", reason="report_to=['tensorboard'] needs the tensorboard package")
    hf_callbacks = HuggingFaceCallbacks([EarlyStoppingCallback], report_to=["tensorboard"])
    loop = hf_callbacks_context(
        files,
        hf_callbacks,
        logging_dir=files["out"] / "tb",
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="eval_loss",
    )
    names = [type(cb) for cb in hf_callbacks.handler.callbacks]
    assert names == [DefaultFlowCallback, TensorBoardCallback, EarlyStoppingCallback, PrinterCallback]
    assert hf_callbacks.handler.callbacks[1].logging_dir == str(files["out"] / "tb")
    fire(loop, Event.TRAIN_END)
    hf_callbacks_with_bar = HuggingFaceCallbacks([], progress=True)
    hf_callbacks_context(files, hf_callbacks_with_bar, disable_tqdm=False)
    assert type(hf_callbacks_with_bar.handler.callbacks[-1]) is ProgressCallback
    no_progress = HuggingFaceCallbacks([], report_to=["none"], progress=False)
    hf_callbacks_context(files, no_progress)
    assert [type(cb) for cb in no_progress.handler.callbacks] == [DefaultFlowCallback]
    assert no_progress.args.report_to == []


def test_duplicate_callback_class_warns_like_trainer(files):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.trainer_callback")
    logger.addHandler(handler)
    try:
        hf_callbacks_context(files, HuggingFaceCallbacks([Recorder(), Recorder]))
    finally:
        logger.removeHandler(handler)
    assert any("there is already one" in r.getMessage() and "Recorder" in r.getMessage() for r in records)


# ============================================================================ control
def test_flags_set_by_callbacks_become_named_native_requests(files):
    setters = [SetFlagAt("on_step_end", flag, 1) for flag in FLAGS]
    # after the hf_callbacks: what it requested at step 1, before the step's agreement
    probe = AtStepEnd(lambda ctx: (dict(ctx.requests.pending), dict(ctx.requests.reasons)))
    loop = make_loop(make_args(files, max_steps=4), [HuggingFaceCallbacks(setters), probe])
    loop.run()
    pending, reasons = probe.seen[0]
    hf_callbacks_index = 2  # ScheduleCallback is 1
    expected = {
        ControlFlag.STOP_TRAINING,
        ControlFlag.STOP_EPOCH,
        ControlFlag.SAVE,
        ControlFlag.EVALUATE,
        ControlFlag.LOG,
    }
    assert {flag for flag, source in pending.items() if source == hf_callbacks_index} == expected
    assert reasons[ControlFlag.SAVE] == "SetFlagAt set control.should_save in on_step_end"
    # the loop acted on every agreed request at step 1: logged, evaluated, saved, stopped
    assert loop.context.global_step == 1 and len(probe.seen) == 1
    assert "eval_loss" in loop.context.metrics
    assert loop.checkpoints.list_checkpoints() == [files["out"] / "checkpoint-1"]
    assert loop.context.stop_reason == (
        "stop_training requested by rank 0 (HuggingFaceCallbacks: "
        "SetFlagAt set control.should_training_stop in on_step_end)"
    )


def test_default_flow_callback_flags_are_not_forwarded(files):
    hf_callbacks = HuggingFaceCallbacks([Recorder()])
    probe = AtStepEnd(lambda ctx: (dict(ctx.requests.pending), _flags(hf_callbacks.control)))
    args = make_args(
        files,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        max_steps=1,
        save_final_checkpoint=False,
    )
    loop = make_loop(args, [hf_callbacks, probe], builtins=False)  # the hf_callbacks alone: no native schedule
    loop.run()
    pending, flags = probe.seen[0]
    assert {"should_log", "should_save", "should_training_stop"} <= flags  # DefaultFlowCallback set them
    assert pending == {}
    assert loop.checkpoints.list_checkpoints() == [] and loop.context.metrics == {}  # nothing acted on them


def _flags(control: TrainerControl | None) -> set[str]:
    return {name for name in FLAGS if control is not None and getattr(control, name)}


def test_early_stopping_requests_stop_at_the_evaluation_patience_runs_out(files, tmp_path):
    # best 1.0, then 0.9 (better), 0.95 (worse: 1), 0.97 (worse: 2 = patience) -> stop at the 4th evaluation
    scripted = ScriptedEvalLoss([1.0, 0.9, 0.95, 0.97, 0.5, 0.4])
    stopper = EarlyStoppingCallback(early_stopping_patience=2)
    args = make_args(
        files,
        data_path=write_samples(tmp_path / "ten.jsonl", 20),
        max_steps=10,
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="eval_loss",
    )
    loop = make_loop(args, [HuggingFaceCallbacks([scripted, stopper])])
    result = loop.run()
    ctx = loop.context
    assert ctx.global_step == 4 and scripted.calls == 4 and result.stopped_early
    assert ctx.stop_reason == (
        "stop_training requested by rank 0 (HuggingFaceCallbacks: "
        "EarlyStoppingCallback set control.should_training_stop in on_evaluate)"
    )
    assert ctx.best_metric == 0.9 and ctx.best_global_step is None  # save_strategy='no': no best step


def test_agreed_decision_is_folded_into_control_once(files):
    recorder = Recorder()
    loop = hf_callbacks_context(files, HuggingFaceCallbacks([recorder]))
    loop.context.agreed = AgreedControl(frozenset({ControlFlag.STOP_TRAINING, ControlFlag.SAVE}))
    fire(loop, Event.EPOCH_END)
    assert recorder.calls[-1][3] == ("should_training_stop", "should_save")
    fire(loop, Event.SAVE, checkpoint_path=files["out"])  # handler resets should_save; not folded again
    assert recorder.calls[-1][3] == ("should_training_stop",)
    fire(loop, Event.TRAIN_END)
    assert recorder.calls[-1][3] == ("should_training_stop",)
    assert loop.context.requests.pending == {}  # folded flags are not requested back


def test_callback_errors_name_the_callback(files):
    class Broken(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            raise ValueError("boom")

    result = make_loop(make_args(files, max_steps=2), [HuggingFaceCallbacks([Broken()])]).run()
    [report] = result.callback_errors  # isolated (the default policy), counted, reported under its own name
    assert report.callback == "Broken" and report.event == "on_step_begin"
    assert report.count == 2
    assert report.first_error == "ValueError: boom"
    with pytest.raises(CallbackFatalError, match=r"Broken raised in on_step_begin: boom"):
        make_loop(
            make_args(files, max_steps=2, callback_error_policy="fatal"), [HuggingFaceCallbacks([Broken()])]
        ).run()


# ============================================================================ checkpoint and resume
def test_trainer_state_json_has_stateful_callbacks_and_best_model_checkpoint(files):
    stopper = EarlyStoppingCallback(early_stopping_patience=5)
    args = make_args(
        files,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="eval_loss",
        logging_steps=1,
    )
    # eval_loss 1.0, 0.5, 0.6, 0.7: best at step 2
    make_loop(args, [HuggingFaceCallbacks([ScriptedEvalLoss([1.0, 0.5, 0.6, 0.7]), stopper])]).run()
    saved = json.loads((files["out"] / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["global_step"] == 4 and saved["best_global_step"] == 2 and saved["best_metric"] == 0.5
    assert saved["best_model_checkpoint"] == str(files["out"] / "checkpoint-2")
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"] == {
        "args": {"early_stopping_patience": 5, "early_stopping_threshold": 0.0},
        "attributes": {"early_stopping_patience_counter": 2},
    }
    assert set(saved["stateful_callbacks"]["TrainerControl"]["args"]) == set(FLAGS)
    first_log = saved["log_history"][0]
    assert set(first_log) == {"loss", "grad_norm", "learning_rate", "epoch", "step"}
    assert first_log["learning_rate"] == args.learning_rate and first_log["epoch"] == 0.25
    assert first_log["step"] == 1 and first_log["loss"] > 0 and first_log["grad_norm"] > 0
    first = json.loads((files["out"] / "checkpoint-2" / "trainer_state.json").read_text())
    assert first["best_model_checkpoint"] == str(files["out"] / "checkpoint-2")  # the one being written
    state = TrainerState.load_from_json(str(files["out"] / "checkpoint-4" / "trainer_state.json"))
    assert state.best_global_step == 2


def _early_stopping_run(files, crash_after_step=None, resume_from=None, restore=True):
    args = make_args(
        files,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="eval_loss",
        restore_callback_states=restore,
        resume_from_checkpoint=resume_from,
    )
    # best 1.0 at step 1, then worse every time: patience 4 runs out at step 5
    scripted = ScriptedEvalLoss([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1])
    hf_callbacks = HuggingFaceCallbacks([scripted, EarlyStoppingCallback(early_stopping_patience=4)])
    crash: list[Callback] = [] if crash_after_step is None else [CrashAt(crash_after_step)]
    if resume_from is not None:
        scripted.calls = json.loads((resume_from / "training_state.json").read_text())["global_step"]
    return make_loop(args, [hf_callbacks, *crash]), hf_callbacks


def test_resume_mid_patience_continues_the_early_stopping_counter(files):
    loop, _ = _early_stopping_run(files)
    loop.run()
    assert loop.context.global_step == 5
    shutil.rmtree(files["out"])
    crashed, _ = _early_stopping_run(files, crash_after_step=3)
    with pytest.raises(Crash):
        crashed.run()
    state_at_resume = hf_callbacks_state(files["out"] / "checkpoint-3")
    resumed, hf_callbacks = _early_stopping_run(files, resume_from=files["out"] / "checkpoint-3")
    resumed.run()
    assert resumed.context.resumed_from == files["out"] / "checkpoint-3" and resumed.context.global_step == 5
    stopper = hf_callbacks.handler.callbacks[2]
    assert isinstance(stopper, EarlyStoppingCallback) and stopper.early_stopping_patience_counter == 4
    assert [e["step"] for e in hf_callbacks.state.log_history if "eval_loss" in e] == [1, 2, 3, 4, 5]
    assert state_at_resume["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 2
    }


def test_resume_without_restoring_callback_states_restarts_the_counter(files):
    crashed, _ = _early_stopping_run(files, crash_after_step=3, restore=False)
    with pytest.raises(Crash):
        crashed.run()
    resumed, hf_callbacks = _early_stopping_run(files, resume_from=files["out"] / "checkpoint-3", restore=False)
    # As under Trainer without restore_callback_states_from_checkpoint: the TrainerState (best metric
    # 1.0 at step 1) comes back, EarlyStopping's counter restarts at 0, so patience 4 runs out at step 7.
    resumed.run()
    assert resumed.context.global_step == 7
    assert hf_callbacks.handler.callbacks[2].early_stopping_patience_counter == 4


def test_state_dict_round_trip_restores_trainer_state_control_and_callbacks(files):
    stopper = EarlyStoppingCallback(early_stopping_patience=3)
    hf_callbacks = HuggingFaceCallbacks([stopper])
    loop = hf_callbacks_context(
        files, hf_callbacks, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss"
    )
    stopper.early_stopping_patience_counter = 2
    hf_callbacks.control.should_save = True
    loop.context.global_step, loop.context.epoch = 3, 0.75
    fire(loop, Event.LOG, logs={"loss": 0.25, "epoch": 0.75})
    saved = json.loads(json.dumps(hf_callbacks.state_dict()))

    fresh_stopper = EarlyStoppingCallback(early_stopping_patience=3)
    fresh = HuggingFaceCallbacks([Recorder(), fresh_stopper])
    restored_loop = make_loop(
        make_args(files, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss"), [fresh]
    )
    fire(restored_loop, Event.INIT_END)
    fresh.load_state_dict(saved)
    fire(restored_loop, Event.TRAIN_BEGIN)
    restored = fresh.handler.callbacks[2]
    assert isinstance(restored, EarlyStoppingCallback) and restored.early_stopping_patience_counter == 2
    assert type(fresh.handler.callbacks[1]) is Recorder  # order kept
    assert fresh.control.should_save  # TrainerControl restored (should_training_stop reset by on_train_begin)
    assert fresh.state.log_history == [{"loss": 0.25, "epoch": 0.75, "step": 3}]


# ============================================================================ construction and helpers
def test_hf_callbacks_is_picklable_before_init_and_validates_config(files):
    hf_callbacks = HuggingFaceCallbacks([EarlyStoppingCallback(2), Recorder], report_to=["tensorboard"])
    clone = cloudpickle.loads(cloudpickle.dumps(hf_callbacks))
    assert [type(c) if not isinstance(c, type) else c for c in clone.callbacks] == [EarlyStoppingCallback, Recorder]
    stopping = HuggingFaceCallbacks([EarlyStoppingCallback(2)])
    with pytest.raises(ValueError, match="EarlyStoppingCallback requires metric_for_best_model"):
        stopping.validate(make_args(files, eval_strategy="steps", eval_steps=1))
    with pytest.raises(ValueError, match="requires eval_strategy"):
        stopping.validate(make_args(files, metric_for_best_model="eval_loss"))
    valid = make_args(files, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss")
    stopping.validate(valid)
    if importlib.util.find_spec("tensorboard") is not None:
        hf_callbacks.validate(valid)
    else:  # an integration that is not installed fails before launch, named
        with pytest.raises(ValueError, match="report_to: tensorboard requested but not installed"):
            hf_callbacks.validate(valid)
    with pytest.raises(ValueError, match="not supported"):
        HuggingFaceCallbacks([], report_to=["nosuchtracker"]).validate(make_args(files))
    with pytest.raises(TypeError, match=r"not a transformers\.TrainerCallback"):
        HuggingFaceCallbacks([object()])  # type: ignore[list-item]


def test_split_callbacks_separates_hf_callbacks_keeping_order():
    native_a, native_b = Callback(), Callback()
    stopper = EarlyStoppingCallback()
    others, hf = split_callbacks([native_a, stopper, "spec", Recorder, native_b])
    assert others == [native_a, "spec", native_b]
    assert hf == [stopper, Recorder]
