"""DPO as a training step (``step.base.TrainStep``): preference pairs planned per step, trl's loss and metrics.

``PairBatches`` plans an epoch as steps of ``pairs_per_step`` pairs (a seeded shuffle; an incomplete last
step is dropped), each rank's part split into micro-batches of ``pairs_per_micro`` pairs.  A micro-batch
is its pairs packed into one padding-free row (``sequence_logps.pack_pairs``: chosen and rejected through
one forward).  ``PreferenceStep.micro_loss`` scores it with the policy and the reference (``ref_model``,
a frozen copy on the policy's device; the PEFT policy with its adapter disabled; or the rows' precomputed
``ref_chosen_logps``/``ref_rejected_logps``), and returns the loss terms of ``preference_loss`` scaled so
that the loop's division by the step's pair count gives each term its own normaliser.  trl's metrics are
reported per micro-batch as sums (``metric_sums``), reduced over ranks in the step's agreement, and
logged as trl logs them: the mean over micro-batches of each micro-batch's ratio.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.step.base import EvalOutput, StepBatches, TrainStep
from trainbridge.trl.preference_data import reference_stats
from trainbridge.trl.preference_loss import (
    METRIC_KEYS,
    DPOLossSettings,
    SequenceLogps,
    dpo_loss_terms,
    pair_weights,
)
from trainbridge.trl.sequence_logps import pack_pairs, sequence_stats

METRIC_COLUMNS = (
    "entropy_sum",
    "completion_tokens",
    "input_tokens",
    "chosen_logits",
    "chosen_tokens",
    "rejected_logits",
    "rejected_tokens",
    "chosen_top1",
    *METRIC_KEYS,
    "pairs",
)
"""One micro-batch's sums, in the order ``metric_sums`` reports them."""


@dataclass(frozen=True)
class PairPlan:
    """One epoch: ``steps[i]`` are the dataset indices of step ``i``'s pairs (every rank's)."""

    steps: list[list[int]]


