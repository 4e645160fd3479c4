"""The model and data every compat run trains on, built once on disk.

The tiny Llama of ``trainbridge.demos.tiny_model``.  The data are arithmetic problems written with fixed
widths (``07+35=042``), so every sample has exactly ``SAMPLE_TOKENS`` tokens.  With equal lengths,
trainbridge's token-budget batching is exact: ``max_batch_len = rows x SAMPLE_TOKENS`` gives each rank
micro-batches of exactly ``rows`` samples, i.e. the micro-batch and accumulation structure of
``Trainer`` with ``per_device_train_batch_size = rows``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainbridge.demos.tiny_model import build_tiny_llama, tiny_bert_config

TRAIN_SAMPLES = 32
"""Training samples (a multiple of every scenario's samples per optimizer step)."""
EVAL_SAMPLES = 8
"""Validation samples (a multiple of every per-rank evaluation batch x world size)."""
SAMPLE_TOKENS = 11
"""``<s>`` + ``aa+bb=ccc`` + ``</s>``: the length of every sample."""


@dataclass(frozen=True)
class CompatAssets:
    """Paths of the model directory and the two JSONL files."""

    model: Path
    train: Path
    val: Path

    def as_json(self) -> dict[str, str]:
        """The paths as strings (for a worker's command line)."""
        return {"model": str(self.model), "train": str(self.train), "val": str(self.val)}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> CompatAssets:
        """Inverse of ``as_json``."""
        return cls(Path(data["model"]), Path(data["train"]), Path(data["val"]))


def build_assets(root: str | Path) -> CompatAssets:
    """Build (or reuse, when already complete) the model and data under ``root``."""
    root = Path(root)
    assets = CompatAssets(root / "model", root / "train.jsonl", root / "val.jsonl")
    if assets.train.is_file() and assets.val.is_file() and (assets.model / "config.json").is_file():
        return assets
    build_tiny_llama(assets.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model)
    _write_fixed_width_problems(assets.train, TRAIN_SAMPLES, seed=1, tokenizer=tokenizer)
    _write_fixed_width_problems(assets.val, EVAL_SAMPLES, seed=2, tokenizer=tokenizer)
    return assets


def _write_fixed_width_problems(path: Path, n: int, seed: int, tokenizer: Any) -> None:
    """``n`` problems as ``{"input_ids", "labels"}`` lines; the prompt is masked with -100."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = [tokenizer.bos_token_id, *tokenizer.encode(f"{a:02d}+{b:02d}=", add_special_tokens=False)]
        answer = [*tokenizer.encode(f"{a + b:03d}", add_special_tokens=False), tokenizer.eos_token_id]
        if len(prompt) + len(answer) != SAMPLE_TOKENS:
            raise ValueError(
                f"{path}: sample {a:02d}+{b:02d} has {len(prompt) + len(answer)} tokens, expected {SAMPLE_TOKENS}"
            )
        lines.append(json.dumps({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


class TokenizedJsonl(torch.utils.data.Dataset):
    """The pre-tokenized JSONL as a map-style dataset for ``Trainer`` (``input_ids`` and ``labels``)."""

    def __init__(self, path: Path) -> None:
        self.rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]


def collate_fixed_length(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Stack equal-length samples: ``input_ids``, ``labels`` and an all-ones ``attention_mask``."""
    input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
    return {
        "input_ids": input_ids,
        "labels": torch.tensor([f["labels"] for f in features], dtype=torch.long),
        "attention_mask": torch.ones_like(input_ids),
    }


# ============================================================================ sequence classification
def classification_model(tokenizer: Any) -> Any:
    """A tiny ``BertForSequenceClassification`` (2 labels) over the tiny Llama's tokenizer, built from a
    config with a fixed seed, so both runners start from the same weights."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id))


def classification_data(tokenizer: Any, n: int, seed: int) -> Any:
    """``n`` texts of varying length whose first letter gives the label, tokenized as a ``datasets.Dataset``
    (``sentence``, ``label``, ``idx``, ``input_ids``, ``attention_mask``: the unused text columns are
    dropped by ``remove_unused_columns``)."""
    import datasets

    rng = random.Random(seed)
    labels = [rng.randint(0, 1) for _ in range(n)]
    texts = [("x" if label else "y") + "".join(rng.choices("abcdefgh", k=rng.randint(3, 11))) for label in labels]
    data = datasets.Dataset.from_dict({"sentence": texts, "label": labels, "idx": list(range(n))})
    return data.map(lambda batch: tokenizer(batch["sentence"]), batched=True)


def accuracy(eval_pred: Any) -> dict[str, float]:
    """``compute_metrics``: the share of argmax predictions equal to the labels."""
    import numpy as np

    predictions, labels = eval_pred
    return {"accuracy": float((np.argmax(predictions, axis=-1) == labels).mean())}


# ============================================================================ preference pairs (DPO)
def prompt_data(n: int, seed: int) -> Any:
    """``n`` text prompts (``prompt``: ``"ab+cd="``) with their ``answer`` column as a ``datasets.Dataset``, as
    trl's GRPOTrainer takes them (the reward functions of ``trainbridge.demos.rewards`` read ``answer``)."""
    import datasets

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"})
    return datasets.Dataset.from_list(rows)


def preference_data(n: int, seed: int) -> Any:
    """``n`` preference pairs (``prompt``, ``chosen``: the right sum, ``rejected``: a wrong one) as a
    ``datasets.Dataset``, as trl's DPOTrainer takes them."""
    import datasets

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{a:02d}+{b:02d}=", "chosen": f"{a + b:03d}", "rejected": f"{(a * b) % 1000:03d}"})
    return datasets.Dataset.from_list(rows)
