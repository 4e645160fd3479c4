"""Items that are not dicts of columns (issue 29, failure 3): Trainer hands any item to the collator and any
batch to ``training_step``, so a ``TensorDataset``, a list of tuples or a stream of tuples trains with the
instance's own ``get_train_dataloader()``, step and ``evaluate()`` -- in place on one rank, against
``transformers.Trainer`` in this process (the same losses step by step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import TrainingArguments

import trainbridge
from tests.run_inputs import as_run
from trainbridge.core.config.loss import InstanceStep
from trainbridge.data import script_data
from trainbridge.demos.tiny_model import arithmetic_problems


def _tuples(tokenizer: Any, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(input_ids, attention_mask, labels)`` per problem, padded to one width."""
    encoded = [tokenizer(p + a)["input_ids"] for p, a in arithmetic_problems(count, seed)]
    width = max(map(len, encoded))
    items = []
    for row in encoded:
        ids = torch.full((width,), tokenizer.pad_token_id)
        ids[: len(row)] = torch.tensor(row)
        mask = (torch.arange(width) < len(row)).long()
        items.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return items


class TupleStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A stream of tuples (no length): its first item is read again by every fresh iterator."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)


def collate_tuples(items: list[Any]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack(column) for column in zip(*items, strict=True))


def collate_dicts(items: list[Any]) -> dict[str, torch.Tensor]:
    ids, mask, labels = collate_tuples(items)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _tuple_trainer(base: type) -> type:
    class TupleTrainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            ids, mask, labels = inputs
            outputs = model(input_ids=ids, attention_mask=mask, labels=labels)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

        def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
            ids, mask, labels = self._prepare_inputs(inputs)
            with torch.no_grad():
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            return loss.detach(), None, None

    return TupleTrainer


KINDS = {
    # how the training tuples are held; whether the batches stay tuples (collate_tuples and the overrides)
    "tensor_dataset": (lambda items: torch.utils.data.TensorDataset(*map(torch.stack, zip(*items))), True),
    "stream_of_tuples": (TupleStream, True),
    "tuples_to_dicts": (list, False),  # a list of tuples, a collator making dicts, no overrides
}


def _run(base: type, kind: str, model_dir: Path, out: Path) -> tuple[list[tuple[int, float]], list[Any], Any]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    make, tuple_batches = KINDS[kind]
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=4,
        max_steps=4 if kind == "stream_of_tuples" else -1,
        num_train_epochs=1,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        learning_rate=1e-2,
        remove_unused_columns=False,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=5,
    )
    cls = _tuple_trainer(base) if tuple_batches else base
    trainer = cls(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=make(_tuples(tokenizer, 16, seed=1)),
        eval_dataset=torch.utils.data.TensorDataset(*map(torch.stack, zip(*_tuples(tokenizer, 8, seed=2)))),
        data_collator=collate_tuples if tuple_batches else collate_dicts,
    )
    trainer.train()
    history = trainer.state.log_history
    losses = [(e["step"], e["loss"]) for e in history if "loss" in e]
    evaluations = [(e["step"], round(e["eval_loss"], 4)) for e in history if "eval_loss" in e]
    return losses, evaluations, trainer


@pytest.mark.parametrize("kind", list(KINDS))
def test_items_that_are_not_dicts_train_as_under_trainer(kind: str, tiny_llama: Path, tmp_path: Path) -> None:
    real_losses, real_evaluations, _ = _run(transformers.Trainer, kind, tiny_llama, tmp_path / "real")
    losses, evaluations, trainer = _run(trainbridge.Trainer, kind, tiny_llama, tmp_path / "ours")
    assert [step for step, _ in losses] == [step for step, _ in real_losses] == [1, 2, 3, 4]
    assert [loss for _, loss in losses] == pytest.approx([loss for _, loss in real_losses], rel=1e-5)
    assert evaluations == real_evaluations and [step for step, _ in evaluations] == [2, 4]
    assert not (trainer.output_dir / ".trainbridge" / "train").exists()  # no rows written: Trainer's loader read them


def test_the_model_trains_on_after_an_evaluation_that_is_not_the_loops(args_for: Any) -> None:
    """Trainer's own ``evaluation_loop`` (an ``evaluate`` of the script's, or Trainer's for tuple items) leaves the
    model in eval mode; the loop's next steps train it in train mode (dropout on) all the same."""
    from trainbridge.callbacks import ScheduleCallback
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.loop import train

    models: list[Any] = []
    modes: list[tuple[int, bool]] = []

    def evaluation(run: Any) -> dict[str, float]:
        models[0].eval()  # as Trainer's evaluation_loop does
        return {"eval_loss": 0.0}

    class Modes(trainbridge.Callback):
        def on_train_begin(self, context: Any, **kwargs: Any) -> None:
            models.append(context.model)

        def on_step_begin(self, context: Any, **kwargs: Any) -> None:
            modes.append((context.global_step, context.model.training))

    args = args_for(max_steps=4, eval_strategy="steps", eval_steps=2, evaluation=evaluation)
    train(*as_run(args), DistributedEnv(), [ScheduleCallback(), Modes()])
    assert modes == [(0, True), (1, True), (2, True), (3, True)]  # evaluated after step 2


def test_column_items_looks_at_the_first_item_of_each_kind() -> None:
    import datasets

    assert script_data.column_items(datasets.Dataset.from_dict({"a": [1]}))
    assert script_data.column_items([{"a": 1}]) and script_data.column_items(None) and script_data.column_items([])
    assert not script_data.column_items([(1, 2)]) and not script_data.column_items([object()])
    assert not script_data.column_items(TupleStream([(1,)])) and script_data.column_items(TupleStream([{"a": 1}]))
    assert not script_data.column_items({"one": [{"a": 1}], "two": [[1, 2]]})  # named sets: each set's


def test_tuple_items_route_to_the_instances_loader_step_and_evaluate(tiny_llama: Path, tmp_path: Path) -> None:
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    items = [(torch.tensor([1, 2]),)] * 4
    plain = trainbridge.Trainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2]}] * 4)
    plan = plain.run_plan()
    assert plan.train_loader is None and not isinstance(plan.loss, InstanceStep) and plan.evaluation is None
    tuples = trainbridge.Trainer(model=model, args=args, train_dataset=items, eval_dataset=items)
    plan = tuples.run_plan()
    assert plan.train_loader is not None and isinstance(plan.loss, InstanceStep) and plan.evaluation is not None
