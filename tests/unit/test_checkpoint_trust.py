"""Checkpoints you can resume without trusting their author, and that nobody else can read (issue 24,
findings 2 and 9).

A checkpoint's author controls every byte of it, its manifest included: ``dcp/.metadata`` and DCP's
non-tensor entries are read without running code, a checkpoint nothing vouches for (no manifest, files
the manifest does not list) is refused unless the user allows it, the best checkpoint a run's state
names must be one of the run's own, and every file a checkpoint holds is private whatever the umask.
"""

from __future__ import annotations

import logging
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch

from tests.run_inputs import as_run
from tests.unit.test_checkpoint import args, new_engine, save_tiny_llama, train_step  # noqa: F401 (fixture)
from trainbridge.checkpoint.dcp_io import read_dcp, write_dcp
from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.manifest import write_manifest
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv


class _RunsCode:
    """Unpickling this creates ``marker``: what a hostile pickle would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _checkpoint(args: TrainingArgs, **manager_kwargs: object) -> tuple[CheckpointManager, Path]:  # noqa: F811
    """A checkpoint whose ``dcp/`` holds the fp32 weights (the HF files are a bf16 export)."""
    engine = new_engine(args)
    train_step(engine, seed=1)
    manager = CheckpointManager(
        args.ckpt_output_dir, DistributedEnv(), None, weights_dtype=torch.bfloat16, **manager_kwargs
    )  # type: ignore[arg-type]
    return manager, manager.save(engine, None, 1, {"global_step": 1}, {})


# ---------------------------------------------------------------------- DCP read without running code
def test_dcp_metadata_that_would_run_code_is_refused_and_the_code_does_not_run(args, tmp_path):  # noqa: F811
    manager, path = _checkpoint(args)
    marker = tmp_path / "ran"
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    write_manifest(path, manager.fingerprint)  # the author rewrites the manifest too: it verifies
    assert manager.resume_path(path) == path

    with pytest.raises(CheckpointError, match=r"\.metadata is refused: it refers to builtins\.exec"):
        manager.load(path, new_engine(args))
    assert not marker.exists(), "unpickling dcp/.metadata ran the checkpoint's code"


def test_dcp_entries_that_would_run_code_are_refused_and_the_code_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    write_dcp({"extra": _RunsCode(marker), "weight": torch.ones(2)}, tmp_path / "dcp", DistributedEnv(), False)
    state = {"extra": None, "weight": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="the entry 'extra' of a DCP checkpoint is refused"):
        read_dcp(state, tmp_path / "dcp", DistributedEnv())
    assert not marker.exists(), "a non-tensor DCP entry ran the checkpoint's code"


def test_dcp_state_of_every_kind_still_round_trips(args):  # noqa: F811
    """Model shards, the optimizer's param groups (floats, tuples, lists of names) and the scheduler."""
    engine = new_engine(args)
    train_step(engine, seed=1)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, weights_dtype=torch.bfloat16)
    pending = manager.begin_save(engine, None, 1, {"global_step": 1}, {}, background=True)
    path = manager.finish_save(pending)
    restored = new_engine(args)
    manager.load(manager.resume_path(path), restored)
    assert restored.optimizer.state_dict()["param_groups"] == engine.optimizer.state_dict()["param_groups"]
    for a, b in zip(restored.unwrapped.parameters(), engine.unwrapped.parameters(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- nothing vouches for it: refused
def test_a_checkpoint_without_its_manifest_is_refused_unless_allowed(args, caplog):  # noqa: F811
    manager, path = _checkpoint(args)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no manifest\.json.*resume_allow_unverified=True"):
        manager.resume_path(path)
    with caplog.at_level(logging.WARNING):
        assert manager.resume_path("auto") is None
    assert "skipping corrupt checkpoint" in caplog.text and "no manifest.json" in caplog.text

    trusting = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, allow_unverified=True)
    assert trusting.resume_path(path) == path
    assert trusting.resume_path("auto") == path


def test_a_file_the_manifest_does_not_list_is_refused_unless_allowed(args):  # noqa: F811
    manager, path = _checkpoint(args)
    (path / "dcp" / "__1_0.distcp").write_bytes(b"planted")
    with pytest.raises(CheckpointError, match=r"dcp/__1_0\.distcp is not listed in its manifest\.json"):
        manager.resume_path(path)
    (path / "dcp" / "__1_0.distcp").unlink()
    (path / "linked.json").symlink_to(path / "training_state.json")
    with pytest.raises(CheckpointError, match=r"linked\.json is a symbolic link"):
        manager.resume_path(path)
    trusting = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, allow_unverified=True)
    assert trusting.resume_path(path) == path


