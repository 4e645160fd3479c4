"""``trainer.hyperparameter_search`` with optuna (transformers' recipe: ``model_init(trial)``, ``hp_space``, a
seeded sampler), in place on one rank, against real ``transformers.Trainer``: the same trials (values, run
folders ``run-<n>/checkpoint-<step>``, one fresh model each), the same best run; a pruned trial stops at the
evaluation that pruned it and the study records it pruned, as under Trainer; Ray Tune is refused before
anything runs.  Both launch styles on 2 ranks: tests/distributed/test_script_kinds.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import transformers
from transformers import DataCollatorWithPadding, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import build_tiny_llama_once, tiny_bert_config

optuna = pytest.importorskip("optuna")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_tiny_llama_once(tmp_path_factory.mktemp("hp") / "llama")
    return transformers.AutoTokenizer.from_pretrained(folder)


def _rows(tokenizer: Any, n: int, seed: int) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).tolist()
    texts = [("x" if label else "y") + "".join(rng.choice(list("abcdefgh"), rng.integers(3, 12))) for label in labels]
    return datasets.Dataset.from_dict({"sentence": texts, "label": labels}).map(
        lambda b: tokenizer(b["sentence"]), batched=True, remove_columns=["sentence"]
    )


class AlwaysPrune(optuna.pruners.BasePruner):  # type: ignore[misc]
    """Prunes every trial at its first report; keeps the study."""

    study: Any = None

    def prune(self, study: Any, trial: Any) -> bool:
        self.study = study
        return True


def _search(
    cls: type, tokenizer: Any, out: Path, monkeypatch: pytest.MonkeyPatch, **search: Any
) -> tuple[Any, list[Any], list[float], list[dict[str, Any]], Any]:
    """``cls``'s search -> (best run, the models model_init built, each evaluation's objective, each trial's
    values, the trainer)."""
    built: list[Any] = []
    objectives: list[float] = []
    trials: list[dict[str, Any]] = []

    def model_init(trial: Any) -> Any:
        config = tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, hidden_dropout_prob=0.0)
        built.append(transformers.BertForSequenceClassification(config))
        return built[-1]

    def hp_space(trial: Any) -> dict[str, Any]:
        values = {
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-3, log=True),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8]),
        }
        trials.append(values)
        return values

    def eval_loss(metrics: dict[str, float]) -> float:
        objectives.append(metrics["eval_loss"])
        return metrics["eval_loss"]

    args = TrainingArguments(
        output_dir=str(out),
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
        num_train_epochs=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_steps=2,
    )
    if cls is Trainer:  # in place, as under a launcher (after the arguments)
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
    trainer = cls(
        model_init=model_init,
        args=args,
        train_dataset=_rows(tokenizer, 16, 1),
        eval_dataset=_rows(tokenizer, 6, 2),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        compute_objective=eval_loss,
        backend="optuna",
        n_trials=2,
        sampler=optuna.samplers.RandomSampler(seed=5),
        **search,
    )
    return best, built, objectives, trials, trainer


def _checkpoints(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.glob("run-*/checkpoint-*"))


def test_each_trial_trains_a_fresh_model_in_place_as_under_trainer(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, built_hf, objectives_hf, trials_hf, hf = _search(transformers.Trainer, tokenizer, tmp_path / "hf", monkeypatch)
    best, built, objectives, trials, ours = _search(Trainer, tokenizer, tmp_path / "ours", monkeypatch)
    assert trials == trials_hf and [t["per_device_train_batch_size"] for t in trials] == [4, 8]
    # each trial's evaluations (the objective: eval_loss at each epoch's end); our batches are not Trainer's
    assert len(objectives) == len(objectives_hf) == 4
    assert objectives == pytest.approx(objectives_hf, rel=0.02)
    assert best.objective == min(objectives[1], objectives[3])  # each trial's last evaluation
    assert best.hyperparameters == trials[int(best.run_id)]
    # the constructor's model, then one per trial; the last trial's model is the one trained
    assert len(built) == len(built_hf) == 3 and ours.state.global_step == hf.state.global_step
    # trial 1's batch size (a trial's TrainingArguments value): its run has half trial 0's steps
    assert _checkpoints(tmp_path / "ours") == _checkpoints(tmp_path / "hf")
    assert len({p.split("/")[0] for p in _checkpoints(tmp_path / "hf")}) == 2
    assert ours.args.learning_rate == hf.args.learning_rate == trials[1]["learning_rate"]  # left as by Trainer


def test_a_pruned_trial_stops_at_its_evaluation_as_under_trainer(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = []
    for cls in (transformers.Trainer, Trainer):
        pruner = AlwaysPrune()
        with pytest.raises(ValueError, match="No trials are completed"):
            _search(cls, tokenizer, tmp_path / cls.__module__, monkeypatch, pruner=pruner)
        study = pruner.study
        runs.append(([t.state for t in study.trials], [sorted(t.intermediate_values) for t in study.trials]))
    assert runs[1] == runs[0]
    assert runs[0][0] == [optuna.trial.TrialState.PRUNED] * 2 and runs[0][1][0] == [4]  # the first epoch's end


def test_ray_tune_is_refused_before_anything_runs(tokenizer: Any, tmp_path: Path) -> None:
    trainer = Trainer(
        model_init=lambda: transformers.BertForSequenceClassification(tiny_bert_config(len(tokenizer))),
        args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True),
        train_dataset=_rows(tokenizer, 4, 1),
    )
    with pytest.raises(ValueError, match=r"backend='ray'.*use backend='optuna'"):
        trainer.hyperparameter_search(backend="ray", n_trials=1)
