"""Hugging Face callbacks in real 2-rank runs (torchrun, gloo): early stopping, resume, one-rank flags,
``report_to`` integrations, and TrainingArguments reporting our ranks without a second process group.

The early-stopping run (``early_stopping_run``) is launched by ``run_training`` (its callbacks shipped to the
workers); the one-rank flags run and the resume-mid-patience runs share one spawn of two processes
(``in_place_runs``: each a ``run_training`` called in place on both ranks, the flags run first, in fresh
processes, as it reads accelerate's process-wide state)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from transformers import EarlyStoppingCallback, TrainerCallback

from tests.distributed.conftest import run_on_ranks
from tests.distributed.training_fixtures import base_args
from tests.run_inputs import run_training, split_run
from trainbridge import Callback, TorchrunArgs

pytestmark = pytest.mark.distributed
TWO = TorchrunArgs(nproc_per_node=2)


# ============================================================================ callbacks shipped to workers
class EvalLossByStep(TrainerCallback):
    """Overwrites ``metrics["eval_loss"]`` with a value per global step (stateless, so resume-safe)."""

    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_loss"] = self.values[state.global_step]


class StopAtStep(Callback):
    """Native: request a clean stop after ``step`` (None: never), to cut a run short before resuming."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, context, **kwargs):
        if context.global_step == self.step:
            context.request_stop_training("test interruption")


class FlagsOnOneRank(TrainerCallback):
    """On rank ``rank`` only: ``should_save`` at ``save_at`` and ``should_training_stop`` at ``stop_at``.
    Every rank records what its HF callbacks saw and writes it to ``output_dir/hf-rank{r}.json``."""

    def __init__(self, rank: int, save_at: int, stop_at: int) -> None:
        self.rank, self.save_at, self.stop_at = rank, save_at, stop_at
        self.saves: list[int] = []
        self.epoch_end_stop: list[bool] = []

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == self.rank:
            control.should_save = control.should_save or state.global_step == self.save_at
            control.should_training_stop = control.should_training_stop or state.global_step == self.stop_at
        return control

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.epoch_end_stop.append(control.should_training_stop)

    def on_train_end(self, args, state, control, **kwargs):
        from accelerate.logging import get_logger
        from accelerate.state import AcceleratorState, PartialState

        get_logger(__name__).info("accelerate's logger works (it needs a PartialState)")  # raises without one
        record = {
            "global_step": state.global_step,
            "saves": self.saves,
            "epoch_end_stop": self.epoch_end_stop,
            "train_end_stop": control.should_training_stop,
            "world_size": args.world_size,
            "is_world_process_zero": state.is_world_process_zero,
            # what Trainer's Accelerator leaves in accelerate's process-wide state
            "accelerate": [
                PartialState().process_index,
                PartialState().num_processes,
                PartialState().is_main_process,
                AcceleratorState().distributed_type.value,
                AcceleratorState().mixed_precision,
                AcceleratorState().deepspeed_plugin is None,
            ],
        }
        from accelerate import Accelerator
        from accelerate.utils import gather_object

        PartialState().wait_for_everyone()  # a barrier on the run's process group
        accelerator = Accelerator()  # built on top of the run's state, as some callbacks do
        record["accelerator"] = [
            accelerator.num_processes,
            accelerator.process_index,
            gather_object([args.process_index]),
            type(accelerator.unwrap_model(kwargs["model"])).__name__,
        ]
        (Path(args.output_dir) / f"hf-rank{args.process_index}.json").write_text(json.dumps(record))


# ============================================================================ TrainingArguments on 2 ranks
def _training_arguments_on_rank(env, model: Path, data: Path, out: Path) -> dict[str, Any]:
    from accelerate.state import PartialState

    from trainbridge.hf import build_training_arguments

    groups_before = len(dist.distributed_c10d._world.pg_map)
    args = split_run(model_path=model, data_path=data, ckpt_output_dir=out, effective_batch_size=8)
    hf = build_training_arguments(args, env)
    seen = {
        "world_size": hf.world_size,
        "process_index": hf.process_index,
        "local_process_index": hf.local_process_index,
        "device": str(hf.device),
        "should_save": hf.should_save,
        "should_log": hf.should_log,
        "parallel_mode": hf.parallel_mode.value,
        "per_device_train_batch_size": hf.per_device_train_batch_size,
    }
    hf.distributed_state.wait_for_everyone()  # a barrier on *our* group
    with hf.main_process_first():
        pass
    seen["groups_added"] = len(dist.distributed_c10d._world.pg_map) - groups_before
    seen["accelerate_state_untouched"] = PartialState._shared_state == {}
    seen["sum"] = env.sum_floats([1.0])[0]  # our group still works
    return seen


