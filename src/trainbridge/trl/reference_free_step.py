"""ORPO and CPO as a training step (``step.base.TrainStep``): reference-free pairs, trl's loss and metrics.

``LabelledPairBatches`` plans steps of pairs as ``dpo_step.PairBatches`` does and packs a micro-batch's
pairs with their labels (``pair_scores.pack_labelled_pairs``: chosen and rejected in one padding-free
forward).  ``ReferenceFreeStep.micro_loss`` returns the micro-batch's loss (``ORPOLoss``/``CPOLoss``,
trl's value for that micro-batch), one loss unit each, so the loop's division gives trl's mean over
micro-batches and ranks.  trl logs, per micro-batch, its metrics over every rank (pair means and means of
per-rank values), averaged over the micro-batches since the last log; each micro-batch's sums ride in
the step's agreement (``metric_sums``) and ``metric_logs`` does the same division.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.modeling.varlen_attention import enable_for_own_rows
from trainbridge.step.base import EvalOutput, StepBatches, TrainStep
from trainbridge.step.metric_rows import MetricRows, RecordsMetricRows
from trainbridge.trl.dpo_step import PairBatches
from trainbridge.trl.pair_scores import pack_labelled_pairs, score_pairs
from trainbridge.trl.reference_free_loss import PAIR_KEYS, CPOLoss, ORPOLoss

if TYPE_CHECKING:
    from trainbridge.core.config.plan import RunPlan

PairLoss = ORPOLoss | CPOLoss


class LabelledPairBatches(PairBatches):
    """Pairs of trl's ORPO/CPO preparation (``chosen_input_ids``/``chosen_labels``/``rejected_input_ids``/
    ``rejected_labels`` rows), packed with their labels."""

    def __init__(self, dataset: Any, *args: Any, whole_sequence: bool = False, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.whole_sequence = whole_sequence

    def micro_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        rows = self.dataset[list(indices)]
        packed = pack_labelled_pairs(
            rows["chosen_input_ids"],
            rows["chosen_labels"],
            rows["rejected_input_ids"],
            rows["rejected_labels"],
            self.whole_sequence,
        )
        batch = CollatedBatch(input_ids=packed.batch["input_ids"], packed=packed)
        batch.seq_lens = packed.batch.seq_lens  # the loop's forward context reads the sequences' bounds
        return batch


class ReferenceFreeStep(RecordsMetricRows, TrainStep):
    """trl's ORPO or CPO step on labelled pair batches (see the module docstring)."""

    train_batches: LabelledPairBatches

    def __init__(self, train_batches: LabelledPairBatches, loss: PairLoss) -> None:
        self.train_batches = train_batches
        self.loss = loss
        self.name = f"{type(loss).__name__[:-4]} (preference pairs, chosen and rejected in one padding-free forward)"
        self.metrics = MetricRows(("pairs", "ranks", *PAIR_KEYS, *loss.rank_keys))

    def prepare(self, step: list[int]) -> StepBatches:
        micro = self.train_batches.micro_batches(step)
        rows = self.train_batches.dataset[list(step)]
        tokens = sum(len(ids) for ids in rows["chosen_input_ids"]) + sum(len(ids) for ids in rows["rejected_input_ids"])
        every_micro = float(len(micro) * self.train_batches.world_size)
        return StepBatches(micro, [1.0] * len(micro), every_micro, len(step), tokens)

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        result = self.loss.micro(score_pairs(model, batch["packed"]))
        values: dict[str, torch.Tensor | float] = {"pairs": float(batch["packed"].pairs), "ranks": 1.0}
        values.update({**result.pair_sums, **result.rank_means})
        self.metrics.record(values, result.loss.device)
        return result.loss * units

    def metric_logs(self) -> dict[str, float]:
        """trl's log: each micro-batch's metrics over every rank, averaged over the micro-batches."""
        rows = self.metrics.take()
        if not rows:
            return {}
        logs = {}
        for key in self.metrics.columns[2:]:
            by = "pairs" if key in PAIR_KEYS else "ranks"  # pair sums over pairs, per-rank values over ranks
            logs[key] = sum(row[key] / max(row[by], 1.0) for row in rows) / len(rows)
        return logs

    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        with torch.no_grad():
            loss = self.loss.micro(score_pairs(model, batch["packed"])).loss
        return EvalOutput(loss.detach(), 1.0)

    def describe_batches(self, effective_batch_size: int) -> str:
        b = self.train_batches
        return (
            f"{b.pairs_per_step} preference pairs per step (all ranks); {b.micro_per_step} micro-batches of "
            f"{b.pairs_per_micro} pairs per rank, chosen and rejected packed padding-free"
        )


class ReferenceFreeStepFactory:
    """``RunPlan.loss`` (``OwnStep``) for ORPO/CPO: a picklable recipe that builds ``ReferenceFreeStep`` in each
    worker over the job's prepared pairs (trl's preparation: the drop-in's ``train_dataset`` in place)."""

    def __init__(self, loss: PairLoss, pairs_per_micro: int, micro_per_step: int, seed: int = 0) -> None:
        self.loss = loss
        self.pairs_per_micro, self.micro_per_step, self.seed = pairs_per_micro, micro_per_step, seed

    def __call__(self, model: torch.nn.Module, tokenizer: Any, args: Any, env: Any, plan: RunPlan) -> ReferenceFreeStep:
        from trainbridge.data.rows import run_rows

        enable_for_own_rows(model, args, None)
        batches = LabelledPairBatches(
            run_rows(args, tokenizer, plan.script_data)[0],
            self.pairs_per_micro,
            self.micro_per_step,
            env.world_size,
            env.rank,
            self.seed,
            None,
            whole_sequence=self.loss.whole_sequence,
        )
        return ReferenceFreeStep(batches, self.loss)
