"""The real training loop in process: built by ``build_run``, run by ``TrainingLoop`` on one rank.

World size 1 needs no process group (``DistributedEnv()``: every named collective is the identity), so
these tests drive exactly the code a torchrun worker runs, minus the transport.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.run_inputs import as_run
from trainbridge.callbacks import BestCheckpointTracker, MetricsFileCallback, ScheduleCallback
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.events import Event
from trainbridge.loop.build import RunComponents, build_run
from trainbridge.loop.loop import TrainingLoop, train


class EventLog(Callback):
    """Every event the loop fires, with the global step at the time."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name in {e.method for e in Event}:
            return lambda context, **kw: self.events.append((name, context.global_step))
        return super().__getattribute__(name)

    def handles(self, event: Event) -> bool:
        return True

    def count(self, name: str) -> int:
        return sum(1 for event, _ in self.events if event == name)


class Crash(BaseException):
    """Cuts a run short like a killed job (a BaseException: callback isolation does not swallow it)."""


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.global_step == self.step:
            raise Crash(f"crash at step {self.step}")


def test_build_returns_the_components_and_the_loop_only_runs_them(args_for):
    args = args_for(eval_strategy="steps", eval_steps=3)
    env = DistributedEnv()
    components = build_run(*as_run(args), env)
    assert isinstance(components, RunComponents)
    assert components.engine.kind == "local" and components.engine.unwrapped.training
    assert components.steps_per_epoch == 6 and components.max_steps == 6 and components.num_epochs == 1
    assert components.eval_batches is not None and components.data_stats[0].lines == 48
    # the FLOPs estimate counts parameters as Trainer does: input embeddings left out
    unwrapped = components.engine.unwrapped
    assert components.num_parameters == unwrapped.num_parameters()
    assert components.flops_parameters == unwrapped.num_parameters(exclude_embeddings=True)
    log = EventLog()
    loop = TrainingLoop(as_run(args).args, env, [ScheduleCallback(), log, BestCheckpointTracker()], components)
    attributes = set(vars(loop))
    assert loop.context.model is components.engine.module and loop.context.tokenizer is components.tokenizer
    result = loop.run()
    assert set(vars(loop)) == attributes, "every attribute of the loop is set in __init__"
    assert result.global_step == 6 and result.final_eval_loss is not None
    micro = loop.context.micro_steps_in_step
    assert micro >= 2  # 8 samples of up to 32 tokens in a 64-token budget
    assert log.count("on_step_end") == 6 and log.count("on_evaluate") == 2
    assert log.count("on_before_forward") == log.count("on_after_backward") >= 6 * 2
    assert log.events[0] == ("on_init_end", 0) and log.events[-1] == ("on_train_end", 6)