class PairBatches:
    """Preference pairs of a prepared dataset (``prompt_ids``/``chosen_ids``/``rejected_ids`` rows)."""

    batch_size: int | None
    """Pairs per micro-batch (``per_device_train_batch_size``)."""

    def __init__(
        self,
        dataset: Any,
        pairs_per_micro: int,
        micro_per_step: int,
        world_size: int,
        rank: int,
        seed: int,
        max_length: int | None,
        truncation_mode: str = "keep_start",
    ) -> None:
        self.dataset = dataset
        self.batch_size = self.pairs_per_micro = pairs_per_micro
        self.micro_per_step = micro_per_step
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.pairs_per_step = pairs_per_micro * micro_per_step * world_size
        self.steps_per_epoch = len(dataset) // self.pairs_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"train_dataset: {len(dataset)} pairs, fewer than one step's {self.pairs_per_step} "
                "(per_device_train_batch_size x gradient_accumulation_steps x ranks); use a smaller batch"
            )

    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> PairPlan:
        order = list(range(len(self.dataset)))
        random.Random(self.seed + epoch).shuffle(order)
        n = self.pairs_per_step
        return PairPlan([order[i * n : (i + 1) * n] for i in range(self.steps_per_epoch)])

    def micro_batches(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """This rank's micro-batches of a step's pairs (``indices``, every rank's)."""
        per_rank = len(indices) // self.world_size
        mine = list(indices[self.rank * per_rank : (self.rank + 1) * per_rank])
        size = self.pairs_per_micro
        return [self.micro_batch(mine[i : i + size]) for i in range(0, len(mine), size)]

    def micro_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        rows = self.dataset[list(indices)]
        packed = pack_pairs(
            rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"], self.max_length, self.truncation_mode
        )
        batch = CollatedBatch(input_ids=packed.batch["input_ids"], packed=packed)
        batch.seq_lens = packed.batch.seq_lens  # the loop's forward context reads the sequences' bounds
        if "ref_chosen_logps" in rows:
            batch["ref_chosen_logps"] = torch.tensor(rows["ref_chosen_logps"], dtype=torch.float32)
            batch["ref_rejected_logps"] = torch.tensor(rows["ref_rejected_logps"], dtype=torch.float32)
        return batch


class PreferenceStep(TrainStep):
    """trl's DPO step on pair batches (see the module docstring)."""

    name = "DPO (preference pairs, chosen and rejected in one padding-free forward)"
    train_batches: PairBatches

    def __init__(
        self, train_batches: PairBatches, settings: DPOLossSettings, ref_model: torch.nn.Module | None = None
    ) -> None:
        self.train_batches = train_batches
        self.settings = settings
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self._rows: list[torch.Tensor] = []
        self._logged: list[list[float]] = []
        self._total_tokens = 0.0
        self._chosen_tokens = 0.0

    def prepare(self, step: list[int]) -> StepBatches:
        micro = self.train_batches.micro_batches(step)
        every = self.train_batches.micro_batch(step)["packed"]  # every rank's pairs: the step's counts
        chosen_tokens = float(every.completion_tokens[: every.pairs].sum())
        self._chosen_tokens = chosen_tokens
        return StepBatches(
            micro,
            [float(b["packed"].pairs) for b in micro],
            float(len(step)),
            len(step),
            int(every.batch["input_ids"].numel()),
        )

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        packed, s = batch["packed"], self.settings
        stats = sequence_stats(model, packed, s.ld_alpha)
        policy = stats.pair_logps()
        if "ref_chosen_logps" in batch:
            device = policy.chosen.device
            reference = SequenceLogps(batch["ref_chosen_logps"].to(device), batch["ref_rejected_logps"].to(device))
        else:
            reference = reference_stats(model, self.ref_model, packed, s.ld_alpha).pair_logps()
        tokens = stats.tokens
        weights = None
        if s.use_weighting:
            mean_aligned = stats.aligned_logps / tokens.clamp(min=1)
            weights = pair_weights(*mean_aligned.chunk(2))
        terms = dpo_loss_terms(policy, reference, s, tokens[: packed.pairs], tokens[packed.pairs :], weights)
        step_pairs = float(self.train_batches.pairs_per_step)
        counts = {"pairs": step_pairs, "chosen_tokens": max(self._chosen_tokens, 1.0)}
        loss = sum(
            (t.weight * t.total * (step_pairs / counts[t.normaliser]) for t in terms),
            torch.zeros((), device=policy.chosen.device),
        )
        self._rows.append(self._metric_row(stats, policy, reference, packed))
        return loss

    def _metric_row(self, stats: Any, policy: SequenceLogps, reference: SequenceLogps, packed: Any) -> torch.Tensor:
        pairs = packed.pairs
        with torch.no_grad():
            chosen_rewards = self.settings.beta * (policy.chosen - reference.chosen).detach()
            rejected_rewards = self.settings.beta * (policy.rejected - reference.rejected).detach()
            tokens = stats.tokens.float()
            values = [
                stats.entropy.sum(),
                tokens.sum(),
                torch.tensor(float(packed.batch["input_ids"].numel())),
                stats.mean_logits[:pairs].sum(),
                tokens[:pairs].sum(),
                stats.mean_logits[pairs:].sum(),
                tokens[pairs:].sum(),
                stats.top1[:pairs].sum(),
                chosen_rewards.sum(),
                rejected_rewards.sum(),
                (chosen_rewards > rejected_rewards).float().sum(),
                (chosen_rewards - rejected_rewards).sum(),
                policy.chosen.detach().sum(),
                policy.rejected.detach().sum(),
                torch.tensor(float(pairs)),
            ]
            device = policy.chosen.device
            return torch.stack([v.to(device, torch.float64) for v in values])

    def metric_sums(self) -> list[torch.Tensor | float]:
        sums: list[torch.Tensor | float] = [value for row in self._rows for value in row]
        self._rows.clear()
        return sums

    def add_metric_sums(self, sums: Sequence[float]) -> None:
        width = len(METRIC_COLUMNS)
        for i in range(0, len(sums), width):
            self._logged.append(list(sums[i : i + width]))

    def metric_logs(self) -> dict[str, float]:
        """trl's DPO log: each micro-batch's ratios over every rank, averaged over the micro-batches."""
        rows, self._logged = self._logged, []
        for row in rows:
            self._total_tokens += row[2]
        if not rows:
            return {"num_tokens": self._total_tokens}

        def mean(ratio: Any) -> float:
            return sum(ratio(dict(zip(METRIC_COLUMNS, row, strict=True))) for row in rows) / len(rows)

        def share(num: str, den: str) -> Any:
            return lambda r: r[num] / r[den] if r[den] > 0 else 0.0

        logs = {
            "entropy": mean(share("entropy_sum", "completion_tokens")),
            "num_tokens": self._total_tokens,
            "logits/chosen": mean(share("chosen_logits", "chosen_tokens")),
            "logits/rejected": mean(share("rejected_logits", "rejected_tokens")),
            "mean_token_accuracy": mean(share("chosen_top1", "chosen_tokens")),
        }
        for key in METRIC_KEYS:
            logs[key] = mean(share(key, "pairs"))
        return logs

    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        with torch.no_grad():
            loss = self.micro_loss(model, batch, float(batch["packed"].pairs))
        self._rows.pop()
        pairs = float(batch["packed"].pairs)
        return EvalOutput(loss * pairs / float(self.train_batches.pairs_per_step), pairs)

    def describe_batches(self, effective_batch_size: int) -> str:
        b = self.train_batches
        return (
            f"{b.pairs_per_step} preference pairs per step (all ranks); {b.micro_per_step} micro-batches of "
            f"{b.pairs_per_micro} pairs per rank, chosen and rejected packed padding-free"
        )


class DPOStepFactory:
    """``TrainingArgs.train_step`` for DPO: a picklable recipe that builds ``PreferenceStep`` in each worker.

    It carries the prepared pairs (``prepare_preference_dataset``; None: the job's ``data_path``, as the
    facade writes them), the loss settings and the batch shape;
    called with the worker's model it plans this rank's pairs and picks the reference: the rows'
    precomputed log-probs when they carry them, else ``ref_model`` (a frozen model object, moved to the
    policy's device), else a frozen copy of the freshly loaded policy, or, for a PEFT policy, the policy
    with its adapter disabled.
    """

    def __init__(
        self,
        dataset: Any,
        settings: DPOLossSettings,
        pairs_per_micro: int,
        micro_per_step: int,
        max_length: int | None,
        truncation_mode: str = "keep_start",
        ref_model: torch.nn.Module | None = None,
        seed: int = 0,
    ) -> None:
        self.dataset, self.settings = dataset, settings
        self.pairs_per_micro, self.micro_per_step = pairs_per_micro, micro_per_step
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.ref_model, self.seed = ref_model, seed
        self.columns: list[str] = list(dataset.column_names) if dataset is not None else []

    def reference(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module | None:
        """The reference model the step scores with (None: precomputed columns or the PEFT base)."""
        if "ref_chosen_logps" in self.columns or (self.ref_model is None and hasattr(model, "disable_adapter")):
            return None
        if self.ref_model is None and any(p.is_meta for p in model.parameters()):
            raise ValueError(
                "ref_model: a copy of the policy cannot be taken from a rank that loads no weights "
                "(fsdp_load_on_rank0); pass ref_model or precompute_ref_log_probs=True"
            )
        import copy

        reference = copy.deepcopy(self.ref_model if self.ref_model is not None else model)
        return reference.to(device).eval().requires_grad_(False)

    def __call__(self, model: torch.nn.Module, tokenizer: Any, args: Any, env: Any) -> PreferenceStep:
        dataset = self.dataset
        if dataset is None:
            from trainbridge.data.rows import open_rows

            dataset = open_rows(args.data_path, tokenizer, args.max_seq_len)
        self.columns = list(dataset.column_names)
        batches = PairBatches(
            dataset,
            self.pairs_per_micro,
            self.micro_per_step,
            env.world_size,
            env.rank,
            self.seed,
            self.max_length,
            self.truncation_mode,
        )
        return PreferenceStep(batches, self.settings, self.reference(model, env.device))
