"""Which checkpoint a run resumes from, and loading it into the live engine.

``choose_resume`` answers ``resume_from_checkpoint``: ``auto`` is the newest complete checkpoint whose
files verify against its manifest (corrupt ones skipped with a warning); a path must be a complete
checkpoint that verifies.  Either way its fingerprint must match the run's unless the user allows a
mismatch.  A checkpoint without a manifest, or with files it does not list, does not verify unless the
user allows it (``resume_allow_unverified``).  ``require_own_checkpoint`` holds a checkpoint the run's
saved state names (the best one) to the same rules, and to the run folder; ``own_best_checkpoint`` applies
it at resume, and ``settle_best`` drops a best checkpoint that fails it from the saved callback states.
``load_checkpoint`` restores the model weights, the engine's optimizer and scheduler state and this rank's
RNG states (a checkpoint of the model alone, ``save_only_model``: the weights only, warned, as Trainer resumes),
and returns the saved ``training_state``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.checkpoint.engine_state import load_engine_state
from trainbridge.checkpoint.folders import CheckpointError, is_complete_checkpoint, list_checkpoints
from trainbridge.checkpoint.layout import COMPLETE_MARKER, SCHEDULER_FILE, TRAINING_STATE_FILE
from trainbridge.checkpoint.manifest import (
    fingerprint_mismatches,
    in_place_data_note,
    read_manifest,
    verify_checkpoint,
)
from trainbridge.checkpoint.rng import restore_rng
from trainbridge.checkpoint.weights import load_model_weights
from trainbridge.core.random_state import SamplerDraw
from trainbridge.core.run_dir import CHECKPOINT_PREFIX

if TYPE_CHECKING:
    from trainbridge.parallel.engine import TrainingEngine

logger = logging.getLogger(__name__)


def latest_verified(output_dir: Path, checksums: bool = True, allow_unverified: bool = False) -> Path | None:
    """The newest complete checkpoint in ``output_dir`` whose files match its manifest; corrupt (and, unless
    ``allow_unverified``, unverifiable) ones are skipped with a warning naming them and what is wrong."""
    for path in reversed(list_checkpoints(output_dir)):
        problems = verify_checkpoint(path, checksums, allow_unverified)
        if not problems:
            return path
        logger.warning("skipping corrupt checkpoint %s: %s", path, "; ".join(problems))
    return None


def require_complete(path: Path, what: str = "") -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint folder."""
    if not path.is_dir() or not is_complete_checkpoint(path):
        raise CheckpointError(
            f"{what}{str(path)!r} is not a complete checkpoint (a {CHECKPOINT_PREFIX}<step> folder with a "
            f"{COMPLETE_MARKER} marker)"
        )


def require_own_checkpoint(output_dir: Path, path: Path, checksums: bool, allow_unverified: bool) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint directly inside ``output_dir`` whose
    files verify (the best checkpoint a run's saved state names: it must not lead outside the run)."""
    if Path(path).resolve().parent != Path(output_dir).resolve():
        raise CheckpointError(f"{str(path)!r} is not a checkpoint of this run: it is not inside {output_dir}")
    require_complete(Path(path))
    problems = verify_checkpoint(Path(path), checksums, allow_unverified)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems)}")


BEST_CHECKPOINT_FIELDS = ("best_checkpoint", "best_model_checkpoint")
"""Where a saved callback state records the best checkpoint: ``BestCheckpointTracker``'s field and
``TrainerState``'s (under ``HuggingFaceCallbacks``)."""
BEST_VALUE_FIELDS = ("best_metric", "best_global_step")
"""What a state records with its best checkpoint, dropped with it."""


def recorded_best(states: Mapping[str, Any]) -> set[str]:
    """Every best checkpoint the saved callback ``states`` name (``BEST_CHECKPOINT_FIELDS``)."""
    return {
        str(state[field])
        for state in states.values()
        if isinstance(state, Mapping)
        for field in BEST_CHECKPOINT_FIELDS
        if state.get(field)
    }


