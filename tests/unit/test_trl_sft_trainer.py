"""``trainbridge.trl.SFTTrainer`` takes trl's arguments as they are and trains on the loop (in place, 1 rank)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
from trl import SFTConfig

from trainbridge import SFTTrainer
from trainbridge.hf.porting import HFPortingWarning

ROWS = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(6) for b in range(4)]


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def test_model_path_formatting_func_and_trl_collator(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=3,
        disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
        max_length=12,
        packing=True,
    )
    _in_place(monkeypatch)
    trainer = SFTTrainer(
        model=str(tiny_llama),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        formatting_func=lambda row: f"{row['question']}={row['answer']}",
        data_collator=DataCollatorForLanguageModeling(pad_token_id=0),
    )
    assert trainer.train_dataset.column_names == ["input_ids", "labels", "seq_lengths"]  # trl's bins
    assert trainer._collator_choice.reproduced  # trl's collator: reproduced by padding-free batches, not called
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)  # max_length, model_init_kwargs, packing... are honoured
        out = trainer.train()
    assert out.global_step == 3 and out.training_loss > 0
    assert [row["step"] for row in trainer.state.log_history if "loss" in row] == [1, 2, 3]
    assert (tmp_path / "out" / "checkpoint-3" / "model.safetensors").is_file()


def test_tokenizer_comes_from_the_model(tiny_llama: Path, tmp_path: Path) -> None:
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False)
    trainer = SFTTrainer(
        model=str(tiny_llama), args=args, train_dataset=datasets.Dataset.from_list([{"text": "1+1=2"}])
    )
    eos = trainer.processing_class.eos_token_id
    assert trainer.train_dataset[0]["input_ids"][-1] == eos  # trl's preparation added the EOS token


def test_quantization_config_is_refused_by_name(tiny_llama: Path, tmp_path: Path) -> None:
    from trainbridge.trainer.facade import UnsupportedTrainerFeatureError

    with pytest.raises(UnsupportedTrainerFeatureError, match="quantization_config"):
        SFTTrainer(
            model=str(tiny_llama),
            args=SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False),
            train_dataset=datasets.Dataset.from_list([{"text": "1+1=2"}]),
            quantization_config=object(),
        )


def _unused(*_: Any) -> None: ...
