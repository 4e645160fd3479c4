"""The best checkpoint a resumed state names is checked at resume, before step 1 (issue 32, item 2).

A checkpoint's ``training_state.json`` records the best checkpoint twice: the tracker's ``best_checkpoint``
and the Hugging Face ``TrainerState``'s ``best_model_checkpoint``.  One outside the run folder, or not a
complete checkpoint whose files verify, is dropped with a warning naming the field and the value (with the
best metric it came with), so the run's own evaluations choose the best again; before, the run trained
every step and then failed at ``load_best_model_at_end``.  One recorded under a folder that no longer
exists (the run folder was moved) is the run's own checkpoint of that name.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from tests.run_inputs import as_run
from tests.unit.test_checkpoint import args, new_engine  # noqa: F401 (fixture)
from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.manifest import read_manifest, write_manifest
from trainbridge.checkpoint.resume import own_best_checkpoint
from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.loop.loop import train


class BestAtFirstStep(Callback):
    """Records the best checkpoint the context and the Hugging Face state hold when step 1 of this run
    begins."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] | None = None

    def on_step_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if self.seen is None:
            self.seen = {"best": context.best_checkpoint, "metric": context.best_metric}


class HFBestAtFirstStep(TrainerCallback):
    def __init__(self) -> None:
        self.seen: str | None = "unset"

    def on_step_begin(self, training_args, state, control, **kwargs):
        if self.seen == "unset":
            self.seen = state.best_model_checkpoint


@pytest.fixture
def args_for(args_for):
    return functools.partial(
        args_for,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )


def _set_best(checkpoint: Path, best: str) -> None:
    """Rewrite the best checkpoint ``checkpoint``'s state names, and its manifest to match (its author
    controls every byte of it)."""
    state_file = checkpoint / "training_state.json"
    state = json.loads(state_file.read_text())
    for callback_state in state["callbacks"].values():
        for field in ("best_checkpoint", "best_model_checkpoint"):
            if field in callback_state:
                callback_state[field] = best
    state_file.write_text(json.dumps(state))
    write_manifest(checkpoint, (read_manifest(checkpoint) or {}).get("fingerprint") or {})


def _run(args_for, out: str, steps: int, *callbacks: Any, **overrides: Any) -> Any:
    run_args = args_for(out=out, max_steps=steps, callbacks=list(callbacks), **overrides)
    return train(*as_run(run_args), DistributedEnv(), assemble_callbacks(*as_run(run_args)))


def test_a_best_checkpoint_outside_the_run_folder_is_dropped_before_step_1(args_for, tmp_path, caplog):
    _run(args_for, "other", 1, HFBestAtFirstStep())
    outside = tmp_path / "other" / "checkpoint-1"  # complete and verified, but another run's
    _run(args_for, "out", 2, HFBestAtFirstStep())
    _set_best(tmp_path / "out" / "checkpoint-2", str(outside))

    native, hf = BestAtFirstStep(), HFBestAtFirstStep()
    with caplog.at_level(logging.WARNING):
        result = _run(args_for, "out", 3, native, hf, resume_from_checkpoint="auto")
    assert native.seen == {"best": None, "metric": None}  # dropped before step 1, with its metric
    assert hf.seen is None
    assert "best_model_checkpoint" in caplog.text and repr(str(outside)) in caplog.text
    assert "is not a checkpoint of this run: it is not inside" in caplog.text
    assert "evaluations choose the best checkpoint again" in caplog.text
    assert result.global_step == 3
    assert Path(result.best_checkpoint).parent == tmp_path / "out"  # chosen by this run's evaluations


# ---------------------------------------------------------------------- the check itself
@pytest.fixture
def saved(args):  # noqa: F811
    """A run folder holding checkpoint-1, saved by the manager."""
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None)
    return manager, manager.save(new_engine(args), None, 1, {"global_step": 1}, {})


def _states(best: str) -> dict[str, Any]:
    return {
        "BestCheckpointTracker": {"best_metric": 0.5, "best_global_step": 1, "best_checkpoint": best},
        "HuggingFaceCallbacks": {"best_metric": 0.5, "best_global_step": 1, "best_model_checkpoint": best},
        "Other": {"best_metric": 7},
    }


def test_an_incomplete_or_unverified_best_checkpoint_is_dropped(saved, tmp_path, caplog):
    manager, path = saved
    (path / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        settled = manager.settle_best(_states(str(path)), resumed=tmp_path / "elsewhere")
    assert settled["BestCheckpointTracker"] == {"best_metric": None, "best_global_step": None, "best_checkpoint": None}
    assert settled["HuggingFaceCallbacks"]["best_model_checkpoint"] is None
    assert settled["Other"] == {"best_metric": 7}  # a state that names no best checkpoint is left alone
    assert "no manifest.json" in caplog.text
    (path / "COMPLETE").unlink()
    assert own_best_checkpoint(manager.output_dir, str(path), True, True)[1] is not None


def test_a_best_checkpoint_of_a_moved_run_folder_is_its_own_of_that_name(saved, tmp_path):
    manager, path = saved
    gone = tmp_path / "moved-from" / path.name  # the folder the run was in before it was moved
    settled = manager.settle_best(_states(str(gone)), resumed=tmp_path / "elsewhere")
    assert settled["BestCheckpointTracker"]["best_checkpoint"] == str(path)
    assert settled["HuggingFaceCallbacks"] == {
        "best_metric": 0.5,
        "best_global_step": 1,
        "best_model_checkpoint": str(path),
    }
    outside = tmp_path / "other" / path.name
    outside.mkdir(parents=True)  # an existing folder elsewhere is not the run's, whatever its name
    assert own_best_checkpoint(manager.output_dir, str(outside), True, False)[0] is None
    assert own_best_checkpoint(manager.output_dir, str(path), True, False, verified=path) == (path, None)
