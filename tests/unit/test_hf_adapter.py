"""The HF adapter driven by a simulated loop (one process): hook order, control both ways, state, resume.

``SimulatedRun`` fires the native events in the order ``trainbridge.loop.loop`` fires them (docs/design.md):
N optimizer steps of M micro-batches, the native ``ScheduleCallback`` and ``BestCheckpointTracker``
around the user's callbacks, ``agree_control`` at the decision points, checkpoints written with every
callback's ``checkpoint_files``.  The reference for "what Trainer does" is a real ``transformers.Trainer``
run on a tiny model with the same schedule.
"""

from __future__ import annotations

import json
import logging
import math
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

from trainbridge.callbacks import BestCheckpointTracker, ScheduleCallback
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.control import AgreedControl, ControlFlag, agree_control
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.events import Event
from trainbridge.hf import HuggingFaceCallbackAdapter, HuggingFaceCallbackError, split_callbacks

FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
HOOKS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
         "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step",
         "on_evaluate", "on_save", "on_epoch_end", "on_train_end")


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

    def on_init_end(self, args, state, control, **kw): self._record("on_init_end", args, state, control, kw)
    def on_train_begin(self, args, state, control, **kw): self._record("on_train_begin", args, state, control, kw)
    def on_epoch_begin(self, args, state, control, **kw): self._record("on_epoch_begin", args, state, control, kw)
    def on_step_begin(self, args, state, control, **kw): self._record("on_step_begin", args, state, control, kw)
    def on_substep_end(self, args, state, control, **kw): self._record("on_substep_end", args, state, control, kw)
    def on_pre_optimizer_step(self, args, state, control, **kw):
        self._record("on_pre_optimizer_step", args, state, control, kw)
    def on_optimizer_step(self, args, state, control, **kw):
        self._record("on_optimizer_step", args, state, control, kw)
    def on_step_end(self, args, state, control, **kw): self._record("on_step_end", args, state, control, kw)
    def on_log(self, args, state, control, **kw): self._record("on_log", args, state, control, kw)
    def on_prediction_step(self, args, state, control, **kw):
        self._record("on_prediction_step", args, state, control, kw)
    def on_evaluate(self, args, state, control, **kw): self._record("on_evaluate", args, state, control, kw)
    def on_save(self, args, state, control, **kw): self._record("on_save", args, state, control, kw)
    def on_epoch_end(self, args, state, control, **kw): self._record("on_epoch_end", args, state, control, kw)
    def on_train_end(self, args, state, control, **kw): self._record("on_train_end", args, state, control, kw)

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


class SimulatedCrash(RuntimeError):
    """Raised by ``SimulatedRun`` to cut a run short after a given step (like a killed job)."""


