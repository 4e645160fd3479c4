"""``ProgressBarCallback``: a tqdm bar on global rank 0 (a plain printer when tqdm is disabled).

Installed by the worker only when no ``HuggingFaceCallbacks`` runs (it brings transformers' own
ProgressCallback/PrinterCallback, as Trainer does).  Each log is one line in the same form as those
print it (``format_logs``), so a run reads the same with and without HF callbacks.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext


def format_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """A log record as transformers' ``ProgressCallback``/``PrinterCallback`` print it: floats to 4
    significant digits, ``total_flos`` left out."""
    return {
        key: (f"{value:.4g}" if isinstance(value, float) else value)
        for key, value in logs.items()
        if key != "total_flos"
    }


class ProgressBarCallback(Callback):
    """Shows steps, loss and throughput on rank 0."""

    rank_zero_only = True

    def __init__(self) -> None:
        self._bar: Any = None

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if not context.args.disable_tqdm:
            self._bar = tqdm(total=context.max_steps, initial=context.global_step, desc="train", dynamic_ncols=True)

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.update(context.global_step - self._bar.n)

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        logs = format_logs(kwargs.get("logs") or {})
        if self._bar is not None:
            if "loss" in logs:
                self._bar.set_postfix(loss=logs["loss"], tok_s=round(context.tokens_per_second or 0.0))
            self._bar.write(str(logs))
        else:
            print(logs, flush=True)

    def close(self, context: TrainingContext) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_bar": None}
