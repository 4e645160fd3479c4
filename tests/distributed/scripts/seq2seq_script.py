"""A Seq2SeqTrainer script with ``predict_with_generate`` (used by test_seq2seq_runs.py).

Run as ``torchrun --nproc_per_node=2 seq2seq_script.py OUT [real]`` or ``python seq2seq_script.py OUT``;
``real`` uses transformers.Seq2SeqTrainer (the reference).  A tiny T5 learns to reverse digit strings;
``compute_metrics`` decodes the generated ids and records (``OUT/metric-calls.jsonl``), per call, the
predictions' shape and the longest generation; after training ``evaluate(max_length=6)`` and
``predict(..., max_new_tokens=3)`` pass their ``generate`` arguments.  The script's class overrides
``compute_loss`` (the model's loss plus a weight penalty: generation plus a custom loss) and counts its calls.
Rank 0 writes ``OUT/summary.json``.
"""

import json
import os
import random
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

if "real" in sys.argv[2:]:
    from transformers import Seq2SeqTrainer
else:
    from trainbridge import Seq2SeqTrainer

from trainbridge.demos.tiny_model import build_tokenizer


class PenalisedSeq2Seq(Seq2SeqTrainer):
    """The model's loss plus an L2 penalty on the weights; counts its training and evaluation calls."""

    calls = {"train": 0, "eval": 0}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self.calls["train" if model.training else "eval"] += 1
        penalty = sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)
        loss = loss + 1e-3 * penalty
        return (loss, outputs) if return_outputs else loss


out = Path(sys.argv[1])
model_dir = out.parent / "tiny-t5"
if not model_dir.exists():
    staging = model_dir.with_name(f"{model_dir.name}.{os.getpid()}")
    tok = build_tokenizer(staging)
    torch.manual_seed(0)
    config = T5Config(
        d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, vocab_size=len(tok),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
    )  # fmt: skip
    T5ForConditionalGeneration(config).save_pretrained(staging)
    try:
        staging.rename(model_dir)
    except OSError:  # another rank published first
        shutil.rmtree(staging)
tokenizer = build_tokenizer(out.parent / "tokenizer")
model = T5ForConditionalGeneration.from_pretrained(model_dir)


def rows(count: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    texts = ["".join(rng.choice("0123456789") for _ in range(rng.randrange(3, 8))) for _ in range(count)]
    return datasets.Dataset.from_dict({"source": texts, "target": [t[::-1] for t in texts]}).map(
        lambda b: {**tokenizer(b["source"]), "labels": tokenizer(text_target=b["target"])["input_ids"]},
        batched=True,
        remove_columns=["source", "target"],
    )


CALLS = out / "metric-calls.jsonl"


def compute_metrics(p):
    predictions, labels = np.asarray(p.predictions), np.asarray(p.label_ids)
    pad = tokenizer.pad_token_id
    kept = np.where(predictions != -100, predictions, pad)
    decoded = tokenizer.batch_decode(kept, skip_special_tokens=True)
    references = tokenizer.batch_decode(np.where(labels != -100, labels, pad), skip_special_tokens=True)
    longest = max(int(np.nonzero(row != pad)[0].max()) + 1 if (row != pad).any() else 0 for row in kept)
    if os.environ.get("RANK", "0") == "0":  # (a launched run calls it in its rank-0 worker)
        call = {"shape": list(predictions.shape), "longest": longest, "dtype": predictions.dtype.kind}
        CALLS.parent.mkdir(parents=True, exist_ok=True)
        with CALLS.open("a") as handle:
            handle.write(json.dumps(call) + "\n")
    return {
        "exact": float(np.mean([d == r for d, r in zip(decoded, references)])),
        "gen_len": float(np.mean([np.count_nonzero(row != pad) for row in kept])),
    }


args = Seq2SeqTrainingArguments(
    output_dir=str(out),
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    max_steps=4,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=2,
    save_steps=2,
    learning_rate=1e-3,
    predict_with_generate=True,
    generation_max_length=10,
    generation_num_beams=2,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=7,
)
trainer = PenalisedSeq2Seq(
    model=model,
    args=args,
    train_dataset=rows(48, 0),
    eval_dataset=rows(10, 1),
    processing_class=tokenizer,
    data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    compute_metrics=compute_metrics,
)
result = trainer.train()
evaluated = trainer.evaluate(max_length=6)
predicted = trainer.predict(rows(6, 2), metric_key_prefix="predict", max_new_tokens=3)
if trainer.is_world_process_zero():
    history = trainer.state.log_history
    summary = {
        "global_step": result.global_step,
        "log_steps": [e["step"] for e in history if "loss" in e],
        "losses": [e["loss"] for e in history if "loss" in e],
        "eval_losses": [e["eval_loss"] for e in history if "eval_exact" in e],
        "compute_loss_calls": PenalisedSeq2Seq.calls,
        "eval_steps": [e["step"] for e in history if "eval_exact" in e],
        "eval_keys": sorted({k for e in history if "eval_exact" in e for k in e if "runtime" not in k}),
        "eval_metrics": [[e["eval_exact"], e["eval_gen_len"]] for e in history if "eval_exact" in e],
        "log_keys": sorted({k for e in history if "loss" in e for k in e}),
        "final_keys": sorted(next(e for e in reversed(history) if "train_runtime" in e)),
        "evaluate_keys": sorted(evaluated),
        "predict_keys": sorted(predicted.metrics),
        "predict_shape": list(np.asarray(predicted.predictions).shape),
        "checkpoints": {
            c.name: sorted(f.name for f in c.iterdir()) for c in sorted(out.glob("checkpoint-*")) if c.is_dir()
        },
        "calls": [json.loads(line) for line in CALLS.read_text().splitlines()],
    }
    (out / "summary.json").write_text(json.dumps(summary))
