"""KTO as a training step (``step.base.TrainStep``): unpaired rows, trl's loss, KL reference point and metrics.

``UnpairedBatches`` plans steps of rows as ``dpo_step.PairBatches`` does; with trl's
``train_sampling_strategy="sequential"`` (what KTO's KL term requires) in trl's order: the dataset cut into
batches of ``per_device_train_batch_size`` rows, batch ``k`` on rank ``k % world_size``.  A micro-batch packs
each row's prompt + completion and prompt + mismatched completion (trl's ``KL_completion_ids``, rotated
within those batches) into one padding-free row (``sequence_logps.pack_pairs``), scored by the policy and
the reference as DPO's pairs are (``preference_data.reference_stats``), or read from the rows'
``ref_logps``/``ref_KL_logps`` (``precompute_ref_log_probs``).  The KL reference point is the mean
over every rank of each rank's mean mismatched log-ratio, as trl gathers it: one all-reduce of a scalar per
micro-batch.  The loss is trl's per micro-batch, one loss unit each; trl's metrics ride in the step's
agreement (``metric_sums``) and are logged as trl averages them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.step.base import EvalOutput, StepBatches, TrainStep
from trainbridge.step.metric_rows import MetricRows, RecordsMetricRows
from trainbridge.trl.dpo_step import SEQUENCE_COLUMNS, DPOStepFactory, PairBatches, PairPlan
from trainbridge.trl.kto_loss import KTOLoss, kl_sum
from trainbridge.trl.preference_data import reference_stats
from trainbridge.trl.preference_loss import DPOLossSettings
from trainbridge.trl.sequence_logps import pack_pairs, sequence_stats

if TYPE_CHECKING:
    from trainbridge.core.config.plan import RunPlan

COLUMNS = (
    "ranks",
    "kl",
    *SEQUENCE_COLUMNS,
    "chosen",
    "rejected",
    "rewards/chosen",
    "logps/chosen",
    "rewards/rejected",
    "logps/rejected",
)
"""The names of one micro-batch's metric sums (``step.metric_rows``)."""


