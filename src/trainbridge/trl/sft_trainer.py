"""``SFTTrainer``: trl's ``SFTTrainer`` constructor on trainbridge's ``Trainer`` facade.

It takes trl's arguments as they are (``SFTConfig``, a model object or a model path with
``model_init_kwargs``, ``peft_config``, ``formatting_func``, trl's collators) and prepares the datasets
with trl's own preparation (``sft_data.prepare_sft_dataset``), so the facade receives ``input_ids``/
``labels`` rows and trains them on the loop with padding-free token-budget batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainbridge.hf.porting import HFPortingWarning
from trainbridge.trainer import Trainer
from trainbridge.trl.arguments import trl_config, trl_tokenizer
from trainbridge.trl.sft_data import prepare_sft_dataset


def _trl_collator(collator: Any) -> bool:
    """trl's own SFT collator: padding-free batches of the prepared rows give its loss (it is not called)."""
    return type(collator).__module__.startswith("trl.") and type(collator).__name__ == "DataCollatorForLanguageModeling"


PREPARED_FIELDS = (
    "dataset_text_field",
    "dataset_kwargs",
    "dataset_num_proc",
    "eos_token",
    "truncation_mode",
    "shuffle_dataset",
    "packing",
    "packing_strategy",
    "padding_free",
    "pad_to_multiple_of",
    "eval_packing",
    "completion_only_loss",
    "assistant_only_loss",
    "chat_template_path",
)
"""``SFTConfig`` fields trl's preparation applies to the rows (so they are honoured, not ignored)."""


@contextmanager
def _prepared_fields_honoured() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=rf"SFTConfig\.({'|'.join(PREPARED_FIELDS)})=", category=HFPortingWarning
        )
        yield


class SFTTrainer(Trainer):
    """trl's ``SFTTrainer(model, args, data_collator, train_dataset, eval_dataset, processing_class, ...,
    peft_config, formatting_func)`` on trainbridge's loop."""

    token_metrics = True
    """Log trl's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` (``TrainingArgs.token_metrics``)."""

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        peft_config: Any = None,
        formatting_func: Any = None,
        **kwargs: Any,
    ) -> None:
        from trl import SFTConfig

        args = trl_config(args, SFTConfig, model, "SFT")
        processing_class, tokenizer = trl_tokenizer(processing_class, model)
        if train_dataset is not None:
            train_dataset = prepare_sft_dataset(train_dataset, tokenizer, args, formatting_func, "train")
        if eval_dataset is not None:
            eval_packing = args.packing if args.eval_packing is None else args.eval_packing
            if isinstance(eval_dataset, dict):
                eval_dataset = {
                    name: prepare_sft_dataset(data, tokenizer, args, formatting_func, name, eval_packing)
                    for name, data in eval_dataset.items()
                }
            else:
                eval_dataset = prepare_sft_dataset(eval_dataset, tokenizer, args, formatting_func, "eval", eval_packing)
        super().__init__(
            model=model,
            args=args,
            data_collator=None if _trl_collator(data_collator) else data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            **kwargs,
        )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with _prepared_fields_honoured():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with _prepared_fields_honoured():
            return super().evaluate(*args, **kwargs)
