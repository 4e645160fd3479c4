"""``Seq2SeqTrainer`` with ``predict_with_generate``: a tiny T5 trains in place, and ``compute_metrics`` gets
the generated token ids and labels that ``transformers.Seq2SeqTrainer`` gives it on the same model and
data (one rank)."""

from __future__ import annotations

import copy
import random
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

from tests.run_inputs import RunInputs
from trainbridge import Seq2SeqTrainer
from trainbridge.core.config.loss import ForwardLoss, InstanceStep
from trainbridge.demos.tiny_model import build_tokenizer
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.trainer.job_args import training_job

T5 = dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2)


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def _reverse_rows(count: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    sources = [[rng.randrange(4, 40) for _ in range(rng.randrange(3, 9))] for _ in range(count)]
    return datasets.Dataset.from_dict(
        {"input_ids": sources, "labels": [[t + 1 for t in reversed(s)] + [2] for s in sources]}
    )


class Recorder:
    """``compute_metrics``: a ROUGE/BLEU-style metric on decoded generations; keeps what it was given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []

    def __call__(self, p: Any) -> dict[str, float]:
        predictions, labels = np.asarray(p.predictions), np.asarray(p.label_ids)
        self.seen.append((predictions, labels))
        pad = self.tokenizer.pad_token_id
        decoded = self.tokenizer.batch_decode(np.where(predictions != -100, predictions, pad), skip_special_tokens=True)
        references = self.tokenizer.batch_decode(np.where(labels != -100, labels, pad), skip_special_tokens=True)
        overlap = [len(set(d) & set(r)) / max(1, len(set(r))) for d, r in zip(decoded, references)]
        return {"overlap": float(np.mean(overlap)), "gen_len": float(np.mean([len(d) for d in decoded]))}


def _args(out: Path, **overrides: Any) -> Seq2SeqTrainingArguments:
    values: dict[str, Any] = dict(
        output_dir=str(out),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        predict_with_generate=True,
        generation_max_length=12,
        seed=3,
    )
    values.update(overrides)
    return Seq2SeqTrainingArguments(**values)


@pytest.fixture
def t5(tmp_path: Path) -> tuple[Any, Any]:
    tok = build_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    config = T5Config(**T5, vocab_size=80, pad_token_id=0, decoder_start_token_id=0, eos_token_id=2)
    return T5ForConditionalGeneration(config), tok


def test_evaluate_gives_compute_metrics_the_generated_ids_seq2seq_trainer_gives(
    t5: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    model, tok = t5
    # 8 rows, two full batches: on a shorter last batch Trainer weighs its mean loss by the first batch's size
    train, evaluation = _reverse_rows(32, seed=0), _reverse_rows(8, seed=1)
    ours, theirs = Recorder(tok), Recorder(tok)
    reference = transformers.Seq2SeqTrainer(
        model=copy.deepcopy(model),
        args=_args(tmp_path / "hf"),
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tok,
        data_collator=DataCollatorForSeq2Seq(tok, model=model),
        compute_metrics=theirs,
    )
    expected = reference.evaluate()
    args = _args(tmp_path / "tb")
    _in_place(monkeypatch)  # (after the arguments: TrainingArguments would set up torch.distributed)
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tok,
        data_collator=DataCollatorForSeq2Seq(tok, model=model),
        compute_metrics=ours,
    )
    got = trainer.evaluate()
    (predictions, labels), (want_predictions, want_labels) = ours.seen[-1], theirs.seen[-1]
    # generated ids (max_length 12 from generation_max_length), padded to the generation config's 20 with
    # the pad token, as are the labels: the same arrays as Seq2SeqTrainer's, not the forward's logits
    assert predictions.shape == want_predictions.shape == (8, 20)
    np.testing.assert_array_equal(predictions, want_predictions)
    np.testing.assert_array_equal(labels, want_labels)
    assert got["eval_overlap"] == pytest.approx(expected["eval_overlap"])
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-4)


def test_seq2seq_trainer_trains_and_evaluates_on_generated_ids(
    t5: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = t5
    recorder = Recorder(tok)
    args = _args(tmp_path / "out", max_steps=6, eval_strategy="steps", eval_steps=3, generation_num_beams=2)
    _in_place(monkeypatch)
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=_reverse_rows(32, seed=0),
        eval_dataset=_reverse_rows(6, seed=1),
        processing_class=tok,
        data_collator=DataCollatorForSeq2Seq(tok, model=model),
        compute_metrics=recorder,
    )
    out = trainer.train()
    assert out.global_step == 6
    evals = [e for e in trainer.state.log_history if "eval_overlap" in e]
    assert [e["step"] for e in evals] == [3, 6] and all("eval_gen_len" in e and "eval_loss" in e for e in evals)
    predictions, labels = recorder.seen[-1]
    assert predictions.shape == (6, 20) and predictions.dtype.kind == "i"  # token ids, not logits
    assert labels.shape == (6, 20)


def test_the_predictions_seam_is_chosen_from_predict_with_generate(t5: tuple[Any, Any], tmp_path: Path) -> None:
    """The class's plan holds the predictions seam (``RunPlan.predictions``), not a ``TrainingArgs`` flag; a
    plan's own seam and ``TrainingArgs.predict_with_generate`` together are refused, naming the field."""
    from trainbridge.core.config import check_consistent
    from trainbridge.core.config.plan import Generate
    from trainbridge.trainer import job_args

    model = t5[0]
    trainer = Seq2SeqTrainer(
        model=model, args=_args(tmp_path / "out", generation_num_beams=3), train_dataset=_reverse_rows(8, seed=0)
    )
    ported = RunInputs(*job_args.training_job(trainer, 1, None))
    assert ported.plan.predictions == Generate({"max_length": 12, "num_beams": 3})
    assert not ported.args.predict_with_generate
    trainer.args.predict_with_generate = False
    assert RunInputs(*job_args.training_job(trainer, 1, None)).plan.predictions is None
    with pytest.raises(ValueError, match=r"^predict_with_generate: .*leave predict_with_generate False"):
        check_consistent(ported.args.model_copy(update={"predict_with_generate": True}), ported.plan)


def test_label_smoothing_is_trainers_step_unless_the_class_generates(t5: tuple[Any, Any], tmp_path: Path) -> None:
    """Only a class that generates (``Seq2SeqTrainer``) drops Trainer's smoothed loss for its generation step; a
    plain ``Trainer`` given ``Seq2SeqTrainingArguments(predict_with_generate=True)`` never generates, so its
    ``label_smoothing_factor`` trains through Trainer's own ``compute_loss``, as under ``transformers.Trainer``."""
    from trainbridge import Trainer

    args = _args(tmp_path / "out", label_smoothing_factor=0.1)
    plain_trainer = Trainer(model=t5[0], args=args, train_dataset=_reverse_rows(8, seed=0))
    plain = plain_trainer.run_plan()
    assert isinstance(plain.loss, InstanceStep) and plain.predictions is None
    generating_trainer = Seq2SeqTrainer(model=t5[0], args=args, train_dataset=_reverse_rows(8, seed=0))
    generating = generating_trainer.run_plan()
    assert generating.loss == ForwardLoss() and generating.predictions is not None
    # the port warns that the smoothing is ignored only where it is: not where Trainer's compute_loss applies it
    with warnings.catch_warnings(record=True) as plain_warnings:
        warnings.simplefilter("always")
        training_job(plain_trainer, 1, None)
    assert not [w for w in plain_warnings if "label_smoothing_factor" in str(w.message)]
    with pytest.warns(HFPortingWarning, match=r"label_smoothing_factor=0\.1 is ignored"):
        training_job(generating_trainer, 1, None)


def _trainer(
    cls: Any, model: Any, tok: Any, out: Path, monkeypatch: pytest.MonkeyPatch | None = None, **arg_overrides: Any
) -> tuple[Any, Recorder]:
    """``cls`` (``transformers.Seq2SeqTrainer``, or ours with ``monkeypatch``: in place) on ``model``, with a
    ``Recorder`` as compute_metrics.  Run the reference's evaluations before building ours: ours resets
    accelerate's state."""
    recorder = Recorder(tok)
    args = _args(out, **arg_overrides)
    if monkeypatch is not None:
        _in_place(monkeypatch)  # (after the arguments: TrainingArguments would set up torch.distributed)
    trainer = cls(
        model=model,
        args=args,
        train_dataset=_reverse_rows(16, seed=0),
        eval_dataset=_reverse_rows(8, seed=1),
        processing_class=tok,
        data_collator=DataCollatorForSeq2Seq(tok, model=model),
        compute_metrics=recorder,
    )
    return trainer, recorder


def test_evaluate_and_predict_pass_their_generate_arguments_as_seq2seq_trainer(
    t5: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    model, tok = t5
    test_rows = _reverse_rows(6, seed=2)
    reference, theirs = _trainer(transformers.Seq2SeqTrainer, copy.deepcopy(model), tok, tmp_path / "hf")
    reference.evaluate(max_length=5, num_beams=2)
    expected = reference.predict(test_rows, max_new_tokens=3, repetition_penalty=1.5)
    reference.evaluate()
    trainer, ours = _trainer(Seq2SeqTrainer, model, tok, tmp_path / "tb", monkeypatch)
    # evaluate(max_length=, num_beams=): shorter generations than generation_max_length's 12, beam search
    trainer.evaluate(max_length=5, num_beams=2)
    np.testing.assert_array_equal(ours.seen[0][0], theirs.seen[0][0])
    assert (ours.seen[0][0][:, 5:] == tok.pad_token_id).all()  # max_length 5, padded to the config's 20
    # predict(max_new_tokens=): replaces generation_max_length; any other generate argument passes through
    got = trainer.predict(test_rows, max_new_tokens=3, repetition_penalty=1.5)
    np.testing.assert_array_equal(got.predictions, expected.predictions)
    assert (got.predictions[:, 4:] == tok.pad_token_id).all()
    # the call's arguments last for that call only: evaluate() generates with generation_max_length again
    trainer.evaluate()
    np.testing.assert_array_equal(ours.seen[-1][0], theirs.seen[-1][0])
    assert not (ours.seen[-1][0][:, 5:12] == tok.pad_token_id).all()


def test_the_generation_config_argument_and_the_models_own_are_used_as_seq2seq_trainer(
    t5: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from transformers import GenerationConfig

    model, tok = t5
    # the model's own generation config: generate's defaults and the length predictions are padded to
    model.generation_config.max_length = 9
    model.generation_config.no_repeat_ngram_size = 2
    # Seq2SeqTrainingArguments(generation_config=...) replaces the model's
    config = GenerationConfig(
        max_length=7, num_beams=2, decoder_start_token_id=0, eos_token_id=2, pad_token_id=0, length_penalty=0.5
    )
    hf = transformers.Seq2SeqTrainer
    reference, theirs = _trainer(hf, copy.deepcopy(model), tok, tmp_path / "hf", generation_max_length=None)
    reference.evaluate()
    reference, theirs_configured = _trainer(
        hf, copy.deepcopy(model), tok, tmp_path / "hf2", generation_max_length=None, generation_config=config
    )
    reference.evaluate()
    trainer, ours = _trainer(
        Seq2SeqTrainer, copy.deepcopy(model), tok, tmp_path / "tb", monkeypatch, generation_max_length=None
    )
    trainer.evaluate()
    (predictions, labels), (want, want_labels) = ours.seen[-1], theirs.seen[-1]
    assert predictions.shape == want.shape == (8, 9)
    np.testing.assert_array_equal(predictions, want)
    np.testing.assert_array_equal(labels, want_labels)
    monkeypatch.undo()  # (the arguments of the next trainer are built outside the launcher's environment)
    trainer, ours = _trainer(
        Seq2SeqTrainer, model, tok, tmp_path / "tb2", monkeypatch, generation_max_length=None, generation_config=config
    )
    assert trainer.model.generation_config.max_length == 7
    trainer.evaluate()
    (predictions, _), (want, _) = ours.seen[-1], theirs_configured.seen[-1]
    assert predictions.shape == want.shape == (8, 7)
    np.testing.assert_array_equal(predictions, want)


def _doubled_loss(cls: Any) -> Any:
    """``cls`` with a ``compute_loss`` override: the model's loss doubled (a custom training loss)."""

    class Doubled(cls):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            return (2 * loss, outputs) if return_outputs else 2 * loss

    return Doubled


def test_a_compute_loss_override_trains_with_generated_predictions_as_seq2seq_trainer(
    t5: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation plus a custom loss (issue 39): the override's loss trains (every logged loss twice the plain
    class's: the gradients, clipped to max_grad_norm 1 from norms above it, are the same) and each evaluation
    generates with generation_max_length and reports the model's own loss, as ``Seq2SeqTrainer.prediction_step``
    does, the same as the plain class's (before: refused when the step was chosen)."""
    model, tok = t5
    steps = dict(max_steps=4, eval_strategy="steps", eval_steps=2, logging_steps=1)
    plain, plain_seen = _trainer(Seq2SeqTrainer, copy.deepcopy(model), tok, tmp_path / "plain", monkeypatch, **steps)
    plain.train()
    monkeypatch.undo()  # (the arguments of the next trainer are built outside the launcher's environment)
    doubled, seen = _trainer(_doubled_loss(Seq2SeqTrainer), model, tok, tmp_path / "doubled", monkeypatch, **steps)
    doubled.train()

    def logged(trainer: Any, key: str) -> list[tuple[int, float]]:
        return [(row["step"], row[key]) for row in trainer.state.log_history if key in row]

    assert [s for s, _ in logged(doubled, "loss")] == [1, 2, 3, 4]
    assert [(s, 2 * v) for s, v in logged(plain, "loss")] == [
        (s, pytest.approx(v, rel=1e-5)) for s, v in logged(doubled, "loss")
    ]
    assert all(v > 1.0 for _, v in logged(doubled, "grad_norm"))  # clipped alike
    for key in ("eval_loss", "eval_overlap", "eval_gen_len"):
        assert [s for s, _ in logged(doubled, key)] == [2, 4], key
        assert logged(doubled, key) == [(s, pytest.approx(v, rel=1e-5)) for s, v in logged(plain, key)], key
    assert len(seen.seen) == len(plain_seen.seen) == 2
    for (predictions, labels), (want_predictions, want_labels) in zip(seen.seen, plain_seen.seen, strict=True):
        assert predictions.dtype.kind == "i" and predictions.shape == (8, 20)  # generated ids, max_length 12
        assert (predictions[:, 12:] == tok.pad_token_id).all()
        np.testing.assert_array_equal(predictions, want_predictions)
        np.testing.assert_array_equal(labels, want_labels)
