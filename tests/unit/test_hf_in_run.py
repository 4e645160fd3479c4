"""Hugging Face callbacks in a real run of the loop, in process on one rank (issue 11).

Each test drives ``trainbridge.loop.loop.train`` with the worker's callback list
(``launch.assembly.assemble_callbacks``), so ``HuggingFaceCallbacks``, the best-checkpoint tracker and the loop run
exactly as in a torchrun worker: best weights before ``on_train_end``, ``TrainingArguments`` subclasses,
isolation per HF callback, ``num_input_tokens_seen``.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl import SFTConfig

from tests.run_inputs import RunInputs, as_run
from trainbridge.core.callback import Callback
from trainbridge.core.config import RunPlan, TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.dispatch import CallbackFatalError
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf import HFPortingWarning, training_args_from_hf
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.loop.loop import train
from trainbridge.loop.result import RunResult


@pytest.fixture
def args_for(args_for):
    """The shared ``args_for`` (tests/unit/conftest.py), 4 steps by default."""
    return functools.partial(args_for, max_steps=4)


def run(inputs: TrainingArgs | RunInputs) -> RunResult:
    """Train ``inputs`` (``args_for``'s: the arguments, or ``RunInputs`` when code was given) in process."""
    args, plan = as_run(inputs)
    return train(args, plan, DistributedEnv(), assemble_callbacks(args, plan))


def weights_digest(model: torch.nn.Module | dict[str, torch.Tensor]) -> float:
    tensors = model.values() if isinstance(model, dict) else model.state_dict().values()
    return float(sum(t.double().abs().sum() for t in tensors))


# ============================================================================ best model before on_train_end
class ScriptedEvalLoss(TrainerCallback):
    """Overwrites ``eval_loss`` with a script: the best evaluation is the second (step 2 of 4)."""

    def __init__(self) -> None:
        self.values = [0.9, 0.1, 0.5, 0.7]
        self.evaluations = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_loss"] = self.values[min(self.evaluations, len(self.values) - 1)]
        self.evaluations += 1


class HFWeightsAtTrainEnd(TrainerCallback):
    def __init__(self) -> None:
        self.digest: float | None = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.digest = weights_digest(model)


class NativeWeightsAtTrainEnd(Callback):
    def __init__(self) -> None:
        self.digest: float | None = None

    def on_train_end(self, context: TrainingContext, **kwargs: Any) -> None:
        self.digest = weights_digest(context.unwrapped_model)


def test_every_callback_sees_the_best_weights_in_on_train_end(args_for, tmp_path):
    native_first, hf, native_last = NativeWeightsAtTrainEnd(), HFWeightsAtTrainEnd(), NativeWeightsAtTrainEnd()
    args, plan = args_for(
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        callbacks=[native_first, ScriptedEvalLoss(), hf, native_last],
    )
    result = run(RunInputs(args, plan))
    assert result.best_checkpoint == str(tmp_path / "out" / "checkpoint-2")
    best = weights_digest(load_file(str(tmp_path / "out" / "checkpoint-2" / "model.safetensors")))
    last = weights_digest(load_file(str(tmp_path / "out" / "checkpoint-4" / "model.safetensors")))
    assert abs(best - last) > 1e-3  # best != last, so the test can tell them apart
    for callback in (native_first, native_last):
        assert callback.digest == pytest.approx(best, rel=1e-9)
    assert hf.digest == pytest.approx(best, rel=1e-9)


# ============================================================================ TrainingArguments subclasses
class ReadsSFTFields(TrainerCallback):
    """A callback written for trl: reads fields only ``SFTConfig`` has, at every step."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, str, int, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(
            (
                type(args).__name__,
                args.max_length,
                args.dataset_text_field,
                args.per_device_train_batch_size,
                args.gradient_accumulation_steps,
            )
        )


@pytest.fixture
def sft_config(tmp_path: Path):
    def build(**kwargs: Any) -> SFTConfig:
        return SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **kwargs)

    yield build
    AcceleratorState._reset_state(reset_partial_state=True)


def test_callbacks_see_the_users_trainingarguments_subclass_with_only_owned_fields_changed(args_for, sft_config):
    config = sft_config(
        max_length=77,
        dataset_text_field="prompt",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        seed=7,
    )
    reader = ReadsSFTFields()
    base = args_for()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = training_args_from_hf(
            config,
            model_path=base.model_path,
            data_path=base.data_path,
            val_data_path=base.val_data_path,
            max_seq_len=32,
            max_batch_len=64,
            effective_batch_size=8,
            disable_tqdm=True,
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, HFPortingWarning)]
    # subclass fields set to non-defaults and not honoured are named (dataset_text_field), as base fields are;
    # max_length is honoured (it is the run's max_seq_len), so it is not called ignored
    assert not any(m.startswith("SFTConfig.max_length") for m in messages), messages
    assert any(m.startswith("SFTConfig.dataset_text_field='prompt' is ignored") for m in messages), messages
    result = run(RunInputs(args, RunPlan.from_keywords(callbacks=[reader], hf_args=config)))
    assert result.callback_errors == []
    # the same class with every field; the batch shape is trainbridge's (8 samples per step on 1 rank)
    assert reader.seen == [("SFTConfig", 77, "prompt", 8, 1)] * 3
    assert config.per_device_train_batch_size == 2  # the user's object is left alone


def test_every_checkpoint_holds_training_args_bin_when_ported_from_training_arguments(args_for, sft_config):
    """As ``Trainer._save_checkpoint``: ``training_args.bin`` (the callbacks' TrainingArguments, torch.save) in
    every checkpoint of a run ported from TrainingArguments; a run of native settings writes none."""
    config = sft_config(
        max_length=77,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        bf16=False,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
    )
    base = args_for()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HFPortingWarning)
        args = training_args_from_hf(
            config,
            model_path=base.model_path,
            data_path=base.data_path,
            max_seq_len=32,
            max_batch_len=64,
            effective_batch_size=8,
            disable_tqdm=True,
        )
    run(RunInputs(args, RunPlan.from_keywords(callbacks=[TrainerCallback()], hf_args=config)))
    for step in (1, 2):
        saved = torch.load(args.ckpt_output_dir / f"checkpoint-{step}" / "training_args.bin", weights_only=False)
        assert type(saved) is SFTConfig and saved.max_length == 77 and saved.output_dir == config.output_dir
    native = args_for(
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
        callbacks=[TrainerCallback()],
        ckpt_output_dir=base.ckpt_output_dir.parent / "native",
    )
    run(native)
    assert (native.ckpt_output_dir / "checkpoint-1" / "trainer_state.json").is_file()
    assert not (native.ckpt_output_dir / "checkpoint-1" / "training_args.bin").exists()


def test_a_default_trl_config_ports_without_warnings(sft_config, args_for):
    base = args_for()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training_args_from_hf(sft_config(), model_path=base.model_path, data_path=base.data_path)
    assert [str(w.message) for w in caught if issubclass(w.category, HFPortingWarning)] == []


# ============================================================================ isolation per HF callback
class BrokenAtStepEnd(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise ValueError("broken callback")


class CountsHooks(TrainerCallback):
    def __init__(self) -> None:
        self.step_ends = 0
        self.logs = 0
        self.train_end = False

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs += 1

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end = True


def test_one_broken_hf_callback_is_switched_off_alone_and_named_in_the_result(args_for):
    before, after = CountsHooks(), CountsHooks()
    args = args_for(max_steps=5, callbacks=[before, BrokenAtStepEnd(), after], callback_max_consecutive_errors=2)
    result = run(args)
    (report,) = result.callback_errors
    assert report.callback == "BrokenAtStepEnd" and report.event == "on_step_end"
    assert report.count == 2 and report.disabled and "broken callback" in report.first_error
    for counter in (before, after):  # every other callback got every hook, before and after the broken one
        assert counter.step_ends == 5 and counter.logs == 6 and counter.train_end


def test_fatal_policy_stops_the_run_on_an_hf_callback_error(args_for):
    after = CountsHooks()
    args = args_for(max_steps=5, callbacks=[BrokenAtStepEnd(), after], callback_error_policy="fatal")
    with pytest.raises(CallbackFatalError, match="BrokenAtStepEnd"):
        run(args)
    assert after.step_ends == 1  # the hook still reached the others; every rank stopped at that step


# ============================================================================ resume restores TrainerState
RUNTIME_KEYS = ("runtime", "per_second")


def _history(state: dict[str, Any]) -> list[dict[str, Any]]:
    """``log_history`` without the wall-clock values (runtimes, throughputs); losses rounded."""
    return [
        {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in row.items()
            if not any(part in k for part in RUNTIME_KEYS)
        }
        for row in state["log_history"]
    ]


def test_run_training_resumed_with_hf_callbacks_has_the_state_of_one_uninterrupted_run(args_for, tmp_path):
    """A run stopped at step 4 and resumed to step 8 ends with the ``TrainerState`` (``trainer_state.json``
    of its last checkpoint) of the same run done at once: every row from step 1, the best metric and
    checkpoint over both parts, ``total_flos``, ``num_input_tokens_seen`` and the early-stopping counter."""
    from transformers import EarlyStoppingCallback

    def args(out: str, max_steps: int, resume: str | None = None) -> RunInputs:
        return args_for(
            ckpt_output_dir=tmp_path / out,
            max_steps=max_steps,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            metric_for_best_model="eval_loss",
            include_num_input_tokens_seen="non_padding",
            resume_from_checkpoint=resume,
            callbacks=[EarlyStoppingCallback(early_stopping_patience=9, early_stopping_threshold=9.0)],
        )

    run(args("once", 8))
    run(args("twice", 4))
    run(args("twice", 8, resume="auto"))
    once, twice = (
        json.loads((tmp_path / out / "checkpoint-8" / "trainer_state.json").read_text()) for out in ("once", "twice")
    )
    assert [row["step"] for row in twice["log_history"]][:2] == [1, 2]
    assert _history(twice) == _history(once)
    for key in (
        "global_step",
        "best_metric",
        "best_global_step",
        "total_flos",
        "num_input_tokens_seen",
        "stateful_callbacks",
    ):
        assert twice[key] == once[key], key
    assert twice["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] == 3
    assert Path(twice["best_model_checkpoint"]).name == Path(once["best_model_checkpoint"]).name


# ============================================================================ num_input_tokens_seen
class TokensSeen(TrainerCallback):
    def __init__(self) -> None:
        self.at_step_end: list[int] = []
        self.logged: list[dict[str, Any]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.at_step_end.append(state.num_input_tokens_seen)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))

    def on_train_end(self, args, state, control, **kwargs):
        self.at_train_end = state.num_input_tokens_seen


class NativeTokens(Callback):
    def on_train_end(self, context: TrainingContext, **kwargs: Any) -> None:
        self.tokens_seen, self.input_tokens_seen = context.tokens_seen, context.input_tokens_seen


@pytest.mark.parametrize("counting", ["no", "non_padding", "all", True])
def test_num_input_tokens_seen_follows_include_num_input_tokens_seen(args_for, counting):
    seen, native = TokensSeen(), NativeTokens()
    args = args_for(packing="padded", include_num_input_tokens_seen=counting, callbacks=[seen, native])
    run(args)
    assert native.tokens_seen > 0 and native.input_tokens_seen > native.tokens_seen  # padded rows
    expected_by_mode = {"no": 0, "non_padding": native.tokens_seen, "all": native.input_tokens_seen}
    expected = expected_by_mode[args.include_num_input_tokens_seen]
    assert seen.at_train_end == expected
    assert len(set(seen.at_step_end)) == (1 if counting == "no" else 4)  # counted at every step
    if counting == "non_padding":  # known from the plan: at on_step_end it includes that step, as under Trainer
        assert seen.at_step_end[-1] == expected
    training_logs = [logs for logs in seen.logged if "loss" in logs]
    assert training_logs  # the checks below are not vacuous
    if counting == "no":
        assert all("num_input_tokens_seen" not in logs for logs in seen.logged)
    else:  # as Trainer.log: every log carries the count, training logs a token throughput too
        assert all(logs["num_input_tokens_seen"] > 0 for logs in seen.logged)
        assert all("train_tokens_per_second" in logs for logs in training_logs)


# ============================================================================ accelerate's process-wide state
class ReadsAccelerateState(TrainerCallback):
    """What callbacks written for Trainer read from accelerate (Trainer's Accelerator has set it up)."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def on_step_end(self, args, state, control, **kwargs):
        from accelerate.logging import get_logger
        from accelerate.state import AcceleratorState, PartialState

        get_logger(__name__).info("logged through accelerate")  # needs a PartialState, else raises
        self.seen.append(
            (
                PartialState().process_index,
                PartialState().num_processes,
                PartialState().is_main_process,
                str(PartialState().device),
                AcceleratorState().mixed_precision,
                AcceleratorState().deepspeed_plugin,
                AcceleratorState().distributed_type.value,
            )
        )


@pytest.fixture
def no_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_callbacks_find_accelerate_state_set_up_as_under_trainer_and_it_is_released_after(
    args_for, no_accelerate_state
):
    from accelerate.state import PartialState

    reader = ReadsAccelerateState()
    result = run(args_for(callbacks=[reader]))
    assert result.callback_errors == []
    assert reader.seen and set(reader.seen) == {(0, 1, True, "cpu", "no", None, "NO")}
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}, "left behind after the run"


def test_trl_sync_ref_model_callback_mixes_the_reference_model_in(args_for, tiny_llama, no_accelerate_state):
    """trl's SyncRefModelCallback (unchanged) reads ``AcceleratorState().deepspeed_plugin`` every
    ``ref_model_sync_steps``: it must run and move the reference model towards the trained one."""
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig
    from trl.trainer.callbacks import SyncRefModelCallback

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    before = weights_digest(ref)
    config = DPOConfig(
        output_dir="unused",
        use_cpu=True,
        bf16=False,
        report_to="none",
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.5,
    )
    result = run(args_for(callbacks=[SyncRefModelCallback(ref_model=ref, accelerator=None)], hf_args=config))
    assert result.callback_errors == []
    assert weights_digest(ref) != before


def test_an_existing_accelerator_state_is_left_as_it_is(args_for, no_accelerate_state):
    from accelerate import Accelerator

    Accelerator(cpu=True)
    state_before = dict(AcceleratorState._shared_state)
    reader = ReadsAccelerateState()
    run(args_for(callbacks=[reader]))
    assert AcceleratorState._shared_state == state_before
    assert reader.seen and reader.seen[0][:4] == (0, 1, True, "cpu")
