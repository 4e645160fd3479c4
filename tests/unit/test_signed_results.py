"""Files one of our processes writes for another to load are signed: the facade's evaluation result.

A launched ``evaluate()``/``predict()`` reads what rank 0 wrote into ``output_dir/.trainbridge/evaluate/``.
It is signed with a key only that launch knows (``launch.transport.write_signed``, the payload's HMAC), so a
file swapped or forged by someone who can write the folder is refused before it is unpickled.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainingArguments

from trainbridge import Trainer
from trainbridge.core.run_dir import FacadeDir
from trainbridge.demos.tiny_model import build_tiny_llama
from trainbridge.launch import launcher
from trainbridge.launch.transport import PayloadIntegrityError, read_signed, write_signed
from trainbridge.trainer.runner import JOB_ENV, RESULT_KEY_ENV


class RunsCode:
    """Unpickling it creates ``marker``: the proof that a forged file's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_a_signed_file_loads_and_a_swapped_or_forged_one_is_refused_unrun(tmp_path: Path) -> None:
    path, marker = tmp_path / "result.pkl", tmp_path / "ran"
    write_signed({"metrics": {"eval_loss": 1.5}}, path, "k" * 64)
    assert read_signed(path, "k" * 64, RESULT_KEY_ENV) == {"metrics": {"eval_loss": 1.5}}
    with pytest.raises(PayloadIntegrityError, match=f"key in {RESULT_KEY_ENV}"):
        read_signed(path, "other" * 13, RESULT_KEY_ENV)
    write_signed(RunsCode(marker), path, "attacker's key")  # a well-formed file under another key
    with pytest.raises(PayloadIntegrityError, match="refusing to unpickle"):
        read_signed(path, "k" * 64, RESULT_KEY_ENV)
    path.write_bytes(pickle.dumps(RunsCode(marker)))  # a bare pickle
    with pytest.raises(PayloadIntegrityError, match="not a trainbridge payload file"):
        read_signed(path, "k" * 64, RESULT_KEY_ENV)
    assert not marker.exists()


def test_writing_replaces_a_planted_link_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    path = tmp_path / "result.pkl"
    path.symlink_to(victim)
    write_signed({"metrics": {}}, path, "k")
    assert victim.read_text() == "keep" and not path.is_symlink()
    assert (path.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("swapped", [False, True])
def test_launched_evaluate_reads_only_the_result_its_workers_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: bool
) -> None:
    """Rank 0 (here a stand-in for the launched workers) signs with the key the launch handed it in the
    environment; a group member swapping the file before the script reads it gets an error, not code run."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    marker = tmp_path / "ran"
    out = tmp_path / "out"

    def workers(args: Any, torchrun_args: Any, worker_module: str) -> None:
        spec, key = json.loads(os.environ[JOB_ENV]), os.environ[RESULT_KEY_ENV]
        assert spec["kind"] == "evaluate" and len(key) == 64
        result = FacadeDir(Path(spec["run_dir"])).evaluation_file
        write_signed({"metrics": {"eval_loss": 2.0}, "predictions": None}, result, key)
        if swapped:
            result.unlink()
            result.write_bytes(pickle.dumps({"metrics": RunsCode(marker), "predictions": None}))

    monkeypatch.setattr(launcher, "run_training", workers)
    model = str(build_tiny_llama(tmp_path / "model"))
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(out), use_cpu=True, report_to="none"))
    if swapped:
        with pytest.raises(PayloadIntegrityError):
            trainer.evaluate(eval_dataset=[{"input_ids": [1, 2, 3]}])
        assert not marker.exists()
    else:
        assert trainer.evaluate(eval_dataset=[{"input_ids": [1, 2, 3]}])["eval_loss"] == 2.0
    assert RESULT_KEY_ENV not in os.environ and JOB_ENV not in os.environ
