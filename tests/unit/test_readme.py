"""README.md checked against behaviour: every Python block parses, the ones that only build objects run (on the
tiny model and files), and what it says a ported Trainer script may bring is accepted at construction."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from trainbridge import Trainer, TrainingArgs
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_every_python_block_parses_and_those_that_build_objects_run(
    run_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a block's relative output folder
    blocks = _python_blocks()
    assert blocks
    ran = 0
    for block in blocks:
        ast.parse(block)
        if "run_training(" in block or ".train(" in block:
            continue  # launches a run: covered by the distributed tier
        if "peft" in block:
            pytest.importorskip("peft")
        code = block.replace("path/to/hf-model", str(run_files["model"]))
        code = code.replace('"train.jsonl"', repr(str(run_files["train"])))
        exec(compile(code, "README.md", "exec"), {"TrainingArgs": TrainingArgs})  # a fragment: names in scope
        ran += 1
    assert ran  # the README's PEFT block at least


class _OwnLoss(Trainer):
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        return super().compute_loss(model, inputs, return_outputs, **kwargs)


class _OwnLoop(Trainer):
    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        return super()._inner_training_loop(*args, **kwargs)


def test_what_the_readme_says_a_ported_script_may_bring_is_accepted(tiny_llama: Path, tmp_path: Path) -> None:
    text = " ".join(README.read_text().split())
    assert "Custom losses work as under Trainer" in text and "live `optimizers=(optimizer, scheduler)`" in text
    hf = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    Trainer(model=model, args=hf, compute_loss_func=lambda outputs, labels, **kwargs: outputs.loss)
    Trainer(model=model, args=hf, optimizers=(optimizer, scheduler))
    _OwnLoss(model=model, args=hf)
    with pytest.raises(UnsupportedTrainerFeatureError, match="_inner_training_loop"):  # "only ... fail at construction"
        _OwnLoop(model=model, args=hf)
