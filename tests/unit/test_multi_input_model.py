"""A model that takes several inputs and returns its own loss: a tiny CLIP (text tower + image tower) from its
config, items of ``input_ids``/``attention_mask``/``pixel_values`` collated by the script's ``collate_fn``
with ``return_loss=True`` (as transformers' run_clip.py), ``remove_unused_columns=False``.  In place (one
rank) against real ``transformers.Trainer``: the contrastive loss of a whole batch does not depend on the
order of its rows, so with one batch per step both train on the same loss, step for step."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import CLIPConfig, CLIPModel, TrainingArguments

from trainbridge import Trainer


def _pairs(count: int, seed: int) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (count, 6), generator=generator)
    pixels = torch.randn(count, 3, 8, 8, generator=generator)
    rows = {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "pixel_values": pixels.tolist()}
    return datasets.Dataset.from_dict(rows).with_format("torch")


def collate_fn(examples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "input_ids": torch.stack([example["input_ids"] for example in examples]),
        "attention_mask": torch.stack([example["attention_mask"] for example in examples]),
        "return_loss": True,
    }


def _run(cls: Any, model: Any, out: Path, monkeypatch: pytest.MonkeyPatch | None) -> tuple[Any, dict]:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=4,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        learning_rate=5e-3,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    if monkeypatch is not None:  # in place, as under a launcher (after the arguments)
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
    trainer = cls(
        model=model, args=args, train_dataset=_pairs(8, 0), eval_dataset=_pairs(6, 1), data_collator=collate_fn
    )
    trainer.train()
    return trainer, trainer.evaluate()


def test_a_two_tower_model_trains_on_the_loss_its_forward_returns_as_under_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"image_size": 8, "patch_size": 4, "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2},
        projection_dim=8,
    )  # fmt: skip
    model = CLIPModel(config)
    reference, expected_eval = _run(transformers.Trainer, copy.deepcopy(model), tmp_path / "hf", None)
    trainer, got_eval = _run(Trainer, model, tmp_path / "tb", monkeypatch)

    def losses(history: list[dict]) -> list[tuple[int, float]]:
        return [(e["step"], e["loss"]) for e in history if "loss" in e]

    got, expected = losses(trainer.state.log_history), losses(reference.state.log_history)
    assert [s for s, _ in got] == [s for s, _ in expected] == [1, 2, 3]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected], rel=1e-4)
    assert expected[-1][1] < expected[0][1]  # it learns
    assert set(got_eval) == set(expected_eval) and "eval_loss" in got_eval
    assert got_eval["eval_loss"] == pytest.approx(expected_eval["eval_loss"], rel=1e-4)
