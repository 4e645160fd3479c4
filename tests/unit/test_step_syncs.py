"""Host-device synchronisations per optimizer step, counted on CPU (issue 16).

On a GPU every read of a device tensor into Python (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``,
``.tolist()``, ``.cpu()``, ``.numpy()``) waits for the queued kernels.  The same calls are counted here
on CPU, during whole optimizer steps of an in-process run (step begin to the next step begin: the
micro-batches, clipping, optimizer, the step's agreement), by patching those ``torch.Tensor`` methods,
and attributed to the file that made the call.  The documented budget (docs/gpu.md):

- trainbridge: exactly ONE per optimizer step, whatever the number of micro-batches -- reading back the
  step's agreement row (``DistributedEnv.gather_rows``), which carries the loss and the grad norm;
- transformers: one per forward of a batch with ``position_ids`` and no ``attention_mask``
  (``masking_utils.find_packed_sequence_indices`` checks ``(...).all()``), which every loop training a
  transformers model with packed rows pays (Trainer with ``DataCollatorWithFlattening`` too);
- torch itself (optimizer, clipping, autograd): none.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.run_inputs import as_run
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.demos.tiny_model import build_tiny_llama
from trainbridge.loop.loop import train

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class SyncCounter:
    """Counts the ``SYNC_METHODS`` calls on tensors, by the calling file's package, while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.calls: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        counter = self

        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.active:
                frame = sys._getframe(1)
                path = frame.f_code.co_filename
                owner = (
                    "trainbridge"
                    if "/trainbridge/" in path
                    else "transformers"
                    if "/transformers/" in path
                    else "test"
                    if path == __file__
                    else "torch/other"
                )
                counter.calls[owner] += 1
                counter.where[f"{owner}: {Path(path).name}:{frame.f_lineno} {name}"] += 1
            return original(tensor, *args, **kwargs)

        return wrapper


class CountPerStep(Callback):
    """Per complete step (step begin to the next step begin): the counted calls by owner."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.per_step: list[Counter[str]] = []
        self.forwards = 0
        self.forwards_per_step: list[int] = []

    def on_step_begin(self, context: Any, **kwargs: Any) -> None:
        if self.counter.active:
            self.per_step.append(Counter(self.counter.calls))
            self.forwards_per_step.append(self.forwards)
        self.counter.calls.clear()
        self.forwards = 0
        self.counter.active = True

    def on_after_forward(self, context: Any, **kwargs: Any) -> None:
        self.forwards += 1

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        self.counter.active = False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("syncs") / "model", hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64
    )


def write_data(path: Path, lengths: list[int], vocab: int) -> Path:
    rng = random.Random(0)
    rows = []
    for n in lengths:
        ids = [rng.randrange(4, vocab) for _ in range(n)]
        rows.append(json.dumps({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]}))
    path.write_text("\n".join(rows) + "\n")
    return path


def run_counted(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lengths: list[int], **overrides: Any
) -> CountPerStep:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    args = TrainingArgs(
        model_path=model_dir,
        data_path=write_data(tmp_path / "data.jsonl", lengths, vocab),
        ckpt_output_dir=tmp_path / "out",
        max_seq_len=64,
        effective_batch_size=4,
        max_steps=4,
        save_strategy="no",
        save_final_checkpoint=False,
        logging_steps=1000,
        disable_tqdm=True,
        device="cpu",
        **overrides,
    )
    callback = CountPerStep(SyncCounter(monkeypatch))
    train(*as_run(args), DistributedEnv(), [callback])
    assert len(callback.per_step) == 3
    return callback


def test_one_trainbridge_sync_per_step_with_micro_batches(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_batch_len 64 with samples of 20..40 tokens: 2-4 packed micro-batches per step (accumulation).
    lengths = [random.Random(1).randint(20, 40) for _ in range(16)]
    counted = run_counted(model_dir, tmp_path, monkeypatch, lengths, max_batch_len=64)
    assert max(counted.forwards_per_step) >= 2, counted.forwards_per_step
    for calls, forwards in zip(counted.per_step, counted.forwards_per_step, strict=True):
        detail = dict(counted.counter.where)
        assert calls["trainbridge"] == 1, detail
        assert calls["torch/other"] == 0, detail
        assert calls["test"] == 0, detail
        assert calls["transformers"] == forwards, detail  # find_packed_sequence_indices, per forward


def test_fixed_length_rows_and_chunked_loss_keep_one_sync(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stacked equal-length rows (the model's own position_ids) and the chunked loss head: still one."""
    counted = run_counted(
        model_dir,
        tmp_path,
        monkeypatch,
        [24] * 16,
        max_batch_len=64,
        loss_implementation="chunked",
        loss_chunk_tokens=16,
    )
    for calls, forwards in zip(counted.per_step, counted.forwards_per_step, strict=True):
        detail = dict(counted.counter.where)
        assert calls["trainbridge"] == 1, detail
        assert calls["torch/other"] == 0, detail
        assert calls["transformers"] == forwards, detail
