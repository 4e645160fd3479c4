"""The model's own loss on Trainer's sample batches: any ``PreTrainedModel`` whose forward returns a loss
(sequence / token classification, masked LM, encoder-decoder, image classification, several inputs;
PEFT-wrapped too).

Batches are ``data.sample_batches.SampleBatches`` (``data.stream_batches.StreamBatches`` for a stream):
``per_device`` items per micro-batch formed by the collator, ``accumulation``
micro-batches per step.  The loss follows ``transformers.Trainer``
(``compute_loss`` / ``training_step`` / ``_get_num_items_in_batch``):

- when the model accepts loss kwargs (``accepts_loss_kwargs``, else a ``**kwargs`` forward) and the batch
  has ``labels``, the step's items are counted -- labels other than -100, ``labels[..., 1:]`` for a causal
  loss -- summed over the step's micro-batches and every rank (one small collective per step, as Trainer's
  gather), and passed to the forward as ``num_items_in_batch``; the model's loss is then a sum over the
  step's items, and the loop normalises by the items (``average_tokens_across_devices=False``: the forward gets
  this rank's items and each rank's mean weighs alike, as under Trainer);
- otherwise the model's loss is a per-batch mean and the step's loss is the mean over micro-batches and
  ranks (Trainer divides by ``gradient_accumulation_steps``; the engines average ranks).

Evaluation: each batch's loss as ``Trainer.prediction_step`` computes it (with ``num_items_in_batch`` over
every rank and the world-size scale when the model accepts loss kwargs), weighted by the batch's real
items (Trainer's ``eval_loss``), predictions as
``Trainer.prediction_step`` gives them (the outputs other than the loss, one tensor when there is one) and
labels from ``label_names``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainbridge.core.distributed import DistributedEnv
from trainbridge.data.sample_batches import SampleStep
from trainbridge.data.stream_batches import StreamStep
from trainbridge.data.types import IGNORE_INDEX
from trainbridge.modeling.load import is_causal_lm, unwrap_peft
from trainbridge.step.base import EvalOutput, StepBatches, TrainSource, TrainStep
from trainbridge.step.step_totals import StepTotals, across_ranks

if TYPE_CHECKING:
    from trainbridge.step.generated import Generation

NUM_ITEMS_KEY = "num_items_in_batch"
"""The batch entry that carries the step's item count to the forward (Trainer passes it the same way)."""


class ItemBatches(TrainSource, Protocol):
    """Micro-batches of dataset items (``SampleBatches``, or ``StreamBatches`` for a stream)."""

    accumulation: int
    world_size: int
    collate: Any

    def micro_batches(self, step: Any) -> list[dict[str, Any]]:
        """Collated micro-batches (CPU) of this rank in ``step``, an entry of the epoch plan's steps."""
        ...


