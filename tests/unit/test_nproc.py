"""One default process count (``core.nproc.default_nproc_per_node``) for ``TorchrunArgs``, the CLI and the facade."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import TrainingArguments

from trainbridge import TorchrunArgs, Trainer
from trainbridge.core import nproc
from trainbridge.demos.tiny_model import build_tiny_llama
from trainbridge.trainer import jobs


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


def test_the_facade_launches_the_default_for_its_device(gpus: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = str(build_tiny_llama(tmp_path / "model"))

    def launched(**kwargs: object) -> TorchrunArgs:
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)  # type: ignore[arg-type]
        return jobs.launch_args(Trainer(model=model, args=args))

    assert launched(use_cpu=True).nproc_per_node == 1
    assert launched().nproc_per_node == 4
    given = Trainer(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True),
        torchrun_args=TorchrunArgs(nproc_per_node=2, nnodes=2),
    )
    assert jobs.launch_args(given).nproc_per_node == 2 and jobs.world_size_of(jobs.launch_args(given)) == 4
