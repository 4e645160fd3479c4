"""A Trainer script whose subclass overrides ``compute_loss`` (used by test_trainer_subclass.py).

Run as ``torchrun --nproc_per_node=2 subclass_script.py OUT [real]`` or ``python subclass_script.py OUT``;
``real`` uses transformers.Trainer (the reference).  The override counts its calls per rank in
``OUT/calls-rank<RANK>.txt`` (written from the process it runs in) and adds a small penalty to the loss.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

if "real" in sys.argv[2:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama

out = Path(sys.argv[1])
model_dir = out.parent / "tiny-model"
if not model_dir.exists():
    staging = model_dir.with_name(f"{model_dir.name}.{os.getpid()}")
    build_tiny_llama(staging)
    try:
        staging.rename(model_dir)
    except OSError:  # another rank published first
        shutil.rmtree(staging)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
texts = [p + a for p, a in arithmetic_problems(64, 1)]
train = datasets.Dataset.from_dict({"text": texts}).map(
    lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
)


class PenaltyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        marker = Path(self.args.output_dir) / f"calls-rank{os.environ.get('RANK', '0')}.txt"
        marker.parent.mkdir(parents=True, exist_ok=True)
        with marker.open("a") as handle:
            handle.write(
                f"{int(num_items_in_batch) if num_items_in_batch is not None else -1} "
                f"{self.accelerator.is_main_process} {type(self.accelerator.unwrap_model(model)).__name__}\n"
            )
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss + 0.0 * outputs.logits.float().pow(2).mean()
        return (loss, outputs) if return_outputs else loss


args = TrainingArguments(
    output_dir=str(out),
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=4,
    logging_steps=1,
    save_strategy="no",
    learning_rate=1e-2,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=3,
)
trainer = PenaltyTrainer(
    model=model,
    args=args,
    train_dataset=train,
    processing_class=tokenizer,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
result = trainer.train()
if trainer.is_world_process_zero():
    calls = {p.name: p.read_text().splitlines() for p in sorted(out.glob("calls-rank*.txt"))}
    (out / "summary.json").write_text(
        json.dumps(
            {
                "global_step": result.global_step,
                "train_metrics": sorted(result.metrics),
                "log_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
                "log_keys": sorted({k for e in trainer.state.log_history for k in e}),
                "calls": calls,
                "pid": os.getpid(),
            }
        )
    )
