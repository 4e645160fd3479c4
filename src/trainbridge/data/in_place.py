"""A script's in-place ``datasets.Dataset``, tokenised once per node and reused, keyed by its fingerprint.

``trainbridge.Trainer.train()`` hands the loop the script's own dataset (``RunPlan.script_data``) as
``InPlaceRows``: the columns the token step reads, and whether labels are still to be derived from
``input_ids`` (``DataCollatorForLanguageModeling``).  ``open_in_place`` reads it through the file cache's own
entries (``data.cache.open_entry``: one process per node builds under the key's lock, the others wait and
memory-map it; entries private, plain Arrow and numpy, nothing in them runs as code), keyed by the dataset's
fingerprint (``datasets.Dataset._fingerprint``: its rows and every transformation) with the tokenizer and
options, so a second ``train()`` or a second run on the same rows tokenises nothing.

A fingerprint that does not name the rows is not used (``unusable_fingerprint``): a transform set on the
dataset (its items are computed at each fetch), rows made by ``Dataset.from_generator`` (the fingerprint
hashes the generator's code, not what it yields), a process where ``datasets`` fell back to random
fingerprints (a transformation it could not hash) or has caching off.  Those rows are tokenised in memory
on every call, and a debug line says why.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.data.cache import CACHE_FORMAT, open_entry, tokenize_in_memory, tokenizer_fingerprint, write_entry
from trainbridge.data.records import DataOptions
from trainbridge.data.samples import ArrowSamples
from trainbridge.data.types import LoadStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InPlaceRows:
    """A script's ``datasets.Dataset`` as the token step reads it (``data.script_data.prepare_rows``)."""

    dataset: Any
    """The columns the data layer reads (pre-tokenised ``input_ids``/``labels``, or raw text columns)."""
    labels_pad_id: int | None = None
    """Labels are ``input_ids`` with this pad id at -100, as ``DataCollatorForLanguageModeling`` makes them
    (derived when the rows are tokenised, so a cache hit skips it); None: the rows' own labels."""

    def rows(self) -> Any:
        """The rows to tokenise: ``dataset``, with the derived labels column when ``labels_pad_id`` is set."""
        dataset = self.dataset.with_format(None)  # plain lists, whatever format the script set
        if self.labels_pad_id is None:
            return dataset
        pad = self.labels_pad_id

        def _labels(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
            return {"labels": [[-100 if t == pad else t for t in ids] for ids in batch["input_ids"]]}

        return dataset.map(
            _labels, batched=True, keep_in_memory=True, desc="labels as DataCollatorForLanguageModeling makes them"
        )


def unusable_fingerprint(dataset: Any) -> str | None:
    """Why ``dataset``'s fingerprint does not identify its rows (None: it does; see the module doc)."""
    import datasets
    from datasets import fingerprint

    if not isinstance(dataset, datasets.Dataset):
        return f"a {type(dataset).__name__}, not a datasets.Dataset"
    if dataset.format.get("type") == "custom":
        return "it has a transform set (set_transform / with_transform): items are computed at each fetch"
    if getattr(dataset.info, "builder_name", None) == "generator":
        return "made by Dataset.from_generator: its fingerprint hashes the generator's code, not its rows"
    if not datasets.is_caching_enabled():
        return "datasets' caching is off (datasets.disable_caching()): fingerprints may be random"
    if fingerprint.fingerprint_warnings.get("update_fingerprint_transform_hash_failed"):
        return "datasets could not hash a transformation in this process: fingerprints may be random"
    return None


def in_place_key(
    rows: InPlaceRows, tokenizer: PreTrainedTokenizerBase | None, chat_template: str | None, options: DataOptions
) -> str:
    """The cache key of ``rows`` tokenised with ``tokenizer``/``chat_template`` under ``options``."""
    payload = {
        "format": CACHE_FORMAT,
        "input": f"datasets:{rows.dataset._fingerprint}:{len(rows.dataset)}",
        "labels_pad_id": rows.labels_pad_id,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": chat_template,
        "options": options.key(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def open_in_place(
    data: InPlaceRows,
    name: str,
    tokenizer: PreTrainedTokenizerBase | None,
    options: DataOptions,
    chat_template: str | None,
    cache_dir: Path,
) -> tuple[ArrowSamples, LoadStats]:
    """The samples of a script's rows: from the cache entry of their fingerprint (built by one process per
    node when missing), or tokenised in memory when the fingerprint is unusable; ``name`` names the rows in
    errors and the summary (``train_dataset``, ``eval_dataset[...]``)."""
    problem = unusable_fingerprint(data.dataset)
    if problem is not None:
        logger.debug("%s: not cached (%s); tokenised in memory", name, problem)
        return tokenize_in_memory(data.rows(), name, tokenizer, options, chat_template)

    def build(target: Path) -> None:
        write_entry(lambda scratch: (data.rows(), False), Path(name), tokenizer, options, chat_template, target)

    samples, stats = open_entry(in_place_key(data, tokenizer, chat_template, options), cache_dir, build)
    stats.path = name  # the entry may have been built under another name (the same rows as eval_dataset)
    return samples, stats
