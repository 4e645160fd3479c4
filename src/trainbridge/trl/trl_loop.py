"""``TrlLoop``: what a trl trainer class gets in front of it to be trained by trainbridge's loop.

``class X(TrlLoop, trl.XTrainer)``: trl's constructor runs unchanged between ``LoopTrainer``'s launch check
(``python script.py`` re-executed under torchrun, refused overrides) and its loop set-up; ``train()`` is the
loop (``trainer.facade.LoopTrainer``), after which trl's model card is written, as trl writes it at each
checkpoint.  Evaluation is trl's through Trainer's own ``evaluate``
(``get_eval_dataloader``, ``evaluation_loop``, trl's ``prediction_step``/``compute_loss``, ``log``), not the
loop's batches: trl's evaluation batches (GRPO's repeat sampler, the reward model's padded pairs) are its own.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments

from trainbridge.trainer import subclass
from trainbridge.trainer.facade import LoopTrainer


class TrlLoop(LoopTrainer):
    """``LoopTrainer`` for a trl trainer class (see the module doc)."""

    def __init__(self, *args: Any, torchrun_args: Any = None, **kwargs: Any) -> None:
        self._check_launch(type(self), torchrun_args)
        self._private_output_dir(kwargs.get("args", next((a for a in args if isinstance(a, TrainingArguments)), None)))
        super().__init__(*args, **kwargs)  # trl's own constructor
        self._init_loop(torchrun_args, self._loop_collator())

    def _loop_collator(self) -> Any:
        """The collator the loop's batches stand for: trl's own (None where trainbridge's step reproduces it)."""
        return self.data_collator

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The loop; then trl's model card in ``output_dir``, which trl's ``_save_checkpoint`` writes there at each
        checkpoint (a checkpoint's save writes only into the checkpoint: ``trainer.save_overrides``)."""
        result = super().train(*args, **kwargs)
        if self.args.should_save and any(self.output_dir.glob("checkpoint-*")):
            name = self.output_dir.name if self.args.hub_model_id is None else self.args.hub_model_id.split("/")[-1]
            self.create_model_card(model_name=name)  # type: ignore[attr-defined]
        return result

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.__dict__.pop(subclass.LOOP_EVALUATION, None)  # trl's evaluation, not the loop's batches
        return super().evaluate(*args, **kwargs)
