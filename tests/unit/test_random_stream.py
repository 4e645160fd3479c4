"""Dropout and random per-access transforms on Trainer's sample batches draw torch's random stream as under
``transformers.Trainer`` (in place, one rank): each epoch's pass draws the ``DataLoader``'s base seed and
reads one micro-batch ahead of the step (accelerate's ``DataLoaderShard``), so a classifier with dropout, on
items masked at random when read, gives Trainer's loss at every step, over two epochs, with and without
gradient accumulation (``data.loader_workers``).  Under ``group_by_length`` each epoch's order is drawn from
the global generator after the earlier epochs' dropout, as Trainer's ``LengthGroupedSampler`` draws it, and a
resume inside an epoch gets that order back; a stream draws the base seed each pass and reads a round ahead
(``data.stream_batches``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification

from trainbridge import Trainer


class RandomlyMasked(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token rows whose tokens are masked at random (torch's stream) each time an item is read."""

    def __init__(self, count: int) -> None:
        rng = np.random.default_rng(0)
        self.ids = torch.tensor(rng.integers(5, 60, (count, 8)))
        self.labels = torch.tensor(rng.integers(0, 2, count))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        keep = torch.rand(self.ids.shape[1]) > 0.2
        return {"input_ids": torch.where(keep, self.ids[i], 4), "labels": self.labels[i]}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_dropout_and_random_transforms_give_trainers_losses(
    accumulation: int, tmp_path: Path, arguments_for: Any
) -> None:
    model = _classifier()
    losses: list[list[Any]] = []
    for cls in (transformers.Trainer, Trainer):
        args = arguments_for(
            cls,
            output_dir=str(tmp_path / cls.__module__),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=accumulation,
            num_train_epochs=2,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=3,
        )
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=RandomlyMasked(16))
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(losses[1]) == len(losses[0]) == 8 // accumulation
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


class VariableRows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token rows of 3 to 12 tokens (a list each, as a tokenised dataset's), padded by ``pad``."""

    def __init__(self, count: int) -> None:
        rng = np.random.default_rng(1)
        self.rows = [rng.integers(5, 60, int(rng.integers(3, 13))).tolist() for _ in range(count)]
        self.labels = rng.integers(0, 2, count).tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


def pad(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.tensor([item["input_ids"] + [0] * (longest - len(item["input_ids"])) for item in items])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([i["labels"] for i in items])}


def _grouped_run(cls: type, model: Any, out: Path, arguments_for: Any, **arguments: Any) -> Any:
    """A classifier with dropout under ``group_by_length``, 4 steps of 4 items an epoch, three epochs."""
    args = arguments_for(
        cls,
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
        train_sampling_strategy="group_by_length",
        **{"save_strategy": "no", **arguments},
    )
    trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=VariableRows(16), data_collator=pad)
    seen: list[list[int]] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.extend(kwargs["input_ids"][:, 0].tolist()), with_kwargs=True
    )
    return trainer, seen


def _classifier() -> Any:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_dropout_prob=0.3,
        attention_probs_dropout_prob=0.3,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def test_group_by_length_epochs_draw_trainers_order_after_dropout(tmp_path: Path, arguments_for: Any) -> None:
    """``group_by_length``'s sampler draws each epoch's order from the global generator after the earlier
    epochs' dropout: three epochs give Trainer's items and losses at every step."""
    model = _classifier()
    seen, losses = [], []
    for cls in (transformers.Trainer, Trainer):
        trainer, order = _grouped_run(cls, model, tmp_path / cls.__module__, arguments_for)
        trainer.train()
        seen.append(order)
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(seen[1]) == 48 and seen[1] == seen[0]
    assert len(losses[1]) == 12 and losses[1] == pytest.approx(losses[0], rel=1e-6)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_training_stop = control.should_training_stop or state.global_step >= self.step


