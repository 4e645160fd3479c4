"""Checks of the run's inputs in the parent, before launch: each fails in a second with one clear line
instead of ~20 s later inside every worker with a page of tracebacks.

* ``ckpt_output_dir`` can be created (private) and written, and nobody else can change what is in it
  (``check_output_dir``: once per launch, by its caller);
* ``model_path`` holds a model the loop can train (``check_trainable_model``): a causal language model, or
  a model whose forward takes labels and returns its own loss;
* an explicit ``resume_from_checkpoint`` exists, is complete and its files match its manifest (sizes);
* the data files can be read and look like their format (the first lines of a JSON-lines file are
  JSON objects; a ``.json`` file starts with ``[`` or ``{``; a ``.parquet`` file has its magic bytes);
* before Python 3.11, the working directory (first in the workers' ``sys.path`` there) is one only this
  user can write (``check_working_directory``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

from trainbridge.checkpoint.folders import is_complete_checkpoint
from trainbridge.checkpoint.layout import COMPLETE_MARKER
from trainbridge.checkpoint.manifest import verify_checkpoint
from trainbridge.core.config import TrainingArgs, peft_adapter_base
from trainbridge.core.private_files import folder_problem, make_run_folder

SNIFF_LINES = 5
"""How many non-blank lines of a JSON-lines data file are parsed before launch."""
_JSONL_SUFFIXES = {".jsonl", ".ndjson", ".jsonlines", ""}


def check_output_dir(path: Path, share_with_group: bool = False) -> str | None:
    """None when ``path`` exists (created if needed: 0700, or 0750 shared with its group) and is writable
    and only this user could have put anything in it (``core.private_files.folder_problem``), else what is
    wrong and what to do.  Run once per launch (``run_training``, or rank 0 of a run in place)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        what = "is" if existing == path else f"would be inside {str(existing)!r}, which is"
        return f"ckpt_output_dir = {str(path)!r}: {what} a file, not a folder; choose another ckpt_output_dir."
    where = "" if existing == path else f" (its nearest existing parent {str(existing)!r})"
    try:
        created = make_run_folder(path, share_with_group)
    except OSError as exc:
        return (
            f"ckpt_output_dir = {str(path)!r}: cannot be created by this user{where}: {exc.strerror or exc}; "
            "choose a folder you can write to."
        )
    try:
        problem = folder_problem(path, trust_group=share_with_group)
    except OSError as exc:
        return f"ckpt_output_dir: cannot inspect {str(path)!r}: {exc.strerror or exc}"
    if problem:
        only_group = not share_with_group and folder_problem(path, trust_group=True) is None
        for folder in reversed(created):  # a refused run leaves nothing behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        fix = (
            "share the run folder with that group (share_run_dir_with_group=true) if you trust all its members, "
            "else take the group's write permission away (chmod g-w) or choose another ckpt_output_dir"
            if only_group
            else "make it yours and writable only by you (chmod go-w) or choose another ckpt_output_dir"
        )
        return (
            f"ckpt_output_dir: {problem}, so others could plant links or files the run would write through or "
            f"load; to allow it, {fix}"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".trainbridge-write-test-"):
            pass
    except OSError as exc:
        return (
            f"ckpt_output_dir = {str(path)!r}: not writable by this user{where}: {exc.strerror or exc}; "
            "choose a folder you can write to."
        )
    return None


def check_trainable_model(model_path: Path | None, label_names: list[str] | None = None) -> str | None:
    """None when ``model_path/config.json`` describes a model the loop can train: a causal LM (the token
    step), or a class whose forward takes the labels and so returns its own loss (the model-loss step); or
    when there is no such folder to check (``model_init``, or a PEFT adapter folder, whose base model is
    checked by ``check_model_setup``)."""
    if model_path is None or peft_adapter_base(model_path) is not None:
        return None
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"model_path: cannot read {model_path / 'config.json'}: {exc}"
    if not isinstance(config, dict):
        return f"model_path: {model_path / 'config.json'} is not a JSON object"
    if "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return None
    architectures = [str(a) for a in config.get("architectures") or []]
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return None
    model_type = config.get("model_type")
    if not architectures:  # rare: no architectures recorded; loaded as its causal LM (slow import)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return None
        return (
            f"model_path: {str(model_path)!r} records no architectures and model_type {model_type!r} has no "
            "causal LM; save the model with save_pretrained so config.json names its class"
        )
    import transformers

    from trainbridge.step.model_loss import default_label_names, returns_loss, untrainable_reason

    cls = getattr(transformers, architectures[0], None)
    if cls is None:  # remote code without an auto_map entry, or a newer transformers: the workers decide
        return None
    names = label_names or default_label_names(cls)
    return None if returns_loss(cls, names) else untrainable_reason(cls, names)