class SimulatedRun:
    """Fires native events in ``trainbridge.loop.loop``'s order on one rank, with real control agreement."""

    def __init__(self, args: TrainingArgs, callbacks: list[Callback], *, steps_per_epoch: int,
                 micro_batches: int = 2, eval_batches: int = 2):
        self.args = args
        self.callbacks: list[Callback] = [ScheduleCallback(), *callbacks, BestCheckpointTracker()]
        self.micro_batches, self.eval_batches = micro_batches, eval_batches
        ctx = self.context = TrainingContext(args=args, env=DistributedEnv())
        model = torch.nn.Linear(4, 4)
        ctx.model = ctx.unwrapped_model = model
        ctx.optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
        ctx.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, lambda step: 1.0)
        ctx.train_dataloader = list(range(steps_per_epoch * micro_batches))
        ctx.eval_dataloader = list(range(eval_batches))
        ctx.tokenizer = object()
        ctx.steps_per_epoch = steps_per_epoch
        ctx.max_steps = args.max_steps or steps_per_epoch * args.num_epochs
        ctx.num_epochs = math.ceil(ctx.max_steps / steps_per_epoch)
        self.stop = False
        self.last_saved = -1
        self.last_logged = 0
        self.evaluations = 0

    # ------------------------------------------------------------------ dispatch and agreement
    def fire(self, event: Event, **kwargs: Any) -> None:
        for index, cb in enumerate(self.callbacks, start=1):
            if cb.handles(event):
                self.context.current_source = index
                cb.run_event(event, self.context, **kwargs)
        self.context.current_source = 0

    def agree(self) -> AgreedControl:
        names = ["loop", *(cb.name for cb in self.callbacks)]
        agreed, _ = agree_control(self.context.env, self.context.requests, names)
        self.context.agreed = agreed
        if agreed.stop_training and not self.stop:
            self.stop = True
            self.context.stop_reason = f"stop_training requested by {agreed.describe(ControlFlag.STOP_TRAINING)}"
        return agreed

    # ------------------------------------------------------------------ the run
    def run(self, resume_from: Path | None = None, crash_after_step: int | None = None) -> TrainingContext:
        ctx = self.context
        self.fire(Event.INIT_END)
        if resume_from is not None:
            self.resume(resume_from)
        self.fire(Event.TRAIN_BEGIN)
        if self.args.eval_on_start:
            self.evaluate()
            self.agree()
        while ctx.epoch_index < ctx.num_epochs and not self.stop:
            self.run_epoch(crash_after_step)
        if self.args.save_final_checkpoint and self.last_saved != ctx.global_step:
            self.save()
        self.fire(Event.LOG, logs={"train_runtime": 1.0, "train_samples_per_second": 2.0,
                                   "train_steps_per_second": 3.0, "total_flos": 4.0, "train_loss": 0.5,
                                   "epoch": ctx.epoch})
        self.fire(Event.TRAIN_END)
        return ctx

    def run_epoch(self, crash_after_step: int | None) -> None:
        ctx = self.context
        self.fire(Event.EPOCH_BEGIN)
        while ctx.step_in_epoch < ctx.steps_per_epoch and ctx.global_step < ctx.max_steps:
            self.train_step()
            agreed = self.agree()
            ctx.loss = 1.0 / ctx.global_step
            ctx.tokens_seen += 10
            flags = self.log_evaluate_save(agreed)
            if crash_after_step == ctx.global_step:
                raise SimulatedCrash(f"crash after step {ctx.global_step}")
            if ControlFlag.STOP_EPOCH in flags or self.stop:
                break
        self.fire(Event.EPOCH_END)
        self.log_evaluate_save(self.agree())
        ctx.epoch_index += 1
        ctx.step_in_epoch = 0

    def train_step(self) -> None:
        ctx = self.context
        self.fire(Event.STEP_BEGIN)
        for i in range(self.micro_batches):
            ctx.micro_step = i
            batch = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
            loss = torch.tensor(1.0)
            self.fire(Event.BEFORE_FORWARD, batch=batch)
            self.fire(Event.AFTER_FORWARD, batch=batch, loss=loss)
            self.fire(Event.BEFORE_BACKWARD, loss=loss)
            self.fire(Event.AFTER_BACKWARD)
            if i < self.micro_batches - 1:
                self.fire(Event.SUBSTEP_END)
        ctx.grad_norm = 1.0
        self.fire(Event.PRE_OPTIMIZER_STEP)
        ctx.learning_rate = self.args.learning_rate
        self.fire(Event.OPTIMIZER_STEP)
        ctx.global_step += 1
        ctx.step_in_epoch += 1
        ctx.samples_seen += self.args.effective_batch_size
        ctx.epoch = ctx.epoch_index + ctx.step_in_epoch / ctx.steps_per_epoch
        self.fire(Event.STEP_END)

    def log_evaluate_save(self, agreed: AgreedControl) -> set[ControlFlag]:
        ctx, flags, ran = self.context, set(agreed.flags), False
        if ControlFlag.LOG in flags and ctx.global_step > self.last_logged:
            self.last_logged = ctx.global_step
            self.fire(Event.LOG, logs={"loss": ctx.loss or 0.0, "grad_norm": 1.0,
                                       "learning_rate": self.args.learning_rate, "epoch": ctx.epoch})
            ran = True
        if ControlFlag.EVALUATE in flags:
            self.evaluate()
            flags |= self.agree().flags
            ran = True
        if ControlFlag.SAVE in flags:
            self.save()
            ran = True
        if ran:
            flags |= self.agree().flags
        return flags

    def evaluate(self) -> None:
        ctx = self.context
        for i in range(self.eval_batches):
            self.fire(Event.PREDICTION_STEP, batch={"index": i})
        self.evaluations += 1
        metrics = {"eval_loss": 2.0 / self.evaluations, "eval_runtime": 0.1, "eval_samples_per_second": 10.0,
                   "eval_steps_per_second": 20.0, "epoch": ctx.epoch}
        ctx.metrics = dict(metrics)
        self.fire(Event.LOG, logs=metrics)
        self.fire(Event.EVALUATE, metrics=metrics)

    def save(self) -> Path:
        ctx = self.context
        path = Path(self.args.ckpt_output_dir) / f"checkpoint-{ctx.global_step}"
        files: dict[str, str] = {}
        for cb in self.callbacks:
            files.update(cb.checkpoint_files(ctx))
        path.mkdir(parents=True)
        for name, text in files.items():
            (path / name).write_text(text)
        states = {str(i): cb.state_dict() for i, cb in enumerate(self.callbacks) if cb.state_dict() is not None}
        training = {"global_step": ctx.global_step, "epoch_index": ctx.epoch_index,
                    "step_in_epoch": ctx.step_in_epoch, "tokens_seen": ctx.tokens_seen, "callbacks": states}
        (path / "training_state.json").write_text(json.dumps(training))
        self.last_saved = ctx.global_step
        ctx.last_checkpoint = path
        self.fire(Event.SAVE, checkpoint_path=path)
        return path

    def resume(self, path: Path) -> None:
        ctx = self.context
        state = json.loads((path / "training_state.json").read_text())
        ctx.global_step, ctx.tokens_seen = state["global_step"], state["tokens_seen"]
        ctx.epoch_index, ctx.step_in_epoch = state["epoch_index"], state["step_in_epoch"]
        if ctx.step_in_epoch >= ctx.steps_per_epoch:
            ctx.epoch_index, ctx.step_in_epoch = ctx.epoch_index + 1, 0
        ctx.epoch = ctx.epoch_index + ctx.step_in_epoch / ctx.steps_per_epoch
        self.last_saved = self.last_logged = ctx.global_step
        ctx.resumed_from = path
        # as trainbridge.loop.loop: run bookkeeping (always_restore_state) always, user state when asked
        for i, cb in enumerate(self.callbacks):
            if str(i) in state["callbacks"] and (self.args.restore_callback_states or cb.always_restore_state):
                cb.load_state_dict(state["callbacks"][str(i)])


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "model"
    LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16).save_pretrained(model)
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return {"model": model, "data": data, "out": tmp_path / "out"}


