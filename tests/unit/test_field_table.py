"""docs/trainer_fields.md: every ``TrainingArguments`` field of the installed transformers, classified from the
port's own data (trainer.field_table), and the committed table is the generated one."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import transformers
from transformers import TrainingArguments

from trainbridge.hf.porting import HFPortingWarning, training_args_from_hf
from trainbridge.trainer.field_table import REGENERATE, field_names, field_row, field_rows, markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer_fields.md"


def _documented() -> list[str]:
    return re.findall(r"^\| `(\w+)` \|", DOC.read_text(), flags=re.MULTILINE)


def test_every_field_of_the_installed_transformers_is_in_the_table() -> None:
    missing = sorted(set(field_names()) - set(_documented()))
    assert not missing, (
        f"transformers {transformers.__version__} has TrainingArguments fields docs/trainer_fields.md does not "
        f"classify: {missing}. Classify each in hf/fields.py FIELD_LINKS or hf/porting.py (NOT_WARNED, "
        f"REPLACED_BY, EXPLANATIONS), then run: {REGENERATE}"
    )


def test_the_committed_table_is_the_generated_one() -> None:
    assert DOC.read_text() == markdown(field_rows()), f"docs/trainer_fields.md is stale; run: {REGENERATE}"


def test_the_table_says_what_the_port_does(run_files: dict[str, Path], tmp_path: Path) -> None:
    # an ignored field warns with the table's words; a carried one, an unwarned one and a honoured one do not
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        save_on_each_node=True,
        fp16=True,
        ddp_find_unused_parameters=True,
        skip_memory_metrics=False,
        neftune_noise_alpha=5.0,
        eval_use_gather_object=True,
        ignore_data_skip=True,
        train_sampling_strategy="group_by_length",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training_args_from_hf(args, model_path=run_files["model"], data_path=run_files["train"], effective_batch_size=2)
    warned = {
        str(w.message).split("=")[0].split(".")[-1]: str(w.message) for w in caught if w.category is HFPortingWarning
    }
    assert field_row("save_on_each_node").status == "ignored"
    assert field_row("save_on_each_node").why in warned["save_on_each_node"]
    assert field_row("fp16").status == "same" and field_row("fp16").here == "mixed_precision: fp16"
    assert field_row("ddp_find_unused_parameters").status == "same"
    assert field_row("skip_memory_metrics").status == "same"
    assert field_row("neftune_noise_alpha").status == "same"
    assert field_row("eval_use_gather_object").status == "differs"  # Trainer's evaluate() reads it on sample batches
    for name in (
        "fp16",
        "ddp_find_unused_parameters",
        "skip_memory_metrics",
        "eval_use_gather_object",
        "ignore_data_skip",
        "train_sampling_strategy",
    ):
        assert name not in warned
    assert "neftune_noise_alpha" in warned  # no honouring callback passed: the facade passes NEFTune
