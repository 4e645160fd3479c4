"""Real 2-rank runs through run_training (torchrun, gloo): events, agreed control, failures, resume.

Each launch costs seconds of process start-up, so one run serves every check that can share it: the
module-scoped runs below (``callbacks_run``, ``plain_run``) are launched once and read by several tests, and
the runs of the stop/resume and FSDP tests share one spawn of two processes (``in_place_runs``: each a
``run_training`` called in place on both ranks, as from a ``torchrun script.py``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import run_on_ranks
from tests.distributed.training_fixtures import EventCounter, base_args, read_rank_files
from tests.run_inputs import run_training
from trainbridge import Callback, TorchrunArgs, WorkerFailedError
from trainbridge.loop.result import RunResult

pytestmark = pytest.mark.distributed
TWO = TorchrunArgs(nproc_per_node=2)


def read_metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def callbacks_run(assets, tmp_path_factory) -> tuple[RunResult, Path]:
    """One 6-step run for the callback checks: every event counted (``EventCounter``), a native callback that
    raises on rank 1 at step 2 (isolated by default), and flat event functions, a closure and lambdas defined
    here, that leave marker files in ``out/markers``.  Logs at 3 and 6, evaluations at 3 and 6, checkpoints
    at 2, 4 and 6."""
    out = tmp_path_factory.mktemp("callbacks") / "out"
    marker_dir = out / "markers"
    marker_dir.mkdir(parents=True)

    def on_save(context, checkpoint_path):  # a closure over marker_dir, defined inside the fixture
        (marker_dir / f"saved-{context.rank}-{Path(checkpoint_path).name}").write_text("ok")

    args = base_args(
        assets,
        out,
        callbacks=[EventCounter(), RaiseOnRank(1, 2)],
        max_steps=6,
        logging_steps=3,
        val_data_path=assets["val"],
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=2,
        on_save=on_save,
        on_evaluate=[
            lambda context, metrics: (marker_dir / f"eval-{context.rank}").write_text(json.dumps(metrics)),
            lambda context, metrics: None,
        ],
    )
    return run_training(args, TWO), out


def test_events_fire_the_expected_number_of_times_on_every_rank(callbacks_run):
    result, out = callbacks_run
    assert result.global_step == 6 and not result.stopped_early
    rank0, rank1 = read_rank_files(out, "events")
    assert rank0["counts"] == rank1["counts"]
    c = rank0["counts"]
    assert c["on_init_end"] == c["on_train_begin"] == c["on_train_end"] == 1
    assert c["on_epoch_begin"] == c["on_epoch_end"] == 1
    assert c["on_step_begin"] == c["on_step_end"] == c["on_pre_optimizer_step"] == c["on_optimizer_step"] == 6
    forwards = c["on_before_forward"]
    assert forwards == c["on_after_forward"] == c["on_before_backward"] == c["on_after_backward"] >= 6
    assert c["on_substep_end"] == forwards - 6  # every micro-batch but the step's last
    assert c["on_evaluate"] == 2 and c["on_prediction_step"] >= 2
    assert c["on_save"] == 3
    # training logs at steps 3 and 6, eval logs twice, and the final train summary
    assert c["on_log"] == 2 + 2 + 1
    assert "on_exception" not in c  # the isolated callback error is not an exception of the run
    assert rank0["steps"] == list(range(1, 7))
    assert (out / "checkpoint-6" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def plain_run(assets, tmp_path_factory) -> tuple[RunResult, Path]:
    """30 plain DDP steps logged every 5, with ``CountAgreements`` counting the agreement collectives."""
    out = tmp_path_factory.mktemp("plain") / "out"
    return run_training(base_args(assets, out, callbacks=[CountAgreements()], max_steps=30, logging_steps=5), TWO), out


def test_ddp_loss_falls_and_metrics_file_is_written(plain_run):
    result, _ = plain_run
    records = [r for r in read_metrics(result.metrics_file) if "loss" in r]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]
    for key in ("grad_norm", "learning_rate", "epoch", "tokens_per_second", "samples_seen"):
        assert key in records[-1]
    assert records[-1]["samples_seen"] == 30 * 16


class StopOnRank(Callback):
    """Requests a stop on one rank only, at one step."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, context, **kwargs):
        if context.rank == self.rank and context.global_step == self.step:
            context.request_stop_training(f"rank {self.rank} says stop")


