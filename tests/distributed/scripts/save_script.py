"""A Trainer script whose subclass overrides ``_save`` (used by test_trainer_save.py).

Run as ``torchrun --nproc_per_node=2 save_script.py OUT [real] [resume] [checkpoint]`` or ``python
save_script.py OUT [checkpoint]``; ``real`` uses transformers.Trainer (the reference); ``resume`` resumes
OUT's run from its checkpoint-2.  The override saves the model as Trainer does, then writes
``value_head.json`` beside it, and appends a line to ``OUT/save-rank<RANK>.txt`` (its process id, and
whether the folder is a checkpoint) from whatever process it runs in.  With ``checkpoint`` the subclass
overrides ``_save_checkpoint`` instead: ``super()``, then ``value_head.json`` into
``output_dir/checkpoint-<step>``, and a line (process id, step) in ``OUT/ckpt-rank<RANK>.txt``.
Checkpoints every 2 steps of 4, then ``trainer.save_model(OUT/final)``.

``save_script.py OUT [real] cases first,resumed,checkpoint`` runs the cases named one after another in the
same processes (one launch): ``OUT/first``, ``OUT/resumed`` (a copy of ``OUT/first`` resumed from its
checkpoint-2, as ``resume`` would in ``OUT/first``) and ``OUT/checkpoint`` (the ``_save_checkpoint``
override), each from a fresh model.
"""

import json
import os
import sys
from pathlib import Path

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

if "real" in sys.argv[2:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once

out = Path(sys.argv[1])  # the current run's folder and whether it resumes (the overrides below read them)
resume = "resume" in sys.argv[2:]
model_dir = out.parent / "tiny-model"
build_tiny_llama_once(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
texts = [p + a for p, a in arithmetic_problems(64, 1)]
train = datasets.Dataset.from_dict({"text": texts}).map(
    lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
)


class ValueHeadTrainer(Trainer):
    def _save(self, output_dir=None, state_dict=None):
        marker = out / f"save-rank{os.environ.get('RANK', '0')}.txt"
        with marker.open("a") as handle:
            handle.write(f"{os.getpid()} {'checkpoint' in Path(output_dir).name}\n")
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            head = {"hidden_size": self.model.config.hidden_size, "resumed": resume}
            Path(output_dir, "value_head.json").write_text(json.dumps(head))


class CheckpointFileTrainer(Trainer):
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        with (out / f"ckpt-rank{os.environ.get('RANK', '0')}.txt").open("a") as handle:
            handle.write(f"{os.getpid()} {self.state.global_step}\n")
        if self.args.should_save:
            (folder / "value_head.json").write_text(json.dumps({"step": self.state.global_step, "resumed": resume}))


def wait_for_final_saves(world_size: int, timeout: float = 120) -> None:
    """Until each rank's ``save-rank<R>.txt`` ends with the final save_model's line (``False``)."""
    import time

    deadline = time.monotonic() + timeout
    markers = [out / f"save-rank{rank}.txt" for rank in range(world_size)]
    while not all(m.is_file() and m.read_text().endswith(" False\n") for m in markers):
        if time.monotonic() > deadline:
            raise SystemExit(f"no final save_model line in {[m.name for m in markers]} after {timeout:.0f} s")
        time.sleep(0.1)


def run(checkpoint: bool) -> None:
    """One run of the script into ``out`` (resuming when ``resume``); rank 0 writes ``out/summary.json``."""
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
    )
    out.mkdir(parents=True, exist_ok=True)
    trainer_class = CheckpointFileTrainer if checkpoint else ValueHeadTrainer
    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    result = trainer.train(resume_from_checkpoint=str(out / "checkpoint-2") if resume else None)
    trainer.save_model(str(out / "final"))
    if trainer.is_world_process_zero():
        if not checkpoint:  # every rank's _save of the final save_model has written its line (no collective after it)
            wait_for_final_saves(int(os.environ.get("WORLD_SIZE", "1")))
        folders = [*sorted(p for p in out.iterdir() if p.name.startswith("checkpoint-")), out / "final"]
        (out / "summary.json").write_text(
            json.dumps(
                {
                    "global_step": result.global_step,
                    "log_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
                    "saves": {p.name: p.read_text().splitlines() for p in sorted(out.glob("save-rank*.txt"))},
                    "files": {p.name: sorted(f.name for f in p.iterdir()) for p in folders},
                    "heads": {
                        p.name: json.loads((p / "value_head.json").read_text())
                        for p in folders
                        if (p / "value_head.json").is_file()
                    },
                    "checkpoint_calls": {
                        p.name: p.read_text().splitlines() for p in sorted(out.glob("ckpt-rank*.txt"))
                    },
                    "pid": os.getpid(),
                }
            )
        )


CASES = {"first": (False, False), "resumed": (True, False), "checkpoint": (False, True)}
"""``cases``' runs: ``(resume, checkpoint)``."""

if "cases" in sys.argv[2:]:
    import shutil

    import torch.distributed as dist

    root = out
    for case in sys.argv[sys.argv.index("cases") + 1].split(","):
        out, (resume, checkpoint) = root / case, CASES[case]
        if resume:  # as `resume` would in OUT/first, in a copy: the first run's summary stays readable
            if dist.get_rank() == 0:
                shutil.copytree(root / "first", out)
            dist.barrier()
        run(checkpoint=checkpoint)
else:
    run(checkpoint="checkpoint" in sys.argv[2:])
