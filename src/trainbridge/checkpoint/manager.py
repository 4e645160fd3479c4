"""``CheckpointManager``: the checkpoints of one run: saving and publishing them, rotation, resume.

A checkpoint ``output_dir/checkpoint-{global_step}/`` (every file is named in ``checkpoint.layout``)
holds the model's files, as the run's ``ModelFiles`` writes them (``checkpoint.model_files``; by default
the model in Hugging Face layout, loadable with ``from_pretrained`` (for a PEFT model its adapter,
in PEFT's layout: only the adapter's weights are gathered, never the frozen base) and the tokenizer
files); ``training_state.json`` (the loop's counters, sampler position and callback states); each rank's
RNG states; the engine's optimizer and scheduler state (``checkpoint.engine_state``); any
``extra_files`` (e.g. the ``trainer_state.json`` of ``HuggingFaceCallbacks``); ``manifest.json`` (every file's size and
SHA-256, the run's fingerprint) and ``COMPLETE``, written last, after every file was fsynced.

The checkpoint's ``dcp/`` also holds the model's own weights, in their training dtype, whenever the
HF-layout files are not those weights: always under FSDP2 (each rank writes and, at resume, reads only
its shards), under a ``ModelFiles`` that ``keeps_model_state``, and under DDP / one process when the
export dtype (``checkpoint_weights_dtype``; by default the original checkpoint's, e.g. bf16 for fp32
training) is lower than the parameters'.  Resume then
loads the weights from ``dcp/`` and is exact.

Atomicity: everything is written into a temporary folder (``checkpoint.folders``), the ranks agree that
all writes succeeded, then rank 0 writes the manifest and ``COMPLETE`` and renames the folder to its
final name.  ``save`` is ``begin_save`` then ``finish_save``; between the two the ``dcp/`` part may
still be written in the background (``checkpoint_async``: ``PendingCheckpoint``), and the checkpoint is
only published once every rank's background write finished.  A crash mid-save leaves earlier
checkpoints whole.  ``output_dir`` must be on a filesystem every rank sees (as for
``torch.distributed.checkpoint`` and DeepSpeed checkpoints).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from trainbridge.checkpoint import folders
from trainbridge.checkpoint.durability import disk_full_message, fsync_dir, is_disk_full, write_durably
from trainbridge.checkpoint.engine_state import save_engine_state
from trainbridge.checkpoint.folders import (
    CheckpointError,
    checkpoint_step,
    is_complete_checkpoint,
    list_checkpoints,
    temporary_folder,
)
from trainbridge.checkpoint.layout import COMPLETE_MARKER, MERGED_DIR, OWNER_FILE, TRAINING_STATE_FILE
from trainbridge.checkpoint.manifest import write_manifest
from trainbridge.checkpoint.model_files import HFModelFiles
from trainbridge.checkpoint.resume import (
    choose_resume,
    latest_verified,
    load_checkpoint,
    own_best_checkpoint,
    recorded_best,
    require_own_checkpoint,
    settle_best,
)
from trainbridge.checkpoint.rng import restore_rng, save_rng
from trainbridge.checkpoint.runlock import RUN_ID_ENV
from trainbridge.checkpoint.weights import fill_tied_weights, load_model_weights, read_safetensors_weights
from trainbridge.checkpoint.weights_dtype import exports_lossy
from trainbridge.core.config.plan import ModelFiles, ModelPart
from trainbridge.core.private_files import modes
from trainbridge.core.random_state import SamplerDraw
from trainbridge.core.run_dir import checkpoint_dir
from trainbridge.modeling.adapter_state import adapter_weight_names
from trainbridge.modeling.load import is_peft_model, merge_adapter
from trainbridge.modeling.saving import without_deepspeed_import

if TYPE_CHECKING:
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.parallel.engine import TrainingEngine

T = TypeVar("T")
logger = logging.getLogger(__name__)

__all__ = [  # the manager, and what callers of this module read beside it
    "CheckpointError",
    "CheckpointManager",
    "PendingCheckpoint",
    "checkpoint_step",
    "fill_tied_weights",
    "is_complete_checkpoint",
    "read_safetensors_weights",
]


@dataclass
class PendingCheckpoint:
    """A checkpoint begun by ``begin_save`` and not yet published by ``finish_save``."""

    step: int
    tmp: Path
    """The temporary folder every file went into."""
    final: Path
    """Where ``finish_save`` renames it to."""
    background_write: Future[Any] | None = None
    """This rank's ``dcp/`` write still going on in the background (``dcp.async_save``), or None."""

    def written(self) -> bool:
        """True once this rank's background write has ended (successfully or not)."""
        return self.background_write is None or self.background_write.done()