def test_train_builds_and_runs_and_the_loss_goes_down(args_for):
    losses: list[float] = []

    class Losses(Callback):
        def on_log(self, context: TrainingContext, logs: dict[str, float], **kwargs: Any) -> None:
            if "loss" in logs:
                losses.append(logs["loss"])

    result = train(*as_run(args_for(max_steps=12)), DistributedEnv(), [ScheduleCallback(), Losses()])
    assert result.global_step == 12 and len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def _resumes_to_the_same_end(args: TrainingArgs, checkpoint: Path, full: TrainingLoop, final_loss: Any) -> None:
    """A run of ``args`` (``resume_from_checkpoint`` set) resumes from ``checkpoint`` and ends as ``full`` did:
    step 6, the same final loss and weights."""
    resumed = TrainingLoop(
        as_run(args).args, DistributedEnv(), [ScheduleCallback()], build_run(*as_run(args), DistributedEnv())
    )
    result = resumed.run()
    assert result.resumed_from == str(checkpoint)
    assert result.global_step == 6 and result.final_loss == pytest.approx(final_loss, rel=1e-6)
    for a, b in zip(full.engine.unwrapped.parameters(), resumed.engine.unwrapped.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_resume_in_process_continues_exactly(args_for):
    full_args = args_for("full", save_strategy="steps", save_steps=3)
    full = TrainingLoop(
        as_run(full_args).args, DistributedEnv(), [ScheduleCallback()], build_run(*as_run(full_args), DistributedEnv())
    )
    full_result = full.run()

    cut_args = args_for("cut", save_strategy="steps", save_steps=3)
    cut = TrainingLoop(
        as_run(cut_args).args,
        DistributedEnv(),
        [ScheduleCallback(), CrashAt(3)],
        build_run(*as_run(cut_args), DistributedEnv()),
    )
    with pytest.raises(Crash):
        cut.run()
    resume_args = args_for("cut", save_strategy="steps", save_steps=3, resume_from_checkpoint="auto")
    _resumes_to_the_same_end(resume_args, cut_args.ckpt_output_dir / "checkpoint-3", full, full_result.final_loss)
    state = json.loads((cut_args.ckpt_output_dir / "checkpoint-6" / "training_state.json").read_text())
    assert state["global_step"] == 6


class StepCounter(Callback):
    """A user callback with state: optimizer steps it has seen, across resumes."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Any) -> None:
        self.steps = int(state["steps"])


def test_resume_with_a_callback_added_brings_every_state_back(args_for, caplog):
    def run(callbacks: list[Callback], **overrides: Any) -> TrainingLoop:
        values: dict[str, Any] = dict(
            max_steps=4,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            save_samples=12,
            metric_for_best_model="eval_loss",
        )
        args = args_for(**{**values, **overrides})
        loop = TrainingLoop(as_run(args).args, DistributedEnv(), callbacks, build_run(*as_run(args), DistributedEnv()))
        loop.run()
        return loop

    counter = StepCounter()
    first = run([ScheduleCallback(), counter, BestCheckpointTracker()])
    latest = first.checkpoints.latest()
    assert latest is not None and latest.name == "checkpoint-4"
    saved = json.loads((latest / "training_state.json").read_text())["callbacks"]
    assert set(saved) == {"ScheduleCallback", "StepCounter", "BestCheckpointTracker"}
    assert first.context.best_metric is not None

    class Added(StepCounter):
        """Registered between save and resume, ahead of the others: positions shift, keys do not."""

    schedule, restored_counter = ScheduleCallback(), StepCounter()
    tracker, added = BestCheckpointTracker(), Added()
    with caplog.at_level(logging.WARNING, logger="trainbridge.core.dispatch"):
        second = run([added, schedule, restored_counter, tracker], max_steps=6, resume_from_checkpoint="auto")
    assert second.context.resumed_from == latest
    assert restored_counter.steps == 4 + 2 and added.steps == 2
    assert schedule.state_dict() == {"last_save_samples": 48}  # 6 steps x 8 samples: carried through
    assert tracker.state_dict()["best_global_step"] in (2, 4, 6)
    assert second.context.best_metric is not None and second.context.best_metric <= first.context.best_metric
    assert [r.getMessage() for r in caplog.records] == [
        f"the checkpoint holds no state for callback Added (state key {Added.__qualname__!r}): it starts fresh"
    ]


@pytest.mark.parametrize("crash", [False, True])
def test_callbacks_close_once_at_the_end_clean_or_not(args_for, crash):
    class Closing(Callback):
        def __init__(self) -> None:
            self.closed: list[tuple[int, bool]] = []
            self.ended = False

        def on_train_end(self, context: TrainingContext, **kwargs: Any) -> None:
            self.ended = True

        def on_exception(self, context: TrainingContext, **kwargs: Any) -> None:
            self.ended = True

        def close(self, context: TrainingContext) -> None:
            self.closed.append((context.global_step, self.ended))

    args = args_for(max_steps=3)
    metrics, closing = MetricsFileCallback(), Closing()
    loop = TrainingLoop(
        as_run(args).args,
        DistributedEnv(),
        [ScheduleCallback(), metrics, closing, *([CrashAt(2)] if crash else [])],
        build_run(*as_run(args), DistributedEnv()),
    )
    if crash:
        with pytest.raises(Crash):
            loop.run()
    else:
        loop.run()
    assert closing.closed == [(2 if crash else 3, True)]  # after on_train_end / on_exception, once
    assert metrics._file is None  # the metrics file is closed either way
    assert len(args.resolved_metrics_file.read_text().splitlines()) == (2 if crash else 4)


class ScriptedEvalLoss(Callback):
    """Overwrites ``metrics["eval_loss"]`` with the next scripted value (runs before the best tracker)."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def on_evaluate(self, context: TrainingContext, metrics: dict[str, float], **kwargs: Any) -> None:
        metrics["eval_loss"] = self.values.pop(0)


def _run(args: TrainingArgs, *callbacks: Callback) -> tuple[TrainingLoop, EventLog]:
    log = EventLog()
    loop = TrainingLoop(
        as_run(args).args,
        DistributedEnv(),
        [ScheduleCallback(), *callbacks, log, BestCheckpointTracker()],
        build_run(*as_run(args), DistributedEnv()),
    )
    loop.run()
    return loop, log


def test_a_save_requested_in_on_evaluate_happens_at_that_step(args_for):
    # save_strategy='best': the tracker requests the save in on_evaluate; the agreement right after the
    # evaluation makes it happen at the evaluated step, not one agreement too late (or never).
    args = args_for(
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="best",
        metric_for_best_model="eval_loss",
        save_final_checkpoint=False,
    )
    loop, log = _run(args, ScriptedEvalLoss([1.0, 0.5, 0.7]))
    assert [p.name for p in loop.checkpoints.list_checkpoints()] == ["checkpoint-2", "checkpoint-4"]
    assert [step for event, step in log.events if event == "on_save"] == [2, 4]


def test_requests_made_at_epoch_end_are_carried_out_at_that_epoch_end(args_for):
    args = args_for(
        max_steps=None, num_epochs=2, eval_strategy="epoch", save_strategy="epoch", save_final_checkpoint=False
    )
    loop, log = _run(args)
    assert [step for event, step in log.events if event == "on_evaluate"] == [6, 12]
    assert [p.name for p in loop.checkpoints.list_checkpoints()] == ["checkpoint-6", "checkpoint-12"]


def test_rotation_keeps_the_best_checkpoint(args_for):
    args = args_for(
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        metric_for_best_model="eval_loss",
    )
    kept: list[list[str]] = []

    class Kept(Callback):
        def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
            kept.append([p.name for p in context.checkpoints])

    loop, _ = _run(args, ScriptedEvalLoss([1.0, 2.0, 3.0, 4.0]), Kept())
    out = args.ckpt_output_dir
    assert loop.context.best_checkpoint == out / "checkpoint-1"
    # during the run the newest is kept beside the best (for resuming); at the end only the best, as Trainer
    assert kept[-1] == ["checkpoint-1", "checkpoint-3"]  # at on_save of step 4: rotated after it
    assert loop.checkpoints.list_checkpoints() == [out / "checkpoint-1"]


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.global_step == self.step:
            context.request_stop_training("enough")


def test_a_run_stopped_mid_epoch_saves_a_final_checkpoint_that_resumes_where_it_stopped(args_for):
    """The final checkpoint of a run a callback stopped at step 3 (of a 6-step epoch) is checkpoint-3, and a run
    resumed from it trains steps 4 to 6 of the same epoch, ending as the uninterrupted run."""
    full_args = args_for("full", save_final_checkpoint=True)
    full = TrainingLoop(
        as_run(full_args).args, DistributedEnv(), [ScheduleCallback()], build_run(*as_run(full_args), DistributedEnv())
    )
    full_result = full.run()
    cut_args = args_for("cut", save_final_checkpoint=True)
    cut = TrainingLoop(
        as_run(cut_args).args,
        DistributedEnv(),
        [ScheduleCallback(), StopAt(3)],
        build_run(*as_run(cut_args), DistributedEnv()),
    )
    stopped = cut.run()
    assert stopped.global_step == 3 and stopped.stopped_early
    assert stopped.checkpoints == [str(cut_args.ckpt_output_dir / "checkpoint-3")]
    resume_args = args_for("cut", save_final_checkpoint=True, resume_from_checkpoint="auto")
    _resumes_to_the_same_end(resume_args, cut_args.ckpt_output_dir / "checkpoint-3", full, full_result.final_loss)
