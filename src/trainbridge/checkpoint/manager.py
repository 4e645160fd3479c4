"""``CheckpointManager``: atomic Hugging Face-layout checkpoints, rotation, ``latest()`` and resume state.

A checkpoint ``output_dir/checkpoint-{global_step}/`` holds:

* the model (``model.safetensors`` or shards + index), ``config.json``, ``generation_config.json`` — loadable
  with ``AutoModelForCausalLM.from_pretrained`` — and the tokenizer files; for a PEFT model the adapter
  instead, in PEFT's layout (``adapter_model.safetensors``, ``adapter_config.json``), loadable with
  ``PeftModel.from_pretrained`` (only the adapter's weights are gathered, never the frozen base);
* ``training_state.json``: the loop's counters, sampler position and callback states;
* ``rng_state_{rank}.pth`` (``rng_state.pth`` for one process, as Trainer): each rank's python / numpy /
  torch CPU / CUDA generator states;
* the optimizer and scheduler state as the engine writes it (``optimizer.pt``; the DCP folder ``dcp/`` for
  FSDP2, and for every engine in a checkpoint written in the background; a DeepSpeed folder for ZeRO) and
  ``scheduler.pt``;
* ``dcp/`` (``torch.distributed.checkpoint``) also holds the model's own weights, in their training dtype,
  whenever the HF-layout files are not those weights: always under FSDP2 (each rank writes and, at resume,
  reads only its shards), and under DDP / one process when the export dtype (``checkpoint_weights_dtype``,
  ``checkpoint.weights_dtype``: by default the original checkpoint's, e.g. bf16 for fp32 training) is lower
  than the parameters'.  Resume then loads the weights from ``dcp/`` and is exact; otherwise (and for a PEFT
  adapter, and DeepSpeed, whose folder holds its fp32 masters) from the HF-layout files;
* any ``extra_files`` (e.g. the ``trainer_state.json`` of HuggingFaceCallbacks);
* ``manifest.json``: every file's size and SHA-256, and the run's fingerprint (``checkpoint.manifest``);
* ``COMPLETE``: written last, after every file was fsynced.

Atomicity: everything is written into ``output_dir/.tmp-checkpoint-{step}`` (every rank writes its rank
files there), the ranks agree that all writes succeeded, then rank 0 writes ``COMPLETE`` and renames the
folder to its final name.  ``save`` is ``begin_save`` then ``finish_save``; between the two the ``dcp/``
part may still be written in the background (``checkpoint_async``: ``PendingCheckpoint``), and the
checkpoint is only published once every rank's background write finished.  A crash mid-save (or
mid-background-write) leaves earlier checkpoints whole; a left-over temporary folder is never listed
and is removed by the next save of the run that made it, or of a later run once its maker is gone
(``.owner`` names it), never while another live run may still be writing it.  Re-saving an existing
step renames the old folder aside, renames the new one in, then deletes the old one.  ``output_dir``
must be on a filesystem every rank sees (as for ``torch.distributed.checkpoint`` and DeepSpeed
checkpoints).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file

from trainbridge.checkpoint.durability import disk_full_message, fsync_dir, is_disk_full, write_durably
from trainbridge.checkpoint.engine_state import load_engine_state, load_model_state, save_engine_state
from trainbridge.checkpoint.layout import (
    ADAPTER_WEIGHTS_FILE,
    COMPLETE_MARKER,
    DELETING_PREFIX,
    MERGED_DIR,
    OLD_PREFIX,
    OWNER_FILE,
    SAFE_WEIGHTS_FILE,
    SAFE_WEIGHTS_INDEX_FILE,
    TMP_PREFIX,
    TRAINING_STATE_FILE,
    rng_state_file_name,
)
from trainbridge.checkpoint.manifest import (
    fingerprint_mismatches,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from trainbridge.checkpoint.runlock import RUN_ID_ENV, process_is_alive
from trainbridge.checkpoint.weights_dtype import cast_for_export, exports_lossy
from trainbridge.core.run_dir import CHECKPOINT_PREFIX, checkpoint_dir
from trainbridge.modeling.adapter_state import adapter_state_for_model, adapter_weight_names
from trainbridge.modeling.load import is_peft_model, merge_adapter

if TYPE_CHECKING:
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.parallel.engine import TrainingEngine

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not a complete checkpoint."""