def test_the_manifest_check_runs_before_launch_too(args):  # noqa: F811
    from trainbridge.launch.checks import check_resume_path

    _, path = _checkpoint(args)
    (path / "manifest.json").unlink()
    assert "no manifest.json" in str(check_resume_path(args.model_copy(update={"resume_from_checkpoint": path})))
    allowed = args.model_copy(update={"resume_from_checkpoint": path, "resume_allow_unverified": True})
    assert check_resume_path(allowed) is None


# ---------------------------------------------------------------------- the best checkpoint
def test_a_best_checkpoint_outside_the_run_folder_is_refused(args, tmp_path):  # noqa: F811
    other_args = args.model_copy(update={"ckpt_output_dir": tmp_path / "elsewhere"})
    _, outside = _checkpoint(other_args)  # complete and verified, but another folder's
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None)
    with pytest.raises(CheckpointError, match="is not a checkpoint of this run: it is not inside"):
        manager.load_model_weights(outside, new_engine(args))


def test_the_best_checkpoint_must_be_complete_and_verify(args):  # noqa: F811
    _, path = _checkpoint(args)
    restarted = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None)  # a later run: not its own save
    restarted.load_model_weights(path, new_engine(args))
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        restarted.load_model_weights(path, new_engine(args))
    (path / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        restarted.load_model_weights(path, new_engine(args))


# ---------------------------------------------------------------------- DeepSpeed's own loader
def test_deepspeed_resume_warns_that_its_checkpoint_must_be_trusted(args, caplog, monkeypatch):  # noqa: F811
    from trainbridge.checkpoint import engine_state

    engine = new_engine(args)
    monkeypatch.setattr(type(engine), "native_checkpoint", True)
    monkeypatch.setattr(engine, "load_native_state", lambda folder: None)
    monkeypatch.setattr(engine, "load_scheduler_state_dict", lambda state: None)
    folder = args.ckpt_output_dir / "checkpoint-1"
    (folder / "deepspeed" / "state").mkdir(parents=True)
    torch.save({}, folder / "scheduler.pt")
    with caplog.at_level(logging.WARNING):
        engine_state.load_engine_state(engine, folder)
    assert "torch.load(weights_only=False)" in caplog.text and "checkpoints you trust" in caplog.text


# ---------------------------------------------------------------------- private whatever the umask
def test_every_checkpoint_file_is_private_whatever_the_umask(args):  # noqa: F811
    previous = os.umask(0o022)
    try:
        engine = new_engine(args)
        train_step(engine, seed=1)
        manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, weights_dtype=torch.bfloat16)
        path = manager.save(engine, None, 1, {"global_step": 1}, {"extra.txt": "x"})
    finally:
        os.umask(previous)
    found = [path, *path.rglob("*")]
    assert {
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "manifest.json",
        "COMPLETE",
        "dcp",
        ".metadata",
        "model.safetensors",
    } <= {p.name for p in found}
    loose = {
        str(p.relative_to(path.parent)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in found
        if stat.S_IMODE(p.stat().st_mode) != (0o700 if p.is_dir() else 0o600)
    }
    assert loose == {}, f"readable by others under umask 022: {loose}"


def test_a_run_shared_with_its_group_writes_checkpoints_its_group_can_read(args_for):
    """``share_run_dir_with_group`` reaches the checkpoint manager: folders 0750, files 0640."""
    from trainbridge.loop.build import build_run

    components = build_run(*as_run(args_for(share_run_dir_with_group=True)), DistributedEnv())
    assert components.checkpoints.share_with_group
    path = components.checkpoints.save(components.engine, components.tokenizer, 1, {"global_step": 1}, {})
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in [path, *path.rglob("*")] if p.is_dir()} == {"0o750"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in path.rglob("*") if p.is_file()} == {"0o640"}
