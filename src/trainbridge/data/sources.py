"""Where a run's samples come from: the configured training and validation data, loaded once.

``load_run_data`` is the data layer's one entry for the builder (``trainbridge.loop.build``): new
input formats are added here (or below it), never in the loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainbridge.data.dataset import LoadStats, Sample, load_jsonl, split_validation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainbridge.core.config import TrainingArgs

logger = logging.getLogger(__name__)


@dataclass
class RunData:
    """A run's samples: training, validation (possibly empty), and what loading read and skipped."""

    train: list[Sample]
    val: list[Sample]
    stats: list[LoadStats] = field(default_factory=list)
    """One entry per file read: the training file, then the validation file if one is configured."""


def load_run_data(args: TrainingArgs, tokenizer: PreTrainedTokenizerBase, *, report: bool = True) -> RunData:
    """Load ``data_path`` and ``val_data_path`` (or split ``validation_split`` off the training data).

    With ``report`` (rank 0), samples dropped, truncated or skipped are logged as one warning per file.
    """
    train, stats = load_jsonl(args.data_path, tokenizer, args.max_seq_len, args.overlong_policy)
    all_stats = [stats]
    val: list[Sample] = []
    if args.val_data_path is not None:
        val, val_stats = load_jsonl(args.val_data_path, tokenizer, args.max_seq_len, args.overlong_policy)
        all_stats.append(val_stats)
    elif args.validation_split > 0:
        train, val = split_validation(train, args.validation_split, args.seed)
    if report:
        for s in all_stats:
            if s.dropped_overlong or s.truncated or s.empty_skipped:
                logger.warning("%s: %d samples dropped as longer than max_seq_len=%d, %d truncated, "
                               "%d without loss tokens skipped", s.path, s.dropped_overlong, args.max_seq_len,
                               s.truncated, s.empty_skipped)
    return RunData(train=list(train), val=list(val), stats=all_stats)
