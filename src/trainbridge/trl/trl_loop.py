"""``TrlLoop``: what a trl trainer class gets in front of it to be trained by trainbridge's loop.

``class X(TrlLoop, trl.XTrainer)``: trl's constructor runs unchanged between ``LoopTrainer``'s launch check
(``python script.py`` re-executed under torchrun, refused overrides) and its loop set-up; ``train()`` is the
loop (``trainer.facade.LoopTrainer``), after which trl's model card is written, as trl writes it at each
checkpoint.  Evaluation is trl's through Trainer's own ``evaluate``
(``get_eval_dataloader``, ``evaluation_loop``, trl's ``prediction_step``/``compute_loss``, ``log``), not the
loop's batches: trl's evaluation batches (GRPO's repeat sampler, the reward model's padded pairs) are its own.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

from transformers import TrainingArguments

from trainbridge.core.callback import Callback
from trainbridge.core.config.loss import Loss, OwnStep, StepFactory
from trainbridge.core.context import TrainingContext
from trainbridge.trainer.facade import LoopTrainer
from trainbridge.trainer.subclass import StandIn


@contextmanager
def fields_read(config: Any) -> Iterator[None]:
    """Without the porting's warning that a field of trl's ``config`` (not a ``TrainingArguments`` field) "has no
    effect": trl's own code (or trainbridge's step standing in for trl's) reads every one of them."""
    from trainbridge.hf.porting import HFPortingWarning

    cls = re.escape(type(config).__name__)
    with warnings.catch_warnings():
        message = rf"{cls}\.\w+=.* is ignored: {cls} is not TrainingArguments"
        warnings.filterwarnings("ignore", message=message, category=HFPortingWarning)
        yield


class _TrainedTokens(Callback):
    """Keeps trl's count of trained input tokens (``_total_train_tokens``, which its evaluation logs as
    ``eval_num_tokens``) as the loop's step counts them: every rank's non-padding input tokens."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        self.trainer._total_train_tokens = context.tokens_seen


STEP_STAND_IN = (
    "compute_loss",
    "training_step",
    "prediction_step",
    "_set_signature_columns_if_needed",
    "_save_checkpoint",
)
"""What a class with a step of trainbridge's own (SFT, DPO) can stand in for (``TrlLoop.stands_in_for``): the step
for trl's loss, its micro-batch step and the columns its loader keeps (the loop reads the rows itself);
``LoopTrainer``'s ``_save_checkpoint`` for trl's, which only adds the model card ``TrlLoop.train`` writes."""

TRLS_OWN_STEP = StandIn(("_save_checkpoint",))
"""Where trl's own step trains (its ``training_step`` on its loader; its ``compute_loss`` logs its metrics): only
``_save_checkpoint`` stood in for."""


class ShardedReference(Callback):
    """At ``on_init_end`` (the policy's engine built), under FSDP2: the trainer's frozen ``ref_model`` (trl's
    object, as its evaluation, ``SyncRefModelCallback`` and trainbridge's DPO/KTO step hold it) sharded in place on
    the policy's units (``parallel.fsdp.shard_frozen``), gathered per forward, as trl's accelerate path shards it
    with ``prepare_fsdp``.  Without it each rank would hold a whole copy."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        from torch.distributed.tensor import DTensor

        reference = getattr(self.trainer, "ref_model", None)
        if context.args.distributed_backend != "fsdp" or reference is None or context.env.world_size < 2:
            return
        if any(isinstance(p, DTensor) for p in reference.parameters()):
            return  # sharded already (a second train() call)
        from trainbridge.parallel.fsdp import shard_frozen

        self.trainer.ref_model = shard_frozen(reference.to(context.env.device), context.args, context.env)


class TrlLoop(LoopTrainer):
    """``LoopTrainer`` for a trl trainer class (see the module doc)."""

    def __init__(self, *args: Any, torchrun_args: Any = None, **kwargs: Any) -> None:
        self._check_launch(type(self), torchrun_args)
        self._private_output_dir(kwargs.get("args", next((a for a in args if isinstance(a, TrainingArguments)), None)))
        args, kwargs = self._holding_natives(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)  # trl's own constructor
        self._init_loop(torchrun_args)

    def _script_callbacks(self, stand_in: StandIn) -> list[Any]:
        """trl's reference sharded under FSDP2 (``ShardedReference``); with trainbridge's step standing in for
        trl's ``compute_loss``, which counts the tokens, the loop's count stands in for it (``_TrainedTokens``)."""
        callbacks = [*super()._script_callbacks(stand_in), ShardedReference(self)]
        return [*callbacks, _TrainedTokens(self)] if stand_in.loss else callbacks

    def _stand_in(self) -> StandIn:
        """Whose step trains, decided at each ``train()`` (``run_plan()``): trainbridge's (``_packed_step``, else
        the token step) where the class stands in for trl's (``stands_in_for``), its checks of its config and data
        hold (``_reproduces_trl``) and the script brings no loss of its own (an override, a
        ``compute_loss_func``); else trl's ``training_step`` on trl's batches (``TRLS_OWN_STEP``)."""
        stand_in = super()._stand_in()
        if not stand_in.methods:
            return stand_in
        if self._reproduces_trl() and not self._steps_through_instance(stand_in):
            return replace(stand_in, step=self._packed_step())
        return TRLS_OWN_STEP

    def _loss_seam(self, items: bool, instance_step: bool, stand_in: StandIn) -> Loss:
        """trainbridge's own step where it stands in for trl's (``stand_in.step``), else ``LoopTrainer``'s choice."""
        if stand_in.step is not None:
            return OwnStep(stand_in.step)
        return super()._loss_seam(items, instance_step, stand_in)

    def _evaluation(self, items: bool) -> Callable[..., Any] | None:
        """trl's evaluation at each evaluation point: the instance's ``evaluate()``, trl's and Trainer's own code
        throughout on trl's evaluation batches (see the module doc), whatever the run trains on."""
        return partial(self._script.evaluation, trainers_own=True)

    def _reproduces_trl(self) -> bool:
        """Whether trainbridge's step gives trl's loss for this instance's config and data."""
        return False

    def _packed_step(self) -> StepFactory | None:
        """trainbridge's step over trl's prepared rows (``RunPlan.loss`` (``OwnStep``)); None: the token step."""
        return None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The loop; then trl's model card in ``output_dir``, which trl's ``_save_checkpoint`` writes there at each
        checkpoint (a checkpoint's save writes only into the checkpoint: ``trainer.save_overrides``)."""
        with fields_read(self.args):  # every field of trl's config: trl's own code reads it
            result = super().train(*args, **kwargs)
        if self.args.should_save and any(self.output_dir.glob("checkpoint-*")):
            name = self.output_dir.name if self.args.hub_model_id is None else self.args.hub_model_id.split("/")[-1]
            self.create_model_card(model_name=name)  # type: ignore[attr-defined]
        return result
