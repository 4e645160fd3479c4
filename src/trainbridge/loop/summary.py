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
from typing import TYPE_CHECKING, Any

from trainbridge.core.context import count_parameters
from trainbridge.core.run_dir import CHECKPOINT_PREFIX
from trainbridge.loop.result import RunResult

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.data import LoadStats
    from trainbridge.loop.build import RunComponents


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


# ----------------------------------------------------------------------------- before training
def announce_run(args: TrainingArgs, env: DistributedEnv, components: RunComponents) -> None:
    """Print the run plan once, on global rank 0."""
    if env.is_world_process_zero:
        print(format_run_plan(args, env, components), flush=True)


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _stats_line(stats: LoadStats, args: TrainingArgs) -> str:
    dropped = [
        (stats.dropped_overlong, f"longer than max_seq_len={args.max_seq_len}"),
        (stats.empty_skipped, "without loss tokens"),
    ]
    reasons = ", ".join(f"{n} {why}" for n, why in dropped if n) or "none"
    truncated = f", {stats.truncated} truncated to max_seq_len" if stats.truncated else ""
    return f"{Path(stats.path).name}: {stats.samples} samples kept of {stats.lines}; dropped: {reasons}{truncated}"


def _lengths(batches: Any) -> list[int]:
    # the source's length column (a memory-mapped dataset is never read sample by sample here); none for
    # a step whose batches are the dataset's items (``step.model_loss``)
    samples = getattr(batches, "samples", None)
    return samples.lengths.tolist() if samples is not None else []


def format_run_plan(args: TrainingArgs, env: DistributedEnv, components: RunComponents) -> str:
    """What the run is about to do: model, data, steps, effective batch, parallelism, outputs."""
    model = components.engine.unwrapped
    params = list(model.parameters())
    trainable = count_parameters(model, trainable_only=True)
    dtype = str(params[0].dtype).removeprefix("torch.") if params else "n/a"
    precision = ", bf16 autocast" if args.mixed_precision == "bf16" else ""
    rows = [
        (
            "model",
            f"{type(model).__name__} from {args.model_path}: {_count(components.num_parameters)} "
            f"parameters ({_count(trainable)} trainable), {dtype}{precision}",
        )
    ]
    train_lengths = _lengths(components.train_batches)
    for i, stats in enumerate(components.data_stats):
        rows.append(("train data" if i == 0 else "validation data", _stats_line(stats, args)))
    if train_lengths:
        total = sum(train_lengths)
        rows.append(
            (
                "train tokens",
                f"{total:,} in {len(train_lengths):,} samples; length mean "
                f"{total / len(train_lengths):.1f}, max {max(train_lengths)}",
            )
        )
    val_lengths = _lengths(components.eval_batches)
    if val_lengths and len(components.data_stats) == 1:
        rows.append(
            ("validation data", f"{len(val_lengths):,} samples split off (validation_split={args.validation_split})")
        )
    steps = components.steps_per_epoch
    cap = f" (max_steps={args.max_steps})" if args.max_steps else ""
    rows.append(
        (
            "steps",
            f"{steps:,} per epoch, {components.max_steps:,} in total over "
            f"{components.num_epochs} epoch{'s' if components.num_epochs != 1 else ''}{cap}",
        )
    )
    rows.append(("effective batch", components.step.describe_batches(args.effective_batch_size)))
    rows.append(
        (
            "parallelism",
            f"{args.distributed_backend}, world size {env.world_size} "
            f"({env.backend or 'no process group'}, {env.device.type})",
        )
    )
    when = (
        f"every {args.save_steps} steps"
        if args.save_strategy == "steps" and args.save_steps
        else f"save_strategy={args.save_strategy}"
    )
    limit = f", keep {args.save_total_limit}" if args.save_total_limit else ""
    final = ", and at the end" if args.save_final_checkpoint else ""
    rows.append(("checkpoints", f"{args.ckpt_output_dir}/{CHECKPOINT_PREFIX}<step> ({when}{final}{limit})"))
    rows.append(("metrics", str(args.resolved_metrics_file)))
    if args.report_to:
        rows.append(("reporting", f"{', '.join(args.report_to)} (logs in {args.resolved_logging_dir})"))
    return "trainbridge: run plan\n" + _table(rows, indent="  ")
