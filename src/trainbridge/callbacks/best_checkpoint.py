"""``BestCheckpointTracker``: best-metric tracking as transformers' Trainer does it.

Runs after user callbacks (they see the previous best at ``on_evaluate``, as under Trainer), requests a
save on a new best under ``save_strategy='best'`` and protects the best checkpoint from rotation; the loop
loads it before ``on_train_end`` when ``load_best_model_at_end``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext
from trainbridge.core.run_dir import checkpoint_dir


class BestCheckpointTracker(Callback):
    """Tracks ``args.best_metric_name`` across evaluations."""

    always_restore_state = True

    def on_evaluate(self, context: TrainingContext, **kwargs: Any) -> None:
        args = context.args
        if not args.tracks_best_metric:
            return
        metrics = kwargs.get("metrics") or {}
        name = args.best_metric_name
        owner = context.args.best_metric_eval_set(context.eval_set_names)
        if owner is not None and f"eval_{owner}_loss" not in metrics:
            return  # named validation sets: this on_evaluate is another set's (each has eval_<set>_loss)
        if name not in metrics and not any(key.startswith("eval_") for key in metrics):
            return  # another set's, evaluated under another prefix (an evaluate override's metric_key_prefix="test")
        if name not in metrics:
            raise KeyError(f"metric_for_best_model {name!r} is not among the evaluation metrics {sorted(metrics)}")
        value = float(metrics[name])
        best = context.best_metric
        if best is None:
            best = -math.inf if args.best_metric_greater_is_better else math.inf
        improved = value > best if args.best_metric_greater_is_better else value < best
        if improved:
            context.best_metric = value
            if args.save_strategy in ("steps", "epoch", "best"):
                context.best_global_step = context.global_step
            if args.save_strategy == "best":
                context.request_save(f"new best {name}={value:.6g}")

    def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.best_global_step is not None:
            best_dir = checkpoint_dir(Path(kwargs["checkpoint_path"]).parent, context.best_global_step)
            if best_dir.is_dir():
                context.best_checkpoint = best_dir

    # The tracked values live on the context (HuggingFaceCallbacks and checkpoint rotation read them there);
    # state_dict/load_state_dict carry them through a checkpoint.
    def __init__(self) -> None:
        self._context: TrainingContext | None = None
        self._restored: dict[str, Any] = {}

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        self._context = context
        restored = self._restored
        if restored.get("best_metric") is not None:
            context.best_metric = float(restored["best_metric"])
        if restored.get("best_global_step") is not None:
            context.best_global_step = int(restored["best_global_step"])
        if restored.get("best_checkpoint") and Path(restored["best_checkpoint"]).is_dir():
            context.best_checkpoint = Path(restored["best_checkpoint"])

    def state_dict(self) -> dict[str, Any]:
        context = self._context
        if context is None:
            return dict(self._restored)
        return {
            "best_metric": context.best_metric,
            "best_global_step": context.best_global_step,
            "best_checkpoint": str(context.best_checkpoint) if context.best_checkpoint else None,
        }

    def load_state_dict(self, state: Any) -> None:
        self._restored = dict(state)
