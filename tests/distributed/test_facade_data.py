"""Trainer scripts that bring their own data path, with only the import changed, both launch styles on 2 gloo
ranks, against transformers.Trainer under torchrun (``scripts/data_script.py``): the same global_step, log
steps and epochs, metric keys and checkpoints; the script's collator gets the items (tensors) in the workers.

- ``stream``: a torch ``IterableDataset`` defined in the script, shorter than ``max_steps`` needs: each rank
  builds its own (``python script.py`` too, as under torchrun); rank 0 reads and collates every rank's micro-batch
  and sends each its own, as accelerate's ``dispatch_batches`` under Trainer; the pass ends inside a step, whose
  micro-batches are carried into the next pass's first step, and the stream is iterated again for the next epoch
  (``set_epoch`` twice in each worker), on the same items, with the same losses, as under Trainer;
  ``hfstream``: the same with a ``datasets`` stream (``to_iterable_dataset()``).
- ``sampler``: a subclass's ``_get_train_sampler`` (a curriculum order) and ``loader``: a subclass's
  ``get_train_dataloader`` (its own batch size, sampler and collate function, prepared with
  ``self.accelerator``): the override runs in each rank's process (per-rank markers: the script's own
  process on each rank, under ``python script.py`` too) and each rank trains on exactly the batches it trains
  on under Trainer (accelerate's sharding).
- ``afbs``: ``auto_find_batch_size`` with a forward out of memory above 3 items on rank 1 alone (ours; on every
  rank for the reference, where Trainer's per-process search agrees only so), then a fresh Trainer resuming;
  ``unagreed`` (ours, last in the ``python script.py`` launch): the same with a backward out of memory on rank 1
  alone, which ends the launch with the error naming it.

The real Trainer's runs of the five cases share one launch (``references``: one after another in the same
processes); ours, one launch per style (``ours``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import _outside_a_launcher, run_script_folders, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "data_script.py"
SAME = ("global_step", "train_metrics", "log_steps", "log_epochs", "checkpoints")


LAUNCHES = {
    "stream": ("torchrun", "python"),
    "hfstream": ("python",),
    "sampler": ("python",),
    "afbs": ("torchrun", "python"),
}
"""Our launch styles per case (torchrun by default): the stream and afbs cases run both; the others one, for suite
time (the datasets stream must travel by value; a subclass's data override runs in each rank's own process, under
``python script.py`` for the sampler case and under torchrun for the loader case, whose path is the same)."""


KINDS = ["stream", "hfstream", "sampler", "loader", "afbs"]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The real Trainer's run of every kind under torchrun, one after another in the same two processes (one
    launch for the references), each kind's summary by name."""
    root = tmp_path_factory.mktemp("facade-data") / "real"
    return run_script_folders(torchrun(SCRIPT, str(root), ",".join(KINDS), "real"), root, KINDS)


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Our runs, ``{launch style: {kind: summary}}``: the kinds of each style (``LAUNCHES``) one after another in
    the same processes, one launch per style (the script re-executed under ``python script.py``), whose last kind,
    ``unagreed``, ends it (``{"returncode", "output"}``)."""
    root = tmp_path_factory.mktemp("facade-data-ours")
    styles = {style: [k for k in KINDS if style in LAUNCHES.get(k, ("torchrun",))] for style in ("torchrun", "python")}
    out = root / "torchrun"
    runs = {
        "torchrun": run_script_folders(
            torchrun(SCRIPT, str(out), ",".join(styles["torchrun"])), out, styles["torchrun"]
        )
    }
    out = root / "python"
    command = [sys.executable, str(SCRIPT), str(out), ",".join([*styles["python"], "unagreed"])]
    env = _outside_a_launcher({"TRAINBRIDGE_NPROC_PER_NODE": "2"})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800)
    runs["python"] = {kind: json.loads((out / kind / "summary.json").read_text()) for kind in styles["python"]}
    runs["python"]["unagreed"] = {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}
    return runs


def _runs(references: dict[str, dict], by_style: dict[str, dict[str, dict]], kind: str) -> tuple[dict, list[dict]]:
    """The reference (real Trainer under torchrun), then ours under torchrun and/or plain python (re-executed)."""
    real = references[kind]
    runs = [by_style[launch][kind] for launch in LAUNCHES.get(kind, ("torchrun",))]
    for ours in runs:
        assert {k: ours[k] for k in SAME} == {k: real[k] for k in SAME}
        assert set(real["log_keys"]) <= set(ours["log_keys"])
        assert set(real["checkpoint_files"]) <= set(ours["checkpoint_files"])
    return real, runs


def _batches(lines: list[str]) -> list[list[int]]:
    return [[int(i) for i in line.split()] for line in lines]


@pytest.mark.parametrize("kind", ["stream", "hfstream"])
def test_an_iterable_dataset_streams_as_under_trainer(
    references: dict[str, dict], ours: dict[str, dict[str, dict]], kind: str
) -> None:
    real, ours_runs = _runs(references, ours, kind)
    assert real["global_step"] == 5 and real["log_epochs"] == [0.2, 0.4, 0.6, 1.2, 1.4]  # a second pass
    # under Trainer rank 0 reads and collates every micro-batch (accelerate dispatches them; it reads ahead)
    assert "seen-rank1.txt" not in real["markers"]
    for ours in ours_runs:
        # so does ours: rank 0 collates every rank's micro-batches, in Trainer's order (5 steps x 2 micro-batches x
        # 2 ranks, and a round ahead of each pass), and sends each rank its own; rank 1 collates none
        assert ours["markers"]["seen-rank0.txt"] == real["markers"]["seen-rank0.txt"]
        assert "seen-rank1.txt" not in ours["markers"]
        batches = _batches(ours["markers"]["seen-rank0.txt"])
        assert len(batches) == 23 and all(len(batch) == 2 for batch in batches)  # per_device_train_batch_size
        first_pass = [set(i for batch in batches[rank:12:2] for i in batch) for rank in range(2)]
        assert not first_pass[0] & first_pass[1]  # disjoint shares: micro-batch i of a round is rank i's
        for rank in range(2 if kind == "stream" else 0):  # each worker iterated the stream again, with set_epoch
            assert ours["markers"][f"epochs-rank{rank}.txt"] == real["markers"][f"epochs-rank{rank}.txt"]
            assert real["markers"][f"epochs-rank{rank}.txt"] == ["0", "0", "1", "1"]  # twice a pass
        # the carried micro-batches: in the gradient of step 4 and in its logged loss
        assert ours["losses"] == pytest.approx(real["losses"], rel=1e-6)


@pytest.mark.parametrize("kind", ["sampler", "loader"])
def test_a_subclass_data_override_runs_in_the_workers_as_under_trainer(
    references: dict[str, dict], ours: dict[str, dict[str, dict]], kind: str
) -> None:
    real, ours_runs = _runs(references, ours, kind)
    assert real["global_step"] == (6 if kind == "sampler" else 4)  # 2 epochs of len(DataLoader) / accumulation
    for ours in ours_runs:
        for rank in range(2):
            marker = f"{kind}-rank{rank}.txt"
            assert [line.split()[0] for line in ours["markers"][marker]] == ["24"], (marker, ours["markers"])
            seen = f"seen-rank{rank}.txt"
            assert ours["markers"][seen] == real["markers"][seen]  # this rank's batches, in Trainer's order
    if "python" in LAUNCHES.get(kind, ()):
        launched = ours_runs[-1]
        pids = {line.split()[1] for rank in range(2) for line in launched["markers"][f"{kind}-rank{rank}.txt"]}
        assert len(pids) == 2 and str(launched["pid"]) in pids  # the script itself on each rank, as under torchrun


def test_auto_find_batch_size_is_agreed_by_the_ranks_and_resumed_as_under_trainer(
    references: dict[str, dict], ours: dict[str, dict[str, dict]]
) -> None:
    """One rank's out-of-memory error in a forward makes every rank retry with Trainer's smaller size (4 -> 3)
    instead of leaving the other waiting in the gradient all-reduce; a fresh Trainer resuming starts from the
    checkpoint's size (no second error), as Trainer restores ``TrainerState.train_batch_size``.  Same items on each
    rank and the same losses as Trainer's."""
    real, ours_runs = _runs(references, ours, "afbs")
    assert real["global_step"] == 5 and real["checkpoints"] == ["checkpoint-3", "checkpoint-5"]
    assert real["markers"]["oom-rank0.txt"] == real["markers"]["oom-rank1.txt"] == ["4"]
    for ours_run in ours_runs:  # torchrun, then python script.py
        markers = ours_run["markers"]
        assert "oom-rank0.txt" not in markers and markers["oom-rank1.txt"] == ["4"]  # one error, rank 1's, at 4
        for rank in range(2):  # both runs' state.train_batch_size, on each rank
            assert markers[f"size-rank{rank}.txt"] == real["markers"][f"size-rank{rank}.txt"] == ["3", "3"]
            assert markers[f"seen-rank{rank}.txt"] == real["markers"][f"seen-rank{rank}.txt"]
        assert ours_run["losses"] == pytest.approx(real["losses"], rel=1e-6)


def test_an_out_of_memory_error_the_ranks_cannot_agree_on_ends_the_run_naming_it(
    ours: dict[str, dict[str, dict]],
) -> None:
    """Under ``python script.py``, rank 1 alone out of memory in a backward (after the agreement, while rank 0
    reduces gradients): no retry on one rank and no hang; the launch fails with the error naming rank and size."""
    ended = ours["python"]["unagreed"]
    assert ended["returncode"] == 1, ended["output"][-4000:]
    # rank 1's own error, in full (which rank the launcher names first is its choice: rank 0's peer closed)
    assert "UnagreedOutOfMemory: auto_find_batch_size: rank 1 ran out of memory" in ended["output"]
    assert "with 4 items per micro-batch" in ended["output"]
