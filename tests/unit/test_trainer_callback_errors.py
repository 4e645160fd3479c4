"""A ``TrainerCallback`` that raises fails ``trainbridge.Trainer.train()``, as under Trainer (the facade's
runs use ``callback_error_policy="fatal"``): a script's guard that raises to abort a run is not swallowed
and the run does not go on (``run_training``'s own default, ``isolate``, stays for trainbridge's
``TrainingArgs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import build_tiny_llama_once


class Guard(TrainerCallback):
    """Raises at the end of step 2, as a script's NaN or time guard would."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            raise ValueError("loss guard tripped")


def test_a_callback_that_raises_fails_train_as_under_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = build_tiny_llama_once(tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = datasets.Dataset.from_list([{"text": f"{i}+{i}={2 * i}"} for i in range(16)])
    rows = rows.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        save_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # in place, as under torchrun
        monkeypatch.setenv(name, value)
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(folder),
        args=args,
        train_dataset=rows,
        processing_class=tokenizer,
        callbacks=[Guard()],
    )
    with pytest.raises(RuntimeError, match="loss guard tripped"):
        trainer.train()
    # the run stopped at the step that raised: no later checkpoint
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1"]


@pytest.mark.parametrize(
    ("policy", "action", "says"),
    [("fatal", "abort", "the run stops"), ("isolate", "continue", "further errors are counted, not logged")],
)
def test_the_first_errors_log_line_says_what_the_policy_does(
    policy: str, action: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    from trainbridge.core.callback_errors import CallbackErrorLedger

    ledger = CallbackErrorLedger(policy)
    with caplog.at_level("ERROR", logger="trainbridge.core.callback_errors"):
        assert ledger.failed("guard", "Guard", "on_step_end", ValueError("tripped"), rank=1) == action
    assert says in caplog.text
    assert ("counted" in caplog.text) == (policy == "isolate")