def checkpoint_step(path: Path) -> int:
    """The global step in a ``checkpoint-{step}`` folder name."""
    match = _CHECKPOINT_NAME.match(path.name)
    if match is None:
        raise CheckpointError(f"{str(path)!r} is not named {CHECKPOINT_PREFIX}<step>")
    return int(match.group(1))


def is_complete_checkpoint(path: Path) -> bool:
    """True for a ``checkpoint-{step}`` folder carrying the ``COMPLETE`` marker."""
    return _CHECKPOINT_NAME.match(path.name) is not None and (path / COMPLETE_MARKER).is_file()


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

    ``save``, ``load`` and ``rotate`` are collective (every rank calls them); only rank 0 creates, renames
    and deletes folders.
    """

    def __init__(self, output_dir: Path, env: DistributedEnv, save_total_limit: int | None,
                 fingerprint: dict[str, Any] | None = None, checksums: bool = True,
                 weights_dtype: torch.dtype | None = None) -> None:
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

    # ------------------------------------------------------------------ saving
    def save(self, engine: TrainingEngine, tokenizer: Any, global_step: int, training_state: dict[str, Any],
             extra_files: dict[str, str | bytes] | None = None) -> Path:
        """Write ``checkpoint-{global_step}`` atomically and return its path (collective).

        ``tokenizer`` may be None (nothing tokenizer-related is written).  ``training_state`` must be
        JSON-serialisable; ``extra_files`` maps file names to text (or bytes) written beside it.
        """
        return self.finish_save(self.begin_save(engine, tokenizer, global_step, training_state, extra_files))

    def begin_save(self, engine: TrainingEngine, tokenizer: Any, global_step: int, training_state: dict[str, Any],
                   extra_files: dict[str, str | bytes] | None = None, background: bool = False) -> PendingCheckpoint:
        """Write everything of ``checkpoint-{global_step}`` into its temporary folder (collective); with
        ``background`` the ``dcp/`` part goes on being written by DCP's writer thread when this returns.
        Publish it with ``finish_save``.  A failure on any rank raises ``CheckpointError`` on every rank."""
        final = checkpoint_dir(self.output_dir, global_step)
        tmp = self.output_dir / f"{TMP_PREFIX}{global_step}"
        error: BaseException | None = None
        if self.env.is_world_process_zero:
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                self._clean_leftovers()
                self._make_owned_tmp(tmp)
            except Exception as exc:
                error = exc
        self._agree(error, f"preparing {tmp}", final)

        # Collective for sharded engines: every rank takes part, rank 0 receives the full weights (of a PEFT
        # model: its adapter's weights only).
        full_state = engine.full_model_state_dict(adapter_weight_names(engine.unwrapped))
        try:
            if self.env.is_world_process_zero:
                self._write_rank_zero_files(engine, tokenizer, tmp, full_state, training_state, extra_files or {})
            del full_state
            torch.save(capture_rng_state(), tmp / rng_state_file_name(self.env.rank, self.env.world_size))
        except Exception as exc:
            error = exc
        self._agree(error, f"writing model, tokenizer and state files into {tmp}", final)

        peft = is_peft_model(engine.unwrapped)
        model_state = not peft and (engine.sharded_model or exports_lossy(engine.unwrapped, self.weights_dtype))
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
        error: BaseException | None = None
        if pending.background_write is not None:
            try:
                pending.background_write.result()
            except Exception as exc:
                error = exc
            self._agree(error, f"writing the sharded state into {tmp} in the background", final)
        if self.env.is_world_process_zero:
            try:
                (tmp / OWNER_FILE).unlink(missing_ok=True)
                write_manifest(tmp, self.fingerprint, self.checksums)  # hashes and fsyncs every file first
                write_durably(tmp / COMPLETE_MARKER, f"{global_step}\n")
                fsync_dir(tmp)
                self._rename_into_place(tmp, final)
                fsync_dir(self.output_dir)
            except Exception as exc:
                error = exc
        self._agree(error, f"publishing {final}", final)
        return final

    def _make_owned_tmp(self, tmp: Path) -> None:
        """Create the temporary folder with an ``.owner`` file naming this run (rank 0)."""
        try:
            tmp.mkdir()
        except FileExistsError:
            owner = _read_owner(tmp)
            raise CheckpointError(
                f"{tmp} is being written by another live run ({owner}) into the same ckpt_output_dir; "
                "two runs must not share a run folder"
            ) from None
        owner_record = {"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid()}
        (tmp / OWNER_FILE).write_text(json.dumps(owner_record))

    def _write_rank_zero_files(self, engine: TrainingEngine, tokenizer: Any, tmp: Path,
                               full_state: dict[str, torch.Tensor] | None, training_state: dict[str, Any],
                               extra_files: dict[str, str | bytes]) -> None:
        if full_state is None:
            raise CheckpointError(f"{type(engine).__name__}.full_model_state_dict() returned None on rank 0")
        if self.weights_dtype is not None and not is_peft_model(engine.unwrapped):
            save_pretrained_as(engine.unwrapped, tmp, cast_for_export(full_state, self.weights_dtype),
                               self.weights_dtype)
        else:  # a PEFT adapter is written in its training dtype
            engine.unwrapped.save_pretrained(tmp, state_dict=full_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
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

    def _rename_into_place(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``; an existing ``final`` is renamed aside first and deleted after."""
        if not final.exists():
            tmp.rename(final)
            return
        aside = final.with_name(f"{OLD_PREFIX}{checkpoint_step(final)}")
        if aside.exists():
            shutil.rmtree(aside)
        final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside)

    def _clean_leftovers(self) -> None:
        """Rank 0, before a save: restore a checkpoint renamed aside by an interrupted re-save, and delete
        temporary folders of interrupted saves and deletions."""
        for path in self.output_dir.iterdir():
            if path.name.startswith(OLD_PREFIX):
                final = path.with_name(CHECKPOINT_PREFIX + path.name[len(OLD_PREFIX):])
                if final.exists():
                    shutil.rmtree(path)
                else:
                    logger.warning("restoring %s, left aside by an interrupted re-save", final)
                    path.rename(final)
            elif path.name.startswith(TMP_PREFIX) and not self._owned_by_us_or_dead(path):
                logger.warning("leaving %s alone: another live run is writing it (%s)", path, _read_owner(path))
            elif path.name.startswith((TMP_PREFIX, DELETING_PREFIX)):
                logger.warning("removing %s, left by an interrupted checkpoint save or deletion", path)
                shutil.rmtree(path)

    def _owned_by_us_or_dead(self, tmp: Path) -> bool:
        """A temporary folder belongs to the run that made it: ours, or one whose writer is gone."""
        try:
            owner = json.loads((tmp / OWNER_FILE).read_text())
        except (OSError, ValueError):
            return True  # no owner file: an old-style or already-finished folder
        if self.run_id and owner.get("run_id") == self.run_id:
            return True
        if owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid():
            return True
        return not process_is_alive(str(owner.get("host")), int(owner.get("pid", 0)))

    def _agree(self, error: BaseException | None, what: str, checkpoint: Path | None = None) -> None:
        """Collective ``all_reduce(MAX)`` of a failure flag: every rank raises if any rank failed.

        On a failure rank 0 removes the partial temporary folder (the previous checkpoint is untouched);
        a full disk is reported as such, naming the filesystem and the checkpoint."""
        flag = torch.tensor([1.0 if error is not None else 0.0], device=self.env.device)
        failed = float(self.env.all_reduce_max(flag).item()) > 0
        if failed and checkpoint is not None and self.env.is_world_process_zero:
            tmp = checkpoint.with_name(f"{TMP_PREFIX}{checkpoint_step(checkpoint)}")
            if tmp.is_dir() and self._owned_by_us_or_dead(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            if checkpoint is not None and is_disk_full(error):
                raise CheckpointError(f"rank {self.env.rank}: " + disk_full_message(
                    self.output_dir, checkpoint, self.latest()) + f" ({type(error).__name__}: {error})") from error
            raise CheckpointError(f"rank {self.env.rank}: checkpoint save failed while {what}: {error}") from error
        if failed:
            raise CheckpointError(f"rank {self.env.rank}: checkpoint save failed on another rank while {what}")

    # ------------------------------------------------------------------ merged export
    def export_merged(self, engine: TrainingEngine, tokenizer: Any, load_base: Callable[[], Any]) -> Path:
        """Write the live PEFT model merged into its base (``merge_and_unload``) in Hugging Face layout to
        ``output_dir/merged`` (collective; rank 0 writes).  The adapter's weights are gathered from the
        engine, applied to a fresh base model from ``load_base()`` on CPU and merged, and written in
        ``weights_dtype``; the folder appears whole (written beside it, then renamed in)."""
        final = self.output_dir / MERGED_DIR
        error: BaseException | None = None
        state = engine.full_model_state_dict(adapter_weight_names(engine.unwrapped))  # collective
        if self.env.is_world_process_zero:
            try:
                if not is_peft_model(engine.unwrapped):
                    raise CheckpointError(f"merged export: {type(engine.unwrapped).__name__} is not a PEFT model")
                tmp = self.output_dir / f".tmp-{MERGED_DIR}"
                self.output_dir.mkdir(parents=True, exist_ok=True)  # a run that saved no checkpoint
                if tmp.exists():
                    shutil.rmtree(tmp)
                with tempfile.TemporaryDirectory(dir=self.output_dir, prefix=".tmp-adapter-") as adapter_dir:
                    engine.unwrapped.save_pretrained(adapter_dir, state_dict=state)
                    merge_adapter(load_base(), Path(adapter_dir), tmp, self.weights_dtype)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
            except Exception as exc:
                error = exc
        del state
        self._agree(error, f"writing the merged model {final}")
        return final

    # ------------------------------------------------------------------ finding and rotating
    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``output_dir``, oldest (lowest step) first."""
        if not self.output_dir.is_dir():
            return []
        found = [p for p in self.output_dir.iterdir() if p.is_dir() and is_complete_checkpoint(p)]
        return sorted(found, key=checkpoint_step)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None (temporary and incomplete ones ignored)."""
        checkpoints = self.list_checkpoints()
        return checkpoints[-1] if checkpoints else None

    def latest_verified(self) -> Path | None:
        """The newest complete checkpoint whose files match its manifest; corrupt ones are skipped
        with a warning naming them and what is wrong."""
        for path in reversed(self.list_checkpoints()):
            problems = verify_checkpoint(path, self.checksums)
            if not problems:
                return path
            logger.warning("skipping corrupt checkpoint %s: %s", path, "; ".join(problems))
        return None

    def resume_path(self, resume_from: str | Path | None, allow_mismatch: bool = False) -> Path | None:
        """The checkpoint to resume from for ``resume_from_checkpoint`` (collective).

        ``auto``: the newest checkpoint that verifies (corrupt ones skipped, named in a warning), or None.
        A path: it must be a complete checkpoint whose files verify.  Either way its fingerprint must
        match this run's unless ``allow_mismatch``.  Rank 0 checks; every rank gets its answer."""
        if resume_from is None:
            return None
        outcome: dict[str, Any] = {}
        if self.env.is_world_process_zero:
            try:
                found = self._choose_resume(resume_from, allow_mismatch)
                outcome["path"] = str(found) if found is not None else None
            except Exception as exc:
                outcome["error"] = str(exc)
        outcome = self.env.broadcast_object(outcome)
        if "error" in outcome:
            raise CheckpointError(outcome["error"])
        return Path(outcome["path"]) if outcome.get("path") else None

    def _choose_resume(self, resume_from: str | Path, allow_mismatch: bool) -> Path | None:
        if str(resume_from) == "auto":
            path = self.latest_verified()
            if path is None:
                return None
        else:
            path = Path(resume_from)
            if not path.is_dir() or not is_complete_checkpoint(path):
                raise CheckpointError(
                    f"resume_from_checkpoint: {str(path)!r} is not a complete checkpoint (a "
                    f"{CHECKPOINT_PREFIX}<step> folder with a {COMPLETE_MARKER} marker)"
                )
            problems = verify_checkpoint(path, self.checksums)
            if problems:
                raise CheckpointError(f"resume_from_checkpoint: checkpoint {path} is corrupt: {'; '.join(problems)}")
        manifest = read_manifest(path) or {}
        mismatches = fingerprint_mismatches(manifest.get("fingerprint") or {}, self.fingerprint)
        if mismatches and not allow_mismatch:
            raise CheckpointError(
                f"resume_from_checkpoint: checkpoint {path} belongs to another run: {'; '.join(mismatches)}. "
                "Set resume_allow_mismatch=True to resume from it anyway"
            )
        if mismatches:
            logger.warning("resuming from %s despite: %s (resume_allow_mismatch=True)", path, "; ".join(mismatches))
        return path

    def rotate(self, protected: set[Path] | frozenset[Path] = frozenset()) -> list[Path]:
        """Keep at most ``save_total_limit`` checkpoints; returns those deleted, on every rank.

        Collective (every rank calls it): rank 0 deletes, then broadcasts what it deleted, so every rank
        lists the same checkpoints afterwards.  As in transformers, protected checkpoints (the best one)
        are never deleted and the newest one is always kept for resuming, so with a limit of 1 and an
        older best checkpoint two remain.
        """
        if self.save_total_limit is None:
            return []
        outcome: dict[str, Any] = {"deleted": []}
        if self.env.is_world_process_zero:
            try:
                outcome["deleted"] = [str(p) for p in self._delete_surplus(protected)]
            except Exception as exc:
                outcome["error"] = f"{type(exc).__name__}: {exc}"
        outcome = self.env.broadcast_object(outcome)
        if "error" in outcome:
            raise CheckpointError(f"rank 0 failed to rotate checkpoints in {self.output_dir}: {outcome['error']}")
        return [Path(p) for p in outcome["deleted"]]

    def _delete_surplus(self, protected: set[Path] | frozenset[Path]) -> list[Path]:
        assert self.save_total_limit is not None
        checkpoints = self.list_checkpoints()
        protected_resolved = {Path(p).resolve() for p in protected}
        keep = [p for p in checkpoints if p.resolve() in protected_resolved]
        for path in reversed(checkpoints):
            if path in keep:
                continue
            if path == checkpoints[-1] or len(keep) < self.save_total_limit:
                keep.append(path)
        deleted = [p for p in checkpoints if p not in keep]
        for path in deleted:
            doomed = path.with_name(f"{DELETING_PREFIX}{checkpoint_step(path)}")
            path.rename(doomed)  # atomic: the checkpoint disappears from listings at once
            shutil.rmtree(doomed)
        return deleted

    # ------------------------------------------------------------------ loading
    def load(self, path: Path, engine: TrainingEngine) -> dict[str, Any]:
        """Load a checkpoint into ``engine`` (collective): model weights (from ``dcp/`` when the checkpoint
        holds them there, each rank reading its own shards; else the HF-layout files), optimizer and
        scheduler state, and this rank's RNG state.  Returns the ``training_state`` dict saved with it."""
        path = Path(path)
        if not path.is_dir() or not is_complete_checkpoint(path):
            raise CheckpointError(
                f"{str(path)!r} is not a complete checkpoint (a {CHECKPOINT_PREFIX}<step> folder with a "
                f"{COMPLETE_MARKER} marker)"
            )
        self.load_model_weights(path, engine)
        load_engine_state(engine, path)
        self.restore_rng(path)
        return json.loads((path / TRAINING_STATE_FILE).read_text())

    def load_model_weights(self, path: Path, engine: TrainingEngine) -> None:
        """Load only the model weights of checkpoint ``path`` into the live model on every rank (collective):
        the full model, or for a PEFT model its adapter (the frozen base is left as it is).  The model's own
        weights from ``dcp/`` when the checkpoint holds them (each rank reading its shards, in the training
        dtype: exact even beside a bf16 export), else the HF-layout weights, read in full on every rank."""
        path = Path(path)
        adapter_file = path / ADAPTER_WEIGHTS_FILE
        if is_peft_model(engine.unwrapped) != adapter_file.is_file():
            raise CheckpointError(
                f"{str(path)!r} holds {'a PEFT adapter' if adapter_file.is_file() else 'a full model'} but the run "
                f"trains {'a PEFT model' if is_peft_model(engine.unwrapped) else 'a full model'}; resume or restore "
                "from a checkpoint of the same kind of run"
            )
        if load_model_state(engine, path):
            return
        if adapter_file.is_file():
            saved = load_file(str(adapter_file), device="cpu")
            engine.load_model_state_dict(adapter_state_for_model(engine.unwrapped, saved), strict=False)
            return
        state = read_safetensors_weights(path)
        fill_tied_weights(state, engine.unwrapped)
        engine.load_model_state_dict(state)

    def restore_rng(self, path: Path) -> None:
        """Restore this rank's RNG states from its ``rng_state_file_name`` file (a checkpoint of one process
        from before Trainer's naming: ``rng_state_0.pth``; a warning if the file is missing, e.g. after a
        change of world size)."""
        file = Path(path) / rng_state_file_name(self.env.rank, self.env.world_size)
        if not file.is_file() and self.env.world_size == 1:
            file = Path(path) / rng_state_file_name(0, 2)
        if not file.is_file():
            logger.warning("rank %d: %s not found; RNG states not restored", self.env.rank, file)
            return
        restore_rng_state(torch.load(file, map_location="cpu", weights_only=True))


def _read_owner(tmp: Path) -> str:
    try:
        owner = json.loads((tmp / OWNER_FILE).read_text())
        return f"run {owner.get('run_id') or '?'}, pid {owner.get('pid')} on {owner.get('host')}"
    except (OSError, ValueError):
        return "owner unknown"


# ---------------------------------------------------------------------- weights
def save_pretrained_as(model: Any, folder: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """``model.save_pretrained(folder, state_dict=state)`` with ``config.json`` recording ``dtype`` (the dtype
    of ``state``; ``save_pretrained`` would record the live parameters' dtype), so that
    ``from_pretrained(folder, dtype="auto")`` loads it as written."""
    model.save_pretrained(folder, state_dict=state)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_safetensors_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The full state dict saved by ``save_pretrained`` in ``directory`` (single file or sharded), on CPU."""
    index = directory / SAFE_WEIGHTS_INDEX_FILE
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in shard_names:
            state.update(load_file(str(directory / name), device="cpu"))
        return state
    single = directory / SAFE_WEIGHTS_FILE
    if not single.is_file():
        raise CheckpointError(f"{str(directory)!r} has neither {SAFE_WEIGHTS_FILE} nor {SAFE_WEIGHTS_INDEX_FILE}")
    return load_file(str(single), device="cpu")


def fill_tied_weights(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Add the names ``save_pretrained`` left out for tied parameters (e.g. ``lm_head.weight`` tied to the
    embeddings), taking the value saved under another name of the same parameter."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        present = [n for n in names if n in state]
        if present:
            for name in names:
                state.setdefault(name, state[present[0]])


# ---------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy (if installed), torch CPU and CUDA generator states."""
    python_state = random.getstate()
    state: dict[str, Any] = {
        "python": [python_state[0], list(python_state[1]), python_state[2]],
        "cpu": torch.get_rng_state(),
    }
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float], np.random.get_state())
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["cpu"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