class CheckpointManager:
    """Writes, finds, rotates and loads the checkpoints of one run in ``output_dir``.

    ``save``, ``load``, ``rotate`` and ``resume_path`` are collective (every rank calls them); only rank 0
    creates, renames and deletes folders, and every rank learns whether it failed.
    """

    def __init__(
        self,
        output_dir: Path,
        env: DistributedEnv,
        save_total_limit: int | None,
        fingerprint: dict[str, Any] | None = None,
        checksums: bool = True,
        weights_dtype: torch.dtype | None = None,
        allow_unverified: bool = False,
        share_with_group: bool = False,
        model_files: ModelFiles | None = None,
        model_only: bool = False,
        sampler: SamplerDraw | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.env = env
        self.save_total_limit = save_total_limit
        self.fingerprint = fingerprint or {}
        """What this run's checkpoints belong to (``checkpoint.manifest.run_fingerprint``)."""
        self.run_id = os.environ.get(RUN_ID_ENV, "")
        self.checksums = checksums
        """SHA-256 of every file in the manifest, checked at resume (``checkpoint_checksums``)."""
        self.weights_dtype = weights_dtype
        """dtype of the HF-layout weights written (``checkpoint.weights_dtype``); None: the parameters'."""
        self.allow_unverified = allow_unverified
        """Use checkpoints without a manifest or with unlisted files (``resume_allow_unverified``)."""
        self.share_with_group = share_with_group
        """Checkpoints readable by the run folder's group (0750/0640); by default private (0700/0600)."""
        self.model_files: ModelFiles = model_files if model_files is not None else HFModelFiles()
        """What writes the model part of each checkpoint (``checkpoint.model_files``)."""
        self.model_only = model_only
        """Checkpoints without optimizer, scheduler, scaler and RNG state (``save_only_model``)."""
        self.sampler = sampler
        """The state the running epoch's training order was drawn from, kept in each rank's RNG file."""
        self._published: set[Path] = set()
        """Checkpoints this manager published (trusted without verifying them again)."""
        self._resumes: dict[tuple[str, bool], Path | None] = {}
        """``resume_path``'s answers: decided once per run, whoever asks (the loop, the batch-size search)."""

    # ------------------------------------------------------------------ saving
    def save(
        self,
        engine: TrainingEngine,
        tokenizer: Any,
        global_step: int,
        training_state: dict[str, Any],
        extra_files: dict[str, str | bytes] | None = None,
    ) -> Path:
        """Write ``checkpoint-{global_step}`` atomically and return its path (collective).

        ``tokenizer`` may be None (nothing tokenizer-related is written).  ``training_state`` must be
        JSON-serialisable; ``extra_files`` maps file names to text (or bytes) written beside it.
        """
        return self.finish_save(self.begin_save(engine, tokenizer, global_step, training_state, extra_files))

    def begin_save(
        self,
        engine: TrainingEngine,
        tokenizer: Any,
        global_step: int,
        training_state: dict[str, Any],
        extra_files: dict[str, str | bytes] | None = None,
        background: bool = False,
    ) -> PendingCheckpoint:
        """Write everything of ``checkpoint-{global_step}`` into its temporary folder (collective); with
        ``background`` the ``dcp/`` part goes on being written by DCP's writer thread when this returns.
        Publish it with ``finish_save``.  A failure on any rank raises ``CheckpointError`` on every rank."""
        final = checkpoint_dir(self.output_dir, global_step)
        tmp = temporary_folder(final)

        def prepare() -> None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            folders.clean_leftovers(self.output_dir, self.run_id)
            folders.make_owned_folder(tmp, self.run_id, self.share_with_group)

        self._on_rank_zero(prepare, f"preparing {tmp}", final)

        # Collective for sharded engines: every rank takes part, rank 0 receives the full weights (of a PEFT
        # model: its adapter's weights only).
        full_state = engine.full_model_state_dict(adapter_weight_names(engine.unwrapped))
        error: BaseException | None = None
        try:
            with without_deepspeed_import():
                rank0 = self.env.is_world_process_zero
                part = ModelPart(engine.unwrapped, tmp, global_step, full_state, tokenizer, self.weights_dtype, rank0)
                self.model_files.write(part)
            del part, full_state  # the gathered weights, freed before the rest is written
            if self.env.is_world_process_zero:
                self._write_rank_zero_files(tmp, training_state, extra_files or {})
            if not self.model_only:
                save_rng(tmp, self.env, self.sampler)
        except Exception as exc:
            error = exc
        self._agree(error, f"writing model, tokenizer and state files into {tmp}", final)
        if self.model_only:  # save_only_model: the model and the counters, as Trainer's
            return PendingCheckpoint(global_step, tmp, final)

        peft = is_peft_model(engine.unwrapped)
        model_state = not peft and (
            engine.sharded_model
            or self.model_files.keeps_model_state
            or exports_lossy(engine.unwrapped, self.weights_dtype)
        )
        background_write = None
        try:
            background_write = save_engine_state(engine, tmp, model_state=model_state, background=background)
        except Exception as exc:
            error = exc
        self._agree(error, f"writing optimizer/scheduler state into {tmp}", final)
        return PendingCheckpoint(global_step, tmp, final, background_write)

    def finish_save(self, pending: PendingCheckpoint) -> Path:
        """Wait for this rank's background write, agree that every rank's succeeded, then publish the
        checkpoint (``manifest.json``, ``COMPLETE``, renamed into place; collective) and return its path.
        A failed write on any rank: every rank raises ``CheckpointError`` and the temporary folder is
        removed; earlier checkpoints are untouched."""
        tmp, final, global_step = pending.tmp, pending.final, pending.step
        if pending.background_write is not None:
            error: BaseException | None = None
            try:
                pending.background_write.result()
            except Exception as exc:
                error = exc
            self._agree(error, f"writing the sharded state into {tmp} in the background", final)

        def publish() -> None:
            (tmp / OWNER_FILE).unlink(missing_ok=True)
            folders.make_private(tmp, self.share_with_group)
            file_mode = modes(self.share_with_group)[1]
            write_manifest(tmp, self.fingerprint, self.checksums, file_mode)  # hashes and fsyncs every file first
            write_durably(tmp / COMPLETE_MARKER, f"{global_step}\n", file_mode)
            fsync_dir(tmp)
            folders.rename_into_place(tmp, final)
            fsync_dir(self.output_dir)

        self._on_rank_zero(publish, f"publishing {final}", final)
        self._published.add(final.resolve())
        return final

    def _write_rank_zero_files(
        self, tmp: Path, training_state: dict[str, Any], extra_files: dict[str, str | bytes]
    ) -> None:
        try:
            text = json.dumps(training_state, indent=2, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"training_state is not JSON-serialisable: {exc}") from exc
        (tmp / TRAINING_STATE_FILE).write_text(text)
        for name, content in extra_files.items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content)

    def _on_rank_zero(self, action: Callable[[], T], what: str, checkpoint: Path | None = None) -> T:
        """``DistributedEnv.on_rank_zero`` raising ``CheckpointError`` on every rank; a failure while saving
        ``checkpoint`` removes its partial temporary folder, and a full disk is reported as such."""

        def guarded() -> T:
            try:
                return action()
            except Exception as exc:
                if checkpoint is not None:
                    self._remove_partial(checkpoint)
                    if is_disk_full(exc):
                        raise CheckpointError(
                            disk_full_message(self.output_dir, checkpoint, self.latest())
                            + f" ({type(exc).__name__}: {exc})"
                        ) from exc
                raise

        return self.env.on_rank_zero(guarded, what, error=CheckpointError)

    def _agree(self, error: BaseException | None, what: str, checkpoint: Path) -> None:
        """For a step every rank took part in: a collective ``all_reduce(MAX)`` of a failure flag, and every
        rank raises if any rank failed.  On a failure rank 0 removes the partial temporary folder (the
        previous checkpoint is untouched); a full disk is reported as such, naming the filesystem and the
        checkpoint."""
        flag = torch.tensor([1.0 if error is not None else 0.0], device=self.env.device)
        failed = float(self.env.all_reduce_max(flag).item()) > 0
        if failed and self.env.is_world_process_zero:
            self._remove_partial(checkpoint)
        if error is not None:
            if is_disk_full(error):
                raise CheckpointError(
                    f"rank {self.env.rank}: "
                    + disk_full_message(self.output_dir, checkpoint, self.latest())
                    + f" ({type(error).__name__}: {error})"
                ) from error
            raise CheckpointError(f"rank {self.env.rank}: checkpoint save failed while {what}: {error}") from error
        if failed:
            raise CheckpointError(f"rank {self.env.rank}: checkpoint save failed on another rank while {what}")

    def _remove_partial(self, checkpoint: Path) -> None:
        """Rank 0: remove checkpoint's temporary folder if this run wrote it."""
        tmp = temporary_folder(checkpoint)
        if tmp.is_dir() and folders.owned_by_us_or_dead(tmp, self.run_id):
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ merged export
    def export_merged(self, engine: TrainingEngine, tokenizer: Any, load_base: Callable[[], Any]) -> Path:
        """Write the live PEFT model merged into its base (``merge_and_unload``) in Hugging Face layout to
        ``output_dir/merged`` (collective; rank 0 writes).  The adapter's weights are gathered from the
        engine, applied to a fresh base model from ``load_base()`` on CPU and merged, and written in
        ``weights_dtype``; the folder appears whole (written beside it, then renamed in)."""
        final = self.output_dir / MERGED_DIR
        state = engine.full_model_state_dict(adapter_weight_names(engine.unwrapped))  # collective

        def write() -> None:
            if not is_peft_model(engine.unwrapped):
                raise CheckpointError(f"merged export: {type(engine.unwrapped).__name__} is not a PEFT model")
            tmp = self.output_dir / f".tmp-{MERGED_DIR}"
            self.output_dir.mkdir(parents=True, exist_ok=True)  # a run that saved no checkpoint
            if tmp.exists():
                shutil.rmtree(tmp)
            with (
                tempfile.TemporaryDirectory(dir=self.output_dir, prefix=".tmp-adapter-") as adapter_dir,
                without_deepspeed_import(),
            ):
                engine.unwrapped.save_pretrained(adapter_dir, state_dict=state)
                merge_adapter(load_base(), Path(adapter_dir), tmp, self.weights_dtype)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            folders.make_private(tmp, self.share_with_group)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)

        self._on_rank_zero(write, f"writing the merged model {final}")
        return final

    # ------------------------------------------------------------------ finding and rotating
    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``output_dir``, oldest (lowest step) first."""
        return list_checkpoints(self.output_dir)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None (temporary and incomplete ones ignored)."""
        checkpoints = self.list_checkpoints()
        return checkpoints[-1] if checkpoints else None

    def latest_verified(self) -> Path | None:
        """The newest complete checkpoint whose files match its manifest (``checkpoint.resume``)."""
        return latest_verified(self.output_dir, self.checksums, self.allow_unverified)

    def resume_path(self, resume_from: str | Path | None, allow_mismatch: bool = False) -> Path | None:
        """The checkpoint to resume from for ``resume_from_checkpoint`` (collective).

        ``auto``: the newest checkpoint that verifies (corrupt ones skipped, named in a warning), or None.
        A path: it must be a complete checkpoint whose files verify.  Either way its fingerprint must
        match this run's unless ``allow_mismatch``.  Rank 0 checks; every rank gets its answer, once: a second
        call (the loop's, after ``auto_find_batch_size`` read the checkpoint's batch size) gets the same one."""
        if resume_from is None:
            return None
        asked = (str(resume_from), allow_mismatch)
        if asked in self._resumes:
            return self._resumes[asked]

        def choose() -> str | None:
            found = choose_resume(
                self.output_dir, resume_from, self.fingerprint, self.checksums, allow_mismatch, self.allow_unverified
            )
            return str(found) if found is not None else None

        chosen = self._on_rank_zero(choose, "choosing the checkpoint to resume from")
        self._resumes[asked] = Path(chosen) if chosen else None
        return self._resumes[asked]

    def rotate(self, protected: set[Path] | frozenset[Path] = frozenset()) -> list[Path]:
        """Keep at most ``save_total_limit`` checkpoints; returns those deleted, on every rank.

        Collective (every rank calls it): rank 0 deletes, and every rank learns what it deleted (or that
        it failed), so every rank lists the same checkpoints afterwards.  As in transformers, protected
        checkpoints (the best one) are never deleted and the newest one is always kept for resuming.
        """
        limit = self.save_total_limit
        if limit is None:
            return []

        def delete() -> list[str]:
            doomed = folders.surplus(self.list_checkpoints(), limit, protected)
            for path in doomed:
                folders.delete_checkpoint(path)
            return [str(p) for p in doomed]

        return [Path(p) for p in self._on_rank_zero(delete, f"rotating checkpoints in {self.output_dir}")]

    def keep_only(self, kept: Path) -> list[Path]:
        """Delete every checkpoint but ``kept``; returns those deleted, on every rank (collective, as ``rotate``).
        ``save_total_limit=1`` at the end of a run with a best checkpoint: Trainer leaves only that one."""

        def delete() -> list[str]:
            doomed = [path for path in self.list_checkpoints() if path.resolve() != kept.resolve()]
            for path in doomed:
                folders.delete_checkpoint(path)
            return [str(p) for p in doomed]

        return [Path(p) for p in self._on_rank_zero(delete, f"keeping only checkpoint {kept} (save_total_limit=1)")]

    # ------------------------------------------------------------------ loading
    def load(self, path: Path, engine: TrainingEngine) -> dict[str, Any]:
        """Load a checkpoint into ``engine`` (collective): model weights, optimizer and scheduler state, and
        this rank's RNG state.  Returns the ``training_state`` dict saved with it."""
        return load_checkpoint(path, engine, self.sampler)

    def settle_best(self, states: Mapping[str, Any], resumed: Path) -> dict[str, Any]:
        """The saved callback ``states`` of checkpoint ``resumed`` with the best checkpoint they name checked
        before any step (collective; rank 0 checks): a complete checkpoint of this run whose files verify is
        kept (one recorded under a folder that no longer exists becomes this run's of that name); any
        other is dropped with its best metric, with a warning, so the run's evaluations choose the best
        again (before, ``load_best_model_at_end`` refused it after the last step)."""
        recorded = sorted(recorded_best(states))
        if not recorded:
            return dict(states)
        decisions = self._on_rank_zero(
            lambda: {
                r: own_best_checkpoint(self.output_dir, r, self.checksums, self.allow_unverified, resumed)
                for r in recorded
            },
            f"checking the best checkpoint {resumed} names",
        )
        for name, (kept, problem) in decisions.items():
            if kept is not None:
                self._published.add(kept.resolve())  # verified now: not hashed again at the end
            if self.env.is_world_process_zero and problem is not None:
                logger.warning(
                    "resumed checkpoint %s names best checkpoint (best_checkpoint / best_model_checkpoint) %r, "
                    "but %s; dropped with its best metric: this run's evaluations choose the best checkpoint "
                    "again (to keep it, copy that checkpoint into %s and resume again)",
                    resumed,
                    name,
                    problem,
                    self.output_dir,
                )
            elif self.env.is_world_process_zero and kept is not None and str(kept) != name:
                logger.warning(
                    "resumed checkpoint %s names best checkpoint %r, whose folder no longer exists: using this "
                    "run's %s (the run folder was moved)",
                    resumed,
                    name,
                    kept,
                )
        return settle_best(states, decisions)

    def load_model_weights(self, path: Path, engine: TrainingEngine) -> None:
        """Load only the model weights of checkpoint ``path`` (e.g. the best one) into the live model
        (collective; ``checkpoint.weights.load_model_weights``).  A checkpoint this manager did not publish
        must be a complete checkpoint inside ``output_dir`` whose files verify (rank 0 checks)."""
        path = Path(path)
        if path.resolve() not in self._published:
            self._on_rank_zero(
                lambda: require_own_checkpoint(self.output_dir, path, self.checksums, self.allow_unverified),
                f"checking checkpoint {path} before loading its weights",
            )
        load_model_weights(path, engine)

    def restore_rng(self, path: Path) -> None:
        """Restore this rank's RNG states from checkpoint ``path``."""
        restore_rng(path, self.env, self.sampler)
