"""Validation predictions for ``compute_metrics``, as ``transformers.Trainer`` hands them over.

Each rank keeps, per validation sample of its share, the predictions of its batch row (after
``preprocess_logits_for_metrics``, applied per batch on the rank so full logits are kept only when no
preprocessing is given), the row's labels and, with ``include_for_metrics``, its inputs and loss.
Padding is removed per sample (positions where ``attention_mask`` is 0).  At the end of an evaluation
the samples of every rank are gathered (one ``all_gather_object``), put back in Trainer's evaluation order (each
validation sample is on exactly one rank: nothing duplicated, nothing dropped; a sample's ``index`` is its
position in that order: dataset order, but under ``group_by_length``), padded to a common
length with ``-100`` (Trainer's ``padding_index``) and stacked into an ``EvalPrediction``.  Rank 0 runs
``compute_metrics`` and broadcasts the result, so every rank holds the same metrics (best-model
tracking and control decisions read them).  It calls it as Trainer's ``evaluation_loop`` does
(``TrainingArguments``, ``RunPlan.hf_args``): with ``batch_eval_metrics`` once per Trainer batch (the rows one
step of Trainer's gathers from every rank: ``per_device_eval_batch_size`` x world size, in dataset order), as
tensors, with ``compute_result`` True on the last and, for ``include_for_metrics`` ``inputs``, the batch of
rank 0's rows as a dict (Trainer's is its rank's batch); with ``eval_do_concat_batches=False`` each field is a
list of those batches' arrays; with ``prediction_loss_only`` no predictions are kept and it is not called.  The
``losses`` of ``include_for_metrics`` are Trainer's: each rank's batch loss (the token mean over its
``per_device_eval_batch_size`` rows, the last batch completed from the first samples as accelerate's even
batches are) repeated for each of its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainbridge.core.config import TrainingArgs
from trainbridge.core.config.plan import RunPlan
from trainbridge.core.distributed import DistributedEnv
from trainbridge.data.types import IGNORE_INDEX

PADDING_INDEX = IGNORE_INDEX
"""Value that pads predictions and labels of different lengths (transformers' ``padding_index``)."""


@dataclass
class SamplePrediction:
    """What one validation sample contributes (numpy arrays, padding removed)."""

    index: int
    predictions: Any
    labels: Any
    inputs: np.ndarray | None = None
    loss: float | None = None
    """The row's summed token loss (``nan`` where the outputs are not token logits)."""
    loss_tokens: int = 0
    """The row's loss tokens (labels after the shift that are not ignored)."""


@dataclass
class GatheredPredictions:
    """Every rank's predictions in dataset order, stacked as ``Trainer.predict``/``evaluate`` build them."""

    predictions: Any
    label_ids: Any
    inputs: np.ndarray | None
    losses: np.ndarray | None
    num_samples: int


class PredictionCollector:
    """Collects one evaluation's predictions on this rank and turns them into metrics (see module doc)."""

    def __init__(self, args: TrainingArgs, plan: RunPlan, world_size: int = 1) -> None:
        self.compute_metrics: Callable[..., Any] | None = plan.compute_metrics
        self.preprocess: Callable[..., Any] | None = plan.preprocess_logits_for_metrics
        self.include_inputs = "inputs" in args.include_for_metrics
        self.include_loss = "loss" in args.include_for_metrics
        hf = plan.hf_args
        self.per_call = bool(hf is not None and hf.batch_eval_metrics)
        """``batch_eval_metrics``: one call per Trainer batch, ``compute_result`` True on the last."""
        self.concat = bool(hf is None or hf.eval_do_concat_batches)
        """``eval_do_concat_batches``: one array per field, else a list of each Trainer batch's."""
        self.rank_batch = int(hf.per_device_eval_batch_size) if hf is not None else 0
        """Rows of one rank's batch under Trainer (0: no Trainer arguments, each row its own loss)."""
        self.trainer_batch = self.rank_batch * world_size
        """Rows of one Trainer batch, gathered from every rank."""
        self._padding: tuple[int, bool] = (0, False)
        """The validation batches' input padding: (value, left side), as the collator pads."""
        self._samples: list[SamplePrediction] = []
        self.last: GatheredPredictions | None = None
        """The last evaluation's gathered predictions (``Trainer.predict`` returns them)."""

    @classmethod
    def of(cls, args: TrainingArgs, plan: RunPlan, world_size: int) -> PredictionCollector | None:
        """The run's collector: None without ``compute_metrics`` or with ``prediction_loss_only`` (Trainer then
        keeps no predictions and does not call it)."""
        if plan.compute_metrics is None or (plan.hf_args is not None and plan.hf_args.prediction_loss_only):
            return None
        return cls(args, plan, world_size)

    def start(self) -> None:
        """Forget the previous evaluation's samples."""
        self._samples = []

    def add(
        self, indices: Sequence[int], batch: dict[str, Any], logits: Any, labels: Any, aligned: bool = True
    ) -> None:
        """Keep the predictions of ``batch``, whose row ``r`` holds validation sample ``indices[r]``:
        ``logits`` a tensor or a (nested) tuple of the model's outputs, ``labels`` a tensor, a tuple of them
        (several ``label_names``) or None.  Positions where the batch's ``attention_mask`` is 0 are dropped
        from sequence-shaped values when they run along the inputs (``aligned``)."""
        if not indices:
            return  # a dummy micro-batch (this rank has fewer validation batches than others)
        predictions: Any = _detach(logits)
        if self.preprocess is not None:
            predictions = self.preprocess(predictions, labels)
        mask = batch.get("attention_mask")
        input_ids = batch.get("input_ids")
        # token-level outputs (labels [rows, width] as the mask) drop padding; others (a class per row) keep all
        token_level = (
            aligned
            and isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and isinstance(labels, torch.Tensor)
            and labels.dim() == 2
            and labels.shape[1] == mask.shape[1]
        )
        width = mask.shape[1] if token_level and mask is not None else None
        losses = _row_losses(logits, labels) if self.include_loss else None
        if self.include_inputs and isinstance(mask, torch.Tensor) and isinstance(input_ids, torch.Tensor):
            padded = mask == 0
            if bool(padded.any()):
                self._padding = (int(input_ids[padded][0]), bool(padded[:, 0].any()))
        for row, index in enumerate(indices):
            valid = mask[row].bool().cpu() if isinstance(mask, torch.Tensor) and width is not None else None
            self._samples.append(
                SamplePrediction(
                    index=index,
                    predictions=_take_row(predictions, row, valid, width),
                    labels=_take_row(labels, row, valid, width),
                    inputs=_take_row(input_ids, row, valid, width) if self.include_inputs else None,
                    loss=losses[row][0] if losses is not None else None,
                    loss_tokens=losses[row][1] if losses is not None else 0,
                )
            )

    def gather(self, env: DistributedEnv) -> GatheredPredictions:
        """Every rank's samples, in dataset order, stacked (collective: ``all_gather_object``)."""
        samples = self._gathered(env)
        return self._stacked(samples, self._losses(samples))

    def _gathered(self, env: DistributedEnv) -> list[SamplePrediction]:
        """Every rank's samples, in dataset order (collective: ``all_gather_object``)."""
        samples = sorted((s for part in env.all_gather_objects(self._samples) for s in part), key=lambda s: s.index)
        self._samples = []
        indices = [s.index for s in samples]
        if len(set(indices)) != len(indices):
            raise RuntimeError("validation predictions: a sample was predicted on more than one rank")
        return samples

    def _trainer_batches(self, samples: list[SamplePrediction]) -> list[list[SamplePrediction]]:
        """``samples`` (dataset order) in the batches one step of Trainer's evaluation gathers."""
        size = self.trainer_batch or len(samples) or 1
        return [samples[start : start + size] for start in range(0, len(samples), size)] or [[]]

    def _losses(self, samples: list[SamplePrediction]) -> dict[int, float]:
        """Trainer's ``losses`` of ``samples`` (all of them, dataset order): each rank's batch loss (token mean
        of its rows; the last batch completed from the first samples, as accelerate evens batches out) repeated
        for each of its rows, by sample index; without Trainer's arguments each row's own mean.  Empty unless
        ``include_for_metrics`` asks for them."""
        if not self.include_loss:
            return {}
        size, count = self.rank_batch or 1, len(samples)
        losses: dict[int, float] = {}
        for start in range(0, count, size):
            rows = [samples[position % count] for position in range(start, start + size)]
            tokens = sum(s.loss_tokens for s in rows)
            total = sum(s.loss for s in rows if s.loss is not None)
            loss = total / tokens if tokens > 0 else float("nan")
            losses.update((s.index, loss) for s in samples[start : start + size])
        return losses

    def _rank_batch(self, samples: list[SamplePrediction]) -> dict[str, torch.Tensor]:
        """Rank 0's rows of one Trainer batch as the collator's batch (Trainer hands ``compute_metrics`` its
        rank's ``inputs`` with ``batch_eval_metrics``): ``input_ids`` padded as the validation batches are,
        ``attention_mask``, ``labels`` padded with ``PADDING_INDEX``."""
        rows = samples[: self.rank_batch or len(samples)]
        value, left = self._padding

        def padded(values: list[Any], fill: int) -> torch.Tensor:
            tensors = [torch.as_tensor(np.asarray(row)).reshape(-1) for row in values]
            width = max((len(row) for row in tensors), default=0)
            out = torch.full((len(tensors), width), fill, dtype=torch.long)
            for number, row in enumerate(tensors):
                if left:
                    out[number, width - len(row) :] = row
                else:
                    out[number, : len(row)] = row
            return out

        batch = {
            "input_ids": padded([s.inputs for s in rows], value),
            "attention_mask": padded([np.ones(len(np.asarray(s.inputs)), dtype=np.int64) for s in rows], 0),
        }
        if rows and isinstance(rows[0].labels, np.ndarray) and rows[0].labels.ndim == 1:
            batch["labels"] = padded([s.labels for s in rows], PADDING_INDEX)
        return batch

    def _prediction(self, gathered: Any, convert: Callable[[Any], Any], inputs: Any = None) -> Any:
        """The ``EvalPrediction`` of ``gathered`` (a ``GatheredPredictions``, or one of lists), each field
        ``convert``ed; ``inputs`` (else ``gathered``'s) / ``losses`` as ``include_for_metrics`` asks."""
        from transformers.trainer_utils import EvalPrediction

        extra: dict[str, Any] = {}
        if self.include_inputs:
            extra["inputs"] = inputs if inputs is not None else convert(gathered.inputs)
        if self.include_loss:
            extra["losses"] = convert(gathered.losses)
        return EvalPrediction(predictions=convert(gathered.predictions), label_ids=convert(gathered.label_ids), **extra)

    def _stacked(self, samples: list[SamplePrediction], losses: dict[int, float]) -> GatheredPredictions:
        """``samples`` stacked as ``Trainer.predict``/``evaluate`` build them (padded with ``PADDING_INDEX``),
        with their ``losses`` (``_losses``)."""
        return GatheredPredictions(
            predictions=_stack_nested([s.predictions for s in samples]),
            label_ids=_stack_nested([s.labels for s in samples]) if samples and samples[0].labels is not None else None,
            inputs=_stack([s.inputs for s in samples if s.inputs is not None]) if self.include_inputs else None,
            losses=np.array([losses[s.index] for s in samples], dtype=np.float32) if self.include_loss else None,
            num_samples=len(samples),
        )

    def compute(self, env: DistributedEnv) -> dict[str, Any]:
        """Gather, run ``compute_metrics`` on rank 0, broadcast; keys prefixed ``eval_`` (collectives)."""
        samples = self._gathered(env)
        losses = self._losses(samples)
        gathered = self.last = self._stacked(samples, losses)
        metrics: dict[str, Any] | None = None
        if env.is_world_process_zero and self.compute_metrics is not None:
            if self.per_call:
                result: Any = {}
                batches = self._trainer_batches(samples)
                for number, batch in enumerate(batches, start=1):
                    inputs = self._rank_batch(batch) if self.include_inputs else None
                    prediction = self._prediction(self._stacked(batch, losses), _tensors, inputs)
                    result = self.compute_metrics(prediction, compute_result=number == len(batches))
            elif self.concat:
                result = self.compute_metrics(self._prediction(gathered, lambda v: v))
            else:
                parts = [self._stacked(batch, losses) for batch in self._trainer_batches(samples)]
                result = self.compute_metrics(self._prediction(_listed(parts), lambda v: v))
            if not isinstance(result, dict):
                raise TypeError(f"compute_metrics returned {type(result).__name__}; it must return a dict")
            metrics = {(k if k.startswith("eval_") else f"eval_{k}"): _plain(v) for k, v in result.items()}
        # collective: rank 0's metrics on every rank
        out = env.broadcast_object(metrics)
        return dict(out or {})


def _listed(parts: list[GatheredPredictions]) -> GatheredPredictions:
    """Each field a list of the parts' arrays (``eval_do_concat_batches=False``)."""
    return GatheredPredictions(
        predictions=[p.predictions for p in parts],
        label_ids=[p.label_ids for p in parts] if parts and parts[0].label_ids is not None else None,
        inputs=[p.inputs for p in parts] if parts and parts[0].inputs is not None else None,  # type: ignore[arg-type]
        losses=[p.losses for p in parts] if parts and parts[0].losses is not None else None,  # type: ignore[arg-type]
        num_samples=sum(p.num_samples for p in parts),
    )


def _tensors(value: Any) -> Any:
    """numpy arrays (nested) as tensors: what Trainer hands ``compute_metrics`` per batch."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, tuple | list):
        return type(value)(_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    return value


def _row_losses(logits: Any, labels: Any) -> list[tuple[float, int]]:
    """Summed shifted token cross entropy and loss tokens of each row (``(nan, 0)`` for every row when the
    outputs are not token logits with token labels)."""
    if not (
        isinstance(logits, torch.Tensor)
        and isinstance(labels, torch.Tensor)
        and logits.dim() == 3
        and labels.dim() == 2
    ):
        rows = len(labels) if labels is not None else len(logits)
        return [(float("nan"), 0)] * rows
    shifted = labels[:, 1:].to(logits.device)
    per_token = F.cross_entropy(
        logits[:, :-1, :].float().transpose(1, 2), shifted, ignore_index=IGNORE_INDEX, reduction="none"
    )
    counts = (shifted != IGNORE_INDEX).sum(dim=1)
    sums = per_token.sum(dim=1)
    return list(zip(sums.tolist(), counts.tolist(), strict=True))


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _take_row(value: Any, row: int, valid: torch.Tensor | None, width: int | None) -> Any:
    """Row ``row`` of a (nested) output; tensors whose second dimension is the batch's sequence length
    (``width``) keep only the ``valid`` positions."""
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return type(value)(_take_row(v, row, valid, width) for v in value)
    if isinstance(value, dict):
        return {k: _take_row(v, row, valid, width) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    item = value[row].detach().cpu()
    if valid is not None and item.dim() >= 1 and item.shape[0] == width:
        item = item[valid]
    if item.dtype in (torch.bfloat16, torch.float16):
        item = item.float()
    return item.numpy()


def _stack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Stack per-sample arrays; different first dimensions are padded with ``PADDING_INDEX`` first."""
    if not arrays:
        return np.zeros((0,))
    arrays = [np.asarray(a) for a in arrays]
    if all(a.shape == arrays[0].shape for a in arrays) or arrays[0].ndim == 0:
        return np.stack(arrays)
    length = max(a.shape[0] for a in arrays)
    out = np.full((len(arrays), length, *arrays[0].shape[1:]), PADDING_INDEX, dtype=arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def _stack_nested(values: Sequence[Any]) -> Any:
    if not values:
        return np.zeros((0,))
    first = values[0]
    if isinstance(first, tuple | list):
        return type(first)(_stack_nested([v[i] for v in values]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _stack_nested([v[k] for v in values]) for k in first}
    return _stack(values)


def _plain(value: Any) -> Any:
    """numpy/torch scalars as Python numbers (metrics travel as JSON and through pickling)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value
