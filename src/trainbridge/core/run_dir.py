"""The names of what a run writes into ``ckpt_output_dir``, each written down once.

``checkpoint-{global_step}/`` folders (``trainbridge.checkpoint``), the run result rank 0 writes for the
launcher (``result.json``, ``trainbridge.loop.result``), the default metrics file (``metrics.jsonl``) and
the launcher's log (``logs/launch.log``: torchrun's own report and every failure in full), and
``.trainbridge/``, where ``trainbridge.Trainer`` writes what its jobs read (``FacadeDir``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
"""A checkpoint folder is ``CHECKPOINT_PREFIX`` followed by its global step (Trainer's layout)."""
RESULT_FILE = "result.json"
"""The run's ``RunResult``, written by rank 0 when training ends cleanly."""
METRICS_FILE = "metrics.jsonl"
"""The default JSONL metrics file (``TrainingArgs.metrics_file`` overrides it)."""
LOGS_DIR = "logs"
"""Folder of the run's logs."""


def checkpoint_dir(output_dir: str | Path, global_step: int) -> Path:
    """The folder of the checkpoint taken at ``global_step``: ``output_dir/checkpoint-{global_step}``."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{global_step}"


def result_file(output_dir: str | Path) -> Path:
    """Where rank 0 writes the run's result: ``output_dir/result.json``."""
    return Path(output_dir) / RESULT_FILE


def launch_log_file(output_dir: str | Path, node: str | None = None) -> Path:
    """The launcher's log, appended by every launch into ``output_dir``: ``logs/launch.log``, or
    ``logs/launch-{node}.log`` for one node of a multi-node job (each node's launcher writes its own)."""
    return Path(output_dir) / LOGS_DIR / (f"launch-{node}.log" if node else "launch.log")


def results_file(output_dir: str | Path, split: str | None = None) -> Path:
    """Metrics ``Trainer.save_metrics`` writes (the facade too): ``{split}_results.json``, or with no split the
    combined ``all_results.json``."""
    return Path(output_dir) / f"{split or 'all'}_results.json"


FACADE_DIR = ".trainbridge"
"""The folder inside ``output_dir`` where ``trainbridge.Trainer`` writes its jobs' inputs and outputs."""
FACADE_STATE_FILE = "trainer_state.json"
"""The recorded ``TrainerState`` fields of a train job, written by rank 0 after training."""
FACADE_EVALUATION_FILE = "evaluation.pkl"
"""The metrics (and predictions) of an evaluation job, written by rank 0 into the job's folder."""
FACADE_FINAL_MODEL_DIR = "final-model"
"""The weights at the end of a train job (HF layout)."""


@dataclass(frozen=True)
class FacadeDir:
    """``output_dir/.trainbridge/``: every path ``trainbridge.Trainer`` and its jobs use there."""

    root: Path

    @classmethod
    def of(cls, output_dir: str | Path) -> FacadeDir:
        """The facade folder of ``output_dir``."""
        return cls(Path(output_dir) / FACADE_DIR)

    @property
    def model(self) -> Path:
        """The script's in-memory model, ``save_pretrained`` with its tokenizer."""
        return self.root / "model"

    @property
    def tokenizer(self) -> Path:
        """The script's tokenizer, when the model was given as a folder."""
        return self.root / "tokenizer"

    @property
    def train_data(self) -> Path:
        """The training rows (Arrow)."""
        return self.root / "train"

    def eval_data(self, index: int | None = None) -> Path:
        """The validation rows: ``eval``, or ``eval-{index}`` for the index-th of named sets."""
        return self.root / ("eval" if index is None else f"eval-{index}")

    @property
    def state_file(self) -> Path:
        """``FACADE_STATE_FILE`` of the train job."""
        return self.root / FACADE_STATE_FILE

    @property
    def final_model(self) -> Path:
        """``FACADE_FINAL_MODEL_DIR`` of the train job."""
        return self.root / FACADE_FINAL_MODEL_DIR

    @property
    def evaluation(self) -> FacadeDir:
        """The folder of ``evaluate()``/``predict()`` jobs (``evaluate/``), laid out as this one: its
        rows in ``eval_data``, the current weights after an in-place training in ``model``."""
        return FacadeDir(self.root / "evaluate")

    @property
    def evaluation_file(self) -> Path:
        """``FACADE_EVALUATION_FILE`` of an evaluation job (inside ``evaluation``)."""
        return self.root / FACADE_EVALUATION_FILE

    @property
    def job_output(self) -> Path:
        """The ``ckpt_output_dir`` of an evaluation job (its result file; it saves no checkpoint)."""
        return self.root / "output"
