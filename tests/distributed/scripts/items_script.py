"""Trainer scripts whose collators need the dataset's own items (used by tests/distributed/test_facade_items.py).

``python|torchrun items_script.py OUT KIND [real]``; ``real`` uses transformers.Trainer (the reference), and
may name several kinds (``alpaca,classify``): each is trained in turn in the same processes (one launch),
into ``OUT/<KIND>``, with a tokenizer of its own.
- ``alpaca``: stanford_alpaca's ``train.py`` in small: a torch ``Dataset`` returning ``input_ids`` / ``labels``
  tensors, its own ``DataCollatorForSupervisedDataset`` calling ``pad_sequence``, embeddings resized for an
  added token; tiny Llama.
- ``classify``: text classification: ``BertForSequenceClassification``, ``DataCollatorWithPadding``,
  ``compute_metrics`` with accuracy, ``EarlyStoppingCallback`` on ``eval_accuracy``; ``evaluate()`` before
  training (21 items, 5 per batch on 2 ranks: a padded last batch).
"""

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    TrainingArguments,
)

if "real" in sys.argv[3:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once, tiny_bert_config

out = Path(sys.argv[1])  # the current run's folder
model_dir = out.parent / "tiny-model"
build_tiny_llama_once(model_dir)
tokenizer = None  # each run loads its own (``train``): alpaca adds a token to it


class SupervisedDataset(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        self.input_ids, self.labels = [], []
        for prompt, answer in arithmetic_problems(count, seed):
            ids = torch.tensor(tokenizer(prompt + answer)["input_ids"])
            labels = ids.clone()
            labels[: len(tokenizer(prompt)["input_ids"])] = -100
            self.input_ids.append(ids)
            self.labels.append(labels)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        return dict(input_ids=self.input_ids[i], labels=self.labels[i])


@dataclass
class DataCollatorForSupervisedDataset:
    tokenizer: object

    def __call__(self, instances):
        input_ids, labels = tuple([instance[key] for instance in instances] for key in ("input_ids", "labels"))
        input_ids = torch.nn.utils.rnn.pad_sequence(
            input_ids, batch_first=True, padding_value=self.tokenizer.pad_token_id
        )
        labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
        return dict(input_ids=input_ids, labels=labels, attention_mask=input_ids.ne(self.tokenizer.pad_token_id))


def accuracy(eval_pred):
    predictions, labels = eval_pred
    return {"accuracy": float((np.argmax(predictions, axis=-1) == labels).mean())}


def train(kind: str):
    """One run of ``kind`` into ``out``; rank 0 writes ``out/summary.json``; returns the trainer."""
    global tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    common = dict(
        output_dir=str(out),
        report_to="none",
        use_cpu=True,
        seed=3,
        disable_tqdm=True,
        per_device_train_batch_size=4,
        logging_steps=2,
    )
    if kind == "alpaca":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.resize_token_embeddings(len(tokenizer))
        args = TrainingArguments(
            **common, learning_rate=3e-3, lr_scheduler_type="constant", max_steps=10, save_strategy="no"
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=SupervisedDataset(64, 1),
            processing_class=tokenizer,
            data_collator=DataCollatorForSupervisedDataset(tokenizer),
        )
    else:
        torch.manual_seed(0)
        model = BertForSequenceClassification(tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id))

        def rows(n, seed):
            rng = np.random.default_rng(seed)
            labels = rng.integers(0, 2, n).tolist()
            texts = [
                ("x" if label else "y") + "".join(rng.choice(list("abcdefgh"), rng.integers(3, 12))) for label in labels
            ]
            data = datasets.Dataset.from_dict({"sentence": texts, "label": labels, "idx": list(range(n))})
            return data.map(lambda b: tokenizer(b["sentence"]), batched=True)

        args = TrainingArguments(
            **common,
            learning_rate=5e-3,
            num_train_epochs=6,
            eval_strategy="steps",
            eval_steps=4,
            save_strategy="steps",
            save_steps=4,
            save_total_limit=2,
            per_device_eval_batch_size=5,
            metric_for_best_model="eval_accuracy",
            load_best_model_at_end=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=rows(64, 1),
            eval_dataset=rows(21, 2),
            processing_class=tokenizer,
            data_collator=DataCollatorWithPadding(tokenizer),
            compute_metrics=accuracy,
            callbacks=[EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1.0)],
        )
    # the untrained classifier's evaluation: the same weights under both, so the same eval_loss
    before = trainer.evaluate() if kind == "classify" else {}
    result = trainer.train()
    if trainer.is_world_process_zero():
        history = trainer.state.log_history
        summary = {
            "global_step": result.global_step,
            "train_metrics": sorted(result.metrics),
            "loss_steps": [e["step"] for e in history if "loss" in e],
            # Trainer adds eval_model_preparation_time to every evaluation after an evaluate() before train()
            "eval_steps": [
                [e["step"], sorted(k for k in e if k.startswith("eval_") and k != "eval_model_preparation_time")]
                for e in history
                if "eval_loss" in e
            ],
            "losses": [e["loss"] for e in history if "loss" in e],
            "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")),
            "embeddings": int(trainer.model.get_input_embeddings().weight.shape[0]),
            "before": {k: before[k] for k in ("eval_loss", "eval_accuracy") if k in before},
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        print("SUMMARY", json.dumps(summary, default=str))
    return trainer


kinds = sys.argv[2].split(",")
root = out
for each in kinds:
    out = root / each if len(kinds) > 1 else root
    trainer = train(each)
# once, after the last run: Trainer.end() destroys the process group the next run's Trainer would use
trainer.end() if hasattr(trainer, "end") else None
if "real" in sys.argv[3:]:  # the reference leaves without finalisation (see facade_script.py); ours as scripts end
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
