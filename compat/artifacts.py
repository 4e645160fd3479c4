"""What a run leaves on disk, normalised for comparison: checkpoints and their ``trainer_state.json``,
scenario observations, TensorBoard tags, MLflow metric and param keys, W&B history keys.

Values that legitimately differ between runners (losses, runtimes, absolute paths) are reduced to
keys, types or paths relative to ``output_dir``; everything else is kept as is.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from compat.recorder import EPOCH_DIGITS, relative_checkpoint
from compat.runners import scoped_environment
from compat.scenarios import OBSERVATIONS_DIR

TRAINER_STATE_FIELDS = (
    "global_step",
    "max_steps",
    "num_train_epochs",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "train_batch_size",
    "best_global_step",
    "is_hyper_param_search",
    "trial_name",
    "stateful_callbacks",
)
"""``trainer_state.json`` fields compared by value (epoch, best metric, best checkpoint and log history
are normalised separately)."""


def collect_artifacts(run_dir: Path) -> dict[str, Any]:
    """Every artifact of the run in ``run_dir`` (``out/``, ``mlruns/``, ``wandb/``), by name."""
    out = run_dir / "out"
    artifacts: dict[str, Any] = {}
    checkpoints = sorted((p for p in out.glob("checkpoint-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    artifacts["checkpoints"] = [p.name for p in checkpoints]
    for checkpoint in checkpoints:
        state_file = checkpoint / "trainer_state.json"
        if state_file.is_file():
            artifacts[f"{checkpoint.name}/trainer_state.json"] = normalised_trainer_state(state_file, out)
    for exported in ("bema", "final_model"):  # models third-party callbacks save (compat.third_party, trl)
        if (out / exported).is_dir():
            artifacts[f"{exported}/ files"] = sorted(p.name for p in (out / exported).iterdir())
    for observation in sorted((out / OBSERVATIONS_DIR).glob("*.json")):
        artifacts[f"observation {observation.stem}"] = json.loads(observation.read_text())
    tags = tensorboard_tags(out)
    if tags is not None:
        artifacts["tensorboard scalar tags"] = tags
    mlflow = mlflow_keys(run_dir / "mlruns")
    if mlflow is not None:
        artifacts["mlflow metric keys"], artifacts["mlflow param keys"] = mlflow
    history = wandb_history_keys(run_dir / "wandb")
    if history is not None:
        artifacts["wandb history keys"] = history
    return artifacts


def normalised_trainer_state(path: Path, output_dir: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` with values that differ by nature reduced."""
    state = json.loads(path.read_text())
    normalised = {name: state.get(name) for name in TRAINER_STATE_FIELDS}
    normalised["epoch"] = round(float(state.get("epoch") or 0), EPOCH_DIGITS)
    normalised["best_metric"] = None if state.get("best_metric") is None else "float"
    normalised["best_model_checkpoint"] = relative_checkpoint(state.get("best_model_checkpoint"), str(output_dir))
    normalised["log_history"] = [[entry.get("step"), sorted(entry)] for entry in state.get("log_history", [])]
    return normalised


def tensorboard_tags(output_dir: Path) -> list[str] | None:
    """Scalar tags of every TensorBoard event file under ``output_dir`` (None when there is none)."""
    files = sorted(output_dir.rglob("events.out.tfevents.*"))
    if not files:
        return None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in files:
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags.update(accumulator.Tags().get("scalars", []))
    return sorted(tags)


def mlflow_keys(tracking_dir: Path) -> tuple[list[str], list[str]] | None:
    """``(metric keys, param keys)`` of every run in an MLflow file store (None when there is none)."""
    if not tracking_dir.is_dir():
        return None
    from mlflow.tracking import MlflowClient

    with scoped_environment({"MLFLOW_ALLOW_FILE_STORE": "true"}):  # MLflow 3 refuses file stores otherwise
        client = MlflowClient(tracking_uri=tracking_dir.resolve().as_uri())
        runs = [
            run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])
        ]
    metrics: set[str] = set()
    params: set[str] = set()
    if not runs:
        return None
    for run in runs:
        metrics.update(run.data.metrics)
        params.update(run.data.params)
    return sorted(metrics), sorted(params)


# W&B's run file (``run-*.wandb``) is a LevelDB-style log of ``wandb_internal_pb2.Record`` protobufs:
# a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header
# (crc32, uint16 length, uint8 type: 1 full, 2 first, 3 middle, 4 last).
_WANDB_FILE_HEADER = 7
_WANDB_BLOCK = 32 * 1024
_WANDB_CHUNK_HEADER = 7


def wandb_records(path: Path) -> list[bytes]:
    """The serialized records of a ``.wandb`` run file, in order."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file (header {data[:4]!r})")
    records: list[bytes] = []
    pending = b""
    position = _WANDB_FILE_HEADER
    while position + _WANDB_CHUNK_HEADER <= len(data):
        left_in_block = _WANDB_BLOCK - position % _WANDB_BLOCK
        if left_in_block < _WANDB_CHUNK_HEADER:  # block trailer padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _WANDB_CHUNK_HEADER])
        position += _WANDB_CHUNK_HEADER
        chunk = data[position : position + length]
        position += length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    return records


def wandb_history_keys(wandb_dir: Path) -> list[str] | None:
    """Keys of every ``history`` record of the offline runs under ``wandb_dir`` (None when there is none)."""
    files = sorted(wandb_dir.rglob("run-*.wandb"))
    if not files:
        return None
    from wandb.proto import wandb_internal_pb2

    keys: set[str] = set()
    for path in files:
        for raw in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                keys.update(item.key or "/".join(item.nested_key) for item in record.history.item)
    return sorted(keys)
