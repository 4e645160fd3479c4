"""A Trainer script run twice in one ``output_dir``: the second run resumes (used by the resume-history test).

``torchrun --nproc_per_node=2 resume_script.py OUT MAX_STEPS [resume] [real]`` or ``python resume_script.py
OUT MAX_STEPS [resume] [real]``; ``real`` uses transformers.Trainer (the reference), ``resume`` calls
``trainer.train(resume_from_checkpoint=True)``.  Tiny local model, ``datasets`` rows, a collator, evaluation and
saving every 4 steps, ``load_best_model_at_end`` and ``EarlyStoppingCallback`` (threshold 1.0: no evaluation
counts as an improvement, so its counter grows by one per evaluation and, restored on resume, stops training
at the 4th evaluation).  Rank 0 writes ``OUT/summary-<MAX_STEPS>.json``: ``trainer.state`` after ``train()`` and
the ``trainer_state.json`` that ``save_state()`` writes.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import datasets
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    EarlyStoppingCallback,
    TrainingArguments,
)

if "real" in sys.argv[3:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama

out = Path(sys.argv[1])
max_steps = int(sys.argv[2])
model_dir = out.parent / "tiny-model"
if not model_dir.exists():
    staging = model_dir.with_name(f"{model_dir.name}.{os.getpid()}")  # every rank builds; the first publishes
    build_tiny_llama(staging)
    try:
        staging.rename(model_dir)
    except OSError:
        shutil.rmtree(staging)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)


def rows(n, seed):
    texts = [p + a for p, a in arithmetic_problems(n, seed)]
    return datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )


def compute_metrics(eval_pred):
    preds, labels = eval_pred
    labels, preds = labels[:, 1:], preds[:, :-1]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


args = TrainingArguments(
    output_dir=str(out),
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    lr_scheduler_type="constant",
    max_steps=max_steps,
    logging_steps=2,
    eval_strategy="steps",
    eval_steps=4,
    save_strategy="steps",
    save_steps=4,
    per_device_eval_batch_size=5,
    metric_for_best_model="accuracy",
    load_best_model_at_end=True,
    include_num_input_tokens_seen="non_padding",
    restore_callback_states_from_checkpoint=True,
    report_to="none",
    use_cpu=True,
    seed=3,
    disable_tqdm=True,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=rows(96, 1),
    eval_dataset=rows(10, 2),
    processing_class=tokenizer,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    compute_metrics=compute_metrics,
    preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    callbacks=[EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=1.0)],
)
trainer.train(resume_from_checkpoint=True if "resume" in sys.argv[3:] else None)
trainer.save_state()
if trainer.is_world_process_zero():
    state = trainer.state
    saved = json.loads((out / "trainer_state.json").read_text())
    summary = {
        "global_step": state.global_step,
        "rows": [[e["step"], sorted(e)] for e in state.log_history],
        "saved_rows": [[e["step"], sorted(e)] for e in saved["log_history"]],
        "accuracy": [[e["step"], e["eval_accuracy"]] for e in state.log_history if "eval_accuracy" in e],
        "last_tokens": state.log_history[-1].get("num_input_tokens_seen"),
        "best_metric": state.best_metric,
        "best_global_step": state.best_global_step,
        "best_model_checkpoint": state.best_model_checkpoint,
        "total_flos": state.total_flos,
        "num_input_tokens_seen": state.num_input_tokens_seen,
        "stateful_callbacks": state.stateful_callbacks,
        "saved": {
            k: saved[k]
            for k in (
                "global_step",
                "best_metric",
                "best_global_step",
                "best_model_checkpoint",
                "total_flos",
                "num_input_tokens_seen",
                "stateful_callbacks",
            )
        },
    }
    (out / f"summary-{max_steps}.json").write_text(json.dumps(summary, indent=1, default=str))
trainer.end()
if "real" in sys.argv[3:]:  # the reference leaves without finalisation (see facade_script.py); ours as scripts end
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
