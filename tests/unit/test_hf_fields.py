"""The one table linking ``TrainingArguments`` and ``TrainingArgs`` fields (``hf/fields.py``) and the code that
applies it: every name in it exists, the run's ``TrainingArguments`` set exactly the owned fields, and the port
fills the ``TrainingArgs`` field each carried-over row names."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.arguments import training_argument_fields
from trainbridge.hf.fields import FIELD_LINKS, OWNED_FIELDS
from trainbridge.hf.porting import _carried_over

HF_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
VERSION_DEPENDENT = {
    "logging_dir",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
}
TRL_FIELDS = {"max_length", "model_init_kwargs"}


def test_every_row_names_fields_that_exist_once() -> None:
    names = [link.hf for link in FIELD_LINKS]
    assert len(names) == len(set(names))
    assert set(names) - VERSION_DEPENDENT - TRL_FIELDS <= HF_FIELDS
    assert {link.ours for link in FIELD_LINKS if link.ours} <= set(TrainingArgs.model_fields)


def test_the_runs_training_arguments_set_exactly_the_owned_fields(tmp_path, tiny_llama) -> None:
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2]}\n')
    args = TrainingArgs(model_path=tiny_llama, data_path=tmp_path / "d.jsonl", ckpt_output_dir=tmp_path / "out")
    fields = training_argument_fields(args, DistributedEnv())
    assert set(fields) == {name for name in OWNED_FIELDS if name in HF_FIELDS}


def test_the_port_fills_the_field_each_carried_row_names(tmp_path) -> None:
    hf = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        max_steps=10,
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        resume_from_checkpoint=str(tmp_path),
        ddp_timeout=60,
        include_for_metrics=["loss"],
    )
    carried = _carried_over(hf)
    expected = {link.ours for link in FIELD_LINKS if link.from_hf and link.ours and link.hf not in VERSION_DEPENDENT}
    assert expected - set(carried) == set()
