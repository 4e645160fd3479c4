"""A Trainer script passing ``optimizers=(SGD(momentum=0.9), LambdaLR)`` (used by test_trainer_optimizers.py).

Run as ``torchrun --nproc_per_node=2 optimizers_script.py OUT [real]`` or ``python optimizers_script.py OUT``;
``real`` uses transformers.Trainer (the reference).  A callback writes, from each rank's process, the
optimizer's class, each group's momentum, lr and size, and the scheduler's class at every step end, in
``OUT/optim-rank<RANK>.txt``, and whether that optimizer is the script's own object.
"""

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TrainerCallback,
    TrainingArguments,
)

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
texts = [p + a for p, a in arithmetic_problems(64, 1)]
train = datasets.Dataset.from_dict({"text": texts}).map(
    lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
)


class OptimizerProbe(TrainerCallback):
    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer under Trainer
        sched = getattr(lr_scheduler, "scheduler", lr_scheduler)
        marker = Path(args.output_dir) / f"optim-rank{os.environ.get('RANK', '0')}.txt"
        marker.parent.mkdir(parents=True, exist_ok=True)
        groups = [[g["momentum"], round(g["lr"], 8), len(g["params"])] for g in inner.param_groups]
        step = [state.global_step, type(inner).__name__, type(sched).__name__, groups, inner is SCRIPT_OPTIMIZER[0]]
        with marker.open("a") as handle:
            handle.write(json.dumps(step) + "\n")


embeddings = [p for n, p in model.named_parameters() if "embed" in n]
others = [p for n, p in model.named_parameters() if "embed" not in n]
optimizer = torch.optim.SGD([{"params": others}, {"params": embeddings, "lr": 0.02}], lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
SCRIPT_OPTIMIZER = [optimizer]

args = TrainingArguments(
    output_dir=str(out),
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=4,
    logging_steps=1,
    save_strategy="no",
    learning_rate=1e-3,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=3,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=train,
    processing_class=tokenizer,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    optimizers=(optimizer, scheduler),
    callbacks=[OptimizerProbe()],
)
result = trainer.train()
if trainer.is_world_process_zero():
    probes = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(out.glob("optim-*"))}
    (out / "summary.json").write_text(
        json.dumps(
            {
                "global_step": result.global_step,
                "learning_rates": [e["learning_rate"] for e in trainer.state.log_history if "loss" in e],
                "probes": probes,
                # the script's own optimizer object stepped, over the parameters of the script's own model
                "stepped_in_place": len(optimizer.state) > 0,
                "groups_hold_model_parameters": optimizer.param_groups[0]["params"][0] is others[0],
            }
        )
    )