def accepts_loss_kwargs(model: Any) -> bool:
    """Trainer's rule: the model's ``accepts_loss_kwargs``, else whether its forward takes ``**kwargs``."""
    inner = unwrap_peft(model)
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    parameters = inspect.signature(inner.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def forward_parameters(model: Any) -> list[str]:
    """The names the model's forward takes (a PEFT model's base model's), as Trainer's signature columns."""
    return list(inspect.signature(unwrap_peft(model).forward).parameters)


def default_label_names(model: Any) -> list[str]:
    """Trainer's default ``label_names``: ``start_positions``/``end_positions`` for question answering,
    else ``labels``."""
    parameters = forward_parameters(model)
    if "start_positions" in parameters and "end_positions" in parameters and "labels" not in parameters:
        return ["start_positions", "end_positions"]
    return ["labels"]


def returns_loss(model: Any, label_names: Sequence[str]) -> bool:
    """Whether the forward can compute a loss: it takes every label name, or a ``return_loss`` flag (CLIP-like
    models, whose collator passes ``return_loss=True``)."""
    parameters = set(forward_parameters(model))
    return "return_loss" in parameters or all(name in parameters for name in label_names)


def untrainable_reason(model: Any, label_names: Sequence[str]) -> str:
    """One line: why the loop cannot train ``model`` (an instance or a class) and what to do."""
    inner = unwrap_peft(model)
    name = (inner if isinstance(inner, type) else type(inner)).__name__
    return (
        f"model: {name} is not a causal LM and its forward takes no {', '.join(label_names)}, so it returns no "
        f"loss to train on; load the model with a task head (e.g. {name.removesuffix('Model')}"
        "ForSequenceClassification, ...ForMaskedLM) or set label_names to the forward's label arguments"
    )


def loss_of(outputs: Any) -> torch.Tensor:
    """The loss of a forward's outputs (``outputs["loss"]``, or the first element of a tuple), as Trainer."""
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        if loss is None:
            raise ValueError(
                f"the model returned no loss (only {', '.join(outputs.keys())}); its forward computes "
                "a loss only when it gets the labels: check label_names and the collator's keys"
            )
        return loss
    return outputs[0]


GENERATION_CACHE_KEYS = ("past_key_values", "cache")
"""The names a model's outputs give its generation cache (``cache`` from transformers 5.2x, ``past_key_values``
before): ``Trainer.prediction_step`` drops its own version's name when the config has no
``keys_to_ignore_at_inference``; dropping both keeps the cache out of the logits on any version."""


def inference_ignore_keys(config: Any) -> list[str]:
    """``Trainer.prediction_step``'s default ``ignore_keys``: the config's ``keys_to_ignore_at_inference``, else
    the generation cache (``GENERATION_CACHE_KEYS``); none without a config."""
    if config is None:
        return []
    keys = getattr(config, "keys_to_ignore_at_inference", None)
    return list(GENERATION_CACHE_KEYS) if keys is None else list(keys)


def predictions_of(outputs: Any, ignore_keys: Sequence[str]) -> Any:
    """``Trainer.prediction_step``'s logits: the outputs other than the loss (and ``ignore_keys``), one value
    when there is one."""
    if isinstance(outputs, Mapping):
        values = tuple(v for k, v in outputs.items() if k not in (*ignore_keys, "loss"))
    else:
        values = tuple(outputs[1:])
    return values[0] if len(values) == 1 else values


class ModelLoss(TrainStep):
    """Sample batches and the loss the model's forward returns (see the module docstring)."""

    name = "the model's own loss (sample batches)"
    flops_input_positions = True
    train_batches: ItemBatches

    def __init__(
        self,
        train_batches: ItemBatches,
        model: Any,
        env: DistributedEnv,
        label_names: Sequence[str] | None = None,
        generation: Generation | None = None,
        average_tokens: bool = True,
    ) -> None:
        self.train_batches = train_batches
        self.env = env
        self.average_tokens = average_tokens
        """``average_tokens_across_devices``: the forward gets every rank's items; False: this rank's, and each
        rank's mean counts alike (the step's loss is the mean over ranks of each rank's mean, as Trainer's)."""
        self._rank_scale = 1.0
        """The running step's factor on each micro-batch's loss sum (1 unless ``average_tokens`` is off)."""
        self.generation = generation
        """The predictions seam: None, the forward's outputs; else generated ids (``predict_with_generate``)."""
        self.label_names = list(label_names) if label_names else default_label_names(model)
        self.counts_items = accepts_loss_kwargs(model)
        self.totals: StepTotals = across_ranks
        """How ``prepare`` sums the step's counts over the ranks (``step_totals``)."""
        inner = unwrap_peft(model)
        config = getattr(inner, "config", None)
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        self.shifts_labels = is_causal_lm(inner) and not self.encoder_decoder
        self.ignore_keys = inference_ignore_keys(config)

    def prepare(self, step: SampleStep | StreamStep) -> StepBatches:
        micro_batches = self.train_batches.micro_batches(step)
        carried = isinstance(step, StreamStep) and step.carried
        counted = self.counts_items and all("labels" in b for b in micro_batches)
        items = [self._items(b) for b in micro_batches] if counted else [0] * len(micro_batches)
        # the step's items and non-padding tokens over every rank (a collective unless built without counts)
        total_items, tokens = self.totals(self.env, float(sum(items)), float(sum(map(_tokens, micro_batches))))
        self._rank_scale = 1.0
        if counted and total_items > 0:
            count = torch.tensor(total_items)
            if not self.average_tokens:  # the forward divides by this rank's items; the loop by every rank's
                count = torch.tensor(float(max(sum(items), 1)))
                self._rank_scale = total_items / (self.env.world_size * float(count))
            for batch in micro_batches:
                batch[NUM_ITEMS_KEY] = count
            return StepBatches(
                micro_batches, [float(n) for n in items], total_items, step.num_samples, int(tokens), carried
            )
        units = float(self.env.world_size * len(micro_batches))
        return StepBatches(micro_batches, [1.0] * len(micro_batches), units, step.num_samples, int(tokens), carried)

    def _items(self, batch: Mapping[str, Any]) -> int:
        labels = batch["labels"]
        if not isinstance(labels, torch.Tensor):
            return 0
        return int((labels[..., 1:] if self.shifts_labels else labels).ne(IGNORE_INDEX).sum())

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        loss = loss_of(model(**batch))
        count = batch.get(NUM_ITEMS_KEY)
        if count is None:
            return loss  # a batch mean
        return loss * count * self._rank_scale  # a sum over the step's items (of this rank's, scaled)

    def eval_batch(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        """The step's loss of the batch and, with ``outputs``, its predictions: the forward's (``eval_loss``), or
        generated ids with the model's own loss, as ``Seq2SeqTrainer.prediction_step`` (``generation``)."""
        if outputs and self.generation is not None:
            return self.generation.predict(
                model, batch, ModelLoss.eval_loss(self, model, batch, cpu_batch, False, rows)
            )
        return self.eval_loss(model, batch, cpu_batch, outputs, rows)

    def eval_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        """The step's loss of one validation batch and, with ``outputs``, the forward's predictions."""
        # a loss without labels when the batch asks for one (``return_loss=True``: CLIP-like), as Trainer
        has_labels = all(batch.get(name) is not None for name in self.label_names) or batch.get("return_loss") is True
        scale = 1.0
        if self.counts_items and self.average_tokens and isinstance(batch.get("labels"), torch.Tensor):
            # Trainer.prediction_step: the batch's items over every rank go to the forward, and compute_loss
            # scales the loss by the world size (average_tokens_across_devices)
            (items,) = self.env.sum_floats([float(self._items(batch))])  # collective: every rank, every batch
            batch = {**batch, NUM_ITEMS_KEY: torch.tensor(items)}
            scale = float(self.env.world_size)
        result = model(**batch)
        loss = loss_of(result).detach().float() * scale if has_labels else torch.zeros((), device=_device(batch))
        if not outputs:
            return EvalOutput(loss * rows, float(rows) if has_labels else 0.0)
        labels = tuple(batch.get(name) for name in self.label_names)
        return EvalOutput(
            loss * rows,
            float(rows) if has_labels else 0.0,
            predictions_of(result, self.ignore_keys),
            (labels[0] if len(labels) == 1 else labels) if has_labels else None,
            inputs_aligned=not self.encoder_decoder,
        )

    def describe_batches(self, effective_batch_size: int) -> str:
        batches = self.train_batches
        return (
            f"{effective_batch_size} samples: {batches.batch_size} per micro-batch x "
            f"{batches.accumulation} micro-batches x {batches.world_size} ranks, "
            f"formed by {type(getattr(batches.collate, 'collator', batches.collate)).__name__}"
        )


def _tokens(batch: Mapping[str, Any]) -> int:
    """Non-padding input tokens of a batch (its ``attention_mask``'s ones, else its ``input_ids``; 0 for
    inputs without tokens)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    input_ids = batch.get("input_ids")
    return int(input_ids.numel()) if isinstance(input_ids, torch.Tensor) else 0


def _device(batch: Mapping[str, Any]) -> torch.device:
    return next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