def make_args(files: dict[str, Path], **overrides: Any) -> TrainingArgs:
    values: dict[str, Any] = dict(model_path=files["model"], data_path=files["data"],
                                  ckpt_output_dir=files["out"], val_data_path=files["data"],
                                  save_strategy="no", disable_tqdm=True, logging_steps=1000)
    values.update(overrides)
    return TrainingArgs(**values)


def adapter_context(files: dict[str, Path], adapter: HuggingFaceCallbackAdapter, **overrides: Any) -> SimulatedRun:
    """A simulated run whose adapter has had ``on_init_end`` and ``on_train_begin``."""
    run = SimulatedRun(make_args(files, **overrides), [adapter], steps_per_epoch=4)
    run.fire(Event.INIT_END)
    run.fire(Event.TRAIN_BEGIN)
    return run


# ============================================================================ parity with Trainer
def transformers_trainer_calls(output_dir: Path) -> list[tuple[Any, ...]]:
    """The hooks a real ``transformers.Trainer`` fires: 2 epochs x 3 steps x 2 micro-batches,
    logging every 2 steps, evaluating every 3 (2 eval batches), saving every 4."""
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    sample = {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}
    recorder = Recorder()
    args = TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=2, num_train_epochs=2, logging_steps=2, eval_strategy="steps",
        eval_steps=3, save_strategy="steps", save_steps=4, save_only_model=True, report_to="none",
        disable_tqdm=True,
    )
    try:
        Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=[sample] * 6,
                eval_dataset=[sample] * 2, callbacks=[recorder]).train()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return recorder.calls


def expected_trainer_hooks() -> list[str]:
    """The same schedule derived by hand from Trainer's rules (docs/design.md)."""
    def step(n: int) -> list[str]:
        return ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    evaluation = ["on_prediction_step", "on_prediction_step", "on_log", "on_evaluate"]
    return [
        "on_init_end", "on_train_begin",
        "on_epoch_begin", *step(1), *step(2), "on_log", *step(3), *evaluation, "on_epoch_end",
        "on_epoch_begin", *step(4), "on_log", "on_save", *step(5), *step(6), "on_log", *evaluation, "on_save",
        "on_epoch_end", "on_log", "on_train_end",
    ]


