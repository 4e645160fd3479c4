"""Evaluation during ``train()`` as ``transformers.Trainer``'s, in place (one rank), against real Trainer on the
same model, data and arguments.  On Trainer's sample batches (the script's collate function) each evaluation is
Trainer's own ``evaluate()`` on the engine's model (``LoopTrainer._evaluation``), so ``batch_eval_metrics``,
``eval_do_concat_batches``, ``eval_accumulation_steps``, ``include_for_metrics`` and ``prediction_loss_only``
hold by construction; on the padding-free token batches the loop's evaluation calls ``compute_metrics`` as
Trainer does (``loop.predictions``)."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
import transformers
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from tests.run_inputs import split_run
from tests.unit.test_trainer_facade import _TwoRanks
from trainbridge import Trainer
from trainbridge.demos.tiny_model import build_tiny_llama_once
from trainbridge.loop.predictions import PredictionCollector
from trainbridge.parallel.script_optimizer import back_to_training


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_tiny_llama_once(tmp_path_factory.mktemp("evaluation") / "llama"))


@pytest.fixture(scope="module")
def llama(folder: Path) -> tuple[Any, Any, datasets.Dataset]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    rows = []
    for _ in range(21):
        ids = tokenizer("".join(rng.choice("12+ab") for _ in range(rng.randint(4, 9))))["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer, datasets.Dataset.from_list(rows)


def _shape(value: Any) -> Any:
    if isinstance(value, Mapping):  # Trainer's batch_eval_metrics inputs: its rank's batch
        return {key: _values(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [type(value).__name__, [_shape(v) for v in value]]
    return list(np.asarray(value.cpu() if hasattr(value, "cpu") else value).shape) if value is not None else None


def _values(value: Any) -> Any:
    return np.asarray(value.cpu() if hasattr(value, "cpu") else value).tolist()


class Metrics:
    """``compute_metrics`` (with ``batch_eval_metrics``: ``compute_result``); keeps how it was called."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.tokens = 0
        self.losses: list[Any] = []
        """Each call's ``losses`` (``include_for_metrics``), compared with a tolerance."""

    def __call__(self, p: Any, compute_result: bool | None = None) -> dict[str, float]:
        self.calls.append(
            {
                "compute_result": compute_result,
                "predictions": _shape(p.predictions),
                "label_ids": _shape(p.label_ids),
                "inputs": _shape(p.inputs),
                "losses": _shape(p.losses),
            }
        )
        if p.losses is not None:
            self.losses.append([_values(part) for part in (p.losses if isinstance(p.losses, list) else [p.losses])])
        self.tokens += int(sum(np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels).size for labels in
                               (p.label_ids if isinstance(p.label_ids, list) else [p.label_ids])))  # fmt: skip
        return {"seen": float(self.tokens)} if compute_result in (None, True) else {}


def _collate(tokenizer: Any) -> Any:
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def collate(items: list[Any]) -> Any:  # a function of the script's: Trainer's sample batches
        return collator(items)

    return collate


def _both(
    llama: tuple[Any, Any, datasets.Dataset], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own: bool, **fields: Any
) -> list[tuple[Any, Metrics]]:
    model, tokenizer, rows = llama
    runs = []
    for cls in (transformers.Trainer, Trainer):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__module__), per_device_train_batch_size=4, per_device_eval_batch_size=3,
            max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="none",
            use_cpu=True, disable_tqdm=True, **fields,
        )  # fmt: skip
        if cls is Trainer:  # in place, as under a launcher (after the arguments)
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
        metrics = Metrics()
        collator = _collate(tokenizer) if own else DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = cls(
            model=copy.deepcopy(model), args=args, train_dataset=rows, eval_dataset=rows.select(range(8)),
            data_collator=collator, compute_metrics=metrics,
        )  # fmt: skip
        trainer.train()
        runs.append((trainer, metrics))
    return runs


def _eval_rows(trainer: Any) -> list[dict[str, Any]]:
    return [row for row in trainer.state.log_history if "eval_loss" in row]


CASES = {
    "batch_eval_metrics": dict(batch_eval_metrics=True, include_for_metrics=["inputs", "loss"]),
    "lists": dict(eval_do_concat_batches=False, eval_accumulation_steps=1),
}
CASES_BY_HAND = {"loss_only": dict(prediction_loss_only=True)}  # compat_full: left out of CI (suite time)