def test_training_arguments_report_our_ranks_on_two_gloo_processes(assets, tmp_path):
    rank0, rank1 = run_on_ranks(_training_arguments_on_rank, assets["model"], assets["train"], tmp_path)
    for rank, seen in enumerate((rank0, rank1)):
        assert seen["world_size"] == 2 and seen["process_index"] == rank == seen["local_process_index"]
        assert seen["device"] == "cpu" and seen["parallel_mode"] == "distributed"
        assert seen["should_save"] is seen["should_log"] is (rank == 0)
        assert seen["per_device_train_batch_size"] == 4
        assert seen["groups_added"] == 0 and seen["accelerate_state_untouched"] and seen["sum"] == 2.0


# ============================================================================ early stopping and resume
# best 1.0 (step 1), 0.9 (step 2, best), then worse: patience 3 runs out at step 5
EVAL_LOSS = {1: 1.0, 2: 0.9, 3: 0.95, 4: 0.97, 5: 0.99, 6: 1.1, 7: 1.2, 8: 1.3, 9: 1.4, 10: 1.5}


def _early_stopping_args(assets, out: Path, stop_at: int | None, **overrides: Any):
    callbacks = [EvalLossByStep(EVAL_LOSS), EarlyStoppingCallback(early_stopping_patience=3), StopAtStep(stop_at)]
    return base_args(
        assets,
        out,
        callbacks=callbacks,
        max_steps=10,
        logging_steps=5,
        val_data_path=assets["val"],
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="eval_loss",
        save_strategy="steps",
        save_steps=1,
        **overrides,
    )


INTEGRATIONS = [name for name in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(name)]


@pytest.fixture(scope="module")
def early_stopping_run(assets, tmp_path_factory):
    """The uninterrupted early-stopping run, with the installed ``report_to`` integrations recording it (one
    launch for both checks)."""
    root = tmp_path_factory.mktemp("early-stopping")
    (root / "wandb-dir").mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", f"file:{root / 'mlruns'}")
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(root / "wandb-dir"))
        env.setenv("WANDB_SILENT", "true")
        args = _early_stopping_args(
            assets,
            root / "out",
            stop_at=None,
            report_to=INTEGRATIONS or "none",
            run_name="hf-report",
            logging_dir=root / "tb",
        )
        return run_training(args, TWO), root


def test_early_stopping_stops_both_ranks_where_patience_runs_out(early_stopping_run):
    result, root = early_stopping_run
    out = root / "out"
    assert result.global_step == 5 and result.stopped_early
    assert "HuggingFaceCallbacks" in result.stop_reason
    assert result.best_metric == 0.9 and result.best_checkpoint.endswith("checkpoint-2")
    state = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {"early_stopping_patience_counter": 3}
    assert state["stateful_callbacks"]["TrainerControl"]["args"]["should_training_stop"] is True
    assert state["best_model_checkpoint"] == str(out / "checkpoint-2") and state["best_global_step"] == 2
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [1, 2, 3, 4, 5]
    # as under Trainer, the evaluation's log entry is written before on_evaluate, so it holds the measured
    # loss, not the value EvalLossByStep put in the metrics that early stopping and best tracking read
    assert all(e["eval_loss"] not in EVAL_LOSS.values() for e in state["log_history"] if "eval_loss" in e)


