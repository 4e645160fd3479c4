"""A Trainer script with only its import changed, both ways users launch it, against transformers.Trainer.

``scripts/facade_script.py`` (tiny Llama, ``datasets`` rows, ``DataCollatorForLanguageModeling``,
``compute_metrics`` with ``preprocess_logits_for_metrics``, best-model tracking on ``accuracy``, early
stopping, ``evaluate``/``predict``/``save_model`` after training) runs as ``torchrun --nproc_per_node=2``
(the loop runs in place on each rank) and as ``python script.py`` (re-executed under torchrun, 2 ranks), and
under real ``transformers.Trainer`` with torchrun as the reference.  37 validation rows on 2 ranks leave
an uneven last batch: the gathered predictions must hold each row exactly once, in dataset order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script, run_script_folders, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "facade_script.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("facade") / "real"
    return run_script(torchrun(SCRIPT, str(out), "real"), out)


def _check_against_reference(ours: dict, reference: dict) -> None:
    problems = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    # compute_metrics saw every validation row once, in dataset order (uneven last batch on 2 ranks)
    check(ours["eval_metrics"]["eval_num_rows"] == 37, f"rows {ours['eval_metrics']}")
    check(ours["eval_metrics"]["eval_row_checksum"] == ours["expected_checksum"], "row order")
    check(reference["eval_metrics"]["eval_row_checksum"] == reference["expected_checksum"], "reference row order")
    # the same outputs as transformers.Trainer: metric keys, steps, early stop, checkpoint layout
    check(
        ours["train_metrics"] == reference["train_metrics"],
        f"train metrics {ours['train_metrics']} != {reference['train_metrics']}",
    )
    check(sorted(ours["eval_metrics"]) == sorted(reference["eval_metrics"]), f"eval metrics {ours['eval_metrics']}")
    check(
        ours["global_step"] == reference["global_step"] == 8,
        f"early stop {ours['global_step']} {reference['global_step']}",
    )  # at the 2nd evaluation
    check(
        ours["checkpoints"] == reference["checkpoints"] == ["checkpoint-4", "checkpoint-8"],
        f"checkpoints {ours['checkpoints']} {reference['checkpoints']}",
    )
    check(set(reference["log_keys"]) <= set(ours["log_keys"]), f"log keys {ours['log_keys']} {reference['log_keys']}")
    check(ours["state"]["global_step"] == 8 and ours["state"]["best_metric"] is not None, f"state {ours['state']}")
    check(Path(ours["best"]).name in ours["checkpoints"], f"best {ours['best']}")
    for key in ("shape", "metrics", "labels_rows"):
        check(
            ours["predict"][key] == reference["predict"][key],
            f"predict {key}: {ours['predict'][key]} != {reference['predict'][key]}",
        )
    missing = sorted(set(reference["checkpoint_files"]) - set(ours["checkpoint_files"]))
    check(not missing, f"checkpoint files missing: {missing}")
    # evaluate()/predict() after training: the script's callbacks get Trainer's events, rank 0's state on rank 0
    check(
        ours["events_after_training"] == reference["events_after_training"],
        f"events after training {ours['events_after_training']} != {reference['events_after_training']}",
    )
    missing = sorted(set(reference["final_files"]) - set(ours["final_files"]))
    check(not missing, f"save_model files missing: {missing}")
    assert not problems, problems


def test_torchrun_script_runs_in_place(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    cache = tmp_path / "data-cache"
    ours = run_script(torchrun(SCRIPT, str(out)), out, TRAINBRIDGE_DATA_CACHE=str(cache))
    _check_against_reference(ours, reference)
    # the in-place datasets were tokenised once on the node (one entry each: training and validation rows, one
    # rank built each under its lock, the other read it), into a private cache; no scratch folder left
    entries = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert len(entries) == 2 and not any(".tmp-" in name for name in entries), entries
    assert all(p.stat().st_mode & 0o077 == 0 for p in [cache, *cache.rglob("*")])
    # one training, not one per rank: the metrics file holds each logged step once
    steps = [
        json.loads(line)["step"]
        for line in (out / "trainbridge" / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert steps == sorted(set(steps))


@pytest.fixture(scope="module")
def python_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Ours under ``python script.py`` (2 ranks), one launch: the plain run, then the ``dict`` one."""
    out = tmp_path_factory.mktemp("facade") / "python"
    command = [sys.executable, str(SCRIPT), str(out), "both"]
    return run_script_folders(command, out, ["plain", "dict"], TRAINBRIDGE_NPROC_PER_NODE="2")


def test_python_script_runs_as_under_torchrun(reference: dict, python_runs: dict[str, dict]) -> None:
    _check_against_reference(python_runs["plain"], reference)


def test_a_dict_of_eval_datasets_is_evaluated_set_by_set_during_training(python_runs: dict[str, dict]) -> None:
    """``eval_dataset={"a": 37 rows, "b": 11 rows}``, ``metric_for_best_model="a_accuracy"``, on 2 ranks (the
    ``python script.py`` launch, after the plain run): as transformers.Trainer (checked side by side,
    examples/ported/README.md), every evaluation (steps 4 and 8, then ``trainer.evaluate()``) logs set a then set
    b, each ``eval_<name>_`` only; best model and early stopping follow ``eval_a_accuracy``; compute_metrics
    sees each set's rows once per rank pair, in order."""
    ours = python_runs["dict"]
    keys = ["accuracy", "loss", "num_rows", "row_checksum", "runtime", "samples_per_second", "steps_per_second"]
    expected = [[step, [f"eval_{name}_{k}" for k in keys]] for step in (4, 8, 8) for name in "ab"]
    assert ours["eval_log_steps"] == expected
    assert ours["eval_metrics"]["eval_a_num_rows"] == 37 and ours["eval_metrics"]["eval_b_num_rows"] == 11
    assert ours["eval_metrics"]["eval_a_row_checksum"] == ours["expected_checksum"]
    assert ours["global_step"] == 8 and ours["checkpoints"] == ["checkpoint-4", "checkpoint-8"]  # early stop
    assert ours["state"]["best_metric"] is not None and Path(ours["best"]).name in ours["checkpoints"]
    assert ours["checkpoint_files"].count("training_args.bin") == 2


def _train_unwritable(env: object, model_dir: str, out: str) -> tuple[str, str]:
    """On each rank of a script under a launcher: ``trainer.train()`` on data only rank 1 cannot prepare (items of
    dicts of columns, by the first, with a later one that is not); the script catches the error, as a notebook
    cell would, and stays alive."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    from trainbridge import Trainer

    args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", max_steps=1)
    rows: list[object] = [{"input_ids": [1, 2, 3]}, [1, 2, 3] if dist.get_rank() == 1 else {"input_ids": [2, 3]}]
    trainer = Trainer(model=model_dir, args=args, train_dataset=rows)
    try:
        trainer.train()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", "train() returned"


def test_one_rank_failing_to_prepare_its_data_fails_every_rank(tmp_path: Path) -> None:
    """Every rank reads the script's data in place; when one raises preparing it, the other learns it at once
    and raises naming that rank and the cause (rather than waiting in a collective until its timeout)."""
    from tests.distributed.conftest import run_on_ranks
    from trainbridge.demos.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "model")
    (rank0, message0), (rank1, message1) = run_on_ranks(_train_unwritable, str(model_dir), str(tmp_path / "out"))
    assert "train_dataset[1]" in message1, (rank1, message1)
    assert rank0 == "RankZeroError", message0
    assert "rank 1 failed preparing its data" in message0 and "train_dataset[1]" in message0