@pytest.mark.parametrize(
    "case", [*CASES, *(pytest.param(case, marks=pytest.mark.compat_full) for case in CASES_BY_HAND)]
)
def test_evaluation_on_sample_batches_is_trainers_own(
    case: str, llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {**CASES, **CASES_BY_HAND}[case]
    (reference, want), (trainer, got) = _both(llama, tmp_path, monkeypatch, own=True, **fields)
    expected, rows = _eval_rows(reference), _eval_rows(trainer)
    assert [sorted(r) for r in rows] == [sorted(r) for r in expected] and len(rows) == 2
    for row, want_row in zip(rows, expected, strict=True):
        assert row["step"] == want_row["step"]
        assert row["eval_loss"] == pytest.approx(want_row["eval_loss"], rel=1e-2)  # (the steps differ slightly)
        assert row.get("eval_seen") == want_row.get("eval_seen")
    assert got.calls == want.calls


TOKEN_CASES = {
    "batch_eval_metrics": dict(batch_eval_metrics=True, include_for_metrics=["inputs", "loss"]),
    "lists": dict(
        eval_do_concat_batches=False,
        eval_accumulation_steps=1,
        include_for_metrics=["inputs", "loss"],
        label_names=["labels"],
    ),
    "loss_only": dict(prediction_loss_only=True),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.compat_full) if c == "loss_only" else c for c in TOKEN_CASES]
)
def test_the_token_batches_evaluation_calls_compute_metrics_as_trainer(
    case: str, llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padding-free evaluation (the LM collator, reproduced): ``compute_metrics`` is called per Trainer batch
    (3 rows, the last 2) with ``compute_result`` as Trainer, gets lists of those batches, or is not called;
    ``include_for_metrics``: the inputs (per batch: the rank's batch as the collator builds it) and the losses
    (each batch's loss, per row) Trainer hands it; ``eval_accumulation_steps`` and ``label_names`` change
    nothing, as under Trainer."""
    (reference, want), (trainer, got) = _both(llama, tmp_path, monkeypatch, own=False, **TOKEN_CASES[case])
    assert [sorted(r) for r in _eval_rows(trainer)] == [sorted(r) for r in _eval_rows(reference)]
    assert [r.get("eval_seen") for r in _eval_rows(trainer)] == [r.get("eval_seen") for r in _eval_rows(reference)]
    assert got.calls == want.calls
    assert len(got.losses) == len(want.losses) == (6 if case == "batch_eval_metrics" else 2 if case == "lists" else 0)
    for ours, theirs in zip(got.losses, want.losses, strict=True):
        assert [len(part) for part in ours] == [len(part) for part in theirs]
        for part, want_part in zip(ours, theirs, strict=True):  # (the trained weights differ slightly)
            assert part == pytest.approx(want_part, rel=1e-2)
            assert len(set(part[:3])) == 1  # one batch loss, repeated for its rows


@pytest.mark.parametrize("fields", [dict(batch_eval_metrics=True), dict(eval_do_concat_batches=False)])
def test_on_two_ranks_a_trainer_batch_is_every_ranks_batch(
    fields: dict[str, Any], folder: Path, tmp_path: Path
) -> None:
    """5 samples on 2 ranks, 2 per rank per batch: Trainer's gathered batches hold samples 0-3, then 4 (accelerate
    drops the samples it repeats to even out the last batch); each is padded to its own longest row."""
    model_dir = folder
    metrics = Metrics()
    hf = TrainingArguments(str(tmp_path / "o"), per_device_eval_batch_size=2, use_cpu=True, **fields)
    args, plan = split_run(
        model_path=model_dir, data_path=model_dir / "config.json", ckpt_output_dir=tmp_path / "o",
        compute_metrics=metrics,
    )  # fmt: skip
    plan = plan.replace(hf_args=hf)

    def batch(rows: list[list[int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)

    rank0, rank1 = PredictionCollector(args, plan, 2), PredictionCollector(args, plan, 2)
    for collector, indices, rows in ((rank0, [0, 2, 4], [[1], [2, 2, 2], [4, 4]]), (rank1, [1, 3], [[1, 1], [3]])):
        b, labels = batch(rows)
        collector.add(indices, b, labels, labels)
    rank0.compute(_TwoRanks(rank1._samples))
    if fields.get("batch_eval_metrics"):
        assert [c["compute_result"] for c in metrics.calls] == [False, True]
        assert [c["label_ids"] for c in metrics.calls] == [[4, 3], [1, 2]]
    else:
        assert [c["label_ids"] for c in metrics.calls] == [["list", [[4, 3], [1, 2]]]]


def test_an_optimizer_with_modes_is_back_in_train_mode_after_an_evaluation() -> None:
    """A schedule-free optimizer (``train()``/``eval()``), which Trainer's evaluation_loop put in eval mode, is put
    back in train mode (as Trainer's next training_step does); a plain optimizer is left alone."""

    class Modal(torch.optim.SGD):
        mode = "train"

        def train(self) -> None:
            self.mode = "train"

        def eval(self) -> None:
            self.mode = "eval"

    optimizer = Modal([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.eval()
    back_to_training(optimizer)
    assert optimizer.mode == "train"
    back_to_training(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    back_to_training(None)
