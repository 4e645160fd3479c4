"""``MetricsFileCallback``: the JSONL metrics file, written by global rank 0."""

from __future__ import annotations

import json
import time
from typing import IO, Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext
from trainbridge.core.private_files import open_private


class MetricsFileCallback(Callback):
    """Appends one JSON line per ``on_log``: step, epoch, the logged values and throughput figures."""

    rank_zero_only = True

    def __init__(self) -> None:
        self._file: IO[str] | None = None

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        path = context.args.resolved_metrics_file
        self._file = open_private(path, "a", context.args.share_run_dir_with_group)

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._file is None:
            return
        logs = kwargs.get("logs") or {}
        record: dict[str, Any] = {
            "time": round(time.time(), 3),
            "step": context.global_step,
            "epoch": round(context.epoch, 6),
        }
        record.update(logs)
        if "loss" in logs:
            record.update(
                tokens_per_second=context.tokens_per_second,
                samples_per_second=context.samples_per_second,
                samples_seen=context.samples_seen,
                tokens_seen=context.tokens_seen,
                memory_bytes=context.memory_bytes,
            )
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self, context: TrainingContext) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_file": None}
