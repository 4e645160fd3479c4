"""``train()`` does not re-seed the script's live model (issue 30): Trainer seeds in its constructor and around a
``model_init``, never in ``train()``, so a script that seeds after building the Trainer (trl's GRPO: ``seed + rank``
for sampling) draws the same numbers in training as under Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers

import trainbridge
from trainbridge.demos.tiny_model import arithmetic_problems


class FirstDraws(transformers.TrainerCallback):
    """Two random numbers drawn at ``on_train_begin`` (what a sampling step would draw first)."""

    def __init__(self) -> None:
        self.draws: list[list[float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.draws.append(torch.rand(2).tolist())


@pytest.mark.parametrize("cls", [transformers.Trainer, trainbridge.Trainer], ids=["transformers", "trainbridge"])
def test_the_scripts_own_seeding_after_construction_holds_in_training(
    cls: type, tiny_llama: Path, tmp_path: Path
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    texts = [p + a for p, a in arithmetic_problems(8, 1)]
    rows = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
    )
    draws = FirstDraws()
    trainer = cls(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny_llama),
        args=args,
        train_dataset=rows,
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[draws],
    )
    torch.manual_seed(1234)  # the script's own seed, after the constructor's set_seed(args.seed)
    trainer.train()
    torch.manual_seed(1234)
    assert draws.draws == [torch.rand(2).tolist()]