def own_best_checkpoint(
    output_dir: Path, recorded: str, checksums: bool, allow_unverified: bool, verified: Path | None = None
) -> tuple[Path | None, str | None]:
    """``(checkpoint, None)``: the run's own checkpoint ``recorded`` names, complete and verified, or
    ``(None, why it is not one)``.  One recorded under a folder that no longer exists stands for the run's
    checkpoint of that name (the run folder was moved); any other outside the run folder is not the run's.
    ``verified``: a checkpoint verified already (the resumed one)."""
    path = Path(recorded)
    outside = path.resolve().parent != Path(output_dir).resolve()
    if outside and not path.parent.exists() and path.name.startswith(CHECKPOINT_PREFIX):
        path = Path(output_dir) / path.name  # its folder is gone: the run folder was moved (checked below)
    if verified is not None and path.resolve() == Path(verified).resolve():
        return path, None
    try:
        require_own_checkpoint(output_dir, path, checksums, allow_unverified)
    except CheckpointError as exc:
        return None, str(exc)
    return path, None


def settle_best(states: Mapping[str, Any], decisions: Mapping[str, tuple[Path | None, str | None]]) -> dict[str, Any]:
    """``states`` with each recorded best checkpoint replaced by the decision's checkpoint, or dropped (with
    ``BEST_VALUE_FIELDS``) when it has none."""
    settled: dict[str, Any] = {}
    for key, state in states.items():
        if isinstance(state, Mapping) and any(state.get(f) for f in BEST_CHECKPOINT_FIELDS):
            state = dict(state)
            for field in BEST_CHECKPOINT_FIELDS:
                if state.get(field):
                    kept, _ = decisions[str(state[field])]
                    state[field] = str(kept) if kept is not None else None
                    if kept is None:
                        state.update(dict.fromkeys(BEST_VALUE_FIELDS))
        settled[key] = state
    return settled


def choose_resume(
    output_dir: Path,
    resume_from: str | Path,
    fingerprint: dict[str, Any],
    checksums: bool,
    allow_mismatch: bool,
    allow_unverified: bool = False,
) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names (``auto``: the newest that verifies, or None)."""
    if str(resume_from) == "auto":
        path = latest_verified(output_dir, checksums, allow_unverified)
        if path is None:
            return None
    else:
        path = Path(resume_from)
        require_complete(path, "resume_from_checkpoint: ")
        problems = verify_checkpoint(path, checksums, allow_unverified)
        if problems:
            raise CheckpointError(f"resume_from_checkpoint: checkpoint {path} is corrupt: {'; '.join(problems)}")
    manifest = read_manifest(path) or {}
    mismatches = fingerprint_mismatches(manifest.get("fingerprint") or {}, fingerprint)
    if mismatches and not allow_mismatch:
        raise CheckpointError(
            f"resume_from_checkpoint: checkpoint {path} belongs to another run: {'; '.join(mismatches)}. "
            "Set resume_allow_mismatch=True to resume from it anyway"
        )
    if mismatches:
        logger.warning(
            "resuming from %s although %s (resume_allow_mismatch=True, a ported TrainingArguments' default: Trainer "
            "resumes from any checkpoint it can load)",
            path,
            "; ".join(mismatches),
        )
    note = in_place_data_note(manifest.get("fingerprint") or {}, fingerprint)
    if note:
        logger.warning("resuming from %s: %s; resumed anyway, as Trainer does", path, note)
    return path


def load_checkpoint(path: Path, engine: TrainingEngine, sampler: SamplerDraw | None = None) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``engine`` (collective): model weights, optimizer and scheduler state,
    and this rank's RNG states (``sampler``: its epoch order's).  Returns the ``training_state`` saved with it."""
    path = Path(path)
    require_complete(path)
    load_model_weights(path, engine)
    if not (path / SCHEDULER_FILE).is_file():  # every engine's state has one, written by rank 0
        if engine.env.is_world_process_zero:
            logger.warning(MODEL_ONLY_RESUME, path)
        return dict(json.loads((path / TRAINING_STATE_FILE).read_text()))
    load_engine_state(engine, path)
    restore_rng(path, engine.env, sampler)
    return dict(json.loads((path / TRAINING_STATE_FILE).read_text()))


MODEL_ONLY_RESUME = (
    "resuming from %s, a checkpoint of the model alone (save_only_model): its weights and step are restored; the "
    "optimizer and learning-rate schedule start afresh and the RNG states are not restored, as under Trainer"
)
"""Warned by rank 0 when a resumed checkpoint holds no optimizer or scheduler state."""
