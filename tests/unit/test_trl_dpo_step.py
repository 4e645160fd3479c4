"""DPO on the step seam (``trl.dpo_step.PreferenceStep``) against a real ``trl.DPOTrainer``: the same pairs
give the same loss, gradient and logged metrics."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from tests.run_inputs import as_run
from trainbridge.core.config.loss import OwnStep
from trainbridge.modeling import VARLEN_SDPA, enable_varlen_sdpa
from trainbridge.trl.dpo_step import PairBatches, PreferenceStep
from trainbridge.trl.preference_data import prepare_preference_dataset
from trainbridge.trl.preference_loss import DPOLossSettings

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a * b + 3)}
    for a, b in [(1, 2), (13, 25), (7, 70), (9, 1), (4, 44), (30, 3)]
]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@pytest.mark.parametrize(
    ("loss_type", "varlen"),
    [("sigmoid", False), ("ipo", False), ("sft", False), ("sigmoid", True)],
    ids=["sigmoid", "ipo", "sft", "sigmoid-varlen-sdpa"],
)
def test_a_step_gives_trls_loss_gradient_and_metrics(
    tiny_llama: Path, tmp_path: Path, loss_type: str, varlen: bool
) -> None:
    """trl pads; ours packs each micro-batch into one row, under masked sdpa or (``varlen``, what the DPO
    step factory switches on) trainbridge's varlen attention for policy and reference."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ref = copy.deepcopy(policy)
    with torch.no_grad():  # a reference unlike the policy, so the rewards are not zero
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_length=12,
        per_device_train_batch_size=4,
        loss_type=[loss_type],
        beta=0.2,
    )
    trainer = DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    pairs = [0, 2, 3, 5]
    trl_model = trainer.model.train()
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in pairs])
    trl_loss = trainer.compute_loss(trl_model, inputs)
    trl_loss.backward()
    trl_logs = {key: sum(v) / len(v) for key, v in trainer._metrics["train"].items()}

    prepared = prepare_preference_dataset(datasets.Dataset.from_list(ROWS), tokenizer, args)
    batches = PairBatches(
        prepared, pairs_per_micro=2, micro_per_step=2, world_size=1, rank=0, seed=0, max_length=args.max_length
    )
    ours_ref, model = copy.deepcopy(ref), copy.deepcopy(policy).train()
    if varlen:
        assert enable_varlen_sdpa(model, 12) and enable_varlen_sdpa(ours_ref, 12)
    step = PreferenceStep(batches, DPOLossSettings.from_config(args), ref_model=ours_ref)
    prepared_step = step.prepare(pairs)
    loss = torch.zeros(())
    for micro, units in zip(prepared_step.micro_batches, prepared_step.micro_units, strict=True):
        micro_sum = step.micro_loss(model, micro, units)
        (micro_sum / prepared_step.loss_units).backward()  # the loop's scale on one rank
        loss = loss + micro_sum.detach()
    step.add_metric_sums({name: float(v) for name, v in step.metric_sums().items()})
    ours = step.metric_logs()

    torch.testing.assert_close(loss / prepared_step.loss_units, trl_loss.detach(), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), trl_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    # trl averages per-micro-batch values: ours has two micro-batches of 2 where trl had one of 4; the
    # per-pair means are the same, the per-token ones weigh the micro-batches alike (checked on one below)
    assert set(ours) == set(trl_logs)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "num_tokens",
    ):
        assert ours[key] == pytest.approx(trl_logs[key], rel=1e-4, abs=1e-5), key


def test_one_micro_batch_gives_trls_per_token_metrics(tiny_llama: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama)
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_length=12,
        per_device_train_batch_size=4,
    )
    trainer = DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(policy),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    pairs = [1, 2, 4, 5]
    trainer.compute_loss(trainer.model.train(), trainer.data_collator([trainer.train_dataset[i] for i in pairs]))
    trl_logs = {key: sum(v) / len(v) for key, v in trainer._metrics["train"].items()}
    prepared = prepare_preference_dataset(datasets.Dataset.from_list(ROWS), tokenizer, args)
    batches = PairBatches(prepared, 4, 1, 1, 0, 0, args.max_length)
    step = PreferenceStep(batches, DPOLossSettings.from_config(args), ref_model=copy.deepcopy(policy))
    micro = step.prepare(pairs)
    step.micro_loss(copy.deepcopy(policy).train(), micro.micro_batches[0], micro.micro_units[0])
    step.add_metric_sums({name: float(v) for name, v in step.metric_sums().items()})
    ours = step.metric_logs()
    assert list(ours) == list(trl_logs)
    for key, value in trl_logs.items():
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