def check_resume_path(args: TrainingArgs) -> str | None:
    """None unless an explicit ``resume_from_checkpoint`` is missing, incomplete or corrupt."""
    resume = args.resume_from_checkpoint
    if resume is None or str(resume) == "auto":
        return None
    path = Path(resume)
    if not path.exists():
        return f"resume_from_checkpoint: {str(path)!r} does not exist"
    if not is_complete_checkpoint(path):
        return (
            f"resume_from_checkpoint: {str(path)!r} is not a complete checkpoint (a checkpoint-<step> "
            f"folder with a {COMPLETE_MARKER} marker); use 'auto' to take the newest complete one"
        )
    problems = verify_checkpoint(path, checksums=False, allow_unverified=args.resume_allow_unverified)
    if problems:
        return f"resume_from_checkpoint: checkpoint {str(path)!r} is corrupt: {'; '.join(problems)}"
    return None


def check_data_file(field: str, path: Path | None) -> str | None:
    """None when the data file can be read and its first lines look like its format."""
    if path is None or Path(path).is_dir():
        return None
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 20)
    except OSError as exc:
        return f"{field}: cannot read {str(path)!r}: {exc.strerror or exc}"
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return None if head[:4] == b"PAR1" else f"{field}: {str(path)!r} is not a parquet file (no PAR1 magic)"
    if suffix == ".json":
        first = head.lstrip()[:1]
        return None if first in (b"[", b"{") else f"{field}: {str(path)!r} does not start with a JSON array or object"
    if suffix not in _JSONL_SUFFIXES:
        return None  # formats the data layer reads itself (arrow, ...)
    lines = head.splitlines()
    complete = lines if len(head) < (1 << 20) else lines[:-1]  # the last line may be cut by the 1 MiB read
    seen = 0
    for number, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return f"{field}: {path}:{number}: not a JSON line ({exc}); expected one JSON object per line"
        if not isinstance(record, dict):
            return f"{field}: {path}:{number}: expected a JSON object, got {type(record).__name__}"
        seen += 1
        if seen >= SNIFF_LINES:
            break
    if seen == 0 and not complete and not head.strip():  # (a first line longer than the read is not empty)
        return f"{field}: {str(path)!r} is empty"
    return None


def check_working_directory(version: tuple[int, int] = sys.version_info[:2], cwd: Path | None = None) -> str | None:
    """None unless the workers would import from a working directory others can write.  Before Python 3.11
    (no ``PYTHONSAFEPATH``) torchrun's ``python -m`` puts the working directory first in the workers'
    ``sys.path``: a module planted there (``torch.py``, ``trainbridge/``) would run as you in every worker."""
    if version >= (3, 11):
        return None
    folder = Path.cwd() if cwd is None else cwd
    try:
        problem = folder_problem(folder)
    except OSError as exc:
        problem = f"{folder} cannot be inspected ({exc.strerror or exc})"
    if problem is None:
        return None
    return (
        f"working directory: Python {version[0]}.{version[1]} puts it first in the workers' sys.path (Python "
        f"3.11+ does not: PYTHONSAFEPATH), and {problem}, so others could put a module there that every worker "
        "imports; launch from a folder only you can write, or use Python 3.11 or newer"
    )


def input_problems(args: TrainingArgs) -> list[str]:
    """Every problem found, in the order above (empty when the run may launch)."""
    found = [
        check_working_directory(),
        check_trainable_model(args.model_path, args.label_names),
        check_resume_path(args),
        check_data_file("data_path", args.data_path),
        check_data_file("val_data_path", args.val_data_path),
        *(check_data_file(f"eval_data_paths[{name!r}]", path) for name, path in args.eval_data_paths.items()),
    ]
    return [problem for problem in found if problem]
