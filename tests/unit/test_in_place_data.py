"""``trainbridge.Trainer.train()`` reads the script's own data in place (issue 29, item 6): a torch ``Dataset`` is
indexed afresh every epoch as under ``transformers.Trainer`` (lazy loading, random augmentation), nothing is
written into ``output_dir`` (no ``.trainbridge/``: no rows, no tokenizer), and a resume on other data is still
flagged by the checkpoint fingerprint (``ScriptData.identity``) while a resume on the same data is exact."""

from __future__ import annotations

import os
import random
import re
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers
from transformers import TrainerCallback, TrainingArguments

import trainbridge
from trainbridge.demos.tiny_model import arithmetic_problems


class AugmentedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A lazily built dataset whose ``__getitem__`` counts its fetches and appends a random token (an augmentation)."""

    def __init__(self, tokenizer: Any, count: int) -> None:
        self.rows = [tokenizer(p + a)["input_ids"] for p, a in arithmetic_problems(count, seed=4)]
        self.fetches: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetches[i] += 1
        ids = torch.tensor([*self.rows[i], random.randrange(3, 12)])
        return {"input_ids": ids, "labels": ids.clone()}


def pad_collator(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([i["input_ids"] for i in items], batch_first=True, padding_value=0)
    labels = torch.nn.utils.rnn.pad_sequence([i["labels"] for i in items], batch_first=True, padding_value=-100)
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}


class CountFromTrainBegin(TrainerCallback):
    """Forgets the fetches made before training (the constructor's or a data check's peeks)."""

    def __init__(self, data: AugmentedDataset) -> None:
        self.data = data

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.data.fetches.clear()


def _args(out: Path, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        num_train_epochs=2,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def _fetches(base: type, model_dir: Path, out: Path) -> dict[int, int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    data = AugmentedDataset(tokenizer, 8)
    trainer = base(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
        args=_args(out),
        train_dataset=data,
        processing_class=tokenizer,
        data_collator=pad_collator,
        callbacks=[CountFromTrainBegin(data)],
    )
    assert trainer.train().global_step == 8  # 8 items / 2 per step x 2 epochs
    return dict(data.fetches)


def test_a_torch_dataset_is_fetched_afresh_every_epoch_as_under_trainer(tiny_llama: Path, tmp_path: Path) -> None:
    """Each item is fetched once per epoch during training (a random augmentation differs each epoch), as
    Trainer's DataLoader fetches it; it used to be fetched once before training and frozen into written rows."""
    real = _fetches(transformers.Trainer, tiny_llama, tmp_path / "real")
    ours = _fetches(trainbridge.Trainer, tiny_llama, tmp_path / "ours")
    assert ours == real == {i: 2 for i in range(8)}


def _token_rows(tokenizer: Any, count: int, seed: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"input_ids": [tokenizer(p + a)["input_ids"] for p, a in arithmetic_problems(count, seed=seed)]}
    )


def test_train_writes_nothing_into_the_output_dir(tiny_llama: Path, tmp_path: Path) -> None:
    """Neither the padding-free token path (a ``datasets.Dataset`` of ``input_ids``) nor sample batches (a torch
    ``Dataset``, the script's collator) writes rows or a tokenizer: no ``output_dir/.trainbridge/``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    for name, data, collator in (
        ("tokens", _token_rows(tokenizer, 8, seed=1), None),
        ("items", AugmentedDataset(tokenizer, 8), pad_collator),
    ):
        out = tmp_path / name
        trainer = trainbridge.Trainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(tiny_llama),
            args=_args(out, num_train_epochs=1, save_strategy="epoch"),
            train_dataset=data,
            eval_dataset=data,
            processing_class=tokenizer,
            data_collator=collator,
        )
        assert trainer.train().global_step == 4
        assert not (out / ".trainbridge").exists(), sorted(p.name for p in out.iterdir())


def _resumed(model_dir: Path, out: Path, data: Any, collator: Any, resume: Any, max_steps: int) -> Any:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = trainbridge.Trainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
        args=_args(
            out,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=2,
            num_train_epochs=1,
            lr_scheduler_type="constant",
        ),
        train_dataset=data(tokenizer),
        processing_class=tokenizer,
        data_collator=collator,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("kind", ["tokens", "items", "unhashable_map"])
def test_a_resume_on_other_data_is_flagged_and_on_the_same_data_is_exact(
    kind: str, tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint records what the in-place data is (a ``datasets.Dataset``'s fingerprint; else the type,
    length and a digest of a few items): other rows of the same shape are named at resume, which goes on as
    under Trainer (it never checks the data; a ``datasets`` fingerprint is random when a ``map`` function cannot
    be hashed, ``unhashable_map``: the same rows then differ by identity, and a refusal would strand the run);
    the same rows resume exactly (the sampler position: the same losses as one run)."""
    unhashable = socket.socket()  # dill cannot hash a map function that holds it: a random fingerprint

    def rows(tokenizer: Any, changed: bool) -> list[list[int]]:
        encoded = [tokenizer(p + a)["input_ids"] for p, a in arithmetic_problems(8, seed=1)]
        if changed:  # one token of one row: the same shape, the same sizes on disk
            encoded[0][-1] = encoded[0][-1] + 1 if encoded[0][-1] < 10 else encoded[0][-1] - 1
        return encoded

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, tokenizer: Any, changed: bool) -> None:
            self.rows = rows(tokenizer, changed)

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.tensor(self.rows[i]), "labels": torch.tensor(self.rows[i])}

    def data(changed: bool) -> Any:
        if kind == "tokens":
            return lambda tokenizer: datasets.Dataset.from_dict({"input_ids": rows(tokenizer, changed)})
        if kind == "unhashable_map":
            return lambda tokenizer: datasets.Dataset.from_dict({"input_ids": rows(tokenizer, changed)}).map(
                lambda row: row if unhashable else {}
            )
        return lambda tokenizer: Rows(tokenizer, changed)

    collator = pad_collator if kind == "items" else None
    whole = _resumed(tiny_llama, tmp_path / "whole", data(False), collator, None, 4)
    _resumed(tiny_llama, tmp_path / "cut", data(False), collator, None, 2)
    if kind != "unhashable_map":
        with caplog.at_level("WARNING", logger="trainbridge.checkpoint.resume"):
            _resumed(tiny_llama, tmp_path / "changed", data(False), collator, None, 2)
            assert _resumed(tiny_llama, tmp_path / "changed", data(True), collator, True, 4).state.global_step == 4
        said = r"training data differs \(checkpoint: train_dataset (datasets|items):.*resumed anyway, as Trainer does"
        assert re.search(said, caplog.text), caplog.text
    resumed = _resumed(tiny_llama, tmp_path / "cut", data(False), collator, True, 4)
    unhashable.close()

    def losses(trainer: Any) -> list[tuple[int, float]]:
        return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e and e["step"] > 2]

    assert [s for s, _ in losses(resumed)] == [3, 4]
    assert [v for _, v in losses(resumed)] == pytest.approx([v for _, v in losses(whole)], rel=1e-4)


