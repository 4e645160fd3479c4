"""A Trainer script that leans on Trainer's own code from the outside (used by test_trainer_own_code.py):

- its ``evaluate`` override runs its own loop, as transformers' question-answering example does
  (``self.get_eval_dataloader``, ``self.evaluation_loop``, a post-processing function, ``self.compute_metrics``,
  ``self.log``, ``self.callback_handler.on_evaluate``), never calling ``super().evaluate()``;
- the script calls ``trainer.get_train_dataloader()`` to print a sample batch before training;
- its ``compute_loss`` counts its calls on the instance (state that must still be there after ``train()``);
- it checks ``isinstance(trainer, transformers.Trainer)``, as third-party code taking a ``trainer`` does;
- it saves checkpoints, the final model and the metrics files;
- then a second Trainer (one launch, as a continual script) trains on items that are tuples (a
  ``TensorDataset``), with a collator returning a tuple and ``compute_loss``/``prediction_step`` overrides that
  unpack it (``remove_unused_columns=False``), an evaluation set of tuples too, with gradient accumulation and
  an epoch's length from the DataLoader: Trainer hands any item to the collator and any batch to the step; its
  best checkpoint (``metric_for_best_model``, ``load_best_model_at_end``, ``save_total_limit=1``) is chosen from
  what Trainer's own ``evaluate()`` gives, and is the one checkpoint left after ``train()``;
- then a third: a masked LM whose decoder weight and bias are tied (``BertForMaskedLM``), whose checkpoint and
  ``save_model()`` hold Trainer's tensors (issue 29 failure 6: not the tied ones twice).

Run as ``torchrun --nproc_per_node=2 own_loop_script.py OUT [real]`` or ``python own_loop_script.py OUT``;
``real`` uses transformers.Trainer (the reference).  Rank 0 writes ``OUT/summary.json``.
"""

import json
import os
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    TrainingArguments,
)