def test_hooks_steps_epochs_and_control_flags_match_a_real_trainer(files, tmp_path):
    recorder = Recorder()
    args = make_args(files, num_epochs=2, logging_steps=2, eval_strategy="steps", eval_steps=3,
                     save_strategy="steps", save_steps=4)
    SimulatedRun(args, [HuggingFaceCallbackAdapter([recorder])], steps_per_epoch=3, micro_batches=2,
                 eval_batches=2).run()
    assert recorder.hooks() == expected_trainer_hooks()
    assert recorder.calls == transformers_trainer_calls(tmp_path / "trainer")


def test_hooks_get_real_trainer_objects_and_trainers_keyword_arguments(files):
    recorder = Recorder()
    run = SimulatedRun(make_args(files, max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=2),
                       [HuggingFaceCallbackAdapter([recorder])], steps_per_epoch=2)
    ctx = run.run()
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
    # include_num_input_tokens_seen="no" (Trainer's default): not counted; flos from the native counter
    assert state.num_input_tokens_seen == 0 and state.total_flos == 6 * 20 * 20  # Linear(4, 4): 20 params
    assert state.is_world_process_zero and state.is_local_process_zero
    assert state.trial_name is None and state.trial_params is None
    assert [entry["step"] for entry in state.log_history] == [1, 2, 2, 2]
    assert state.log_history[-1]["train_loss"] == 0.5


def test_callback_handler_builds_trainers_callback_list(files):
    adapter = HuggingFaceCallbackAdapter([EarlyStoppingCallback], report_to=["tensorboard"])
    run = adapter_context(files, adapter, logging_dir=files["out"] / "tb", eval_strategy="steps", eval_steps=1,
                          metric_for_best_model="eval_loss")
    names = [type(cb) for cb in adapter.handler.callbacks]
    assert names == [DefaultFlowCallback, TensorBoardCallback, EarlyStoppingCallback, PrinterCallback]
    assert adapter.handler.callbacks[1].logging_dir == str(files["out"] / "tb")
    run.fire(Event.TRAIN_END)
    adapter_with_bar = HuggingFaceCallbackAdapter([], progress=True)
    adapter_context(files, adapter_with_bar, disable_tqdm=False)
    assert type(adapter_with_bar.handler.callbacks[-1]) is ProgressCallback
    no_progress = HuggingFaceCallbackAdapter([], report_to=["none"], progress=False)
    adapter_context(files, no_progress)
    assert [type(cb) for cb in no_progress.handler.callbacks] == [DefaultFlowCallback]
    assert no_progress.args.report_to == []


def test_duplicate_callback_class_warns_like_trainer(files):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.trainer_callback")
    logger.addHandler(handler)
    try:
        adapter_context(files, HuggingFaceCallbackAdapter([Recorder(), Recorder]))
    finally:
        logger.removeHandler(handler)
    assert any("there is already one" in r.getMessage() and "Recorder" in r.getMessage() for r in records)


# ============================================================================ control
def test_flags_set_by_callbacks_become_named_native_requests(files):
    setters = [SetFlagAt("on_step_end", flag, 1) for flag in FLAGS]
    run = adapter_context(files, HuggingFaceCallbackAdapter(setters))
    run.train_step()
    pending = run.context.requests.pending
    adapter_index = 2  # ScheduleCallback is 1
    expected = {ControlFlag.STOP_TRAINING, ControlFlag.STOP_EPOCH, ControlFlag.SAVE, ControlFlag.EVALUATE,
                ControlFlag.LOG}
    assert {flag for flag, source in pending.items() if source == adapter_index} == expected
    assert run.context.requests.reasons[ControlFlag.SAVE] == "SetFlagAt set control.should_save in on_step_end"
    agreed = run.agree()
    assert agreed.describe(ControlFlag.STOP_TRAINING) == "rank 0 (HuggingFaceCallbackAdapter)"


def test_default_flow_callback_flags_are_not_forwarded(files):
    adapter = HuggingFaceCallbackAdapter([Recorder()])
    run = adapter_context(files, adapter, logging_steps=1, eval_strategy="steps", eval_steps=1,
                          save_strategy="steps", save_steps=1, max_steps=1)
    run.callbacks = [run.callbacks[1]]  # the adapter alone: no native schedule
    run.train_step()
    assert adapter.control.should_log and adapter.control.should_save and adapter.control.should_training_stop
    assert run.context.requests.pending == {}


