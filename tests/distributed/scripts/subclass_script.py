"""A Trainer script whose subclass overrides ``compute_loss``, ``training_step``, ``prediction_step``,
``evaluate`` and ``log`` and sets an attribute in its ``__init__`` (used by test_trainer_subclass.py).

Run as ``torchrun --nproc_per_node=2 subclass_script.py OUT [real]`` or ``python subclass_script.py OUT``;
``real`` uses transformers.Trainer (the reference).  Each override writes a line per call into
``OUT/<method>-rank<RANK>.txt`` from the process it runs in (``calls-`` for ``compute_loss``);
``compute_loss`` adds a small penalty to the loss and ``log`` adds ``alpha`` to every log.
"""

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

if "real" in sys.argv[2:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once

out = Path(sys.argv[1])
model_dir = out.parent / "tiny-model"
build_tiny_llama_once(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
texts = [p + a for p, a in arithmetic_problems(80, 1)]
rows = datasets.Dataset.from_dict({"text": texts}).map(
    lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
)
train, evaluation = rows.select(range(64)), rows.select(range(64, 80))


def mark(trainer, method, line):
    marker = Path(trainer.args.output_dir) / f"{method}-rank{os.environ.get('RANK', '0')}.txt"
    marker.parent.mkdir(parents=True, exist_ok=True)
    with marker.open("a") as handle:
        handle.write(f"{line}\n")


def token_accuracy(prediction):
    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    mask = labels != -100
    return {"token_accuracy": float((predicted[mask] == labels[mask]).mean())}


class PenaltyTrainer(Trainer):
    def __init__(self, *args, alpha=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.alpha = alpha

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not return_outputs:  # training (evaluation asks for the outputs too)
            mark(
                self,
                "calls",
                f"{int(num_items_in_batch) if num_items_in_batch is not None else -1} "
                f"{self.accelerator.is_main_process} {type(self.accelerator.unwrap_model(model)).__name__}",
            )
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss + 0.0 * outputs.logits.float().pow(2).mean()
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        mark(self, "training_step", f"{self.state.global_step} {self.alpha} {self.state.max_steps}")
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        mark(self, "prediction_step", f"{self.state.global_step} {prediction_loss_only}")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        mark(self, "evaluate", f"{self.state.global_step} {' '.join(sorted(metrics))}")
        return metrics

    def log(self, logs, start_time=None):
        mark(self, "log", f"{self.state.global_step} {'loss' in logs} {start_time is not None}")
        logs["alpha"] = self.alpha
        super().log(logs, start_time)


args = TrainingArguments(
    output_dir=str(out),
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=4,
    logging_steps=1,
    save_strategy="no",
    eval_strategy="steps",
    eval_steps=2,
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
    eval_dataset=evaluation,
    processing_class=tokenizer,
    compute_metrics=token_accuracy,
    preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    alpha=0.3,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
result = trainer.train()
trainer.accelerator.wait_for_everyone()  # every rank's marker lines are written before rank 0 reads them
if trainer.is_world_process_zero():
    calls = {p.name: p.read_text().splitlines() for p in sorted(out.glob("*-rank*.txt"))}
    (out / "summary.json").write_text(
        json.dumps(
            {
                "global_step": result.global_step,
                "train_metrics": sorted(result.metrics),
                "log_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
                "log_keys": sorted({k for e in trainer.state.log_history for k in e}),
                "entries": [sorted(e) for e in trainer.state.log_history],
                "calls": calls,
                "pid": os.getpid(),
            }
        )
    )

if "real" in sys.argv[2:]:
    # the reference's work is done: real Trainer leaves gloo's threads (and a stream's) to the interpreter's exit,
    # which now and then aborts a rank ("terminate called without an active exception"); leave without it
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