class CountAgreements(Callback):
    """Counts agreement collectives (DistributedEnv.gather_rows) between consecutive step ends."""

    def on_train_begin(self, context, **kwargs):
        self.calls = 0
        self.per_step: list[int] = []
        env = context.env
        original = env.gather_rows

        def counting(row):
            self.calls += 1
            return original(row)

        env.gather_rows = counting

    def on_step_begin(self, context, **kwargs):
        if context.global_step:
            self.per_step.append(self.calls)
        self.calls = 0

    def on_train_end(self, context, **kwargs):
        path = context.args.ckpt_output_dir / f"agreements-rank{context.rank}.json"
        path.write_text(json.dumps(self.per_step))


def test_control_agreement_adds_no_collective_on_plain_steps(plain_run):
    _, out = plain_run
    per_step = read_rank_files(out, "agreements")[0]
    # steps 1..29 measured; a logged step (every 5th) has one more agreement after the log phase, and so has
    # step 16, the end of the first epoch (16 steps of 16 samples), after the epoch-end phase; the others:
    # one agreement that also carries the loss sum — the collective the step needs anyway.
    assert per_step == [2 if step % 5 == 0 or step == 16 else 1 for step in range(1, 30)]


class RaiseOnRank(Callback):
    def __init__(self, rank: int, step: int, event: str = "on_step_end"):
        self.rank, self.step, self.event = rank, step, event

    def on_train_begin(self, context, **kwargs):
        if self.event == "on_train_begin" and context.rank == self.rank:
            raise RuntimeError("broken callback at train begin")

    def on_step_end(self, context, **kwargs):
        if self.event == "on_step_end" and context.rank == self.rank and context.global_step == self.step:
            raise RuntimeError("broken callback mid-run")


def test_isolated_callback_error_does_not_stop_training_and_is_reported(callbacks_run):
    result, _ = callbacks_run
    assert result.global_step == 6
    (report,) = result.callback_errors
    assert report.rank == 1 and report.callback == "RaiseOnRank" and report.count == 1
    assert "broken callback mid-run" in report.first_error


def test_fatal_policy_stops_both_ranks_cleanly_and_fails_the_run(assets, tmp_path):
    args = base_args(
        assets, tmp_path, callbacks=[RaiseOnRank(1, 2), EventCounter()], max_steps=6, callback_error_policy="fatal"
    )
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="fatal") as info:
        run_training(args, TWO, timeout_s=240)
    assert time.monotonic() - start < 240
    assert "RaiseOnRank" in str(info.value)
    assert info.value.rank == 1  # every rank raised; the root cause is the rank whose callback did


def test_setup_error_on_one_rank_fails_before_the_first_step_naming_rank_and_callback(assets, tmp_path):
    args = base_args(assets, tmp_path, callbacks=[RaiseOnRank(1, 0, "on_train_begin")])
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_training(args, TWO, timeout_s=240)
    assert time.monotonic() - start < 240
    message = str(info.value)
    assert "rank 1" in message and "RaiseOnRank" in message and "on_train_begin" in message
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()


STOP_RESUME = dict(max_steps=8, save_strategy="steps", save_steps=4, lr_scheduler="linear", warmup_steps=2)
LOSSES = ("standard", "chunked")


def _in_place(env, assets: dict[str, Path], root: Path) -> dict[str, RunResult]:
    """On each rank, one after another: the stop/resume test's straight run, its run stopped by rank 1 at step 3
    and the run resumed from that; then the FSDP test's run of each loss implementation."""
    runs = {"straight": run_training(base_args(assets, root / "straight", **STOP_RESUME), TWO)}
    resumed_out = root / "resumed"
    callbacks = [StopOnRank(1, 3), EventCounter()]
    stopped = base_args(assets, resumed_out, callbacks=callbacks, save_final_checkpoint=True, **STOP_RESUME)
    runs["first"] = run_training(stopped, TWO)
    runs["second"] = run_training(base_args(assets, resumed_out, resume_from_checkpoint="auto", **STOP_RESUME), TWO)
    for loss in LOSSES:
        fsdp = base_args(
            assets,
            root / loss,
            max_steps=4,
            logging_steps=1,
            distributed_backend="fsdp",
            loss_implementation=loss,
            loss_chunk_tokens=7,
            save_strategy="no",
            save_final_checkpoint=True,
            callbacks=[EventCounter()],
        )
        runs[loss] = run_training(fsdp, TWO)
    return runs


