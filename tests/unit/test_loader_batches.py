"""A Trainer subclass's ``get_train_dataloader`` / ``_get_train_sampler`` in the workers (``LoopTrainer.run_plan``'s
``train_loader``, ``data.loader_batches``, ``TrainingArgs.train_loader``): the loader's batches,
``accumulation`` per step with Trainer's remainder step; its share per rank as accelerate deals it; the
override called on a worker-side instance with the training items; a run in-process trains ``epochs x
ceil(len / accumulation)`` steps on the sampler's order, and a resumed run skips the consumed batches and
reaches the weights of an uninterrupted one."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainingArguments

from tests.run_inputs import as_run, split_run
from tests.unit.test_stream_batches import classifier  # noqa: F401  (the fixture)
from trainbridge import Trainer
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.distributed import DistributedEnv
from trainbridge.data.loader_batches import LoaderBatches
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop


def _train_loader(trainer: Any) -> Any:
    """The ``RunPlan.train_loader`` the instance's class decides (``LoopTrainer.run_plan``)."""
    return trainer.run_plan().train_loader


def _items(count: int) -> list[dict[str, Any]]:
    return [{"idx": i} for i in range(count)]


def _collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"idx": torch.tensor([item["idx"] for item in items])}


def _loader(count: int, batch_size: int, sampler: Any = None) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_items(count), batch_size=batch_size, sampler=sampler, collate_fn=_collate)


def _steps(batches: LoaderBatches, start: int = 0) -> list[list[list[int]]]:
    return [[b["idx"].tolist() for b in batches.micro_batches(step)] for step in batches.set_epoch(0).steps[start:]]


def test_steps_take_accumulation_batches_with_trainers_remainder_step():
    batches = LoaderBatches(_loader(10, 2), accumulation=2, world_size=2, max_steps=None)
    assert batches.steps_per_epoch == 3 and len(batches) == 5
    assert _steps(batches) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert [step.num_samples for step in batches.set_epoch(0).steps[0:]] == [8, 8, 4]  # rows x 2 ranks
    assert _steps(batches, start=2) == [[[8, 9]]]  # resume: the first steps' batches read and dropped


class EpochSampler(torch.utils.data.Sampler):
    def __init__(self, count: int) -> None:
        self.count, self.epochs = count, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        return iter(range(self.count))

    def __len__(self) -> int:
        return self.count


def test_set_epoch_reaches_the_loaders_sampler_once():
    sampler = EpochSampler(6)
    batches = LoaderBatches(_loader(6, 2, sampler), accumulation=1, world_size=1, max_steps=None)
    batches.set_epoch(1)
    assert sampler.epochs == [1]


def test_a_loader_without_length_repeats_passes_up_to_max_steps():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(_items(5))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=2, collate_fn=_collate)
    batches = LoaderBatches(loader, accumulation=1, world_size=1, max_steps=7)
    assert batches.unsized and batches.steps_per_epoch == 7
    assert _steps(batches) == [[[0, 1]], [[2, 3]], [[4]]]
    with pytest.raises(ValueError, match="max_steps"):
        LoaderBatches(loader, accumulation=1, world_size=1, max_steps=None)


class Reversed(torch.utils.data.Sampler):
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> Any:
        return iter(range(self.count - 1, -1, -1))

    def __len__(self) -> int:
        return self.count


class SamplerTrainer(Trainer):
    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return Reversed(len(train_dataset if train_dataset is not None else self.train_dataset))


class LoaderTrainer(Trainer):
    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()  # Trainer's, with Trainer's own sampler
        assert self.data_collator is _collate and len(self.train_dataset) == 6
        return loader


class StridedTrainer(Trainer):
    """A sampler reading an attribute the script's ``__init__`` set."""

    def __init__(self, *args: Any, stride: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stride = stride

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        count = len(train_dataset if train_dataset is not None else self.train_dataset)
        return [i for start in range(self.stride) for i in range(start, count, self.stride)]


def test_the_override_is_called_on_the_scripts_own_instance(tmp_path: Path):
    """The batches are the instance's own ``get_train_dataloader()`` (Trainer's, over a ``_get_train_sampler``
    override), on its own dataset and collator, with the attributes the script set."""
    hf = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
    )
    model = torch.nn.Linear(2, 2)
    data = {"train_dataset": _items(6), "data_collator": _collate}
    loader = _train_loader(SamplerTrainer(model=model, args=hf, **data))
    assert loader is not None and [b["idx"].tolist() for b in loader(None, None, model)] == [[5, 4], [3, 2], [1, 0]]
    loader = _train_loader(LoaderTrainer(model=model, args=hf, **data))
    assert loader is not None and sorted(i for b in loader(None, None, model) for i in b["idx"].tolist()) == list(
        range(6)
    )
    strided = _train_loader(StridedTrainer(model=model, args=hf, stride=3, **data))  # the script's attribute
    assert strided is not None
    assert [b["idx"].tolist() for b in strided(None, None, model)] == [[0, 3], [1, 4], [2, 5]]
    assert _train_loader(Trainer(model=model, args=hf)) is None
    # Trainer's own, in the script's process too (a script printing a sample batch)
    assert next(iter(SamplerTrainer(model=model, args=hf, **data).get_train_dataloader()))["idx"].tolist() == [5, 4]


def _rows(path: Path, count: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(count):
            label = rng.randrange(2)
            ids = [2 + label * 10 + rng.randrange(8) for _ in range(rng.randrange(3, 9))]
            mask = [1] * len(ids) + [0] * (8 - len(ids))
            handle.write(json.dumps({"input_ids": ids + [0] * (8 - len(ids)), "attention_mask": mask, "labels": label}))
            handle.write("\n")
    return path


def _train(model_path: Path, tmp_path: Path, out: str, **overrides: Any) -> Any:
    from transformers import AutoModelForSequenceClassification

    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, report_to="none")
    rows = datasets.load_dataset("json", data_files=str(_rows(tmp_path / "train.jsonl", 10)), split="train")
    model = AutoModelForSequenceClassification.from_pretrained(model_path)
    trainer = SamplerTrainer(model=model, args=hf, train_dataset=rows)
    fields: dict[str, Any] = dict(
        model_path=model_path,
        model_init=lambda: model,
        data_path=tmp_path / "train.jsonl",
        train_loader=_train_loader(trainer),
        ckpt_output_dir=tmp_path / out,
        effective_batch_size=4,
        per_device_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        num_epochs=2,
        save_strategy="steps",
        save_steps=3,
        disable_tqdm=True,
    )
    fields.update(overrides)
    args = split_run(**fields)
    components = build_run(*as_run(args), DistributedEnv())
    assert isinstance(components.train_batches, LoaderBatches)
    return TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback()], components).run()


def test_a_run_trains_the_loaders_batches_and_resumes_exactly(classifier, tmp_path):  # noqa: F811
    whole = _train(classifier, tmp_path, "whole")
    assert whole.global_step == 6  # 2 epochs x ceil(5 batches / 2)
    cut = _train(classifier, tmp_path, "cut", max_steps=4, save_steps=4)  # checkpoint-4: one step into epoch 1
    assert cut.global_step == 4
    resumed = _train(
        classifier, tmp_path, "cut", save_steps=3, resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-4")
    )
    assert resumed.global_step == 6
    a = load_file(tmp_path / "whole" / "checkpoint-6" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoint-6" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
