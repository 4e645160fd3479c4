"""An image-classification Trainer script's shape (as transformers' run_image_classification.py): a tiny ViT
from its config, a ``datasets`` image dataset with an on-the-fly transform (``set_transform``) making
``pixel_values``, the script's own ``collate_fn``, ``remove_unused_columns=False``, accuracy on argmax.
In place (one rank) against real ``transformers.Trainer``: the transform runs on the rows the workers read,
the same steps, log keys, metric keys and ``total_flos`` (Trainer counts ``pixel_values`` elements)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import TrainingArguments, ViTConfig, ViTForImageClassification

from trainbridge import Trainer

CALLS: list[int] = []


def _images(count: int, seed: int) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(count):
        label = i % 2
        pixels = rng.integers(0, 60, size=(12, 12, 3), dtype=np.uint8)
        pixels[..., 2 * label] += 150
        images.append(Image.fromarray(pixels))
        labels.append(label)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["red", "blue"])})
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def transform(batch: dict[str, Any]) -> dict[str, Any]:
    """The script's transform: PIL images -> normalised ``pixel_values`` tensors (counts its calls)."""
    CALLS.append(len(batch["image"]))
    batch["pixel_values"] = [
        torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        for image in batch["image"]
    ]
    return batch


def collate_fn(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def compute_metrics(p: Any) -> dict[str, float]:
    return {"accuracy": float((np.argmax(p.predictions, axis=1) == p.label_ids).mean())}


def _run(cls: Any, model: Any, out: Path, monkeypatch: pytest.MonkeyPatch | None) -> tuple[Any, Any, dict]:
    train, evaluation = _images(24, 0), _images(8, 1)
    train.set_transform(transform)
    evaluation.set_transform(transform)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        remove_unused_columns=False,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    if monkeypatch is not None:  # in place, as under a launcher (after the arguments)
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
    trainer = cls(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate_fn,
        compute_metrics=compute_metrics,
    )
    return trainer, trainer.train(), trainer.evaluate()


def test_an_image_dataset_with_its_transform_trains_as_under_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=12, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2,
    )  # fmt: skip
    model = ViTForImageClassification(config)
    reference, expected, expected_eval = _run(transformers.Trainer, copy.deepcopy(model), tmp_path / "hf", None)
    CALLS.clear()
    trainer, got, got_eval = _run(Trainer, model, tmp_path / "tb", monkeypatch)
    # the transform ran on the rows read back: 12 training items, 8 validation items twice
    assert sum(CALLS) >= 12 + 2 * 8
    assert got.global_step == expected.global_step == 3
    assert set(got.metrics) == set(expected.metrics)
    assert trainer.state.total_flos == reference.state.total_flos > 0  # pixel_values elements, as Trainer
    assert set(got_eval) == set(expected_eval) and "eval_accuracy" in got_eval

    def logs(history: list[dict]) -> list[tuple[int, list[str]]]:
        return [(e["step"], sorted(k for k in e if "runtime" not in k and "per_second" not in k)) for e in history]

    assert logs(trainer.state.log_history) == logs(reference.state.log_history)