def test_early_stopping_requests_stop_at_the_evaluation_patience_runs_out(files):
    # best 1.0, then 0.9 (better), 0.95 (worse: 1), 0.97 (worse: 2 = patience) -> stop at the 4th evaluation
    scripted = ScriptedEvalLoss([1.0, 0.9, 0.95, 0.97, 0.5, 0.4])
    stopper = EarlyStoppingCallback(early_stopping_patience=2)
    args = make_args(files, max_steps=10, eval_strategy="steps", eval_steps=1,
                     metric_for_best_model="eval_loss")
    run = SimulatedRun(args, [HuggingFaceCallbackAdapter([scripted, stopper])], steps_per_epoch=10)
    ctx = run.run()
    assert ctx.global_step == 4 and scripted.calls == 4
    assert ctx.stop_reason == "stop_training requested by rank 0 (HuggingFaceCallbackAdapter)"
    assert ctx.best_metric == 0.9 and ctx.best_global_step is None  # save_strategy='no': no best step


def test_agreed_decision_is_folded_into_control_once(files):
    recorder = Recorder()
    run = adapter_context(files, HuggingFaceCallbackAdapter([recorder]))
    run.context.agreed = AgreedControl(frozenset({ControlFlag.STOP_TRAINING, ControlFlag.SAVE}))
    run.fire(Event.EPOCH_END)
    assert recorder.calls[-1][3] == ("should_training_stop", "should_save")
    run.fire(Event.SAVE, checkpoint_path=files["out"])  # handler resets should_save; not folded again
    assert recorder.calls[-1][3] == ("should_training_stop",)
    run.fire(Event.TRAIN_END)
    assert recorder.calls[-1][3] == ("should_training_stop",)
    assert run.context.requests.pending == {}  # folded flags are not requested back


