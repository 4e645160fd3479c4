"""``RunResult``: what a finished run reports back to ``run_training``'s caller.

Rank 0 writes it to ``trainbridge.core.run_dir.result_file(ckpt_output_dir)`` (``result.json``); the
launcher reads it back.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.core.callback_errors import CallbackErrorReport
from trainbridge.core.context import TrainingContext
from trainbridge.core.private_files import replace_text


class RunResult(BaseModel):
    """Outcome of a training run."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    global_step: int
    """Completed optimizer steps."""
    epoch: float
    """Fractional epochs completed."""
    max_steps: int
    """Steps the run was planned for."""
    train_loss: float | None = None
    """Mean training loss over the steps of this run (transformers' ``train_loss``)."""
    final_loss: float | None = None
    """Loss of the last step, averaged across ranks."""
    final_eval_loss: float | None = None
    """Last validation loss, if any validation ran."""
    stopped_early: bool = False
    """True when an agreed stop request ended training before ``max_steps``."""
    stop_reason: str | None = None
    """Who asked to stop and why."""
    checkpoints: list[str] = Field(default_factory=list)
    """Checkpoint directories on disk at the end, oldest first."""
    best_checkpoint: str | None = None
    """Best checkpoint when best-metric tracking is on."""
    best_metric: float | None = None
    """Best metric value."""
    metrics_file: str | None = None
    """Path of the JSONL metrics file."""
    callback_errors: list[CallbackErrorReport] = Field(default_factory=list)
    """Isolated callback errors on every rank."""
    train_runtime_s: float | None = None
    """Wall time of the training loop."""
    resumed_from: str | None = None
    """Checkpoint the run resumed from."""
    restarts: int = 0
    """How many times the launcher restarted the job after a worker failed (``max_restarts``)."""
    merged_model: str | None = None
    """Folder of the merged PEFT model (``merge_adapter_at_end``), loadable with ``AutoModelForCausalLM``."""

    @classmethod
    def of_run(
        cls,
        ctx: TrainingContext,
        checkpoints: list[Path],
        errors: list[CallbackErrorReport],
        runtime: float,
        merged: Path | None,
    ) -> RunResult:
        """The result of the run that ``ctx`` holds at its end."""
        ended_early = ctx.global_step < ctx.max_steps
        return cls(
            global_step=ctx.global_step,
            epoch=ctx.epoch,
            max_steps=ctx.max_steps,
            train_loss=ctx.logs.get("train_loss"),
            final_loss=ctx.loss,
            final_eval_loss=ctx.metrics.get("eval_loss"),
            stopped_early=ended_early and (ctx.agreed.stop_training or ctx.stop_reason is not None),
            stop_reason=ctx.stop_reason if ended_early else None,
            checkpoints=[str(p) for p in checkpoints],
            best_checkpoint=str(ctx.best_checkpoint) if ctx.best_checkpoint else None,
            best_metric=ctx.best_metric,
            metrics_file=str(ctx.args.resolved_metrics_file),
            callback_errors=errors,
            train_runtime_s=runtime,
            resumed_from=str(ctx.resumed_from) if ctx.resumed_from else None,
            merged_model=str(merged) if merged else None,
        )

    def write(self, path: Path) -> None:
        """Write as JSON (atomically, 0600, following no link)."""
        replace_text(path.parent, path.name, self.model_dump_json(indent=2))

    @classmethod
    def read(cls, path: Path) -> RunResult:
        """Read back what ``write`` wrote."""
        return cls.model_validate(json.loads(path.read_text()))
