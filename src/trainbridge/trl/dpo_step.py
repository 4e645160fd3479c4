"""DPO as a training step (``step.base.TrainStep``): preference pairs planned per step, trl's loss and metrics.

``PairBatches`` plans an epoch as steps of ``pairs_per_step`` pairs (a seeded shuffle; an incomplete last
step is dropped), each rank's part split into micro-batches of ``pairs_per_micro`` pairs.  A micro-batch
is its pairs packed into one padding-free row (``sequence_logps.pack_pairs``: chosen and rejected through
one forward).  ``PreferenceStep.micro_loss`` scores it with the policy and the reference (``ref_model``,
a frozen copy on the policy's device; the PEFT policy with its adapter disabled; or the rows' precomputed
``ref_chosen_logps``/``ref_rejected_logps``), and returns the loss terms of ``preference_loss`` scaled so
that the loop's division by the step's pair count gives each term its own normaliser.  trl's metrics are
reported per micro-batch as sums (``metric_sums``), reduced over ranks in the step's agreement, and
logged as trl logs them: the mean over micro-batches of each micro-batch's ratio.  ``PairEvalBatches``
forms the validation pairs; an evaluation reports ``eval_loss`` (each batch's loss weighted by its pairs,
as Trainer averages it) and trl's metrics with the ``eval_`` prefix, their sums reduced with the loss.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.modeling.varlen_attention import enable_for_own_rows
from trainbridge.step.base import EvalOutput, EvalSource, StepBatches, TrainStep
from trainbridge.step.metric_rows import MetricRows, RecordsMetricRows
from trainbridge.trl.preference_data import reference_stats
from trainbridge.trl.preference_loss import (
    METRIC_KEYS,
    DPOLossSettings,
    LossTerm,
    Normaliser,
    SequenceLogps,
    combine_terms,
    dpo_loss_terms,
    dpo_metric_sums,
    pair_weights,
)
from trainbridge.trl.sequence_logps import SequenceStats, pack_pairs, sequence_stats

if TYPE_CHECKING:
    from trainbridge.core.config.plan import RunPlan

Batches = TypeVar("Batches", bound="PairBatches")

SEQUENCE_COLUMNS = (
    "entropy_sum",
    "completion_tokens",
    "input_tokens",
    "chosen_logits",
    "chosen_tokens",
    "rejected_logits",
    "rejected_tokens",
)
"""The metric sums of a micro-batch's scored sequences (``sequence_logps.sequence_stats``), DPO's and KTO's."""

METRIC_COLUMNS = (
    *SEQUENCE_COLUMNS,
    "chosen_top1",
    *METRIC_KEYS,
    "pairs",
)
"""The names of one micro-batch's metric sums (``step.metric_rows``)."""


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
        return pair_batch(self.dataset, indices, self.max_length, self.truncation_mode)