if "real" in sys.argv[2:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once, tiny_bert_config

out = Path(sys.argv[1])
model_dir = out.parent / "tiny-model"
build_tiny_llama_once(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
texts = [p + a for p, a in arithmetic_problems(48, 1)]
rows = datasets.Dataset.from_dict({"text": texts}).map(
    lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
)
train, evaluation = rows.select(range(32)), rows.select(range(32, 48))


def post_process(output):
    """Token accuracy from the evaluation loop's predictions (the QA example's post-processing step)."""
    predicted, labels = np.asarray(output.predictions)[:, :-1], np.asarray(output.label_ids)[:, 1:]
    mask = labels != -100
    return {"token_accuracy": float((predicted[mask] == labels[mask]).mean())}


class OwnLoopTrainer(Trainer):
    def __init__(self, *args, post_process_function=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.post_process_function = post_process_function
        self.loss_calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.loss_calls += 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        eval_dataloader = self.get_eval_dataloader(eval_dataset)
        compute_metrics = self.compute_metrics
        self.compute_metrics = None  # metrics after post-processing, as the QA example
        try:
            output = self.evaluation_loop(
                eval_dataloader, description="Evaluation", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
            )
        finally:
            self.compute_metrics = compute_metrics
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in self.post_process_function(output).items()}
        metrics.update(output.metrics)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


args = TrainingArguments(
    output_dir=str(out),
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    max_steps=4,
    logging_steps=1,
    save_strategy="steps",
    save_steps=2,
    eval_strategy="steps",
    eval_steps=2,
    learning_rate=1e-2,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=3,
)
trainer = OwnLoopTrainer(
    model=model,
    args=args,
    train_dataset=train,
    eval_dataset=evaluation,
    processing_class=tokenizer,
    preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    post_process_function=post_process,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
is_trainer = isinstance(trainer, transformers.Trainer)
sample = next(iter(trainer.get_train_dataloader()))  # a sample batch, printed before training
print("sample batch:", {k: tuple(v.shape) for k, v in sample.items()})
result = trainer.train()
trainer.save_metrics("train", result.metrics)
metrics = trainer.evaluate()
trainer.save_metrics("eval", metrics)
trainer.save_model(str(out / "final"))
trainer.save_state()
loss_calls = trainer.accelerator.gather(torch.tensor([trainer.loss_calls])).tolist()


def tuple_items(rows):
    """``(input_ids, attention_mask, labels)`` tuples of tensors, padded to one length (a TensorDataset)."""
    width = max(len(ids) for ids in rows["input_ids"])
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows["input_ids"]):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return torch.utils.data.TensorDataset(ids, mask, ids.masked_fill(mask == 0, -100))


def collate_tuples(items):
    """A batch as a tuple of stacked tensors (the items' own order)."""
    return tuple(torch.stack(column) for column in zip(*items, strict=True))


class TupleTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_calls = self.prediction_calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.loss_calls += 1
        input_ids, attention_mask, labels = inputs
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.prediction_calls += 1
        input_ids, attention_mask, labels = self._prepare_inputs(inputs)
        with torch.no_grad():
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        if prediction_loss_only:
            return outputs.loss.detach(), None, None
        return outputs.loss.detach(), outputs.logits.argmax(-1), labels


tuple_out = out / "tuples"
tuple_trainer = TupleTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    args=TrainingArguments(
        output_dir=str(tuple_out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=4,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-2,
        remove_unused_columns=False,
        metric_for_best_model="loss",  # the highest eval_loss: the first evaluation's, not the last checkpoint
        greater_is_better=True,
        load_best_model_at_end=True,
        save_total_limit=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=5,
    ),
    train_dataset=tuple_items(train),
    eval_dataset=tuple_items(evaluation),
    data_collator=collate_tuples,
)
tuple_result = tuple_trainer.train()
tuple_trainer.save_metrics("train", tuple_result.metrics)
tuple_metrics = tuple_trainer.evaluate()
tuple_trainer.save_metrics("eval", tuple_metrics)
tuple_trainer.save_model(str(tuple_out / "final"))
tuple_calls = tuple_trainer.accelerator.gather(
    torch.tensor([tuple_trainer.loss_calls, tuple_trainer.prediction_calls])
).tolist()

mlm_out = out / "masked-lm"
mlm_tokenizer = AutoTokenizer.from_pretrained(model_dir)
mlm_tokenizer.add_special_tokens({"mask_token": "<mask>"})
torch.manual_seed(0)  # the same model on every rank
mlm_model = BertForMaskedLM(tiny_bert_config(len(mlm_tokenizer), pad_token_id=mlm_tokenizer.pad_token_id))
mlm_trainer = Trainer(
    model=mlm_model,
    args=TrainingArguments(
        output_dir=str(mlm_out),
        per_device_train_batch_size=4,
        max_steps=2,
        save_steps=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    ),
    train_dataset=train,
    data_collator=DataCollatorForLanguageModeling(mlm_tokenizer, mlm=True),
)
mlm_result = mlm_trainer.train()
mlm_trainer.save_model(str(mlm_out / "final"))
if trainer.is_world_process_zero():

    def tensor_names(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            return sorted(handle.keys())

    def side(folder, result, metrics, state):
        """What a run left: steps, logs, checkpoints and their tensors, results files, the best checkpoint (and
        trainbridge's metrics file's evaluations)."""
        history, metrics_file = state.log_history, folder / "trainbridge" / "metrics.jsonl"
        checkpoints = sorted(p.name for p in folder.glob("checkpoint-*"))
        return {
            "global_step": result.global_step,
            "train_metrics": sorted(result.metrics),
            "losses": [(e["step"], e["loss"]) for e in history if "loss" in e],
            "eval_entries": [(e["step"], sorted(e)) for e in history if "eval_loss" in e],
            "eval_metrics": sorted(metrics),
            "checkpoints": checkpoints,
            "checkpoint_files": {c: sorted(p.name for p in (folder / c).iterdir()) for c in checkpoints},
            "checkpoint_tensors": tensor_names(folder / checkpoints[-1]),
            "final_tensors": tensor_names(folder / "final"),
            "results_files": sorted(p.name for p in folder.glob("*results.json")),
            "best": [Path(state.best_model_checkpoint or "-").name, state.best_metric, state.best_global_step],
            "metrics_file_evaluations": [
                line["step"] for line in map(json.loads, metrics_file.read_text().splitlines()) if "eval_loss" in line
            ]
            if metrics_file.is_file()
            else None,
        }

    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    (out / "summary.json").write_text(
        json.dumps(
            {
                "is_trainer": is_trainer,
                "sample_keys": sorted(sample),
                "sample_rows": int(sample["input_ids"].shape[0]),
                "global_step": result.global_step,
                "train_metrics": sorted(result.metrics),
                "log_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
                "eval_entries": [
                    (e["step"], sorted(e)) for e in trainer.state.log_history if "eval_token_accuracy" in e
                ],
                "eval_metrics": sorted(metrics),
                "loss_calls": loss_calls,
                "checkpoints": checkpoints,
                "checkpoint_files": {c: sorted(p.name for p in (out / c).iterdir()) for c in checkpoints},
                "checkpoint_tensors": tensor_names(out / checkpoints[-1]),
                "final_tensors": tensor_names(out / "final"),
                "results_files": sorted(p.name for p in out.glob("*results.json")),
                "masked_lm": {
                    "global_step": mlm_result.global_step,
                    "checkpoint_tensors": tensor_names(mlm_out / "checkpoint-2"),
                    "final_tensors": tensor_names(mlm_out / "final"),
                },
                "tuples": {
                    **side(tuple_out, tuple_result, tuple_metrics, tuple_trainer.state),
                    "calls": tuple_calls,
                },
            }
        )
    )

if "real" in sys.argv[2:]:
    # the reference's work is done: real Trainer leaves gloo's threads to the interpreter's exit (see
    # subclass_script.py); leave without it
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