@pytest.fixture(scope="module")
def in_place_runs(assets, tmp_path_factory) -> tuple[dict[str, RunResult], Path]:
    """``_in_place``'s runs in one spawn of two processes; rank 0's results and their root folder."""
    root = tmp_path_factory.mktemp("in-place")
    return run_on_ranks(_in_place, assets, root, timeout=600, collective_timeout_s=300)[0], root


def test_stop_on_rank_1_only_stops_both_ranks_at_one_step_and_the_resumed_run_ends_as_the_uninterrupted_one(
    in_place_runs,
):
    """Stop requested on rank 1 only at step 3: both ranks stop after step 3 and save a final checkpoint;
    resuming from it gives the weights of a run that was never interrupted (linear schedule with warmup)."""
    runs, root = in_place_runs
    straight, first, second = runs["straight"], runs["first"], runs["second"]
    resumed_out = root / "resumed"
    assert first.global_step == 3 and first.stopped_early
    assert "rank 1 (StopOnRank: rank 1 says stop)" in first.stop_reason
    rank0, rank1 = read_rank_files(resumed_out, "events")
    assert rank0["steps"] == rank1["steps"] == [1, 2, 3]
    assert rank0["counts"]["on_train_end"] == rank1["counts"]["on_train_end"] == 1
    assert first.checkpoints == [str(resumed_out / "checkpoint-3")]
    assert second.resumed_from.endswith("checkpoint-3") and second.global_step == 8
    a = load_file(Path(straight.checkpoints[-1]) / "model.safetensors")
    b = load_file(Path(second.checkpoints[-1]) / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-6, name


def test_flat_event_functions_closures_and_lambdas_reach_every_worker(callbacks_run):
    _, out = callbacks_run
    marker_dir = out / "markers"
    names = sorted(p.name for p in marker_dir.iterdir())
    assert names == ["eval-0", "eval-1"] + [f"saved-{r}-checkpoint-{s}" for r in (0, 1) for s in (2, 4, 6)]
    metrics = json.loads((marker_dir / "eval-1").read_text())
    assert set(metrics) == {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"}


class TerminateOnRank(Callback):
    """Sends SIGTERM to its own worker at a step (as a scheduler pre-empting the job would) and records
    which exit event fired."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, context, **kwargs):
        if context.rank == self.rank and context.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, context, **kwargs):
        (context.args.ckpt_output_dir / f"exit-rank{context.rank}").write_text("on_train_end")

    def on_exception(self, context, exception, **kwargs):
        (context.args.ckpt_output_dir / f"exit-rank{context.rank}").write_text(f"on_exception {exception}")


def test_sigterm_fires_on_exception_and_fails_the_run_naming_the_rank(assets, tmp_path):
    args = base_args(assets, tmp_path, callbacks=[TerminateOnRank(1, 2)], max_steps=6)
    with pytest.raises(WorkerFailedError) as info:
        run_training(args, TWO, timeout_s=240)
    assert "rank 1" in str(info.value) and "signal 15" in str(info.value)
    assert (tmp_path / "exit-rank1").read_text() == "on_exception received signal 15"


def test_fsdp_trains_through_run_training_and_the_chunked_loss_head_trains_like_the_standard_loss(in_place_runs):
    """FSDP2 through run_training: the loss falls, every rank fires the same events, the checkpoint loads with
    ``from_pretrained``; and the chunked loss, run inside the FSDP2 ``norm + lm_head`` unit's forward (the CUDA
    default without Liger), gives the same losses and weights as the standard loss over full logits.
    (DeepSpeed through run_training: ``test_peft.py``'s ZeRO-2/3 runs and ``test_engines.py``.)"""
    from transformers import AutoModelForCausalLM

    results, root = in_place_runs
    standard, chunked = (
        [r["loss"] for r in read_metrics(results[k].metrics_file) if "loss" in r] for k in ("standard", "chunked")
    )
    assert len(standard) == 4 and standard[-1] < 0.9 * standard[0]
    assert chunked == pytest.approx(standard, rel=1e-5)
    for loss in ("standard", "chunked"):
        rank0, rank1 = read_rank_files(root / loss, "events")
        assert rank0["counts"] == rank1["counts"] and rank0["steps"] == [1, 2, 3, 4]
    weights = [load_file(root / k / "checkpoint-4" / "model.safetensors") for k in ("standard", "chunked")]
    assert max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0]) < 1e-5
    model = AutoModelForCausalLM.from_pretrained(root / "standard" / "checkpoint-4")
    assert sum(p.numel() for p in model.parameters()) > 0