def pair_batch(dataset: Any, indices: Sequence[int], max_length: int | None, truncation_mode: str) -> dict[str, Any]:
    """The pairs ``indices`` of ``dataset`` packed into one padding-free row (``pack_pairs``), with their
    precomputed reference log-probs when the rows carry them."""
    rows = dataset[list(indices)]
    packed = pack_pairs(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"], max_length, truncation_mode)
    batch = CollatedBatch(input_ids=packed.batch["input_ids"], packed=packed)
    batch.seq_lens = packed.batch.seq_lens  # the loop's forward context reads the sequences' bounds
    if "ref_chosen_logps" in rows:
        batch["ref_chosen_logps"] = torch.tensor(rows["ref_chosen_logps"], dtype=torch.float32)
        batch["ref_rejected_logps"] = torch.tensor(rows["ref_rejected_logps"], dtype=torch.float32)
    return batch


class PairEvalBatches:
    """Validation pairs (an ``EvalSource``): batches of ``pairs_per_micro`` pairs in the dataset's order,
    batch ``i`` on rank ``i % world_size``.  A rank short of a batch in the last round gets a dummy (its
    pairs counted as none), so every rank runs the same forwards (FSDP2 gathers in them)."""

    dataset: Any
    batch_size: int | None
    num_samples_local: int

    def __init__(
        self,
        dataset: Any,
        pairs_per_micro: int,
        world_size: int,
        rank: int,
        max_length: int | None,
        truncation_mode: str = "keep_start",
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("eval_dataset: no preference pairs to evaluate; pass pairs or eval_dataset=None")
        self.dataset, self.batch_size, self.pairs_per_micro = dataset, pairs_per_micro, pairs_per_micro
        self.max_length, self.truncation_mode = max_length, truncation_mode
        starts = range(0, len(dataset), pairs_per_micro)
        rounds = math.ceil(len(starts) / world_size)
        self._mine = [
            list(range(starts[i], min(starts[i] + pairs_per_micro, len(dataset)))) if i < len(starts) else []
            for i in (r * world_size + rank for r in range(rounds))
        ]
        self.num_samples_local = sum(len(indices) for indices in self._mine)

    def __len__(self) -> int:
        return len(self._mine)

    def indexed(self) -> Iterator[tuple[list[int], dict[str, Any]]]:
        dummy = list(range(min(self.pairs_per_micro, len(self.dataset))))
        for indices in self._mine:
            yield indices, pair_batch(self.dataset, indices or dummy, self.max_length, self.truncation_mode)


class PreferenceStep(RecordsMetricRows, TrainStep):
    """trl's DPO step on pair batches (see the module docstring)."""

    name = "DPO (preference pairs, chosen and rejected in one padding-free forward)"
    train_batches: PairBatches

    def __init__(
        self,
        train_batches: PairBatches,
        settings: DPOLossSettings,
        ref_model: torch.nn.Module | None = None,
        eval_batches: PairEvalBatches | None = None,
        named_eval_batches: dict[str, EvalSource] | None = None,
    ) -> None:
        self.train_batches = train_batches
        self.settings = settings
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self.eval_batches = eval_batches
        self.named_eval_batches = named_eval_batches or {}
        self.metrics, self.eval_metrics = MetricRows(METRIC_COLUMNS), MetricRows(METRIC_COLUMNS)
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

    def _score(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[SequenceStats, SequenceLogps, SequenceLogps, list[LossTerm]]:
        """The policy's and the reference's log-probs of a micro-batch's pairs and the loss terms."""
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
        return stats, policy, reference, terms

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        stats, policy, reference, terms = self._score(model, batch)
        step_pairs = float(self.train_batches.pairs_per_step)
        counts = {"pairs": step_pairs, "chosen_tokens": max(self._chosen_tokens, 1.0)}
        loss = sum(
            (t.weight * t.total * (step_pairs / counts[t.normaliser]) for t in terms),
            torch.zeros((), device=policy.chosen.device),
        )
        self.metrics.record(self._metric_row(stats, policy, reference, batch["packed"]), policy.chosen.device)
        return loss

    def _metric_row(
        self, stats: Any, policy: SequenceLogps, reference: SequenceLogps, packed: Any
    ) -> dict[str, torch.Tensor | float]:
        pairs = packed.pairs
        with torch.no_grad():
            tokens = stats.tokens.float()
            return {
                "entropy_sum": stats.entropy.sum(),
                "completion_tokens": tokens.sum(),
                "input_tokens": float(packed.batch["input_ids"].numel()),
                "chosen_logits": stats.mean_logits[:pairs].sum(),
                "chosen_tokens": tokens[:pairs].sum(),
                "rejected_logits": stats.mean_logits[pairs:].sum(),
                "rejected_tokens": tokens[pairs:].sum(),
                "chosen_top1": stats.top1[:pairs].sum(),
                **dpo_metric_sums(policy, reference, self.settings.beta),
                "pairs": float(pairs),
            }

    def metric_logs(self) -> dict[str, float]:
        """trl's DPO log: each micro-batch's ratios over every rank, averaged over the micro-batches."""
        rows = self.metrics.take()
        self._total_tokens += sum(row["input_tokens"] for row in rows)
        return _metric_means(rows, self._total_tokens)

    def own_eval_sets(self) -> tuple[EvalSource | None, dict[str, EvalSource]]:
        return self.eval_batches, self.named_eval_batches

    def eval_metric_sums(self) -> dict[str, float]:
        return cast("dict[str, float]", self.eval_metrics.sums(read=True))

    def eval_metric_logs(self, sums: Mapping[str, float]) -> dict[str, float]:
        """trl's metrics of an evaluation: each batch's ratios over every rank, averaged over the batches;
        ``num_tokens`` is the training's count so far, as trl reports it."""
        unlogged = sum(row["input_tokens"] for row in self.metrics.agreed)
        return _metric_means(self.eval_metrics.rows_of(sums), self._total_tokens + unlogged)

    def describe_batches(self, effective_batch_size: int) -> str:
        b = self.train_batches
        return (
            f"{b.pairs_per_step} preference pairs per step (all ranks); {b.micro_per_step} micro-batches of "
            f"{b.pairs_per_micro} pairs per rank, chosen and rejected packed padding-free"
        )

    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        """trl's loss of one validation batch (normalised by its own pairs or chosen tokens), weighted by
        its pairs; a dummy batch (``rows`` 0) counts as nothing."""
        packed = batch["packed"]
        stats, policy, reference, terms = self._score(model, batch)
        counts: dict[Normaliser, float] = {
            "pairs": float(packed.pairs),
            "chosen_tokens": float(stats.tokens[: packed.pairs].sum()),
        }
        pairs = float(packed.pairs) if rows else 0.0
        if rows:
            self.eval_metrics.record(self._metric_row(stats, policy, reference, packed), policy.chosen.device)
        else:  # a rank's dummy batch counts as nothing
            self.eval_metrics.record_zeros(policy.chosen.device)
        return EvalOutput(combine_terms(terms, counts).detach() * pairs, pairs)


def _metric_means(rows: list[dict[str, float]], num_tokens: float) -> dict[str, float]:
    """trl's DPO metrics from per-micro-batch sums (``METRIC_COLUMNS`` rows, every rank's summed)."""
    if not rows:
        return {"num_tokens": num_tokens}

    def mean(ratio: Any) -> float:
        return sum(ratio(row) for row in rows) / len(rows)

    def share(num: str, den: str) -> Any:
        return lambda r: r[num] / r[den] if r[den] > 0 else 0.0

    logs = {
        "entropy": mean(share("entropy_sum", "completion_tokens")),
        "num_tokens": num_tokens,
        "logits/chosen": mean(share("chosen_logits", "chosen_tokens")),
        "logits/rejected": mean(share("rejected_logits", "rejected_tokens")),
        "mean_token_accuracy": mean(share("chosen_top1", "chosen_tokens")),
    }
    for key in METRIC_KEYS:
        logs[key] = mean(share(key, "pairs"))
    return logs


class DPOStepFactory:
    """``RunPlan.loss`` (``OwnStep``) for DPO: a picklable recipe that builds ``PreferenceStep`` in each worker.

    It carries the prepared pairs (``prepare_preference_dataset``; None: the run's rows, ``data.rows.run_rows``:
    the drop-in's ``train_dataset`` in place), the loss settings and the batch shape;
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
        eval_dataset: Any = None,
        eval_pairs_per_micro: int | None = None,
        shared_reference: bool = False,
    ) -> None:
        self.dataset, self.settings = dataset, settings
        self.shared_reference = shared_reference
        self.pairs_per_micro, self.micro_per_step = pairs_per_micro, micro_per_step
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.ref_model, self.seed = ref_model, seed
        self.eval_dataset = eval_dataset
        self.eval_pairs_per_micro = eval_pairs_per_micro or pairs_per_micro
        self.columns: list[str] = list(dataset.column_names) if dataset is not None else []

    def reference(self, model: torch.nn.Module, args: Any, env: Any, plan: RunPlan) -> torch.nn.Module | None:
        """The reference model the step scores with (None: precomputed columns or the PEFT base); under
        FSDP2 sharded as the policy is (``parallel.fsdp.shard_frozen``): a copy of the factory's, or the trainer's
        own in place (``shared_reference``: ``trl_loop.ShardedReference`` at ``on_init_end``)."""
        if "ref_chosen_logps" in self.columns or (self.ref_model is None and hasattr(model, "disable_adapter")):
            return None
        fsdp = args.distributed_backend == "fsdp" and env.world_size > 1
        if self.shared_reference and self.ref_model is not None:
            # the trainer's own reference (trl's ref_model): scored as it is, no copy
            enable_for_own_rows(self.ref_model, args, self.max_length)
            shared = self.ref_model if fsdp else self.ref_model.to(env.device)
            return shared.eval().requires_grad_(False)
        import copy

        reference = copy.deepcopy(self.ref_model if self.ref_model is not None else model)
        if self.ref_model is not None:  # a copy of the policy has the policy's attention already
            enable_for_own_rows(reference, args, self.max_length)
        if fsdp:
            from trainbridge.modeling.load import loads_on_rank0_only
            from trainbridge.parallel.fsdp import shard_frozen

            # fsdp_load_on_rank0: the copy of the policy is a skeleton off rank 0, filled from rank 0's
            from_rank0 = self.ref_model is None and loads_on_rank0_only(args, env.world_size, plan.model_init)
            return shard_frozen(reference, args, env, weights_from_rank0=from_rank0)
        if any(p.is_meta for p in reference.parameters()):
            raise ValueError(
                "ref_model: a copy of the policy cannot be taken from a rank that loads no weights; "
                "pass ref_model or precompute_ref_log_probs=True"
            )
        return reference.to(env.device).eval().requires_grad_(False)

    def train_rows(self, model: torch.nn.Module, tokenizer: Any, args: Any, plan: RunPlan) -> tuple[Any, Any, Any]:
        """``(training rows, validation rows, named validation rows)``: the prepared pairs when the factory
        carries them, else the run's (``data.rows.run_rows``); ``model`` set to read them one attention call per
        layer, not through a ``[T, T]`` mask; ``columns`` are the training rows'."""
        from trainbridge.data.rows import run_rows

        enable_for_own_rows(model, args, self.max_length)
        own = self.dataset is not None and self.eval_dataset is not None
        rows, val, named = run_rows(args, tokenizer, plan.script_data) if not own else (self.dataset, None, {})
        dataset = self.dataset if self.dataset is not None else rows
        self.columns = list(dataset.column_names)
        return dataset, val, named

    def batches(self, kind: type[Batches], dataset: Any, env: Any, **options: Any) -> Batches:
        """This rank's training batches of ``dataset`` (``kind``: ``PairBatches`` or a subclass, with ``options``)
        in the factory's shape."""
        shape = (self.pairs_per_micro, self.micro_per_step, env.world_size, env.rank, self.seed, self.max_length)
        return kind(dataset, *shape, self.truncation_mode, **options)

    def __call__(self, model: torch.nn.Module, tokenizer: Any, args: Any, env: Any, plan: RunPlan) -> PreferenceStep:
        dataset, val, named = self.train_rows(model, tokenizer, args, plan)
        batches = self.batches(PairBatches, dataset, env)
        evaluation = self.eval_dataset
        if evaluation is None:
            evaluation = val if val is not None else named or None

        def eval_set(data: Any) -> PairEvalBatches:
            return PairEvalBatches(
                data, self.eval_pairs_per_micro, env.world_size, env.rank, self.max_length, self.truncation_mode
            )

        named = {str(k): eval_set(v) for k, v in evaluation.items()} if isinstance(evaluation, dict) else {}
        single = eval_set(evaluation) if evaluation is not None and not named else None
        reference = self.reference(model, args, env, plan)
        self.hand_to_sync_callback(reference, plan.callbacks)
        return PreferenceStep(batches, self.settings, reference, single, dict(named))

    @staticmethod
    def hand_to_sync_callback(reference: torch.nn.Module | None, callbacks: list[Any]) -> None:
        """trl's ``SyncRefModelCallback`` (``sync_ref_model``, as trl's trainer adds it) mixes the policy into
        ``reference``, the model the step scores with."""
        for callback in callbacks:
            if type(callback).__name__ == "SyncRefModelCallback" and reference is not None:
                callback.ref_model = reference
