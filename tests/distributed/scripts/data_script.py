"""Trainer scripts that bring their own data path (used by tests/distributed/test_facade_data.py).

``python|torchrun data_script.py OUT KIND [real]``; ``real`` uses transformers.Trainer (the reference).  KIND
may name several kinds (``stream,sampler``): each is trained in turn in the same processes (one launch),
into ``OUT/<KIND>``.
A tiny ``BertForSequenceClassification`` on items of fixed length, each with its ``idx``; the script's own
collator stacks the tensors it gets and appends each micro-batch's ``idx`` to ``OUT/seen-rank<RANK>.txt``.

- ``stream``: a torch ``IterableDataset`` defined here (26 items; a step takes 8), ``max_steps=5``: the
  stream runs out inside step 4 (its last 2 items, 1 a rank), which is carried into the next pass's first
  step, and is iterated again (its ``set_epoch`` records each call).
- ``hfstream``: the same items as a ``datasets`` stream (``Dataset.to_iterable_dataset()``, torch format).
- ``sampler``: a map-style ``Dataset`` and a Trainer subclass whose ``_get_train_sampler`` returns a custom
  curriculum sampler (a fixed order); the override records ``OUT/sampler-rank<RANK>.txt`` where it runs.
- ``loader``: a Trainer subclass whose ``get_train_dataloader`` builds its own ``DataLoader`` (batch size 3,
  the curriculum sampler, its own collate function) and prepares it with ``self.accelerator``; it records
  ``OUT/loader-rank<RANK>.txt`` (with the process id: the summary names the script's).
- ``afbs``: ``auto_find_batch_size`` from 4 items a micro-batch, a forward that runs out of memory above 3 (every
  rank under ``real``, where Trainer's per-process search agrees only so; ours, on rank 1 alone), 3 steps saved
  at 3; then a fresh Trainer resumes to step 5 (``train(resume_from_checkpoint=True)``).  Each raise is
  recorded in ``OUT/oom-rank<RANK>.txt``, each run's ``state.train_batch_size`` in ``OUT/size-rank<RANK>.txt``;
  the summary is the resumed run's (its history holds the first run's rows).
- ``unagreed`` (ours only, last): the same search, with a backward out of memory above 3 items on rank 1 alone,
  which the ranks cannot agree on: the run ends there with an error naming it (the launch fails).
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

if "real" in sys.argv[3:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

COUNT = 24
STREAM_COUNT = 26  # 3 steps a pass, then a round of 1 item a rank: carried
out = Path(sys.argv[1])  # the current run's folder (the markers below write there)


def item(i):
    ids = torch.tensor([2 + (i * 7 + k) % 30 for k in range(8)])
    return {"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": i % 2, "idx": i}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(STREAM_COUNT):
            yield item(i)

    def set_epoch(self, epoch):
        with (out / f"epochs-rank{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write(f"{epoch}\n")


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return COUNT

    def __getitem__(self, i):
        return item(i)


class Collator:
    """Stacks the items' tensors (they must arrive as tensors) and records their ``idx``."""

    def __call__(self, items):
        assert all(isinstance(x["input_ids"], torch.Tensor) for x in items), [type(x["input_ids"]) for x in items]
        with (out / f"seen-rank{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write(" ".join(str(int(x["idx"])) for x in items) + "\n")
        return {
            "input_ids": torch.stack([x["input_ids"] for x in items]),
            "attention_mask": torch.stack([x["attention_mask"] for x in items]),
            "labels": torch.tensor([int(x["labels"]) for x in items]),
        }


class Curriculum(torch.utils.data.Sampler):
    """A fixed order: odd items first, then even ones."""

    def __init__(self, count):
        self.count = count

    def __iter__(self):
        return iter([*range(1, self.count, 2), *range(0, self.count, 2)])

    def __len__(self):
        return self.count


class SamplerTrainer(Trainer):
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        with (out / f"sampler-rank{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write(f"{len(dataset)} {os.getpid()}\n")
        return Curriculum(len(dataset))


class LoaderTrainer(Trainer):
    def get_train_dataloader(self):
        with (out / f"loader-rank{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write(f"{len(self.train_dataset)} {os.getpid()}\n")
        loader = torch.utils.data.DataLoader(
            self.train_dataset, batch_size=3, sampler=Curriculum(len(self.train_dataset)), collate_fn=Collator()
        )
        return self.accelerator.prepare(loader)


def out_of_memory_above_3(module, args, kwargs):
    """An out-of-memory error for a micro-batch above 3 items: on every rank for the reference, on rank 1 for ours."""
    rank = os.environ.get("RANK", "0")
    if kwargs["input_ids"].shape[0] > 3 and ("real" in sys.argv[3:] or rank == "1"):
        with (out / f"oom-rank{rank}.txt").open("a") as handle:
            handle.write(f"{kwargs['input_ids'].shape[0]}\n")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def backward_out_of_memory_above_3(module, grad_output):
    """An out-of-memory error in the backward of a micro-batch above 3 items, on rank 1 alone."""
    if grad_output[0].shape[0] > 3 and os.environ.get("RANK") == "1":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def train(kind: str, resume: bool = False) -> None:
    """One run of ``kind`` into ``out``; rank 0 writes ``out/summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    search = kind in ("afbs", "unagreed")
    config = BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
        # afbs: no dropout, so rank 0's forward in the failed attempt (ours) draws nothing Trainer's does not
        hidden_dropout_prob=0.0 if search else 0.1,
        attention_probs_dropout_prob=0.0 if search else 0.1,
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4 if search else 2,
        gradient_accumulation_steps=1 if search else 2,
        auto_find_batch_size=search,
        max_steps=(5 if resume else 3) if search else 5 if kind.endswith("stream") else -1,
        num_train_epochs=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3 if search else 2,  # afbs: saved at 3, the first run's end, and at 5
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=3,
    )
    if kind == "hfstream":
        import datasets

        rows = [
            {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in item(i).items()}
            for i in range(STREAM_COUNT)
        ]
        train_dataset = datasets.Dataset.from_list(rows).to_iterable_dataset().with_format("torch")
    else:
        train_dataset = Stream() if kind == "stream" else Items()
    trainer_cls = {"sampler": SamplerTrainer, "loader": LoaderTrainer}.get(kind, Trainer)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=Collator(),
    )
    if kind == "afbs":
        trainer.model.register_forward_pre_hook(out_of_memory_above_3, with_kwargs=True)
    if kind == "unagreed":
        trainer.model.classifier.register_full_backward_pre_hook(backward_out_of_memory_above_3)
    result = trainer.train(resume_from_checkpoint=resume or None)
    if kind == "afbs":
        with (out / f"size-rank{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write(f"{trainer.state.train_batch_size}\n")
        torch.distributed.barrier()  # every rank's marker written before rank 0 reads them
        if not resume:
            return train(kind, resume=True)
    if trainer.is_world_process_zero():
        last = out / f"checkpoint-{result.global_step}"
        summary = {
            "global_step": result.global_step,
            "train_metrics": sorted(result.metrics),
            "log_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
            "log_epochs": [round(e["epoch"], 4) for e in trainer.state.log_history if "loss" in e],
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "log_keys": sorted({k for e in trainer.state.log_history for k in e}),
            "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")),
            "checkpoint_files": sorted(p.name for p in last.iterdir()) if last.is_dir() else [],
            "pid": os.getpid(),
            "markers": {p.name: p.read_text().split("\n")[:-1] for p in sorted(out.glob("*-rank*.txt"))},
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))


kinds = sys.argv[2].split(",")
root = out
for kind in kinds:
    out = root / kind if len(kinds) > 1 else root
    train(kind)

if "real" in sys.argv[3:]:
    # the reference's work is done: real Trainer leaves gloo's threads (and a stream's) to the interpreter's exit,
    # which now and then aborts a rank ("terminate called without an active exception"); leave without it
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