def test_in_place_rows_are_tokenised_once_per_fingerprint_into_a_private_cache(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``datasets.Dataset`` handed to ``train()`` is tokenised once (``data.in_place``): a second ``train()``
    and a second run on the same rows (the same fingerprint) read the cache entry (no tokenisation, the same
    losses); changed rows are tokenised again; rows with a transform set are never cached (a debug line says
    why).  The cache is private under umask 002 (folders 0700, files 0600)."""
    from trainbridge.data import cache

    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("TRAINBRIDGE_DATA_CACHE", str(cache_dir))
    monkeypatch.setattr(datasets.fingerprint, "fingerprint_warnings", {})  # an earlier test's unhashable map
    encoded: list[str] = []
    encode = cache._encode

    def counted(dataset: Any, source: Path, *args: Any, **kwargs: Any) -> Any:
        encoded.append(str(source))
        return encode(dataset, source, *args, **kwargs)

    monkeypatch.setattr(cache, "_encode", counted)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def trainer(data: Any, name: str) -> Any:
        return trainbridge.Trainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(tiny_llama),
            args=_args(tmp_path / name, max_steps=2, num_train_epochs=1),
            train_dataset=data,
            processing_class=tokenizer,
            data_collator=collator,
        )

    def losses(run: Any) -> list[float]:
        return [e["loss"] for e in run.state.log_history if "loss" in e]

    umask = os.umask(0o002)
    try:
        first = trainer(_token_rows(tokenizer, 8, seed=1), "first")
        first.train()
        expected = losses(first)
        first.train()  # train() again: the same rows
        assert encoded == ["train_dataset"]
        again = trainer(_token_rows(tokenizer, 8, seed=1), "again")  # a second run: rows rebuilt, same fingerprint
        again.train()
        assert encoded == ["train_dataset"] and losses(again) == expected
        trainer(_token_rows(tokenizer, 8, seed=2), "changed").train()
        assert encoded == ["train_dataset"] * 2
        with caplog.at_level("DEBUG", logger="trainbridge.data.in_place"):
            trainer(_token_rows(tokenizer, 8, seed=1).with_transform(lambda batch: batch), "transform").train()
        assert encoded == ["train_dataset"] * 3
        assert "train_dataset: not cached (it has a transform set" in caplog.text
    finally:
        os.umask(umask)
    entries = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 2  # the two fingerprints (none for the transformed rows); no scratch folder left
    for path in [cache_dir, *cache_dir.rglob("*")]:
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))


def test_a_fingerprint_that_does_not_name_the_rows_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``unusable_fingerprint`` names why a dataset's fingerprint is not a cache key: not a ``datasets.Dataset``,
    a transform set, ``Dataset.from_generator`` rows, ``datasets``' caching off, a transformation it could not
    hash in this process (random fingerprints); plain rows and their ``map``/``select`` results are usable."""
    from trainbridge.data.in_place import unusable_fingerprint

    monkeypatch.setattr(datasets.fingerprint, "fingerprint_warnings", {})
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    assert unusable_fingerprint(rows) is None
    assert unusable_fingerprint(rows.map(lambda row: {"n": len(row["input_ids"])}).select([1])) is None
    assert "not a datasets.Dataset" in str(unusable_fingerprint([{"input_ids": [1]}]))
    assert "transform set" in str(unusable_fingerprint(rows.with_transform(lambda batch: batch)))

    def generate() -> Any:
        yield {"input_ids": [1, 2]}

    generated = datasets.Dataset.from_generator(generate, cache_dir=str(tmp_path / "hf"))
    assert "from_generator" in str(unusable_fingerprint(generated))
    datasets.disable_caching()
    try:
        assert "caching is off" in str(unusable_fingerprint(rows))
    finally:
        datasets.enable_caching()
    unhashable = socket.socket()
    rows.map(lambda row: row if unhashable else {})  # datasets warns and falls back to a random fingerprint
    unhashable.close()
    assert "could not hash" in str(unusable_fingerprint(rows))
