"""``trainer.scope``: the loop's presence in a call into the instance is one typed ``LoopScope`` installed by
``ScriptTrainer.call`` and removed afterwards; the facade's ``log`` / ``_save_checkpoint`` branch on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, TrainerState, TrainingArguments

from trainbridge import Trainer
from trainbridge.hf.stand_in_handlers import LogCapture
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError
from trainbridge.trainer.scope import LoopScope


@pytest.fixture
def trainer(tmp_path: Path) -> Trainer:
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    hf = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    return Trainer(model=LlamaForCausalLM(config), args=hf)


def test_a_call_installs_its_scope_and_puts_back_the_one_around(trainer: Trainer) -> None:
    script, handler = trainer._script, trainer.callback_handler
    assert trainer._in_loop is None and "_in_loop" not in vars(trainer)  # the class's None: nothing poked
    with script.call(checkpoint=None, routed=True) as instance:
        outer = instance._in_loop
        assert isinstance(outer, LoopScope) and outer.routed
        with script.call(log=LogCapture(None)) as inner:
            assert inner._in_loop is not outer and inner._in_loop is not None
            assert inner._in_loop.routed and inner._in_loop.log is not None  # the scope around, with the call's
        assert instance._in_loop is outer
    assert trainer._in_loop is None and trainer.callback_handler is handler


def test_the_facades_log_gives_the_loop_what_trainer_hands_on_log(trainer: Trainer) -> None:
    trainer.state = TrainerState()
    capture = LogCapture(None)
    with trainer._script.call(log=capture) as instance:
        instance.log({"loss": 1.5})
    assert capture.logs is not None and capture.logs["loss"] == 1.5
    assert trainer.state.log_history == []  # the loop records its log itself
    trainer.log({"loss": 2.0})  # the script's own call: Trainer's log
    assert trainer.state.log_history[-1]["loss"] == 2.0


def test_save_checkpoint_outside_a_checkpoint_is_refused(trainer: Trainer) -> None:
    with pytest.raises(UnsupportedTrainerFeatureError, match="inside train"):
        trainer._save_checkpoint(trainer.model, None)
    with trainer._script.call(), pytest.raises(UnsupportedTrainerFeatureError):
        trainer._save_checkpoint(trainer.model, None)  # a call of the loop's, but no checkpoint being written
