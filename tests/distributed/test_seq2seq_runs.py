"""A ``Seq2SeqTrainer`` script with ``predict_with_generate`` (``scripts/seq2seq_script.py``), both launch
styles on 2 ranks, against transformers.Seq2SeqTrainer: the same global_step, log and eval steps, metric keys
and checkpoint files; ``compute_metrics`` gets generated token ids padded as Seq2SeqTrainer pads them, with
``generation_max_length`` during training and the ``generate`` arguments ``evaluate``/``predict`` pass.
After training ``evaluate``/``predict`` are Seq2SeqTrainer's own.  Differs: during training Seq2SeqTrainer on
2 ranks hands ``compute_metrics`` the samples accelerate repeats to even out the ranks' batches; the loop's
evaluation hands over each sample once.
One launch style: ``python script.py`` is re-executed under torchrun at the import, so it runs this same
code (test_script_launch and test_trainer_own_code check the two styles)."""

from __future__ import annotations

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
    # (the loop's evaluations during training: each sample once; after training Seq2SeqTrainer's own)
    assert [c["shape"] for c in ours["calls"]] == [[10, 20], [10, 20], [16, 20], [8, 20]]
    assert [c["shape"] for c in reference["calls"]] == [[16, 20], [16, 20], [16, 20], [8, 20]]
    assert all(c["dtype"] == "i" for c in ours["calls"])
    # the longest generation: generation_max_length while training, then the calls' own limits
    assert [c["longest"] for c in ours["calls"]] == [c["longest"] for c in reference["calls"]] == [10, 10, 6, 4]


def test_torchrun_seq2seq_script_generates_in_place(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(run_script(torchrun(SCRIPT, str(out)), out), reference)