class _Logs:
    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []

    def on_log(self, context, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        self.logs.append((context.global_step, dict(logs or {})))


def _run_dpo(args_for, tmp_path: Path, tiny_llama: Path, **factory_kwargs: object) -> tuple[list, object]:  # type: ignore[no-untyped-def]
    """Three DPO steps of 2 pairs on the real loop, the step built in the worker by ``TrainingArgs.train_step``."""
    from trainbridge.callbacks import ScheduleCallback
    from trainbridge.core.callback import Callback
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.build import build_run
    from trainbridge.loop.loop import TrainingLoop
    from trainbridge.trl.dpo_step import DPOStepFactory

    config = DPOConfig(output_dir=str(tmp_path / "dpo"), report_to="none", use_cpu=True, max_length=12, beta=0.2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prepared = prepare_preference_dataset(datasets.Dataset.from_list(ROWS), tokenizer, config)
    factory = DPOStepFactory(
        prepared, DPOLossSettings.from_config(config), 1, 2, config.max_length, seed=0, **factory_kwargs
    )
    args = args_for(max_steps=3, logging_steps=1, val_data_path=None, loss=OwnStep(factory))
    components = build_run(*as_run(args), DistributedEnv())
    assert isinstance(components.step, PreferenceStep)
    seen = type("Logs", (_Logs, Callback), {})()
    TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback(), seen], components).run()
    return [(s, logs) for s, logs in seen.logs if "loss" in logs], factory


def test_the_loop_runs_the_dpo_step_and_logs_trls_keys(args_for, tmp_path: Path, tiny_llama: Path) -> None:
    step_logs, _ = _run_dpo(args_for, tmp_path, tiny_llama)
    assert [s for s, _ in step_logs] == [1, 2, 3]
    first = step_logs[0][1]
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is its reference at step 1: log 2
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "entropy",
        "mean_token_accuracy",
        "num_tokens",
    } <= set(first)
    assert step_logs[2][1]["rewards/margins"] != 0.0  # the policy moved away from the reference
    assert step_logs[2][1]["num_tokens"] > step_logs[1][1]["num_tokens"] > first["num_tokens"] > 0


def test_the_loops_first_dpo_step_gives_trls_loss(args_for, tmp_path: Path, tiny_llama: Path) -> None:
    """A reference unlike the policy (so the loss is not log 2): the loop's first logged loss and rewards
    equal trl's ``DPOTrainer.compute_loss`` on the same two pairs."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    step_logs, factory = _run_dpo(args_for, tmp_path, tiny_llama, ref_model=copy.deepcopy(ref))
    pairs = PairBatches(factory.dataset, 1, 2, 1, 0, 0, 12).set_epoch(0).steps[0]

    config = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=12,
        beta=0.2,
        per_device_train_batch_size=1,
    )
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_llama),
        ref_model=ref,
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    model = trainer.model.train()
    losses = [trainer.compute_loss(model, trainer.data_collator([trainer.train_dataset[i]])) for i in pairs]
    trl_logs = {key: sum(v) / len(v) for key, v in trainer._metrics["train"].items()}
    first = step_logs[0][1]
    assert first["loss"] == pytest.approx(float(sum(losses)) / len(losses), rel=1e-4)
    assert abs(first["loss"] - 0.6931) > 1e-3
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert first[key] == pytest.approx(trl_logs[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("varlen_sdpa", [True, False])
def test_the_step_factory_switches_policy_and_reference_to_varlen_attention(
    args_for, tmp_path: Path, tiny_llama: Path, varlen_sdpa: bool
) -> None:
    """A DPO step packs its own rows, so its factory (not the loop's batch set-up) switches the policy and a
    given ``ref_model`` to the varlen attention: one attention call per layer instead of a ``[T, T]`` mask;
    ``TrainingArgs.varlen_sdpa=False`` keeps sdpa."""
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.trl.dpo_step import DPOStepFactory

    config = DPOConfig(output_dir=str(tmp_path / "dpo"), report_to="none", use_cpu=True, max_length=12)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prepared = prepare_preference_dataset(datasets.Dataset.from_list(ROWS), tokenizer, config)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    factory = DPOStepFactory(prepared, DPOLossSettings.from_config(config), 1, 2, 12, ref_model=ref)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama)
    args = args_for(max_steps=1, val_data_path=None, loss=OwnStep(factory), varlen_sdpa=varlen_sdpa)
    step = factory(policy, tokenizer, as_run(args).args, DistributedEnv(), as_run(args).plan)
    expected = VARLEN_SDPA if varlen_sdpa else "sdpa"
    assert step.ref_model is not None
    assert policy.config._attn_implementation == expected
    assert step.ref_model.config._attn_implementation == expected