def _in_place(env, assets, root: Path) -> dict[str, Any]:
    """On each rank, one after another: the one-rank flags run, then the resume-mid-patience runs (stopped at
    step 3, then resumed from its checkpoint-3)."""
    flags = base_args(
        assets,
        root / "flags",
        callbacks=[FlagsOnOneRank(rank=1, save_at=2, stop_at=3)],
        max_steps=8,
        save_final_checkpoint=False,
    )
    runs = {"flags": run_training(flags, TWO)}
    runs["first"] = run_training(_early_stopping_args(assets, root / "resume", stop_at=3), TWO)
    # the state run 2 resumes from, as run 1 left it
    runs["saved"] = json.loads((root / "resume" / "checkpoint-3" / "trainer_state.json").read_text())
    resumed = _early_stopping_args(assets, root / "resume", stop_at=None, resume_from_checkpoint="auto")
    runs["second"] = run_training(resumed, TWO)
    return runs


@pytest.fixture(scope="module")
def in_place_runs(assets, tmp_path_factory) -> tuple[dict[str, Any], Path]:
    """``_in_place``'s runs in one spawn of two processes; rank 0's results and their root folder."""
    root = tmp_path_factory.mktemp("hf-in-place")
    return run_on_ranks(_in_place, assets, root, timeout=600, collective_timeout_s=300)[0], root


def test_resume_mid_patience_stops_at_the_same_step_as_the_uninterrupted_run(in_place_runs):
    runs, root = in_place_runs
    first, saved, second = runs["first"], runs["saved"], runs["second"]
    assert first.global_step == 3
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {"early_stopping_patience_counter": 1}
    assert second.resumed_from.endswith("checkpoint-3")
    # with the counter restored (1 at step 3) patience runs out at step 5, as without interruption;
    # a counter restarted at 0 would stop at step 6
    assert second.global_step == 5 and second.stopped_early
    state = json.loads((root / "resume" / "checkpoint-5" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [1, 2, 3, 4, 5]


# ============================================================================ one rank's flags act everywhere
def test_flags_set_on_rank_1_only_act_on_both_ranks_at_the_same_step(in_place_runs):
    runs, root = in_place_runs
    result = runs["flags"]
    assert result.global_step == 3 and result.stopped_early
    assert [Path(p).name for p in result.checkpoints] == ["checkpoint-2"]
    records = [json.loads((root / "flags" / f"hf-rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert record["global_step"] == 3 and record["saves"] == [2] and record["world_size"] == 2
        # rank 0's own callbacks never asked to stop, yet its control shows the agreed stop, as under Trainer
        assert record["epoch_end_stop"] == [True] and record["train_end_stop"] is True
        assert record["is_world_process_zero"] is (rank == 0)
        assert record["accelerate"] == [rank, 2, rank == 0, "MULTI_CPU", "no", True]
        assert record["accelerator"] == [2, rank, [0, 1], "LlamaForCausalLM"]


# ============================================================================ report_to integrations
@pytest.mark.skipif(not INTEGRATIONS, reason="none of tensorboard, mlflow, wandb is installed")
def test_report_to_integrations_record_the_run(early_stopping_run, monkeypatch):
    """The early-stopping run (training logs at step 5, evaluations at every step) as each integration saw it."""
    result, root = early_stopping_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the run's file store
    assert result.global_step == 5

    if "tensorboard" in INTEGRATIONS:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        event_files = list((root / "tb").glob("events.out.tfevents.*"))
        assert len(event_files) == 1  # rank 0 only
        events = EventAccumulator(str(event_files[0]))
        events.Reload()
        scalars = set(events.Tags()["scalars"])
        assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss", "train/train_loss"} <= scalars
        assert [e.step for e in events.Scalars("train/loss")] == [5]
        assert [e.step for e in events.Scalars("eval/loss")] == [1, 2, 3, 4, 5]
        assert "args/text_summary" in events.Tags()["tensors"]

    if "mlflow" in INTEGRATIONS:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"file:{root / 'mlruns'}")
        runs = client.search_runs(experiment_ids=["0"])
        assert len(runs) == 1 and runs[0].info.run_name == "hf-report"
        assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == [5]
        assert {"eval_loss", "train_loss", "learning_rate"} <= set(runs[0].data.metrics)
        assert runs[0].data.params["eval_steps"] == "1"

    if "wandb" in INTEGRATIONS:
        run_files = list((root / "wandb-dir" / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(run_files) == 1  # rank 0 only
        history = run_files[0].read_bytes()  # protobuf records: history keys are stored as plain strings
        assert b"train/loss" in history and b"eval/loss" in history and b"train/global_step" in history
