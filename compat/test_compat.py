"""The conformance suite under pytest.

- Unit part (no processes): trace alignment, explanations, the attribute-access patch.
- CI part (``distributed``): the ``fast`` selection of ``compat.scenarios`` (every scenario's one-rank
  runs but the long ones, ``classification`` included; ``step_schedules`` and ``one_rank_stop`` on two
  ranks), run once for the module with each side batched into one launch per world size; each
  (scenario, ranks) is a test that fails on an unexplained difference.
- Full part (``compat_full``): every other pair, as ``python -m compat`` runs them.  CI deselects it:
  ``python -m pytest -m "not compat_full"``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from transformers import DefaultFlowCallback, TrainerControl, TrainerState, TrainingArguments

from compat.diff import Difference, compare_traces, explain
from compat.recorder import AttributeAccessLog
from compat.report import report_fingerprint
from compat.scenarios import scenario_fingerprint
from compat.suite import all_pairs, fast_pairs, run_suite
from trainbridge.launch.launcher import free_port


def _hook(event: str, step: int, **fields) -> dict:
    flags = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
    snapshot = {
        "event": event,
        "global_step": step,
        "epoch": 0.0,
        "max_steps": 4,
        "num_train_epochs": 1,
        "logs": None,
        "metrics": None,
        "best_metric": None,
        "best_global_step": None,
        "best_model_checkpoint": None,
        "control": dict.fromkeys(flags, False),
        "kwargs": ["model"],
    }
    snapshot.update(fields)
    return snapshot


# ============================================================================ unit part
def test_the_report_is_as_new_as_the_scenarios():
    """``compat/REPORT.md`` was written by a full ``python -m compat`` run of the scenarios as they are now:
    a scenario added or changed (arguments, callbacks, ranks, expectations) without regenerating it fails."""
    recorded = report_fingerprint((Path(__file__).parent / "REPORT.md").read_text())
    assert recorded == scenario_fingerprint(), (
        f"compat/REPORT.md records scenario fingerprint {recorded}, the scenarios are now "
        f"{scenario_fingerprint()}: regenerate it with `python -m compat` (every scenario, 1 and 2 ranks)"
    )


def test_a_missing_hook_is_one_difference_and_later_hooks_still_align():
    trainer = [_hook("on_step_end", 1), _hook("on_save", 1), _hook("on_step_end", 2)]
    ours = [_hook("on_step_end", 1), _hook("on_step_end", 2, max_steps=5)]
    differences = compare_traces("s", 1, 0, "rank 0 trace", trainer, ours)
    assert [(d.event, d.step, d.field) for d in differences] == [
        ("on_save", 1, "hook"),
        ("on_step_end", 2, "max_steps"),
    ]
    assert differences[0].trainer == "called" and differences[0].trainbridge == "not called"


def test_control_flags_are_compared_one_by_one():
    stop = dict.fromkeys(
        ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log"), False
    ) | {"should_training_stop": True}
    (difference,) = compare_traces("s", 1, 0, "t", [_hook("on_step_end", 3, control=stop)], [_hook("on_step_end", 3)])
    assert difference.field == "control.should_training_stop"
    assert (difference.trainer, difference.trainbridge) == (True, False)


def test_explanations_match_only_their_difference():
    batch = Difference("x", 1, "artifact checkpoint-4/trainer_state.json", "train_batch_size", 2, 4)
    later = Difference("x", 1, "rank 0 trace", "max_steps", 12, 13, event="on_step_end", step=3)
    assert explain(batch).key == "train-batch-size"
    assert explain(later) is None


def test_attribute_access_log_attributes_reads_to_the_callback_class_and_restores_the_classes():
    log = AttributeAccessLog([DefaultFlowCallback])
    args = TrainingArguments(output_dir="unused", use_cpu=True, logging_steps=2, report_to="none")
    state = TrainerState(global_step=2, max_steps=4, logging_steps=2, eval_steps=2, save_steps=2)
    log.install()
    try:
        control = DefaultFlowCallback().on_step_end(args, state, TrainerControl())
        _ = args.learning_rate  # read by this test, not by the callback: not attributed
    finally:
        log.restore()
    assert control.should_log
    reads = log.as_json()["DefaultFlowCallback"]
    # logging_first_step is not read at step 2: `global_step == 1 and args.logging_first_step` short-circuits
    assert {"logging_strategy", "eval_strategy", "save_strategy"} <= set(reads["args"])
    assert "logging_first_step" not in reads["args"]
    assert "learning_rate" not in reads["args"]
    assert {"global_step", "logging_steps", "max_steps"} <= set(reads["state"])
    assert "__getattribute__" not in vars(TrainingArguments) and "__getattribute__" not in vars(TrainerState)


def test_jobs_of_one_trainer_launch_share_one_process_group_which_only_the_last_ends(tmp_path, monkeypatch):
    """A group destroyed by one job and created again by the next, in one torchrun launch, rendezvouses on
    the same store keys (torch resets its group counter): a rank can read a peer's stale address and hang
    in ``init_process_group`` (the 2-rank hang of issue 32).  Here: Trainer's own ``end()`` (transformers
    5.2x destroys the group there) runs after the last job only, and the group is created once."""
    import torch.distributed as dist
    from transformers import Trainer

    from compat import trainer_worker
    from compat.assets import build_assets
    from compat.runners import integration_environment

    class TrainedNothing(Trainer):  # the real Trainer and its ``end``; no steps (the jobs' cost is not the point)
        ends: list[bool] = []

        def train(self, *args, **kwargs):
            return None

        def end(self):
            TrainedNothing.ends.append(dist.is_initialized())
            super().end()

    assets = build_assets(tmp_path / "assets")
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    jobs = []
    for number in (1, 2, 3):
        run_dir = tmp_path / f"job{number}"
        (run_dir / "wandb").mkdir(parents=True)
        for name, value in integration_environment(run_dir).items():
            monkeypatch.setenv(name, value)  # restored after the test (a job sets its own)
        jobs.append({"scenario": "defaults", "world_size": 1, "out": str(run_dir / "out"),
                     "trace": str(run_dir / "trace"), "resume_from": None, "env": integration_environment(run_dir),
                     "status": str(run_dir / "status.json"), "trainer": "transformers"})  # fmt: skip
    inits = []
    real_init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: (inits.append(a), real_init(*a, **k))[1])
    monkeypatch.setattr(trainer_worker, "Trainer", TrainedNothing)
    try:
        trainer_worker.main(["--assets", json.dumps(assets.as_json()), "--jobs", json.dumps(jobs)])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert TrainedNothing.ends == [True], "Trainer.end() ran before the launch's last job, or not at the end"
    assert len(inits) == 1, f"the process group was created {len(inits)} times in one launch"
    assert all(json.loads(Path(job["status"]).read_text()) == {"status": "completed"} for job in jobs)


def test_a_hung_trainer_job_is_killed_at_its_own_deadline_and_named(tmp_path):
    """The launch's second job never ends: it is killed at that job's ``timeout_s`` (not the launch's sum),
    and the outcome names it."""
    from compat.runners import _run_launch

    job = {"world_size": 2, "trainer": "transformers"}
    jobs = [
        {**job, "scenario": name, "phase": phase, "timeout_s": timeout, "status": str(tmp_path / f"{name}.json")}
        for name, phase, timeout in (("defaults", "", 30), ("stateful_resume", "resume", 3))
    ]
    worker = (
        "import json, sys, time; from pathlib import Path\n"
        f"Path({jobs[0]['status']!r}).write_text(json.dumps({{'status': 'completed'}}))\n"
        f"Path({jobs[1]['status']!r}).write_text(json.dumps({{'status': 'started'}}))\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    error = _run_launch([sys.executable, "-c", worker], dict(os.environ), jobs, tmp_path / "console.log")
    assert time.monotonic() - start < 20
    assert error is not None and error[0] == "timeout"
    assert (
        "Trainer job stateful_resume (resume phase) x2 (2 of 2 of its launch) did not finish within its 3 s"
        in (error[1])
    )


# ============================================================================ CI part
FAST = fast_pairs()


FAST_SUITE_TIMEOUT_S = 1500
"""The fast suite runs once, in the set-up of whichever of its tests comes first (every CI scenario on a
shared 2-core machine): longer than the default per-test limit."""


@pytest.fixture(scope="module")
def fast_suite(tmp_path_factory):
    result = run_suite(FAST, tmp_path_factory.mktemp("compat"), skip_expected_trainer_failures=True)
    return {(c.scenario.name, c.world_size): c for c in result.comparisons}


def _failure_message(comparison) -> str:
    lines = [
        f"{comparison.scenario.name} on {comparison.world_size} rank(s): "
        f"{len(comparison.unexplained)} unexplained difference(s)"
    ]
    lines += [f"  {d.describe()}" for d in comparison.unexplained[:30]]
    lines += [f"  finding: {f}" for f in comparison.findings]
    return "\n".join(lines)


@pytest.mark.distributed
@pytest.mark.timeout(FAST_SUITE_TIMEOUT_S)
@pytest.mark.parametrize(
    ("name", "world_size"), [(s.name, ws) for s, ws in FAST], ids=[f"{s.name}-x{ws}" for s, ws in FAST]
)
def test_trainbridge_matches_trainer(fast_suite, name, world_size):
    comparison = fast_suite[(name, world_size)]
    assert comparison.passed, _failure_message(comparison)


@pytest.mark.distributed
@pytest.mark.timeout(FAST_SUITE_TIMEOUT_S)
def test_one_rank_stop_stops_every_trainbridge_rank_at_the_same_step(fast_suite):
    comparison = fast_suite[("one_rank_stop", 2)]
    assert comparison.trainbridge.status == "completed"
    from compat.recorder import read_trace

    for rank in (0, 1):
        steps = [
            s["global_step"]
            for s in read_trace(comparison.trainbridge.trace_dir(), rank)
            if s["event"] == "on_step_end"
        ]
        assert steps == [1, 2, 3], f"rank {rank} ran steps {steps}"


@pytest.mark.distributed
@pytest.mark.timeout(FAST_SUITE_TIMEOUT_S)
def test_classification_stops_early_on_eval_accuracy(fast_suite):
    comparison = fast_suite[("classification", 1)]
    from compat.recorder import read_trace

    trace = read_trace(comparison.trainbridge.trace_dir(), 0)
    evaluations = [s for s in trace if s["event"] == "on_evaluate"]
    assert [s["global_step"] for s in evaluations] == [2, 4, 6]  # patience 2 of 12 steps
    assert all("eval_accuracy" in s["metrics"] for s in evaluations)  # compute_metrics ran
    assert trace[-1]["event"] == "on_train_end" and trace[-1]["global_step"] == 6


def test_the_classification_scenario_runs_in_ci_on_one_rank_and_in_full_on_two():
    assert ("classification", 1) in {(s.name, ws) for s, ws in fast_pairs()}
    assert ("classification", 2) in {(s.name, ws) for s, ws in all_pairs()}


@pytest.mark.distributed
@pytest.mark.timeout(FAST_SUITE_TIMEOUT_S)
def test_dpo_evaluates_preference_pairs_with_trls_eval_metrics(fast_suite):
    comparison = fast_suite[("dpo", 1)]
    from compat.recorder import read_trace

    trace = read_trace(comparison.trainbridge.trace_dir(), 0)
    evaluations = [s for s in trace if s["event"] == "on_evaluate"]
    assert [s["global_step"] for s in evaluations] == [2, 4, 6, 8]
    assert all({"eval_loss", "eval_rewards/margins", "eval_logps/chosen"} <= set(s["metrics"]) for s in evaluations)


def test_the_dpo_scenario_runs_in_ci_on_one_rank_and_in_full_on_two():
    assert ("dpo", 1) in {(s.name, ws) for s, ws in fast_pairs()}
    assert ("dpo", 2) in {(s.name, ws) for s, ws in all_pairs()}


# ============================================================================ full part
SLOW = [(s, ws) for s, ws in all_pairs() if (s, ws) not in FAST]


@pytest.mark.distributed
@pytest.mark.compat_full
@pytest.mark.parametrize(
    ("name", "world_size"), [(s.name, ws) for s, ws in SLOW], ids=[f"{s.name}-x{ws}" for s, ws in SLOW]
)
def test_trainbridge_matches_trainer_full(tmp_path: Path, name, world_size):
    (comparison,) = run_suite([(s, ws) for s, ws in SLOW if (s.name, ws) == (name, world_size)], tmp_path).comparisons
    assert comparison.passed, _failure_message(comparison)
