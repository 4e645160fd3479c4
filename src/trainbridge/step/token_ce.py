"""The padding-free token-budget step: the summed token cross entropy (causal LMs' default).

Every rank knows the whole epoch plan (``data.plan``), so a step's global loss-token count is known
locally and the loss is normalised by it without a collective: ``loss = sum_token_CE / step.loss_tokens
* world_size``.  Batches are packed rows (or padded rows, or a user's collator's) within the token budget
``max_batch_len`` (``data.loader.TrainBatches``); the loss is ``data.loss.token_loss_sum`` (the installed
chunked / Liger loss head when there is one).  With ``token_metrics`` the step also reports trl's SFT
metrics (``token_metrics.TokenMetrics``) from the micro-batches' full logits, in training and evaluation
(each validation batch's sums ride in the evaluation's one reduction).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.data.loader import TrainBatches
from trainbridge.data.loss import forward_logits, logits_loss_sum, token_loss_sum
from trainbridge.data.plan import StepPlan
from trainbridge.data.types import IGNORE_INDEX
from trainbridge.step.base import EvalOutput, StepBatches, TrainStep
from trainbridge.step.metric_rows import MetricRows
from trainbridge.step.token_metrics import TOKEN_SUMS, TokenMetrics, eval_logs, token_metric_sums

PLAN_SAMPLE_STEPS = 64
"""Steps of the first epoch's plan the run plan averages its "effective batch" line over."""


class TokenCrossEntropy(TrainStep):
    """Token-budget micro-batches of the global step plan; the loss is the summed shifted token cross entropy."""

    name = "token cross entropy (token-budget batches)"
    train_batches: TrainBatches

    def __init__(
        self,
        train_batches: TrainBatches,
        max_batch_len: int,
        padded: bool,
        token_metrics: bool = False,
        batch_mean_eval: bool = False,
    ) -> None:
        self.train_batches = train_batches
        self.batch_mean_eval = batch_mean_eval
        """Validation in Trainer's batches (``per_device_eval_batch_size``): ``eval_loss`` is Trainer's, each
        batch's token mean weighted by its samples; else the token mean of the whole set."""
        self.max_batch_len = max_batch_len
        self.padded = padded
        self.token_metrics = TokenMetrics() if token_metrics else None
        self.metrics = MetricRows((*TOKEN_SUMS, "input_tokens"))
        self.eval_metrics = MetricRows(TOKEN_SUMS)

    def prepare(self, step: StepPlan) -> StepBatches:
        micro_batches = self.train_batches.micro_batches(step)
        planned = self.train_batches.micro_batch_loss_tokens(step)
        # a user's collator's batch counts its own labels (on the CPU: no device synchronisation)
        units = [
            float(n if isinstance(b, CollatedBatch) else cpu_loss_tokens(b))
            for n, b in zip(planned, micro_batches, strict=True)
        ]
        return StepBatches(micro_batches, units, float(step.loss_tokens), step.num_samples, step.num_tokens)

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        if self.token_metrics is None:
            return token_loss_sum(model, batch, num_tokens=int(units))[0]
        logits = forward_logits(model, batch)
        sums = token_metric_sums(logits, batch["labels"])
        mask = batch.get("attention_mask")  # padded rows: the attended tokens, counted on the device
        inputs = float(batch["input_ids"].numel()) if mask is None else mask.sum().float()
        self.metrics.record({**dict(zip(TOKEN_SUMS, sums.unbind(), strict=True)), "input_tokens": inputs}, sums.device)
        return logits_loss_sum(logits, batch["labels"], int(units))[0]

    def metric_sums(self) -> dict[str, torch.Tensor | float]:
        return self.metrics.sums()

    def add_metric_sums(self, sums: Mapping[str, float]) -> None:
        if self.token_metrics is not None:
            for row in self.metrics.rows_of(sums):
                self.token_metrics.add([row[key] for key in TOKEN_SUMS], input_tokens=int(row["input_tokens"]))

    def metric_logs(self) -> dict[str, float]:
        return {} if self.token_metrics is None else self.token_metrics.log()

    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        n_tokens = cpu_loss_tokens(cpu_batch)
        if not outputs and self.token_metrics is None:
            return self._eval_loss(token_loss_sum(model, batch, num_tokens=n_tokens)[0], n_tokens, rows)
        logits = forward_logits(model, batch)  # full logits are needed for the predictions and the metrics
        if self.token_metrics is not None:  # read once, after the evaluation (eval_metric_sums)
            sums = token_metric_sums(logits, batch["labels"])
            self.eval_metrics.record(dict(zip(TOKEN_SUMS, sums.unbind(), strict=True)), sums.device)
        loss = self._eval_loss(logits_loss_sum(logits, batch["labels"], n_tokens)[0], n_tokens, rows)
        return loss._replace(predictions=logits, labels=batch["labels"]) if outputs else loss

    def _eval_loss(self, loss_sum: torch.Tensor, n_tokens: int, rows: int) -> EvalOutput:
        """The batch's share of ``eval_loss``: its token sum over tokens, or (``batch_mean_eval``) its token
        mean once per validation sample, as Trainer's ``evaluation_loop`` repeats each batch's loss."""
        if not self.batch_mean_eval:
            return EvalOutput(loss_sum, n_tokens)
        return EvalOutput(loss_sum * (rows / max(n_tokens, 1)), rows)

    def eval_metric_sums(self) -> dict[str, float]:
        return cast("dict[str, float]", self.eval_metrics.sums(read=True))

    def eval_metric_logs(self, sums: Mapping[str, float]) -> dict[str, float]:
        """trl's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` of an evaluation (``eval_logs``)."""
        if self.token_metrics is None:
            return {}
        return eval_logs(self.eval_metrics.rows_of(sums), self.token_metrics.total_tokens)

    def describe_batches(self, effective_batch_size: int) -> str:
        plan_steps = self.train_batches.plan.steps[:PLAN_SAMPLE_STEPS]  # steps are packed when read
        if not plan_steps:
            return f"{effective_batch_size} samples"
        tokens = sum(step.num_tokens for step in plan_steps) / len(plan_steps)
        micro = sum(step.micro_batches_per_rank for step in plan_steps) / len(plan_steps)
        return (
            f"{effective_batch_size} samples, ~{tokens:,.0f} tokens per step (all ranks); {micro:.1f} "
            f"micro-batches of <= {self.max_batch_len} tokens per rank, "
            f"{'padded' if self.padded else 'padding-free'}"
        )


def cpu_loss_tokens(cpu_batch: dict[str, Any]) -> int:
    """Loss tokens of a batch still on the CPU (counted there: no device synchronisation)."""
    return int((cpu_batch["labels"][:, 1:] != IGNORE_INDEX).sum())
