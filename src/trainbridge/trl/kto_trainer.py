"""``KTOTrainer``: trl's ``KTOTrainer`` constructor on trainbridge's ``Trainer`` facade.

It takes trl's arguments as they are (``KTOConfig``, a model object or a path with ``model_init_kwargs``,
``ref_model``, ``peft_config``, ``processing_class``), prepares the rows with trl's own
``KTOTrainer._prepare_dataset`` (prompt extraction, paired rows unpaired, EOS, tokenisation, rows whose
prompt fills ``max_length`` dropped, the mismatched ``KL_completion_ids``) and hands the workers a
``kto_step.KTOStepFactory`` as the job's ``train_step``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainbridge.trainer import Trainer
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError
from trainbridge.trl.arguments import trl_config, trl_tokenizer
from trainbridge.trl.kto_loss import KTOLoss
from trainbridge.trl.kto_step import KTOStepFactory

KTO_COLUMNS = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")


def prepare_kto_dataset(dataset: Any, tokenizer: Any, config: Any, loss: KTOLoss) -> Any:
    """``dataset`` as trl's ``KTOTrainer`` prepares it, reduced to ``KTO_COLUMNS``."""
    from trl import KTOTrainer

    sample = next(iter(dataset))
    if "image" in sample or "images" in sample:
        raise ValueError("train_dataset: vision KTO rows (image/images) are not supported; use trl's KTOTrainer")
    stand_in = SimpleNamespace(
        _tokenizer=tokenizer,
        calculate_KL=loss.uses_kl,
        desirable_weight=loss.desirable_weight,
        undesirable_weight=loss.undesirable_weight,
    )
    prepared = KTOTrainer._prepare_dataset(stand_in, dataset, tokenizer, config, "train")  # type: ignore[arg-type]
    return prepared.select_columns([c for c in KTO_COLUMNS if c in prepared.column_names])


def precompute_kto_reference(rows: Any, policy: Any, ref_model: Any, config: Any, with_kl: bool) -> Any:
    """``rows`` with trl's ``ref_logps`` (and, for the KL term, ``ref_KL_logps``) columns: the reference
    (``ref_model``, the PEFT policy's base, or the untrained policy itself, as trl) scores
    ``precompute_ref_batch_size`` rows and their mismatched completions per packed forward."""
    from trainbridge.trl.preference_data import reference_stats
    from trainbridge.trl.sequence_logps import pack_pairs

    reference = ref_model if ref_model is not None or hasattr(policy, "disable_adapter") else policy
    size = int(config.precompute_ref_batch_size or 8)
    ref_logps: list[float] = []
    ref_kl_logps: list[float] = []
    was_training = (reference or policy).training
    (reference or policy).eval()
    try:
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            mismatched = chunk["KL_completion_ids"] if with_kl else chunk["completion_ids"]
            packed = pack_pairs(chunk["prompt_ids"], chunk["completion_ids"], mismatched, config.max_length)
            logps = reference_stats(policy, reference, packed).logps.float().cpu().tolist()
            ref_logps.extend(logps[: packed.pairs])
            ref_kl_logps.extend(logps[packed.pairs :])
    finally:
        (reference or policy).train(was_training)
    rows = rows.add_column("ref_logps", ref_logps)
    return rows.add_column("ref_KL_logps", ref_kl_logps) if with_kl else rows


class KTOTrainer(Trainer):
    """trl's ``KTOTrainer(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
    compute_metrics, callbacks, optimizers, quantization_config, peft_config)`` on trainbridge's loop."""

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        from trl import KTOConfig

        args = trl_config(args, KTOConfig, model, "KTO")
        if train_dataset is None:
            raise ValueError("train_dataset: KTOTrainer needs prompt/completion/label rows (or paired rows)")
        for name, value in (("eval_dataset", eval_dataset), ("data_collator", data_collator)):
            if value is not None:
                raise UnsupportedTrainerFeatureError(f"{name}: KTOTrainer does not take it yet; pass {name}=None")
        if quantization_config is not None:
            raise UnsupportedTrainerFeatureError(
                "quantization_config: pass it in model_init_kwargs (bitsandbytes bases load there)"
            )
        loss = KTOLoss.from_config(args)
        if loss.uses_kl and args.train_sampling_strategy != "sequential":
            raise ValueError(
                f"train_sampling_strategy: {args.train_sampling_strategy!r} with loss_type 'kto'; the KL term "
                "pairs each row with its neighbour in a fixed-order batch, use 'sequential' (as trl)"
            )
        if loss.uses_kl and args.per_device_train_batch_size <= 1:
            raise ValueError(
                "per_device_train_batch_size: must be > 1 for loss_type 'kto' (the KL term needs another row)"
            )
        processing_class, tokenizer = trl_tokenizer(processing_class, model)
        rows = prepare_kto_dataset(train_dataset, tokenizer, args, loss)
        if args.precompute_ref_log_probs:
            from transformers import AutoModelForCausalLM

            policy = (
                AutoModelForCausalLM.from_pretrained(str(model), **(args.model_init_kwargs or {}))
                if isinstance(model, str | Path)
                else model
            )
            rows = precompute_kto_reference(rows, policy, ref_model, args, loss.uses_kl)
        self.step_factory = KTOStepFactory(
            loss,
            rows_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            max_length=args.max_length,
            ref_model=ref_model,
            seed=int(args.seed),
            sequential=args.train_sampling_strategy == "sequential",
            disable_dropout=bool(args.disable_dropout),
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=None,
            train_dataset=rows,
            eval_dataset=None,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            **kwargs,
        )

    def _row_preparation(self) -> Any:
        """The prepared rows are the job's items, written as they are (every column)."""
        return dataclasses.replace(super()._row_preparation(), items=True)
