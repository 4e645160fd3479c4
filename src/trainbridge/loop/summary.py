"""What a run will do and what it did, as people read it.

``format_run_result`` is the end-of-run summary that ``trainbridge train`` and ``trainbridge demo``
print (steps, loss first and last log, eval loss, checkpoints, best checkpoint, metrics file, wall time,
callback errors).  ``format_run_plan`` is the summary rank 0 prints before training (and
``trainbridge train --dry-run`` prints alone): model, data, steps, effective batch, backend and world
size, and where checkpoints and metrics go.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainbridge.loop.result import RunResult


def logged_values(metrics_file: str | Path | None, key: str) -> list[float]:
    """Every numeric ``key`` logged in a JSONL metrics file, in order (empty if there is no file)."""
    if not metrics_file or not Path(metrics_file).is_file():
        return []
    values = []
    for line in Path(metrics_file).read_text(encoding="utf-8").splitlines():
        try:
            record: dict[str, Any] = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if isinstance(record.get(key), int | float):
            values.append(float(record[key]))
    return values


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def format_run_result(result: RunResult, wall_time_s: float | None = None, indent: str = "") -> str:
    """A finished run in a few aligned lines."""
    losses = logged_values(result.metrics_file, "loss")
    eval_losses = logged_values(result.metrics_file, "eval_loss")
    stop = f"stopped early: {result.stop_reason}" if result.stopped_early else "completed"
    rows = [("steps", f"{result.global_step}/{result.max_steps} ({stop})")]
    if result.resumed_from:
        rows.append(("resumed from", result.resumed_from))
    if losses:
        rows.append(("training loss", f"{losses[0]:.4f} (first log) -> {losses[-1]:.4f} (last log)"))
    rows += [("final loss", _number(result.final_loss)), ("mean train loss", _number(result.train_loss))]
    if eval_losses:
        rows.append(("eval loss", f"{eval_losses[0]:.4f} (first eval) -> {eval_losses[-1]:.4f} (last eval)"))
    names = [Path(c).name for c in result.checkpoints]
    folder = str(Path(result.checkpoints[0]).parent) if result.checkpoints else ""
    rows.append(("checkpoints", f"{', '.join(names)} in {folder}" if names else "none"))
    if result.best_checkpoint:
        rows.append(("best checkpoint", f"{result.best_checkpoint} ({_number(result.best_metric)})"))
    if result.callback_errors:
        rows.append(("callback errors", f"{len(result.callback_errors)} (see result.json)"))
    if result.metrics_file:
        rows.append(("metrics file", result.metrics_file))
    if result.train_runtime_s is not None:
        rows.append(("training time", f"{result.train_runtime_s:.1f} s"))
    if wall_time_s is not None:
        rows.append(("wall time", f"{wall_time_s:.1f} s"))
    return _table(rows, indent)


def _table(rows: list[tuple[str, str]], indent: str = "") -> str:
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{indent}{(name + ':').ljust(width)}{value}" for name, value in rows)
