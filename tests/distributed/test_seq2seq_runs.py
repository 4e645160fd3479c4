"""A ``Seq2SeqTrainer`` script with ``predict_with_generate`` whose class overrides ``compute_loss``
(``scripts/seq2seq_script.py``, issue 39: generation plus a custom loss), on 2 ranks, against
transformers.Seq2SeqTrainer running the same subclass: the same global_step, losses, log and eval steps, log and
metric keys, compute_metrics' values during training, checkpoint files and ``compute_loss`` calls (training and
evaluation); each evaluation during training is Seq2SeqTrainer's own ``evaluate`` on the loop's DDP model, so
``compute_metrics`` gets what Seq2SeqTrainer gives it (generated token ids padded as it pads them, with
``generation_max_length``; the samples accelerate repeats to even out the ranks' batches included), and after
training ``evaluate``/``predict`` pass their ``generate`` arguments. Launch styles: ``torchrun script.py`` here in
CI; ``python script.py`` (the forked ranks) under ``compat_full``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "seq2seq_script.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("seq2seq") / "real"
    return run_script(torchrun(SCRIPT, str(out), "real"), out)


def _check(ours: dict, reference: dict) -> None:
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["log_steps"] == reference["log_steps"] == [1, 2, 3, 4]
    assert ours["eval_steps"] == reference["eval_steps"] == [2, 4, 4]  # the last: evaluate() after training
    assert set(reference["eval_keys"]) <= set(ours["eval_keys"])
    assert ours["evaluate_keys"] == reference["evaluate_keys"]
    assert ours["predict_keys"] == reference["predict_keys"]
    # predict() is Seq2SeqTrainer's own: accelerator.gather keeps the samples that accelerate's even batches
    # repeat on the second rank (8 rows for 6, 16 for 10)
    assert ours["predict_shape"] == reference["predict_shape"] == [8, 20]
    assert sorted(ours["checkpoints"]) == sorted(reference["checkpoints"]) == ["checkpoint-2", "checkpoint-4"]
    for name, files in reference["checkpoints"].items():
        assert set(files) <= set(ours["checkpoints"][name]), (name, files)
    # compute_metrics: two evaluations while training (generation_max_length 10), evaluate(max_length=6),
    # predict(max_new_tokens=3): token ids padded to the generation config's max_length (20), as Seq2SeqTrainer
    assert [c["shape"] for c in ours["calls"]] == [c["shape"] for c in reference["calls"]]
    assert [c["shape"] for c in reference["calls"]] == [[16, 20], [16, 20], [16, 20], [8, 20]]
    # the override's loss trains (once per step on rank 0; Seq2SeqTrainer's generating prediction_step takes the
    # model's own loss): the logged losses carry its weight penalty (about 7), the evaluation losses do not
    assert ours["compute_loss_calls"] == reference["compute_loss_calls"] == {"train": 4, "eval": 0}
    for run in (ours, reference):
        assert min(run["losses"]) > max(run["eval_losses"]) + 5
    assert ours["losses"] == pytest.approx(reference["losses"], rel=0.1)  # (the batches' order differs)
    assert ours["eval_losses"] == pytest.approx(reference["eval_losses"], rel=2e-2)
    assert ours["eval_metrics"] == reference["eval_metrics"]  # compute_metrics' values (exact, gen_len)
    assert ours["log_keys"] == reference["log_keys"] and ours["final_keys"] == reference["final_keys"]
    assert all(c["dtype"] == "i" for c in ours["calls"])
    # the longest generation: generation_max_length while training, then the calls' own limits
    assert [c["longest"] for c in ours["calls"]] == [c["longest"] for c in reference["calls"]] == [10, 10, 6, 4]


def test_torchrun_seq2seq_script_generates_in_place(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(run_script(torchrun(SCRIPT, str(out)), out), reference)


@pytest.mark.compat_full  # (a third launch: left out of CI for the suite's time; run by hand)
def test_python_seq2seq_script_runs_as_under_torchrun(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(run_script([sys.executable, str(SCRIPT), str(out)], out, TRAINBRIDGE_NPROC_PER_NODE="2"), reference)