def test_callback_errors_name_the_callback(files):
    class Broken(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            raise ValueError("boom")

    with pytest.raises(HuggingFaceCallbackError, match=r"Broken\.on_train_begin raised ValueError: boom"):
        adapter_context(files, HuggingFaceCallbackAdapter([Broken()]))


# ============================================================================ checkpoint and resume
def test_trainer_state_json_has_stateful_callbacks_and_best_model_checkpoint(files):
    stopper = EarlyStoppingCallback(early_stopping_patience=5)
    args = make_args(files, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                     save_steps=2, metric_for_best_model="eval_loss", logging_steps=1)
    # eval_loss 1.0, 0.5, 0.6, 0.7: best at step 2
    run = SimulatedRun(args, [HuggingFaceCallbackAdapter([ScriptedEvalLoss([1.0, 0.5, 0.6, 0.7]), stopper])],
                       steps_per_epoch=4)
    run.run()
    saved = json.loads((files["out"] / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["global_step"] == 4 and saved["best_global_step"] == 2 and saved["best_metric"] == 0.5
    assert saved["best_model_checkpoint"] == str(files["out"] / "checkpoint-2")
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"] == {
        "args": {"early_stopping_patience": 5, "early_stopping_threshold": 0.0},
        "attributes": {"early_stopping_patience_counter": 2},
    }
    assert set(saved["stateful_callbacks"]["TrainerControl"]["args"]) == set(FLAGS)
    assert saved["log_history"][0] == {"loss": 1.0, "grad_norm": 1.0, "learning_rate": args.learning_rate,
                                       "epoch": 0.25, "step": 1}
    first = json.loads((files["out"] / "checkpoint-2" / "trainer_state.json").read_text())
    assert first["best_model_checkpoint"] == str(files["out"] / "checkpoint-2")  # the one being written
    state = TrainerState.load_from_json(str(files["out"] / "checkpoint-4" / "trainer_state.json"))
    assert state.best_global_step == 2


def _early_stopping_run(files, crash_after_step=None, resume_from=None, restore=True):
    args = make_args(files, max_steps=12, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                     save_steps=1, metric_for_best_model="eval_loss", restore_callback_states=restore)
    # best 1.0 at step 1, then worse every time: patience 4 runs out at step 5
    scripted = ScriptedEvalLoss([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1])
    adapter = HuggingFaceCallbackAdapter([scripted, EarlyStoppingCallback(early_stopping_patience=4)])
    run = SimulatedRun(args, [adapter], steps_per_epoch=12)
    if resume_from is not None:
        scripted.calls = json.loads((resume_from / "training_state.json").read_text())["global_step"]
    return run, adapter


def test_resume_mid_patience_continues_the_early_stopping_counter(files):
    run, _ = _early_stopping_run(files)
    assert run.run().global_step == 5
    shutil.rmtree(files["out"])
    crashed, _ = _early_stopping_run(files)
    with pytest.raises(SimulatedCrash):
        crashed.run(crash_after_step=3)
    resumed, adapter = _early_stopping_run(files, resume_from=files["out"] / "checkpoint-3")
    state_at_resume = json.loads((files["out"] / "checkpoint-3" / "training_state.json").read_text())
    ctx = resumed.run(resume_from=files["out"] / "checkpoint-3")
    assert ctx.global_step == 5
    stopper = adapter.handler.callbacks[2]
    assert isinstance(stopper, EarlyStoppingCallback) and stopper.early_stopping_patience_counter == 4
    assert [e["step"] for e in adapter.state.log_history if "eval_loss" in e] == [1, 2, 3, 4, 5]
    hf_state = state_at_resume["callbacks"]["1"]
    assert hf_state["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 2}


def test_resume_without_restoring_callback_states_restarts_the_counter(files):
    crashed, _ = _early_stopping_run(files, restore=False)
    with pytest.raises(SimulatedCrash):
        crashed.run(crash_after_step=3)
    resumed, adapter = _early_stopping_run(files, resume_from=files["out"] / "checkpoint-3", restore=False)
    # As under Trainer without restore_callback_states_from_checkpoint: the TrainerState (best metric
    # 1.0 at step 1) comes back, EarlyStopping's counter restarts at 0, so patience 4 runs out at step 7.
    ctx = resumed.run(resume_from=files["out"] / "checkpoint-3")
    assert ctx.global_step == 7
    assert adapter.handler.callbacks[2].early_stopping_patience_counter == 4


def test_state_dict_round_trip_restores_trainer_state_control_and_callbacks(files):
    stopper = EarlyStoppingCallback(early_stopping_patience=3)
    adapter = HuggingFaceCallbackAdapter([stopper])
    run = adapter_context(files, adapter, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss")
    stopper.early_stopping_patience_counter = 2
    adapter.control.should_save = True
    run.context.global_step, run.context.epoch = 3, 0.75
    run.fire(Event.LOG, logs={"loss": 0.25, "epoch": 0.75})
    saved = json.loads(json.dumps(adapter.state_dict()))

    fresh_stopper = EarlyStoppingCallback(early_stopping_patience=3)
    fresh = HuggingFaceCallbackAdapter([Recorder(), fresh_stopper])
    restored_run = SimulatedRun(make_args(files, eval_strategy="steps", eval_steps=1,
                                          metric_for_best_model="eval_loss"), [fresh], steps_per_epoch=4)
    restored_run.fire(Event.INIT_END)
    fresh.load_state_dict(saved)
    restored_run.fire(Event.TRAIN_BEGIN)
    restored = fresh.handler.callbacks[2]
    assert isinstance(restored, EarlyStoppingCallback) and restored.early_stopping_patience_counter == 2
    assert type(fresh.handler.callbacks[1]) is Recorder  # order kept
    assert fresh.control.should_save  # TrainerControl restored (should_training_stop reset by on_train_begin)
    assert fresh.state.log_history == [{"loss": 0.25, "epoch": 0.75, "step": 3}]


# ============================================================================ construction and helpers
def test_adapter_is_picklable_before_init_and_validates_config(files):
    adapter = HuggingFaceCallbackAdapter([EarlyStoppingCallback(2), Recorder], report_to=["tensorboard"])
    clone = cloudpickle.loads(cloudpickle.dumps(adapter))
    assert [type(c) if not isinstance(c, type) else c for c in clone.callbacks] == [EarlyStoppingCallback, Recorder]
    with pytest.raises(ValueError, match="EarlyStoppingCallback requires metric_for_best_model"):
        adapter.validate(make_args(files, eval_strategy="steps", eval_steps=1))
    with pytest.raises(ValueError, match="requires eval_strategy"):
        adapter.validate(make_args(files, metric_for_best_model="eval_loss"))
    adapter.validate(make_args(files, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss"))
    with pytest.raises(ValueError, match="not supported"):
        HuggingFaceCallbackAdapter([], report_to=["nosuchtracker"]).validate(make_args(files))
    with pytest.raises(TypeError, match=r"not a transformers\.TrainerCallback"):
        HuggingFaceCallbackAdapter([object()])  # type: ignore[list-item]


def test_split_callbacks_separates_hf_callbacks_keeping_order():
    native_a, native_b = Callback(), Callback()
    stopper = EarlyStoppingCallback()
    others, hf = split_callbacks([native_a, stopper, "spec", Recorder, native_b])
    assert others == [native_a, "spec", native_b]
    assert hf == [stopper, Recorder]
