"""A transformers.Trainer script with its import changed to trainbridge's facade (used by the facade tests).

Run as ``torchrun --nproc_per_node=2 facade_script.py OUT [real] [dict|both]`` or ``python facade_script.py OUT
[real] [dict|both]``; ``real`` uses transformers.Trainer instead (the reference).  Tiny local model, arithmetic
data built in memory as a ``datasets.Dataset``; 37 validation rows (an uneven last batch on 2 ranks);
compute_metrics records which samples it saw.  ``dict``: ``eval_dataset={"a": 37 rows, "b": 11 rows}`` with
``metric_for_best_model="a_accuracy"`` (Trainer evaluates each set in turn, ``eval_<name>_`` metrics).
``both``: the plain run into ``OUT/plain``, then the ``dict`` one into ``OUT/dict``, in the same processes.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    EarlyStoppingCallback,
    TrainerCallback,
    TrainingArguments,
)

if "real" in sys.argv[2:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama

out = Path(sys.argv[1])
model_dir = out.parent / "tiny-model"
if not model_dir.exists():
    # Every rank runs this script: each builds into its own folder and the first rename publishes it
    # (a rank reading a half-written tokenizer file of another failed once in CI).
    staging = model_dir.with_name(f"{model_dir.name}.{os.getpid()}")
    build_tiny_llama(staging)
    try:
        staging.rename(model_dir)
    except OSError:  # another rank published first
        shutil.rmtree(staging)
tokenizer = AutoTokenizer.from_pretrained(model_dir)


def rows(n, seed):
    texts = [p + a for p, a in arithmetic_problems(n, seed)]
    return datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )


train = rows(96, 1)
val = rows(37, 2)


def preprocess_logits_for_metrics(logits, labels):
    return logits.argmax(-1)


def compute_metrics(eval_pred):
    preds, labels = eval_pred
    labels = labels[:, 1:]
    preds = preds[:, :-1]
    mask = labels != -100
    # the first character of each row (label 1: label 0 is <s>) identifies it; records order and count
    first = [int(row[1]) for row in eval_pred.label_ids]
    return {
        "accuracy": float((preds[mask] == labels[mask]).mean()),
        "num_rows": float(len(first)),
        "row_checksum": float(np.sum(np.arange(len(first)) * np.array(first))),
    }


class EventsAfterTraining(TrainerCallback):
    """The on_log / on_evaluate / on_predict calls this process's instance gets once ``recording`` is set (after
    train(): Trainer's evaluate() logs and fires on_evaluate, predict() fires on_predict), with the state's
    is_world_process_zero."""

    def __init__(self):
        self.recording, self.events = False, []

    def _record(self, name, state, values):
        if self.recording:
            self.events.append([name, state.is_world_process_zero, sorted(k for k in values if k != "epoch")])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._record("on_log", state, logs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._record("on_evaluate", state, metrics)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self._record("on_predict", state, metrics)


def run(eval_dict: bool):
    """Train, evaluate, predict and save into ``out``; rank 0 writes ``out/summary.json``."""
    after_training = EventsAfterTraining()
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        num_train_epochs=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        save_total_limit=2,
        per_device_eval_batch_size=5,
        metric_for_best_model="a_accuracy" if eval_dict else "accuracy",
        load_best_model_at_end=True,
        report_to="none",
        use_cpu=True,
        seed=3,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=train,
        eval_dataset={"a": val, "b": rows(11, 4)} if eval_dict else val,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        # threshold 1.0: no evaluation counts as an improvement, so training stops at the 2nd evaluation
        callbacks=[EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1.0), after_training],
    )
    result = trainer.train()
    after_training.recording = True
    metrics = trainer.evaluate()
    prediction = trainer.predict(val)
    trainer.save_model(str(out / "final"))
    if trainer.is_world_process_zero():
        summary = {
            "global_step": result.global_step,
            "train_metrics": sorted(result.metrics),
            "eval_metrics": metrics,
            "best": trainer.state.best_model_checkpoint,
            "log_keys": sorted({k for e in trainer.state.log_history for k in e}),
            "eval_log_steps": [
                [e["step"], sorted(k for k in e if k.startswith("eval_"))]
                for e in trainer.state.log_history
                if any(k.startswith("eval_") for k in e)
            ],
            "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")),
            "checkpoint_files": sorted(f.name for f in out.glob("checkpoint-*/*")),
            "final_files": sorted(f.name for f in (out / "final").iterdir()),
            "predict": {
                "shape": list(prediction.predictions.shape),
                "metrics": sorted(prediction.metrics),
                "labels_rows": len(prediction.label_ids),
            },
            "events_after_training": after_training.events,
            "state": {
                "global_step": trainer.state.global_step,
                "best_metric": trainer.state.best_metric,
                "epoch": trainer.state.epoch,
            },
            "expected_checksum": float(np.sum(np.arange(len(val)) * np.array([r[1] for r in val["input_ids"]]))),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        print("SUMMARY", json.dumps(summary, default=str))
    return trainer


if "both" in sys.argv[2:]:
    root = out
    out = root / "plain"
    run(eval_dict=False)
    out = root / "dict"
    trainer = run(eval_dict=True)
else:
    trainer = run(eval_dict="dict" in sys.argv[2:])
trainer.end()  # once, after the last run (transformers >= 5.18: finish trackers, leave the process group)
if "real" in sys.argv[2:]:
    # The reference leaves without the interpreter's finalisation: a gloo worker thread releasing a finished
    # collective's tensors then takes the GIL and is ended on the spot, which aborts the process ("terminate
    # called without an active exception"; torch's, see core.distributed.wait_for_idle_gloo_threads).
    # trainbridge's in-place run ends as scripts end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
