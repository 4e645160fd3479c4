"""``ScheduleCallback``: requests log / evaluate / save at the steps ``transformers.Trainer`` would
(``DefaultFlowCallback``'s rules), plus ``save_samples`` and ``checkpoint_at_epoch``, through the same
agreement as any user request."""

from __future__ import annotations

from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext


class ScheduleCallback(Callback):
    """Log / evaluate / save triggers from ``TrainingArgs`` (steps, epochs, samples)."""

    always_restore_state = True

    def __init__(self) -> None:
        self._last_save_samples = 0

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        save_samples = context.args.save_samples
        if save_samples:
            self._last_save_samples = context.samples_seen // save_samples * save_samples

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        args, step = context.args, context.global_step
        if step == 1 and args.logging_first_step:
            context.request_log("logging_first_step")
        if args.logging_strategy == "steps" and step % args.logging_steps == 0:
            context.request_log(f"logging_steps={args.logging_steps}")
        eval_due = args.eval_strategy == "steps" and args.eval_delay <= step
        if eval_due and args.eval_steps and step % args.eval_steps == 0:
            context.request_evaluate(f"eval_steps={args.eval_steps}")
        if args.save_strategy == "steps" and args.save_steps and step % args.save_steps == 0:
            context.request_save(f"save_steps={args.save_steps}")
        if args.save_samples and context.samples_seen - self._last_save_samples >= args.save_samples:
            self._last_save_samples = context.samples_seen // args.save_samples * args.save_samples
            context.request_save(f"save_samples={args.save_samples}")
        if step >= context.max_steps:
            context.request_stop_training("max_steps reached")
            if eval_due and args.eval_steps and step % args.eval_steps != 0:
                context.request_evaluate("final step")
            if args.save_strategy == "steps":
                context.request_save("final step")

    def on_epoch_end(self, context: TrainingContext, **kwargs: Any) -> None:
        args = context.args
        if args.logging_strategy == "epoch":
            context.request_log("logging_strategy=epoch")
        if args.eval_strategy == "epoch" and args.eval_delay <= context.epoch:
            context.request_evaluate("eval_strategy=epoch")
        if args.save_strategy == "epoch" or args.checkpoint_at_epoch:
            context.request_save("epoch end")

    def state_dict(self) -> dict[str, Any]:
        return {"last_save_samples": self._last_save_samples}

    def load_state_dict(self, state: Any) -> None:
        self._last_save_samples = int(state.get("last_save_samples", 0))
