"""2-rank runs from chat ``messages``: JSONL (the shipped demo data) and the same rows as parquet.

The preflight tokenises into the cache in the parent; both workers memory-map it; a second run with the
same data, tokenizer and options starts from the cache (nothing tokenised again).  The second run is launched
for JSONL only: a cache hit does not depend on the source's format (``tests/unit/test_data_inputs.py``
opens every format twice, the second time from the cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from tests.distributed.training_fixtures import base_args
from tests.run_inputs import run_training
from trainbridge import TorchrunArgs
from trainbridge.demos.tiny_model import build_tiny_llama

pytestmark = pytest.mark.distributed
TWO = TorchrunArgs(nproc_per_node=2)
SHIPPED = Path(__file__).parents[2] / "src" / "trainbridge" / "demos" / "data" / "chat_train.jsonl"


@pytest.fixture(scope="module")
def chat_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines()[:128]]
    jsonl = root / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = root / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    return {
        "model": build_tiny_llama(root / "model"),
        "jsonl": jsonl,
        "parquet": parquet,
        "cache": root / "cache",
    }


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_two_ranks_train_on_chat_messages_from_the_cache(
    chat_assets: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    assets = {"model": chat_assets["model"], "train": chat_assets[kind]}
    args = base_args(
        assets,
        tmp_path / "run1",
        max_seq_len=128,
        max_batch_len=256,
        max_steps=6,
        data_cache_dir=chat_assets["cache"],
        validation_split=0.1,
        eval_strategy="steps",
        eval_steps=6,
    )
    first = run_training(args, TWO)
    assert first is not None and first.global_step == 6
    (cache,) = [
        m.parent
        for m in chat_assets["cache"].glob("*/meta.json")
        if json.loads(m.read_text())["source"] == str(chat_assets[kind])
    ]
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["stats"]["samples"] == 128 and meta["stats"]["lines"] == 128
    if kind != "jsonl":
        return
    built = (cache / "meta.json").stat().st_mtime_ns
    second = run_training(args.model_copy(update={"ckpt_output_dir": tmp_path / "run2"}), TWO)
    assert second is not None and (cache / "meta.json").stat().st_mtime_ns == built, "the cache was rebuilt"
    assert second.final_loss == pytest.approx(first.final_loss)
