"""A continual-learning Trainer script (issue 29, failures 4, 6 and 7) with its import changed to trainbridge's.

Run as ``python continual_script.py OUT [real]`` or ``torchrun --nproc_per_node=2 continual_script.py OUT``;
``real`` uses transformers.Trainer.  Two tasks in turn, each a new Trainer on the same model with ``train()``
then ``evaluate()``; ``TrainingArguments`` is a ``@dataclass`` subclass defined here, in ``__main__`` (classic
instruction-tuning scripts; its checkpoints' ``training_args.bin`` pickles it); the model's output layer is
tied to its embeddings; one of its parameters takes no part in the loss (issue 41).  Every process that
trains appends its pid, parent pid and rank per call to ``OUT/calls-<pid>.jsonl``; rank 0 writes
``OUT/summary.json``.
"""

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

if "real" in sys.argv[2:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    task_name: str = field(default="task", metadata={"help": "which task of the sequence"})


out = Path(sys.argv[1])
model_dir = build_tiny_llama_once(out.parent / "tiny-model")
tokenizer = AutoTokenizer.from_pretrained(model_dir)
torch.manual_seed(0)  # the same tied model on every rank
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir, tie_word_embeddings=True))
# a parameter no batch's loss uses, as in permutation language modeling (issue 41): Trainer's DDP runs with
# find_unused_parameters=True unless gradient checkpointing is on, and so must ours
model.unused_head = torch.nn.Linear(8, 8)
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
rank = int(os.environ.get("RANK", "0"))


def rows(n, seed):
    texts = [p + a for p, a in arithmetic_problems(n, seed)]
    return datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )


def record(call):
    out.mkdir(parents=True, exist_ok=True)
    line = {"pid": os.getpid(), "ppid": os.getppid(), "rank": rank, "call": call}
    with open(out / f"calls-{os.getpid()}.jsonl", "a") as calls:
        calls.write(json.dumps(line) + "\n")


summary = {"tasks": []}
for task in range(2):
    args = TrainingArguments(
        output_dir=str(out / f"task{task}"),
        task_name=f"task{task}",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=2,
        logging_steps=1,
        save_steps=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        seed=task,
    )
    trainer = Trainer(
        model=model,
        args=args,
        data_collator=collator,
        train_dataset=rows(16, task),
        eval_dataset=rows(8, 100 + task),
    )
    record(f"train{task}")
    result = trainer.train()
    record(f"evaluate{task}")
    metrics = trainer.evaluate()
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        tensors = sorted(weights.keys())
    summary["tasks"].append(
        {
            "global_step": result.global_step,
            "train_loss": result.training_loss,
            "eval_keys": sorted(metrics),
            "eval_loss": metrics["eval_loss"],
            "log_steps": [entry.get("step") for entry in trainer.state.log_history],
            "checkpoint_files": sorted(p.name for p in checkpoint.iterdir()),
            "tensors": tensors,
        }
    )
if rank == 0:
    summary["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
