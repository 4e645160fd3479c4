"""DPO evaluation (``PairEvalBatches``, ``PreferenceStep.eval_batch``/``eval_metric_logs``) against a real
``trl.DPOTrainer.evaluate()``: the same pairs and models give trl's ``eval_loss`` and ``eval_`` metrics;
the loop reports them at the evaluation steps with trl's keys."""

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
from trainbridge.trl.dpo_step import PairBatches, PairEvalBatches, PreferenceStep
from trainbridge.trl.preference_data import prepare_preference_dataset
from trainbridge.trl.preference_loss import DPOLossSettings

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a * b + 3)}
    for a, b in [(1, 2), (13, 25), (7, 70), (9, 1), (4, 44), (30, 3)]
]
EVAL_KEYS = (
    "eval_loss",
    "eval_entropy",
    "eval_logits/chosen",
    "eval_logits/rejected",
    "eval_mean_token_accuracy",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "eval_logps/chosen",
    "eval_logps/rejected",
)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _evaluate(step: PreferenceStep, model: torch.nn.Module, batches: PairEvalBatches) -> dict[str, float]:
    """What the loop's evaluation does on one rank: eval_batch per batch, then the step's metrics."""
    loss, units = 0.0, 0.0
    with torch.no_grad():
        for indices, batch in batches.indexed():
            out = step.eval_batch(model, batch, batch, outputs=False, rows=len(indices))
            loss, units = loss + float(out.loss_sum), units + out.units
    logs = step.eval_metric_logs(step.eval_metric_sums())
    return {"eval_loss": loss / units, **{f"eval_{k}": v for k, v in logs.items()}}


@pytest.mark.parametrize("loss_type", ["sigmoid", "sft"])
def test_evaluation_gives_trls_eval_loss_and_metrics(tiny_llama: Path, tmp_path: Path, loss_type: str) -> None:
    """6 pairs in batches of 4: an uneven last batch, so trl's per-batch averaging is what is compared."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ref = copy.deepcopy(policy)
    torch.manual_seed(5)
    with torch.no_grad():  # a reference unlike the policy, so rewards and margins are not zero
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_length=12,
        per_device_eval_batch_size=4,
        loss_type=[loss_type],
        beta=0.2,
    )
    trainer = DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        eval_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    trl_metrics = trainer.evaluate()

    prepared = prepare_preference_dataset(datasets.Dataset.from_list(ROWS), tokenizer, args)
    step = PreferenceStep(
        PairBatches(prepared, 2, 1, 1, 0, 0, args.max_length), DPOLossSettings.from_config(args), copy.deepcopy(ref)
    )
    ours = _evaluate(step, copy.deepcopy(policy).eval(), PairEvalBatches(prepared, 4, 1, 0, args.max_length))
    assert abs(trl_metrics["eval_rewards/margins"]) > 1e-4
    for key in EVAL_KEYS:
        assert ours[key] == pytest.approx(trl_metrics[key], rel=1e-4, abs=1e-5), key
    assert set(ours) == {k for k in trl_metrics if not k.endswith(("runtime", "per_second"))} - {"epoch"}


def test_each_rank_evaluates_its_batches_and_a_short_rank_runs_a_dummy() -> None:
    data = datasets.Dataset.from_dict({"prompt_ids": [[1]] * 10, "chosen_ids": [[2]] * 10, "rejected_ids": [[3]] * 10})
    ranks = [PairEvalBatches(data, 4, 2, rank, None) for rank in (0, 1)]
    plans = [[indices for indices, _ in r.indexed()] for r in ranks]
    assert plans == [[[0, 1, 2, 3], [8, 9]], [[4, 5, 6, 7], []]]  # rank 1's second batch: a dummy
    assert [len(r) for r in ranks] == [2, 2] and [r.num_samples_local for r in ranks] == [6, 4]


def test_a_dummy_batch_counts_as_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=12)
    prepared = prepare_preference_dataset(datasets.Dataset.from_list(ROWS), tokenizer, args)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    step = PreferenceStep(PairBatches(prepared, 2, 1, 1, 0, 0, 12), DPOLossSettings.from_config(args), policy)
    _, batch = next(PairEvalBatches(prepared, 2, 1, 0, 12).indexed())
    with torch.no_grad():
        out = step.eval_batch(policy, batch, batch, outputs=False, rows=0)
    assert out.units == 0.0 and float(out.loss_sum) == 0.0
    assert all(value == 0.0 for value in step.eval_metric_sums().values())


def test_the_loop_evaluates_dpo_at_trls_steps_with_trls_keys(args_for, tmp_path: Path, tiny_llama: Path) -> None:
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
        prepared, DPOLossSettings.from_config(config), 1, 2, 12, eval_dataset=prepared, eval_pairs_per_micro=4
    )
    args = args_for(max_steps=4, logging_steps=1, loss=OwnStep(factory), eval_strategy="steps", eval_steps=2)

    class Evaluations(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, dict[str, float]]] = []

        def on_evaluate(self, context, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
            self.seen.append((context.global_step, dict(metrics or {})))

    seen = Evaluations()
    TrainingLoop(
        as_run(args).args, DistributedEnv(), [ScheduleCallback(), seen], build_run(*as_run(args), DistributedEnv())
    ).run()
    assert [s for s, _ in seen.seen] == [2, 4]
    metrics = seen.seen[0][1]
    assert set(EVAL_KEYS) | {"eval_num_tokens"} <= set(metrics)
    assert metrics["eval_num_tokens"] > 0  # the training's tokens so far, as trl reports them
