"""One default process count (``core.nproc.default_nproc_per_node``) for ``TorchrunArgs``, the CLI and the facade."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import TrainingArguments

from trainbridge import TorchrunArgs, Trainer
from trainbridge.core import nproc
from trainbridge.demos.tiny_model import build_tiny_llama


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(nproc.NPROC_ENV, raising=False)
    monkeypatch.setattr(nproc, "visible_gpu_count", lambda: 4)
    return monkeypatch


def test_default_is_every_visible_gpu_none_for_a_cpu_run_and_one_without_gpus(gpus: pytest.MonkeyPatch) -> None:
    assert nproc.default_nproc_per_node() == 4 and nproc.default_nproc_per_node("cuda") == 4
    assert nproc.default_nproc_per_node("cpu") == 1
    gpus.setattr(nproc, "visible_gpu_count", lambda: 0)
    assert nproc.default_nproc_per_node("auto") == 1


def test_the_environment_variable_overrides_the_default_and_is_checked(gpus: pytest.MonkeyPatch) -> None:
    gpus.setenv(nproc.NPROC_ENV, "3")
    assert nproc.default_nproc_per_node("cpu") == 3 == TorchrunArgs().nproc_per_node
    gpus.setenv(nproc.NPROC_ENV, "0")
    with pytest.raises(ValueError, match="TRAINBRIDGE_NPROC_PER_NODE='0': expected a positive number"):
        nproc.default_nproc_per_node()


def test_torchrun_args_default_is_counted_for_the_runs_device_unless_given(gpus: pytest.MonkeyPatch) -> None:
    assert TorchrunArgs().nproc_per_node == 4
    assert TorchrunArgs().for_device("cpu").nproc_per_node == 1
    assert TorchrunArgs(nproc_per_node=2).for_device("cpu").nproc_per_node == 2  # given: kept


def test_a_python_script_starts_the_default_count_and_a_trainer_honours_only_the_running_world(
    gpus: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``python script.py`` is re-executed under torchrun with the default count (one per visible GPU), read when
    the Trainer is imported, before the script's arguments exist; ``torchrun_args=`` must be the running world."""
    from trainbridge.launch import script_launch, script_workers

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        gpus.delenv(name, raising=False)
    launched: list[int] = []
    gpus.setattr(script_launch, "_done", False)
    gpus.setattr(script_launch, "session_kind", lambda: "script")
    gpus.setattr(sys, "orig_argv", [sys.executable, "train.py"])  # as a script's (pytest-xdist's worker is `-c`)
    gpus.setattr(script_workers, "run_under_torchrun", lambda command, n: launched.append(n) or 0)
    gpus.setattr(script_workers, "exit_with", lambda code: None)
    script_launch.launch_script()
    assert launched == [4]
    model = str(build_tiny_llama(tmp_path / "model"))
    with pytest.raises(script_launch.ScriptLaunchError, match="asks for 4 processes but this script runs as 1"):
        Trainer(
            model=model,
            args=TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True),
            torchrun_args=TorchrunArgs(nproc_per_node=2, nnodes=2),
        )
