"""``checkpoint_async``: intermediate checkpoints whose ``dcp/`` part is written in the background, published
(and ``on_save`` fired) at the first step end at which the write has finished; the real loop in process.

The tiny model trains in fp32 and exports bf16 here (``checkpoint_weights_dtype='bfloat16'``), so every
checkpoint has a ``dcp/`` part (the fp32 weights) to write in the background.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

from tests.run_inputs import as_run
from tests.unit.test_loop import Crash, CrashAt
from trainbridge.callbacks import ScheduleCallback
from trainbridge.checkpoint import dcp_io
from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.layout import COMPLETE_MARKER
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop


class Saves(Callback):
    """(step at which on_save fired, checkpoint name, whether it was complete on disk then)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, bool]] = []

    def on_save(self, context: TrainingContext, checkpoint_path: Path, **kwargs: Any) -> None:
        path = Path(checkpoint_path)
        self.seen.append((context.global_step, path.name, (path / COMPLETE_MARKER).is_file()))
        assert context.last_checkpoint == path


@pytest.fixture
def args_for(args_for):
    """The shared ``args_for`` (tests/unit/conftest.py), saving asynchronously every 2 steps in bf16."""
    return functools.partial(
        args_for, save_strategy="steps", save_steps=2, checkpoint_weights_dtype="bfloat16", checkpoint_async=True
    )


def _loop(args: TrainingArgs, *callbacks: Callback) -> TrainingLoop:
    return TrainingLoop(
        as_run(args).args,
        DistributedEnv(),
        [ScheduleCallback(), *callbacks],
        build_run(*as_run(args), DistributedEnv()),
    )


def test_on_save_fires_once_published_and_a_crash_while_pending_resumes_from_the_previous_exactly(args_for):
    saves = Saves()
    full = _loop(args_for("full"), saves)
    full.run()
    # checkpoint-2 and -4 are published at a later step end (never before the step after the save); the
    # final checkpoint-6 is written at once.  Each on_save names a complete, published checkpoint.
    names = [name for _, name, _ in saves.seen]
    assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert all(complete for _, _, complete in saves.seen)
    fired_at = {name: step for step, name, _ in saves.seen}
    assert fired_at["checkpoint-2"] >= 3 and fired_at["checkpoint-4"] >= 5 and fired_at["checkpoint-6"] == 6
    out = full.args.ckpt_output_dir
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", ".tmp"))) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    # written in the background, the optimizer state is in dcp/; the synchronous final one keeps optimizer.pt
    assert not (out / "checkpoint-2" / "optimizer.pt").exists() and (out / "checkpoint-6" / "optimizer.pt").exists()

    # Killed at step 5's start: checkpoint-4 was begun at step 4 and cannot be published before step 5
    # ends, so it is not there; checkpoint-2 is whole and the run resumes from it to the same weights.
    cut = _loop(args_for("cut"), CrashAt(4))
    with pytest.raises(Crash):
        cut.run()
    cut_out = cut.args.ckpt_output_dir
    assert [p.name for p in cut.checkpoints.list_checkpoints()] == ["checkpoint-2"]
    assert not (cut_out / "checkpoint-4").exists()
    resumed = _loop(args_for("cut", resume_from_checkpoint="auto"))
    result = resumed.run()
    assert result.resumed_from == str(cut_out / "checkpoint-2") and result.global_step == 6
    assert result.final_loss == full.context.loss
    for a, b in zip(full.engine.unwrapped.parameters(), resumed.engine.unwrapped.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_failed_background_write_fails_the_save_and_keeps_the_previous_checkpoint(args_for, monkeypatch):
    loop = _loop(args_for("failing"))
    real_write = dcp_io.write_dcp
    calls: list[bool] = []

    def write(state: dict[str, Any], path: Path, env: Any, background: bool) -> Future[Any] | None:
        calls.append(background)
        if len(calls) == 1:
            return real_write(state, path, env, background)
        failed: Future[Any] = Future()
        failed.set_exception(OSError("the background writer failed"))
        return failed

    monkeypatch.setattr(dcp_io, "write_dcp", write)
    with pytest.raises(CheckpointError, match="in the background: the background writer failed"):
        loop.run()
    assert calls == [True, True]
    out = loop.args.ckpt_output_dir
    assert [p.name for p in loop.checkpoints.list_checkpoints()] == ["checkpoint-2"]
    assert not (out / ".tmp-checkpoint-4").exists(), "the failed checkpoint's temporary folder is removed"


def test_off_by_default_a_checkpoint_is_published_and_on_save_fired_at_its_step(args_for):
    saves = Saves()
    _loop(args_for("sync", checkpoint_async=False), saves).run()
    assert saves.seen == [(2, "checkpoint-2", True), (4, "checkpoint-4", True), (6, "checkpoint-6", True)]


def test_hf_callbacks_with_on_save_are_warned_about_under_checkpoint_async(args_for):
    class Uploads(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            pass

    class Logs(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            pass

    hf_callbacks = HuggingFaceCallbacks([Uploads(), Logs()], report_to=[])
    with pytest.warns(HFPortingWarning, match=r"on_save of Uploads fires when the checkpoint is published"):
        hf_callbacks.validate(args_for("warned"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)
        hf_callbacks.validate(args_for("quiet", checkpoint_async=False))
        HuggingFaceCallbacks([Logs()], report_to=[]).validate(args_for("no-on-save"))


def test_a_peft_run_saves_its_adapter_and_optimizer_in_the_background_and_resumes_exactly(args_for):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    full = _loop(args_for("peft", peft_config=lora, max_steps=4, checkpoint_weights_dtype="auto"))
    full.run()
    second = full.args.ckpt_output_dir / "checkpoint-2"
    assert (second / "adapter_model.safetensors").is_file() and not (second / "optimizer.pt").exists()
    assert (second / "dcp" / ".metadata").is_file()  # the adapter's optimizer state, written in the background
    resumed = _loop(
        args_for(
            "peft-resumed",
            peft_config=lora,
            max_steps=4,
            checkpoint_weights_dtype="auto",
            resume_from_checkpoint=second,
        )
    )
    result = resumed.run()
    assert result.resumed_from == str(second) and result.final_loss == full.context.loss
    trained = [(n, p) for n, p in full.engine.unwrapped.named_parameters() if p.requires_grad]
    again = dict(resumed.engine.unwrapped.named_parameters())
    assert trained and all(torch.equal(p, again[n]) for n, p in trained)
