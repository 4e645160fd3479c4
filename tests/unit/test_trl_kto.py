"""``trainbridge.KTOTrainer``: trl's KTO loss and metrics on the same tensors, trl's data preparation, and an
in-place run with trl's config as it is (trl's keys at trl's log steps; first-step loss and metrics equal to
trl's ``KTOTrainer.compute_loss`` on the same rows and reference model)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig
from trl import KTOTrainer as TrlKTOTrainer

from trainbridge import KTOTrainer
from trainbridge.core.config.loss import OwnStep
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.trl.kto_loss import KTOLoss
from trainbridge.trl.kto_step import UnpairedBatches

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


def _config(out: Path, **overrides: object) -> KTOConfig:
    values: dict[str, object] = dict(
        output_dir=str(out),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=12,
        beta=0.3,
        learning_rate=1e-3,
        desirable_weight=1.5,
    )
    values.update(overrides)
    return KTOConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_equals_trls_formula(loss_type: str) -> None:
    generator = torch.Generator().manual_seed(0)
    logps, ref = -torch.rand(6, generator=generator) * 5, -torch.rand(6, generator=generator) * 5
    desirable = torch.tensor([True, False, True, True, False, False])
    loss = KTOLoss(loss_type=loss_type, beta=0.4, desirable_weight=1.3, undesirable_weight=0.7)
    kl = torch.tensor(0.25)
    value, sums = loss.micro(logps, ref, desirable, kl)
    ratio = logps - ref
    if loss_type == "kto":
        chosen = 1 - torch.sigmoid(0.4 * (ratio[desirable] - kl))
        rejected = 1 - torch.sigmoid(0.4 * (kl - ratio[~desirable]))
    else:
        chosen, rejected = 1 - torch.sigmoid(0.4 * ratio[desirable]), torch.sigmoid(0.4 * ratio[~desirable])
    expected = torch.cat([1.3 * chosen, 0.7 * rejected]).mean()
    assert float(value) == pytest.approx(float(expected), rel=1e-6)
    assert float(sums["rewards/chosen"]) == pytest.approx(float(0.4 * ratio[desirable].sum()), rel=1e-6)
    assert float(sums["chosen"]) == 3 and float(sums["rejected"]) == 3


def test_sequential_plan_is_trls_batch_order() -> None:
    rows = datasets.Dataset.from_dict({"label": [True] * 16})
    plan = UnpairedBatches(rows, 2, 2, 2, 0, 0, None, sequential=True).set_epoch(0)
    # batch k (2 rows) goes to rank k % 2; a rank's 2 micro-batches are its next two batches
    assert plan.steps[0] == [0, 1, 4, 5, 2, 3, 6, 7]
    assert plan.steps[1] == [8, 9, 12, 13, 10, 11, 14, 15]


def test_in_place_run_equals_trls_first_step(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def trl_trainer(out: str) -> Any:
        return TrlKTOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_llama),
            ref_model=copy.deepcopy(ref),
            args=_config(tmp_path / out),
            train_dataset=datasets.Dataset.from_list(ROWS),
            processing_class=tokenizer,
        )

    trl = trl_trainer("trl")
    trl.train()
    trl_logged = [row for row in trl.state.log_history if "loss" in row]
    fresh = trl_trainer("trl2")
    batch = fresh.data_collator([fresh.train_dataset[i] for i in range(4)])  # trl's first batch (sequential)
    loss = fresh.compute_loss(fresh.model.train(), batch)
    metrics = {key: sum(v) / len(v) for key, v in fresh._metrics["train"].items()}
    config = _config(tmp_path / "out")
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)  # after trl's configs: they set up accelerate first
    trainer = KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_llama),
        ref_model=ref,
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    assert trainer.train_dataset["completion_ids"] == fresh.train_dataset["completion_ids"]  # trl's preparation
    assert trainer.train_dataset["KL_completion_ids"] == fresh.train_dataset["KL_completion_ids"]
    out = trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert out.global_step == trl.state.global_step == 3
    assert [row["step"] for row in logged] == [row["step"] for row in trl_logged] == [1, 2, 3]
    for row, trl_row in zip(logged, trl_logged, strict=True):
        assert set(row) == set(trl_row)

    assert logged[0]["loss"] == pytest.approx(float(loss), rel=1e-4)
    for key, value in metrics.items():
        assert logged[0][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert metrics["kl"] > 0  # the perturbed reference: the KL term is in play


def test_a_peft_policy_is_its_own_reference_with_the_adapter_disabled(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import LoraConfig

    config = _config(
        tmp_path / "out", max_steps=2, save_steps=2, save_strategy="steps", desirable_weight=1.0, learning_rate=1e-2
    )
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    trainer = KTOTrainer(
        model=str(tiny_llama),
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    first, second = [row for row in trainer.state.log_history if "loss" in row]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)  # a fresh LoRA is its base: log-ratios and KL are 0
    assert first["kl"] == 0.0
    assert abs(second["loss"] - 0.5) > 1e-4  # the trained adapter against the base, not against itself
    files = {p.name for p in (tmp_path / "out" / "checkpoint-2").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files


def test_precomputed_reference_columns_equal_trls(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trl = TrlKTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_llama),
        ref_model=copy.deepcopy(ref),
        args=_config(tmp_path / "trl", precompute_ref_log_probs=True),
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    config = _config(tmp_path / "out", precompute_ref_log_probs=True, max_steps=2)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    trainer = KTOTrainer(
        model=str(tiny_llama),
        ref_model=ref,
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    theirs = trl.train_dataset  # trl scores the reference in its constructor, as ours (trl's constructor) does
    for column in ("ref_logps", "ref_KL_logps"):
        assert trainer.train_dataset[column] == pytest.approx(theirs[column], rel=1e-4, abs=1e-4), column
    assert isinstance(trainer.run_plan().loss, OwnStep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ignored = [str(w.message) for w in caught if issubclass(w.category, HFPortingWarning)]
    assert not ignored  # every KTOConfig field is read: trl's constructor precomputes, trl's code reads the rest
    assert [row["step"] for row in trainer.state.log_history if "loss" in row] == [1, 2]


def test_kto_trainer_is_trls_class() -> None:
    import transformers
    import trl

    assert issubclass(KTOTrainer, trl.KTOTrainer) and issubclass(KTOTrainer, transformers.Trainer)


TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}
NOT_COMPARED = {*TIMING, "total_flos"}
"""Wall-clock values, and the FLOPs estimate (trl's counts its padded batches' positions, the loop has none)."""


@pytest.mark.parametrize("precompute", [False, True], ids=["ref-model", "precomputed"])
def test_the_kto_step_logs_trls_values(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precompute: bool
) -> None:
    """The loop's packed KTO step on trl's prepared rows, against trl's reference model (loaded from the model's
    path, as trl builds it) or the columns trl's constructor precomputed, gives every value trl logs, step by
    step: 3 steps of all 16 unpaired rows (one micro-batch), the weights moving."""
    logs = []
    for cls in (TrlKTOTrainer, KTOTrainer):
        config = _config(
            tmp_path / cls.__module__,
            per_device_train_batch_size=16,
            learning_rate=1e-2,
            precompute_ref_log_probs=precompute,
            model_init_kwargs={"dtype": "float32"},
        )
        if cls is KTOTrainer:
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)  # after the config: accelerate's state is trl's
        trainer = cls(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
        if cls is KTOTrainer:
            assert isinstance(trainer.run_plan().loss, OwnStep)  # the packed step, not trl's compute_loss
        trainer.train()
        logs.append([{k: v for k, v in row.items() if k not in NOT_COMPARED} for row in trainer.state.log_history])
    trl_log, log = logs
    assert [row["step"] for row in log] == [row["step"] for row in trl_log] == [1, 2, 3, 3]
    assert abs(log[2]["rewards/margins"]) > 1e-3 and log[2]["kl"] > 0
    for row, trl_row in zip(log, trl_log, strict=True):
        assert row.keys() == trl_row.keys()
        for key, value in trl_row.items():
            # float32 rounding of the packed and the padded forwards, amplified by Adam over the steps
            assert row[key] == pytest.approx(value, rel=2e-3, abs=1e-5), (key, row["step"], row[key], value)


def test_a_subclass_compute_loss_runs_per_micro_batch(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script's subclass overriding ``compute_loss`` gets its own code run through trl's ``training_step`` on
    trl's collated micro-batches, not the loop's packed step; trl's metrics are logged."""
    calls: list[int] = []

    class Counting(KTOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            calls.append(int(inputs["input_ids"].shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = _config(tmp_path / "out", max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    trainer = Counting(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
    assert not isinstance(trainer.run_plan().loss, OwnStep)  # trl's own step
    trainer.train()
    assert calls == [2, 2, 2, 2]  # 2 steps of 2 micro-batches of 2 rows: trl's batches
    assert {"kl", "rewards/chosen", "logps/chosen"} <= set(trainer.state.log_history[0])  # trl's metrics


EVAL_TIMING = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time"}


def test_evaluate_is_trls(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``eval_dataset`` is taken and prepared by trl's constructor; ``evaluate()`` is trl's own (its batches, loss
    and metrics): equal to trl's ``evaluate()`` on the same model and reference."""
    found = []
    for cls in (TrlKTOTrainer, KTOTrainer):
        config = _config(
            tmp_path / cls.__module__, per_device_eval_batch_size=4, model_init_kwargs={"dtype": "float32"}
        )
        if cls is KTOTrainer:
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
        trainer = cls(
            model=str(tiny_llama),
            args=config,
            train_dataset=datasets.Dataset.from_list(ROWS),
            eval_dataset=datasets.Dataset.from_list(ROWS[:4]),
        )
        found.append({k: v for k, v in trainer.evaluate().items() if k not in EVAL_TIMING})
    trl_metrics, metrics = found
    assert {"eval_loss", "eval_kl", "eval_rewards/chosen", "eval_logps/rejected"} <= set(metrics)
    assert metrics == pytest.approx(trl_metrics, rel=1e-5)