class UnpairedBatches(PairBatches):
    """Rows of trl's KTO preparation (``prompt_ids``, ``completion_ids``, ``KL_completion_ids``, ``label``)."""

    def __init__(self, dataset: Any, *args: Any, sequential: bool = True, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.sequential = sequential

    def set_epoch(self, epoch: int) -> PairPlan:
        if not self.sequential:
            return super().set_epoch(epoch)
        size, micro, world = self.pairs_per_micro, self.micro_per_step, self.world_size
        steps = []
        for step in range(self.steps_per_epoch):
            order: list[int] = []
            for rank in range(world):  # each rank's part is contiguous (``micro_batches``)
                for m in range(micro):
                    first = ((step * micro + m) * world + rank) * size
                    order.extend(range(first, first + size))
            steps.append(order)
        return PairPlan(steps)

    def micro_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        rows = self.dataset[list(indices)]
        mismatched = rows["KL_completion_ids"] if "KL_completion_ids" in rows else rows["completion_ids"]
        packed = pack_pairs(rows["prompt_ids"], rows["completion_ids"], mismatched, self.max_length, "keep_start")
        batch = CollatedBatch(input_ids=packed.batch["input_ids"], packed=packed)
        batch.seq_lens = packed.batch.seq_lens  # the loop's forward context reads the sequences' bounds
        batch["desirable"] = torch.tensor([bool(label) for label in rows["label"]], dtype=torch.bool)
        if "ref_logps" in rows:  # precompute_ref_log_probs: the reference's columns, mismatched pairs second
            mismatched_ref = rows["ref_KL_logps"] if "ref_KL_logps" in rows else rows["ref_logps"]
            batch["ref_logps"] = torch.tensor([*rows["ref_logps"], *mismatched_ref], dtype=torch.float32)
        return batch


class KTOStep(RecordsMetricRows, TrainStep):
    """trl's KTO step on unpaired rows (see the module docstring)."""

    name = "KTO (unpaired rows with mismatched completions, one padding-free forward)"
    train_batches: UnpairedBatches

    def __init__(self, train_batches: UnpairedBatches, loss: KTOLoss, ref_model: Any, env: Any) -> None:
        self.train_batches, self.loss, self.ref_model, self.env = train_batches, loss, ref_model, env
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self.metrics = MetricRows(COLUMNS)
        self._total_tokens = 0.0

    def prepare(self, step: list[int]) -> StepBatches:
        micro = self.train_batches.micro_batches(step)
        every = self.train_batches.micro_batch(step)["packed"]
        tokens = sum(every.batch.seq_lens[0][: every.pairs])
        units = float(len(micro) * self.train_batches.world_size)
        return StepBatches(micro, [1.0] * len(micro), units, len(step), tokens)

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        packed, rows = batch["packed"], batch["packed"].pairs
        stats = sequence_stats(model, packed)
        device = stats.logps.device
        if "ref_logps" in batch:
            reference = batch["ref_logps"].to(device, stats.logps.dtype)
        else:
            reference = reference_stats(model, self.ref_model, packed).logps
        desirable = batch["desirable"].to(device)
        kl = torch.zeros((), device=device, dtype=torch.float64)
        if self.loss.uses_kl:
            kl = kl_sum(stats.logps[rows:], reference[rows:]).to(torch.float64)
            kl = (self.env.all_reduce_sum(kl.clone()) / self.env.world_size).clamp(min=0)
        loss, sums = self.loss.micro(stats.logps[:rows], reference[:rows], desirable, kl.to(stats.logps.dtype))
        with torch.no_grad():
            tokens = stats.tokens[:rows].to(stats.logps.dtype)
            chosen, rejected = desirable.to(tokens.dtype), (~desirable).to(tokens.dtype)
            values: dict[str, torch.Tensor | float] = {
                "ranks": 1.0,
                "kl": kl,
                "entropy_sum": stats.entropy[:rows].sum(),
                "completion_tokens": tokens.sum(),
                "input_tokens": float(sum(packed.batch.seq_lens[0][:rows])),
                "chosen_logits": (stats.mean_logits[:rows] * chosen).sum(),
                "chosen_tokens": (tokens * chosen).sum(),
                "rejected_logits": (stats.mean_logits[:rows] * rejected).sum(),
                "rejected_tokens": (tokens * rejected).sum(),
                **sums,  # the loss's own: chosen/rejected counts, rewards and logps
            }
            self.metrics.record(values, device)
        return loss * units

    def metric_logs(self) -> dict[str, float]:
        """trl's KTO log: per micro-batch values over every rank, averaged over the micro-batches that have them."""
        rows = self.metrics.take()
        values: dict[str, list[float]] = {}

        def add(key: str, value: float) -> None:
            values.setdefault(key, []).append(value)

        for r in rows:
            self._total_tokens += r["input_tokens"]
            add("kl", r["kl"] / r["ranks"])
            add("entropy", r["entropy_sum"] / r["completion_tokens"] if r["completion_tokens"] > 0 else 0.0)
            for side in ("chosen", "rejected"):
                if r[f"{side}_tokens"] > 0:
                    add(f"logits/{side}", r[f"{side}_logits"] / r[f"{side}_tokens"])
                if r[side] > 0:
                    add(f"rewards/{side}", r[f"rewards/{side}"] / r[side])
                    add(f"logps/{side}", r[f"logps/{side}"] / r[side])
            if r["chosen"] > 0 and r["rejected"] > 0:
                add("rewards/margins", r["rewards/chosen"] / r["chosen"] - r["rewards/rejected"] / r["rejected"])
        logs = {key: sum(v) / len(v) for key, v in values.items()}
        if rows:
            logs["num_tokens"] = self._total_tokens
        return logs

    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        with torch.no_grad():
            loss = self.micro_loss(model, batch, 1.0)
        self.metrics.drop_last()
        return EvalOutput(loss.detach(), 1.0)

    def describe_batches(self, effective_batch_size: int) -> str:
        b = self.train_batches
        return (
            f"{b.pairs_per_step} KTO rows per step (all ranks); {b.micro_per_step} micro-batches of "
            f"{b.pairs_per_micro} rows per rank, each row with its mismatched completion, packed padding-free"
        )


class KTOStepFactory(DPOStepFactory):
    """``RunPlan.loss`` (``OwnStep``) for KTO: builds ``KTOStep`` in each worker over the job's prepared rows (trl's
    ``KTOTrainer`` preparation, written by the facade); the reference is picked as for DPO
    (``DPOStepFactory.reference``: trl's ``ref_model``, the PEFT base, or the rows' precomputed columns)."""

    def __init__(
        self,
        loss: KTOLoss,
        rows_per_micro: int,
        micro_per_step: int,
        max_length: int | None,
        ref_model: torch.nn.Module | None = None,
        seed: int = 0,
        sequential: bool = True,
    ) -> None:
        super().__init__(
            None,
            DPOLossSettings(),
            rows_per_micro,
            micro_per_step,
            max_length,
            ref_model=ref_model,
            seed=seed,
            shared_reference=True,  # trl's own object: what its evaluation and SyncRefModelCallback hold
        )
        self.loss, self.sequential = loss, sequential

    def __call__(  # type: ignore[override]
        self, model: torch.nn.Module, tokenizer: Any, args: Any, env: Any, plan: RunPlan
    ) -> KTOStep:
        dataset = self.train_rows(model, tokenizer, args, plan)[0]  # the run's rows (trl's prepared rows)
        batches = self.batches(UnpairedBatches, dataset, env, sequential=self.sequential)
        reference = None if "ref_logps" in self.columns else self.reference(model, args, env, plan)
        self.hand_to_sync_callback(reference, plan.callbacks)
        return KTOStep(batches, self.loss, reference, env)
