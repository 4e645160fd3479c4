"""``trainbridge plot RUN_DIR``: a run's ``metrics.jsonl`` as one PNG.

Four panels against the optimizer step: training and eval loss, learning rate, gradient norm and
tokens per second.  Needs matplotlib (the ``plot`` extra: ``pip install 'trainbridge[plot]'``); it is
imported only here, with the non-interactive Agg backend, so plotting works on a headless node.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainbridge.core.private_files import open_private
from trainbridge.core.run_dir import run_files_in

METRICS_FILE_NAME = "metrics.jsonl"
"""The metrics file's name inside a run folder (``TrainingArgs.resolved_metrics_file``'s default)."""

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss", "eval_loss")),
    ("learning rate", ("learning_rate",)),
    ("grad norm", ("grad_norm",)),
    ("tokens / s", ("tokens_per_second",)),
)
"""Each panel's title and the logged keys drawn in it."""


class PlotError(RuntimeError):
    """The plot cannot be drawn: no metrics file, nothing plottable in it, or matplotlib missing."""


def find_metrics_file(run: str | Path) -> Path:
    """``run`` itself when it is a file, else ``run/metrics.jsonl`` (or the file ``result.json`` names)."""
    run = Path(run)
    if run.is_file():
        return run
    run = run_files_in(run)  # a ported TrainingArguments' run keeps its files in output_dir/trainbridge
    candidate = run / METRICS_FILE_NAME
    if candidate.is_file():
        return candidate
    result = run / "result.json"
    if result.is_file():
        named = json.loads(result.read_text()).get("metrics_file")
        if named and Path(named).is_file():
            return Path(named)
    raise PlotError(f"no {METRICS_FILE_NAME} in {str(run)!r}: give a run's ckpt_output_dir or its metrics file")


def read_series(metrics_file: Path) -> dict[str, tuple[list[int], list[float]]]:
    """``key -> (steps, values)`` for every numeric key of every logged record."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        try:
            record: dict[str, Any] = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    return series


def plot_metrics(run: str | Path, output: str | Path | None = None) -> Path:
    """Draw ``run``'s metrics (a run folder or a metrics file) to ``output`` (default: ``metrics.png``
    beside the metrics file) and return its path."""
    metrics_file = find_metrics_file(run)
    series = read_series(metrics_file)
    drawn = [(title, [k for k in keys if k in series]) for title, keys in PANELS]
    if not any(keys for _, keys in drawn):
        raise PlotError(f"{metrics_file} holds no logged loss, learning rate, grad norm or throughput yet")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install 'trainbridge[plot]'") from None
    path = Path(output) if output is not None else metrics_file.with_name("metrics.png")
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for axis, (title, keys) in zip(axes.flat, drawn):
        for key in keys:
            steps, values = series[key]
            axis.plot(
                steps,
                values,
                marker="o" if key.startswith("eval_") or len(steps) < 20 else None,
                markersize=3,
                label=key,
            )
        if not keys:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if len(keys) > 1:
            axis.legend()
    for axis in axes[-1]:
        axis.set_xlabel("step")
    figure.suptitle(str(metrics_file.parent.name or metrics_file))
    figure.tight_layout()
    with open_private(path, "wb") as handle:  # private whatever the umask, as the run folder
        figure.savefig(handle, dpi=100, format=path.suffix.lstrip(".") or "png")
    plt.close(figure)
    return path