def test_group_by_length_resumed_inside_an_epoch_gets_its_order_back(tmp_path: Path, arguments_for: Any) -> None:
    """Saved at step 6 (inside the second epoch, whose order was drawn after the first's dropout), a fresh
    Trainer resumes with the uninterrupted run's items and losses (the state the order was drawn from is in
    the checkpoint's RNG file)."""
    model = _classifier()
    whole, seen_whole = _grouped_run(Trainer, model, tmp_path / "whole", arguments_for)
    whole.train()
    out = tmp_path / "resumed"
    first, _ = _grouped_run(Trainer, model, out, arguments_for, save_strategy="steps", save_steps=6)
    first.add_callback(StopAt(6))  # the same schedule as the uninterrupted run's
    first.train()
    resumed, seen = _grouped_run(Trainer, model, out, arguments_for)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert seen == seen_whole[24:]
    ends = [e["loss"] for e in whole.state.log_history if "loss" in e][6:]
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e][-6:] == pytest.approx(ends, rel=1e-6)


class MaskedStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """``RandomlyMasked``'s items as a stream (no length): masked at random as they are read."""

    def __init__(self, count: int) -> None:
        self.items = RandomlyMasked(count)

    def __iter__(self) -> Any:
        for i in range(len(self.items)):
            yield self.items[i]


class CountedStream(MaskedStream):
    """``MaskedStream`` recording each ``set_epoch`` call into ``events``."""

    def __init__(self, count: int, events: list[Any]) -> None:
        super().__init__(count)
        self.events = events

    def set_epoch(self, epoch: int) -> None:
        self.events.append(("set_epoch", epoch))


class StepEvents(transformers.TrainerCallback):
    """Records the epoch and step events Trainer fires, with the global step."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("epoch_begin", state.global_step))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("step_begin", state.global_step))

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("substep_end", state.global_step))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("step_end", state.global_step))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("epoch_end", state.global_step))


def test_a_pass_the_stream_cannot_fill_carries_its_micro_batches_into_the_next_step_as_trainer(
    tmp_path: Path, arguments_for: Any
) -> None:
    """9 items, 2 a micro-batch, 2 micro-batches a step: each pass takes 2 steps and ends with one micro-batch of
    one item (as Trainer's loader gives it), trained without an optimizer step (``on_step_begin``,
    ``on_substep_end``), its gradient and loss carried into the next pass's first step; ``set_epoch`` twice per
    pass, after ``on_epoch_begin`` (Trainer's own call, then accelerate's loader's).  The same events, losses and
    epochs as Trainer's: with dropout, on items masked at random as read, each pass draws the ``DataLoader``'s base
    seed and reads a round ahead, as under Trainer."""
    model = _classifier()
    runs: list[tuple[list[Any], list[Any], list[Any]]] = []
    for cls in (transformers.Trainer, Trainer):
        args = arguments_for(
            cls,
            output_dir=str(tmp_path / cls.__module__),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=5,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=3,
        )
        events: list[Any] = []
        stream = CountedStream(9, events)
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=stream, callbacks=[StepEvents(events)])
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        runs.append((events, [e["loss"] for e in logs], [e["epoch"] for e in logs]))
    (real_events, real_losses, real_epochs), (events, losses, epochs) = runs
    assert real_events[:10] == [
        ("epoch_begin", 0), ("set_epoch", 0), ("set_epoch", 0),
        ("step_begin", 0), ("substep_end", 0), ("step_end", 1),
        ("step_begin", 1), ("substep_end", 1), ("step_end", 2),
        ("step_begin", 2),
    ]  # fmt: skip
    assert real_events[10:13] == [("substep_end", 2), ("epoch_end", 2), ("epoch_begin", 2)]
    assert events == real_events
    assert epochs == pytest.approx(real_epochs) and len(losses) == 5
    assert losses == pytest.approx(real_losses, rel=1e-6)  # step 3: the carried micro-batch's loss added
