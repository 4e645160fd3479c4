"""``trainbridge.DPOTrainer`` takes trl's arguments as they are and trains DPO on the loop (in place, 1 rank):
trl's metric keys at the log steps, and a first-step loss equal to trl's DPOTrainer on the same pairs."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("trl")
import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig

from trainbridge import DPOTrainer
from trainbridge.core.config.loss import OwnStep
from trainbridge.trl.dpo_step import PairBatches
from trainbridge.trl.preference_loss import METRIC_KEYS

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a * b + 3)}
    for a, b in [(1, 2), (13, 25), (7, 70), (9, 1), (4, 44), (30, 3), (5, 6), (8, 12)]
]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def _config(out: Path, **overrides: object) -> DPOConfig:
    values: dict[str, object] = dict(
        output_dir=str(out),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=12,
        beta=0.2,
        learning_rate=1e-3,
        model_init_kwargs={"dtype": "float32"},
    )
    values.update(overrides)
    return DPOConfig(**values)  # type: ignore[arg-type]


def test_a_model_path_trains_dpo_with_trls_metrics(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path / "out")
    _in_place(monkeypatch)
    trainer = DPOTrainer(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
    out = trainer.train()
    assert out.global_step == 3
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in logged] == [1, 2, 3]
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the frozen copy is the policy at step 1
    for row in logged:
        assert set(METRIC_KEYS) | {"logits/chosen", "logits/rejected", "entropy", "num_tokens"} <= set(row)
    assert logged[-1]["rewards/margins"] != 0.0


def test_first_step_loss_equals_trls_with_a_ref_model(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trl import DPOTrainer as TrlDPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    config = _config(tmp_path / "out", loss_type=["sigmoid"], label_smoothing=0.1)
    trl = TrlDPOTrainer(  # trl first: its config sets up accelerate before the in-place environment
        model=AutoModelForCausalLM.from_pretrained(tiny_llama),
        ref_model=copy.deepcopy(ref),
        args=_config(tmp_path / "trl", loss_type=["sigmoid"], label_smoothing=0.1),
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    _in_place(monkeypatch)
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_llama),
        ref_model=ref,
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    trainer.train()
    first = next(row for row in trainer.state.log_history if "loss" in row)

    factory = trainer.run_plan().loss.factory  # the DPO step of the run
    pairs = PairBatches(trainer.train_dataset, 2, 1, 1, 0, factory.seed, 12).set_epoch(0).steps[0]
    loss = trl.compute_loss(trl.model.train(), trl.data_collator([trl.train_dataset[i] for i in pairs]))
    assert abs(float(loss) - 0.6931) > 1e-3
    assert first["loss"] == pytest.approx(float(loss), rel=1e-4)
    trl_logs = {key: sum(v) / len(v) for key, v in trl._metrics["train"].items()}
    for key in METRIC_KEYS:
        assert first[key] == pytest.approx(trl_logs[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("sync", [False, True])
def test_sync_ref_model_mixes_the_policy_into_the_reference_the_step_scores_with(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """``sync_ref_model`` adds trl's ``SyncRefModelCallback`` (unchanged) as trl does, holding the DPO step's
    reference: with ``ref_model_mixup_alpha=1`` every step the reference becomes the policy, so every
    step starts from policy == reference (loss log 2, zero margins); without it the policy drifts away."""
    config = _config(
        tmp_path / "out",
        max_steps=4,
        learning_rate=2e-2,
        sync_ref_model=sync,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=1.0,
    )
    _in_place(monkeypatch)
    trainer = DPOTrainer(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
    assert any(type(c).__name__ == "SyncRefModelCallback" for c in trainer.callback_handler.callbacks) == sync
    trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    later = [abs(row["rewards/margins"]) for row in logged[1:]]
    if sync:
        assert all(margin < 1e-6 for margin in later)
        assert all(row["loss"] == pytest.approx(0.6931, abs=1e-4) for row in logged)
    else:
        assert max(later) > 1e-3


def test_sync_ref_model_with_precomputed_reference_log_probs_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    config = _config(tmp_path / "out", sync_ref_model=True, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="sync_ref_model"):
        DPOTrainer(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))


def test_evaluate_after_training_scores_against_the_untrained_reference(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``eval_dataset`` is evaluated at the evaluation steps with trl's keys; ``evaluate()`` after training
    (a job of its own, on the trained weights) still scores against the untrained model as the reference,
    and prepares raw rows passed to it as trl does."""
    config = _config(
        tmp_path / "out",
        max_steps=2,
        learning_rate=2e-2,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=2,
    )
    _in_place(monkeypatch)
    trainer = DPOTrainer(
        model=str(tiny_llama),
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        eval_dataset=datasets.Dataset.from_list(ROWS[:3]),
    )
    trainer.train()
    during = [row for row in trainer.state.log_history if "eval_loss" in row]
    assert [row["step"] for row in during] == [1, 2]
    assert {f"eval_{key}" for key in METRIC_KEYS} <= set(during[-1])
    after = trainer.evaluate()
    assert after["eval_rewards/margins"] == pytest.approx(during[-1]["eval_rewards/margins"], rel=1e-3, abs=1e-6)
    assert abs(after["eval_rewards/margins"]) > 1e-5  # not a copy of the trained policy
    raw = trainer.evaluate(eval_dataset=datasets.Dataset.from_list(ROWS[3:]))
    assert {"eval_loss", "eval_rewards/accuracies", "eval_logps/chosen"} <= set(raw)


TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}
NOT_COMPARED = {*TIMING, "total_flos"}
"""Wall-clock values, and the FLOPs estimate (trl's counts its padded batches' positions, the loop has none)."""


def test_dpo_trainer_is_trls_class() -> None:
    import transformers
    import trl

    assert issubclass(DPOTrainer, trl.DPOTrainer) and issubclass(DPOTrainer, transformers.Trainer)


def test_the_dpo_step_logs_trls_values(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's packed DPO step on trl's prepared pairs, against trl's reference model (loaded from the
    model's path, as trl builds it), gives every value trl logs, step by step: 3 steps of every pair (one
    micro-batch: neither side's order changes a value), the weights moving."""
    import trl

    logs = []
    for cls in (trl.DPOTrainer, DPOTrainer):
        out = tmp_path / cls.__module__
        config = _config(out, max_steps=3, per_device_train_batch_size=len(ROWS), learning_rate=1e-2)
        if cls is DPOTrainer:
            _in_place(monkeypatch)  # after the config: accelerate's state is trl's
        trainer = cls(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
        if cls is DPOTrainer:
            assert isinstance(trainer.run_plan().loss, OwnStep)  # the packed step, not trl's compute_loss
        trainer.train()
        logs.append([{k: v for k, v in row.items() if k not in NOT_COMPARED} for row in trainer.state.log_history])
    trl_log, log = logs
    assert [row["step"] for row in log] == [row["step"] for row in trl_log] == [1, 2, 3, 3]
    assert abs(log[2]["rewards/margins"]) > 1e-3
    for row, trl_row in zip(log, trl_log, strict=True):
        assert row.keys() == trl_row.keys()
        for key, value in trl_row.items():
            assert row[key] == pytest.approx(value, rel=5e-4, abs=1e-5), (key, row["step"], row[key], value)


def test_a_subclass_compute_loss_runs_per_micro_batch(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script's subclass overriding ``compute_loss`` gets its own code run through trl's ``training_step`` on
    trl's collated micro-batches, not the loop's packed step."""
    calls: list[int] = []

    class Counting(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            calls.append(int(inputs["input_ids"].shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = _config(tmp_path / "out", max_steps=2, gradient_accumulation_steps=2)
    _in_place(monkeypatch)
    trainer = Counting(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
    assert not isinstance(trainer.run_plan().loss, OwnStep)  # trl's own step
    trainer.train()
    assert calls == [4, 4, 4, 4]  # 2 steps of 2 micro-batches of 2 pairs (chosen and rejected rows): trl's batches
    assert {"rewards/margins", "logps/chosen"} <= set(trainer.state.log_history[0])  # trl's metrics
