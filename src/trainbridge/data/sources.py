"""Where a run's samples come from: the configured training and validation data, loaded once.

``load_run_data(args, tokenizer)`` is the data layer's one entry for the builder
(``trainbridge.loop.build``; the launcher's preflight calls it in the parent first through
``launch.data_check.check_data``, so bad rows fail before launch and the workers find the cache built).  It
reads ``data_path``/``val_data_path`` (or the named ``eval_data_paths``) through the tokenisation cache
(``data.cache``), holds out ``validation_split`` by index, and logs the start-up summary.  New input
formats are added here (or below it), never in the loop.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.core.config import TrainingArgs
from trainbridge.data.cache import open_tokenized
from trainbridge.data.chat import ChatTemplateError, resolve_chat_template
from trainbridge.data.in_place import open_in_place
from trainbridge.data.inputs import default_cache_dir
from trainbridge.data.records import DataOptions
from trainbridge.data.samples import ArrowSamples, SampleSource
from trainbridge.data.types import LoadStats, OverlongPolicy, Sample, validation_indices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainbridge.core.config.plan import ScriptData

logger = logging.getLogger(__name__)


@dataclass
class RunData:
    """A run's samples: training, validation (``None`` without validation), and what reading found."""

    train: SampleSource
    val: SampleSource | None
    stats: list[LoadStats]
    """One entry per file read: the training file, then the validation file(s) if configured."""
    named_val: dict[str, SampleSource] = field(default_factory=dict)
    """The named validation sets of ``eval_data_paths``, in their order (``val`` is then None)."""

    def summary(self, max_seq_len: int) -> str:
        """The start-up summary: one line per data file, and the validation split if any."""
        lines = [f"data: {s.describe(max_seq_len)}" for s in self.stats]
        if self.named_val:
            sets = ", ".join(f"{name}: {len(source)}" for name, source in self.named_val.items())
            lines.append(f"data: {len(self.train)} training samples, validation sets ({sets} samples)")
        else:
            lines.append(
                f"data: {len(self.train)} training samples, "
                f"{len(self.val) if self.val is not None else 0} validation samples"
            )
        return "\n".join(lines)


def data_options(args: TrainingArgs) -> DataOptions:
    """The tokenisation options of a run."""
    return DataOptions(
        max_seq_len=args.max_seq_len,
        overlong_policy=args.overlong_policy,
        columns=tuple(sorted(args.data_columns.items())),
        chat_train_on=args.chat_train_on,
        system_prompt=args.chat_system_prompt,
        chat_template=read_chat_template(args.chat_template),
        num_proc=args.data_num_proc or min(8, os.cpu_count() or 1),
        vocab_size=model_vocab_size(args.model_path),
    )


def model_vocab_size(model_path: Path | str | None) -> int | None:
    """``vocab_size`` of the model folder's ``config.json`` (its ``text_config``'s for a multimodal model);
    None where there is none to read (a hub id, an adapter folder, which may resize the embeddings)."""
    try:
        config = json.loads((Path(str(model_path)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        if isinstance(section, dict) and type(section.get("vocab_size")) is int:
            return int(section["vocab_size"])
    return None


def read_chat_template(value: str | None) -> str | None:
    """A template given as a path to a file (``.jinja`` or any existing file) is read; a string is the template."""
    if value is None:
        return None
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    return value


def _template(tokenizer: PreTrainedTokenizerBase | None, options: DataOptions) -> str | None:
    """The chat template conversations render with, or ``None`` (rows that need one then fail, named)."""
    try:
        return resolve_chat_template(tokenizer, options.chat_template)
    except ChatTemplateError:
        return None


def open_dataset(
    path: str | Path, tokenizer: PreTrainedTokenizerBase | None, options: DataOptions, cache_dir: Path | None = None
) -> tuple[ArrowSamples, LoadStats]:
    """The samples of one data file or folder (through the tokenisation cache)."""
    return open_tokenized(
        Path(path), tokenizer, options, _template(tokenizer, options), cache_dir or default_cache_dir()
    )


def load_run_data(
    args: TrainingArgs,
    tokenizer: PreTrainedTokenizerBase | None,
    *,
    report: bool = True,
    script: ScriptData | None = None,
) -> RunData:
    """Training and validation samples of ``args`` (memory-mapped; in place, ``script``'s rows, ``RunPlan.script_data``,
    through the same cache by their fingerprint: ``data.in_place``); logs the summary when ``report`` (rank 0)."""
    options = data_options(args)
    cache_dir = args.data_cache_dir or default_cache_dir()

    def load(data: Any, name: str) -> tuple[SampleSource, LoadStats]:
        if script is not None:
            return open_in_place(data, name, tokenizer, options, _template(tokenizer, options), cache_dir)
        return open_dataset(data, tokenizer, options, cache_dir)

    train_data = script.train if script is not None else args.data_path
    if train_data is None:
        raise ValueError("data_path: token-budget batches read a data file; a train_stream trains on 'model_loss'")
    train, stats = load(train_data, "train_dataset")
    all_stats = [stats]
    val: SampleSource | None = None
    source: SampleSource = train
    val_data = script.eval if script is not None else args.val_data_path
    if val_data is not None:
        val, val_stats = load(val_data, "eval_dataset")
        all_stats.append(val_stats)
    elif args.validation_split > 0:
        train_rows, val_rows = validation_indices(len(train), args.validation_split, args.seed)
        source, val = train.subset(train_rows), train.subset(val_rows)
    named: dict[str, SampleSource] = {}
    named_data = script.named_eval if script is not None else args.eval_data_paths
    for name, data in named_data.items():
        named[name], named_stats = load(data, f"eval_dataset[{name!r}]" if script is not None else str(name))
        all_stats.append(named_stats)
    data = RunData(source, val, all_stats, named)
    if report:
        for line in data.summary(args.max_seq_len).splitlines():
            logger.info("%s", line)
    return data


def load_jsonl(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None,
    max_seq_len: int,
    overlong_policy: OverlongPolicy,
    *,
    cache_dir: Path | None = None,
) -> tuple[list[Sample], LoadStats]:
    """Read a data file into a list of samples of at most ``max_seq_len`` tokens (small data, tests).

    ``tokenizer`` is needed only for rows that are not pre-tokenized.  A sample longer than
    ``max_seq_len`` is dropped (``"drop"``), cut (``"truncate"``) or rejected (``"error"``).  Raises
    ``DataFormatError`` naming file and line for bad rows and ``ValueError`` when no usable sample
    remains.  Without ``cache_dir`` the tokenised form is built in a temporary folder and discarded.
    """
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if overlong_policy not in ("drop", "truncate", "error"):
        raise ValueError(f"overlong_policy must be 'drop', 'truncate' or 'error', got {overlong_policy!r}")
    options = DataOptions(max_seq_len=max_seq_len, overlong_policy=overlong_policy)
    with tempfile.TemporaryDirectory(prefix="trainbridge-data-") as scratch:
        source, stats = open_dataset(path, tokenizer, options, cache_dir or Path(scratch))
        samples = source.fetch(range(len(source)))
    return samples, stats
