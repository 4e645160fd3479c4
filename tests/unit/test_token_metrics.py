"""trl's SFT metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) against trl's fused LM head."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from tests.run_inputs import as_run
from trainbridge.core.config.loss import TokenLoss
from trainbridge.step.token_metrics import TokenMetrics, token_metric_sums


def test_sums_match_trls_fused_head() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(4, 40, (3, 9))
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[2, 6:] = -100
    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    with torch.no_grad():
        out = fused(input_ids=input_ids, labels=labels, fused_lm_head=True)
        entropy, hits, tokens = token_metric_sums(model(input_ids=input_ids).logits, labels).tolist()
    assert tokens == out.label_mask.sum().item()
    assert entropy == pytest.approx(out.entropy.sum().item(), rel=1e-5)
    assert hits == out.is_top1.sum().item()


def test_logging_rule_is_trls() -> None:
    metrics = TokenMetrics()
    metrics.add([2.0, 1.0, 4.0], input_tokens=10)
    metrics.add([3.0, 3.0, 3.0], input_tokens=7)
    assert metrics.log() == {"num_tokens": 17.0, "entropy": pytest.approx(0.75), "mean_token_accuracy": 0.625}
    metrics.add([0.0, 0.0, 0.0], input_tokens=5)
    assert metrics.log() == {"num_tokens": 22.0, "entropy": 0.0, "mean_token_accuracy": 0.0}


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def _trl_values(model: LlamaForCausalLM, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """What trl's SFTTrainer logs for these micro-batches (one rank): its fused head's sums, its rule."""
    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    entropy, accuracy, tokens = [], [], 0
    with torch.no_grad():
        for batch in micro_batches:
            out = fused(input_ids=batch["input_ids"], labels=batch["labels"], fused_lm_head=True)
            valid = out.label_mask.sum()
            entropy.append((out.entropy.sum() / valid).item())
            accuracy.append((out.is_top1.sum() / valid).item())
            tokens += batch["input_ids"].size(1)  # trl's padding-free count: position_ids.size(1)
    return {
        "entropy": sum(entropy) / len(entropy),
        "mean_token_accuracy": sum(accuracy) / len(accuracy),
        "num_tokens": float(tokens),
    }


def test_the_token_step_logs_trls_values_through_its_metric_sums() -> None:
    from trainbridge.step.token_ce import TokenCrossEntropy

    model = _tiny_llama()
    micro_batches = []
    for length, masked in ((11, 3), (7, 5)):  # packed rows of one step
        input_ids = torch.randint(4, 40, (1, length))
        labels = input_ids.clone()
        labels[0, :masked] = -100
        micro_batches.append(
            {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(length).unsqueeze(0)}
        )
    step = TokenCrossEntropy(None, 64, padded=False, token_metrics=True)  # type: ignore[arg-type]
    with torch.no_grad():
        for batch in micro_batches:
            step.micro_loss(model, batch, float((batch["labels"][:, 1:] != -100).sum()))
    sums = step.metric_sums()
    assert list(sums) == [  # by name, per micro-batch: entropy, hits, scored and input tokens
        f"{i}/{name}" for i in range(len(micro_batches)) for name in ("entropy", "hits", "tokens", "input_tokens")
    ]
    assert step.metric_sums() == {}  # taken once per optimizer step
    step.add_metric_sums({name: float(v) for name, v in sums.items()})  # one rank: the agreement's sums are its own
    logs = step.metric_logs()
    expected = _trl_values(model, micro_batches)
    assert list(logs) == ["entropy", "mean_token_accuracy", "num_tokens"]
    assert logs == {key: pytest.approx(value, rel=1e-5) for key, value in expected.items()}
    assert step.metric_logs() == {"num_tokens": expected["num_tokens"]}  # an interval without steps


def test_a_run_logs_the_token_metrics_at_its_log_steps(args_for) -> None:
    from trainbridge.callbacks import ScheduleCallback
    from trainbridge.core.callback import Callback
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.build import build_run
    from trainbridge.loop.loop import TrainingLoop

    class Logs(Callback):
        def __init__(self) -> None:
            self.logs: list[tuple[int, dict[str, float]]] = []

        def on_log(self, context, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            self.logs.append((context.global_step, dict(logs or {})))

    args = args_for(max_steps=4, logging_steps=2, loss=TokenLoss(metrics=True))
    seen = Logs()
    TrainingLoop(
        as_run(args).args, DistributedEnv(), [ScheduleCallback(), seen], build_run(*as_run(args), DistributedEnv())
    ).run()
    step_logs = [(step, logs) for step, logs in seen.logs if "loss" in logs]
    assert [step for step, _ in step_logs] == [2, 4]
    for _, logs in step_logs:
        assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(logs)
        assert logs["entropy"] > 0.0 and 0.0 <= logs["mean_token_accuracy"] <= 1.0
    assert step_logs[1][1]["num_tokens"] > step_logs[0][1]["num_tokens"] > 0


def test_evaluation_sums_each_batch_over_ranks_and_averages_the_batches() -> None:
    """Two ranks' validation batches: each batch's sums are added over the ranks (the evaluation's one
    reduction), then trl's rule: the mean over batches of each batch's ratio, and the training's tokens."""
    from trainbridge.step.token_ce import TokenCrossEntropy

    model = _tiny_llama()
    generator = torch.Generator().manual_seed(1)
    batches = []  # [rank][batch]
    for lengths in ((9, 6), (12, 4)):
        row = []
        for length in lengths:
            input_ids = torch.randint(4, 40, (1, length), generator=generator)
            labels = input_ids.clone()
            labels[0, : length // 3] = -100
            row.append({"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(length)[None]})
        batches.append(row)
    steps = [TokenCrossEntropy(None, 64, padded=False, token_metrics=True) for _ in range(2)]  # type: ignore[arg-type]
    for step, rank_batches in zip(steps, batches, strict=True):
        step.token_metrics.total_tokens = 57  # type: ignore[union-attr]  # trained so far
        for batch in rank_batches:
            out = step.eval_batch(model, batch, batch, outputs=False, rows=1)
            assert out.units == int((batch["labels"][:, 1:] != -100).sum())
    rank_sums = [step.eval_metric_sums() for step in steps]
    assert len(rank_sums[0]) == 6 and steps[0].eval_metric_sums() == {}  # taken once per evaluation
    reduced = {name: rank_sums[0][name] + rank_sums[1][name] for name in rank_sums[0]}
    logs = steps[0].eval_metric_logs(reduced)
    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    entropy, accuracy = [], []
    with torch.no_grad():
        for k in range(2):  # trl: each batch's sums gathered over the ranks, then one ratio
            outs = [fused(input_ids=b[k]["input_ids"], labels=b[k]["labels"], fused_lm_head=True) for b in batches]
            valid = sum(o.label_mask.sum() for o in outs)
            entropy.append((sum(o.entropy.sum() for o in outs) / valid).item())
            accuracy.append((sum(o.is_top1.sum() for o in outs) / valid).item())
    assert logs == {
        "entropy": pytest.approx(sum(entropy) / 2, rel=1e-5),
        "mean_token_accuracy": pytest.approx(sum(accuracy) / 2, rel=1e-6),
        "num_tokens": 57.0,
    }
