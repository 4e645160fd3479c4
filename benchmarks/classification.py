"""Sequence-classification fine-tune on the model's own loss: trainbridge vs ``transformers.Trainer``.

    python benchmarks/classification.py [--steps 30] [--repeats 2] [--out docs/benchmarks.md]

Builds a small ``BertForSequenceClassification`` from a config (hidden 128, 2 layers, 4 heads, 2 labels,
the character tokenizer of ``trainbridge.demos.tiny_model``), saved with ``save_pretrained``, and
``--rows`` JSONL rows of variable-length text (8..120 characters) with a label, deterministic from
``--seed``.  Then trains it ``--repeats`` times each way, interleaved (Trainer, trainbridge, Trainer, ...),
2 gloo ranks on CPU (``OMP_NUM_THREADS=1`` each):

- Trainer: this file as a worker under ``torchrun --nproc_per_node=2``; the text is tokenised
  (``truncation``, ``MAX_SEQ_LEN``) before ``trainer.train()``; ``DataCollatorWithPadding``;
- trainbridge: ``run_training(TrainingArgs(training_step="model_loss", ...), TorchrunArgs(nproc_per_node=2))``
  on the same file (its ``text`` column tokenised up to ``max_seq_len``; its default collator for a
  tokenizer is ``DataCollatorWithPadding``).

Both: ``PER_DEVICE`` items per micro-batch, ``ACCUMULATION`` micro-batches per optimizer step (so
``SAMPLES_PER_STEP`` samples per step), ``--steps`` steps, same learning rate (constant), seed, and the
same ``StepClock`` ``TrainerCallback`` (``benchmarks/trainer_run.py``) recording ``time.time()`` at every
``on_step_end`` (and ``time.process_time()``).  Throughput is samples of steps 2..N / (t_N - t_1) on
rank 0's clock: start-up (launch, imports, model load, tokenisation, the first step) is excluded; the
CPU-normalised throughput divides the same samples by the ranks' mean CPU seconds over those steps.
The ratio of each repetition (trainbridge / the Trainer run of the same repetition) is reported with its
median and range, beside each side's peak memory per rank (``StepClock``'s ``ru_maxrss`` at train end,
the largest of the ranks; on CUDA also ``torch.cuda.max_memory_allocated``) and its same-repetition ratio;
the result is written between the markers of ``--out`` (text outside them is kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS_DIR))

from throughput import (  # noqa: E402
    WORKER_ENVIRONMENT,
    WORLD_SIZE,
    machine_facts,
    run_torchrun_script,
    train_with_callbacks,
)
from trainer_run import LOGGING_STEPS, StepClock  # noqa: E402

PER_DEVICE = 8
"""Items per micro-batch on one rank (Trainer's ``per_device_train_batch_size``)."""
ACCUMULATION = 2
"""Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
SAMPLES_PER_STEP = PER_DEVICE * ACCUMULATION * WORLD_SIZE
MAX_SEQ_LEN = 128
"""Tokens per sample at most (the longest text is 120 characters + ``<s>``)."""
BERT: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=512,
    max_position_embeddings=MAX_SEQ_LEN,
    num_labels=2,
)
RESULTS_BEGIN = "<!-- classification results: begin (written by benchmarks/classification.py) -->"
RESULTS_END = "<!-- classification results: end -->"
WORDS = ("alpha", "beta", "gamma", "delta", "train", "model", "loss", "step", "rank", "batch", "good", "bad")


# ----------------------------------------------------------------------------- assets
def build_model(folder: Path, seed: int) -> Path:
    """A ``BertForSequenceClassification`` from ``BERT`` and the character tokenizer, saved to ``folder``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from trainbridge.demos.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(folder)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **BERT)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def write_rows(path: Path, count: int, seed: int) -> Path:
    """``count`` rows ``{"text", "label"}``: words joined by spaces, 8..120 characters; label 1 when
    "good" occurs more often than "bad"."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        target = rng.randint(8, 120)
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append(rng.choice(WORDS))
        text = " ".join(words)[:target]
        lines.append(json.dumps({"text": text, "label": int(text.count("good") > text.count("bad"))}))
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- the two runners
def run_trainer_worker(argv: Sequence[str]) -> None:
    """Under torchrun: train with ``transformers.Trainer`` (``DataCollatorWithPadding``)."""
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    parser = argparse.ArgumentParser()
    for name in ("--model", "--data", "--out"):
        parser.add_argument(name, type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    options = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    model = AutoModelForSequenceClassification.from_pretrained(options.model, dtype=torch.float32)
    rows = [json.loads(line) for line in options.data.read_text().splitlines() if line]
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=MAX_SEQ_LEN)
    dataset = [
        {"input_ids": ids, "attention_mask": mask, "labels": row["label"]}
        for ids, mask, row in zip(encoded["input_ids"], encoded["attention_mask"], rows)
    ]
    args = TrainingArguments(
        output_dir=str(options.out / "trainer-output"),
        use_cpu=True,
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=options.steps,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        seed=options.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=LOGGING_STEPS,
        disable_tqdm=True,
    )
    Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        callbacks=[StepClock(str(options.out))],
    ).train()
    if torch.distributed.is_initialized():  # without it gloo's threads abort the exit
        torch.distributed.destroy_process_group()


def run_trainbridge(model: Path, data: Path, out: Path, steps: int, learning_rate: float, seed: int) -> None:
    """``run_training`` with ``training_step="model_loss"`` and the ``StepClock`` HF callback."""
    fields: dict[str, object] = dict(
        model_path=model,
        data_path=data,
        ckpt_output_dir=out,
        training_step="model_loss",
        max_seq_len=MAX_SEQ_LEN,
        overlong_policy="truncate",
        per_device_batch_size=PER_DEVICE,
        effective_batch_size=SAMPLES_PER_STEP,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler="constant",
        seed=seed,
        device="cpu",
        logging_steps=LOGGING_STEPS,
        save_strategy="no",
        save_final_checkpoint=False,
        disable_tqdm=True,
    )
    train_with_callbacks(fields, [StepClock(str(out))], out / "run.log")


@dataclass(frozen=True)
class Measurement:
    """One run: samples/s, samples/CPU-s and the peak memory of its largest rank."""

    per_s: float
    per_cpu_s: float
    peak_rss_mib: float
    peak_cuda_mib: float | None = None


def samples_per_s(out: Path, steps: int) -> Measurement:
    """Samples of steps 2..N / (t_N - t_1) on rank 0's step-end clock, and the same samples / the ranks'
    mean CPU seconds over those steps (steadier on a shared machine: another job's load lengthens the
    wall clock, not the CPU time a step needs); the largest rank's peak RSS (and peak CUDA memory)."""
    clocks = [json.loads((out / f"clock-rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    times = clocks[0]["step_end_times"]
    if len(times) != steps:
        raise RuntimeError(f"rank 0 recorded {len(times)} step ends, expected {steps} ({out})")
    samples = (steps - 1) * SAMPLES_PER_STEP
    cpu = statistics.mean(c["step_end_cpu_times"][-1] - c["step_end_cpu_times"][0] for c in clocks)
    cuda = [c["peak_cuda_mib"] for c in clocks if "peak_cuda_mib" in c]
    return Measurement(
        samples / (times[-1] - times[0]), samples / cpu, max(c["peak_rss_mib"] for c in clocks), max(cuda, default=None)
    )


# ----------------------------------------------------------------------------- report
def _ratio_line(ratios: list[float]) -> str:
    return (
        f"median {statistics.median(ratios):.2f} (range {min(ratios):.2f}–{max(ratios):.2f}; "
        f"per repetition {', '.join(f'{r:.2f}' for r in ratios)})"
    )


def results_section(command: str, facts: list[str], runs: dict[str, list[Measurement]], steps: int, rows: int) -> str:
    """The generated part of the report (between the markers)."""
    cuda = all(m.peak_cuda_mib is not None for ms in runs.values() for m in ms)
    table = [
        "| runner | samples/s per repetition | median | samples/CPU-s per repetition | median "
        "| peak RSS per rank per repetition (MiB) |" + (" peak CUDA per rank (MiB) |" if cuda else ""),
        "|---|---|---:|---|---:|---|" + ("---|" if cuda else ""),
    ]
    for name, label in (("trainer", "transformers.Trainer"), ("trainbridge", "trainbridge (model_loss)")):
        wall, cpu = [m.per_s for m in runs[name]], [m.per_cpu_s for m in runs[name]]
        table.append(
            f"| {label} | {', '.join(f'{v:.1f}' for v in wall)} | {statistics.median(wall):.1f} "
            f"| {', '.join(f'{v:.1f}' for v in cpu)} | {statistics.median(cpu):.1f} "
            f"| {', '.join(f'{m.peak_rss_mib:,.0f}' for m in runs[name])} |"
            + (f" {', '.join(f'{m.peak_cuda_mib:,.0f}' for m in runs[name])} |" if cuda else "")
        )
    pairs = list(zip(runs["trainbridge"], runs["trainer"]))
    memory = [f"- peak RSS per rank: {_ratio_line([tb.peak_rss_mib / tr.peak_rss_mib for tb, tr in pairs])}"]
    if cuda:
        memory.append(
            f"- peak CUDA memory per rank: {_ratio_line([tb.peak_cuda_mib / tr.peak_cuda_mib for tb, tr in pairs])}"  # type: ignore[operator]
        )
    return "\n".join(
        [
            RESULTS_BEGIN,
            "",
            "```",
            command,
            "```",
            "",
            *facts,
            f"- BertForSequenceClassification (hidden 128, 2 layers), {rows} text rows (8..120 characters), "
            f"{steps} optimizer steps of {SAMPLES_PER_STEP} samples ({PER_DEVICE} per micro-batch x "
            f"{ACCUMULATION} accumulation x {WORLD_SIZE} ranks); samples/s over steps 2..{steps}; "
            f"{len(pairs)} repetition(s), interleaved",
            "",
            *table,
            "",
            "trainbridge / Trainer, same repetition:",
            "",
            f"- wall clock (samples/s): {_ratio_line([tb.per_s / tr.per_s for tb, tr in pairs])}",
            f"- CPU-normalised (samples/CPU-s): {_ratio_line([tb.per_cpu_s / tr.per_cpu_s for tb, tr in pairs])}",
            *memory,
            "",
            RESULTS_END,
        ]
    )


def write_report(path: Path, section: str) -> None:
    """Replace the text between the markers of ``path`` with ``section`` (append it when they are missing)."""
    text = path.read_text() if path.exists() else ""
    start, end = text.find(RESULTS_BEGIN), text.find(RESULTS_END)
    if start < 0 or end < start:
        text = text.rstrip() + "\n\n" + section + "\n"
    else:
        text = text[:start] + section + text[end + len(RESULTS_END) :]
    path.write_text(text)


# ----------------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Build model and data, run Trainer and trainbridge ``--repeats`` times each, report the ratio."""
    parser = argparse.ArgumentParser(prog="classification.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (>= 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved")
    parser.add_argument("--rows", type=int, default=3000, help="text rows in the data file")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="markdown report to update (docs/benchmarks.md)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep model, data and logs here")
    parser.add_argument("--only", nargs="+", choices=["trainer", "trainbridge"], default=["trainer", "trainbridge"])
    parser.add_argument("--json", type=Path, default=None, help="also write every run's measurement here")
    options = parser.parse_args(argv)
    if options.steps < 3:
        parser.error("--steps must be at least 3")
    os.environ.update(WORKER_ENVIRONMENT)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="trainbridge-cls-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    model = build_model(workdir / "model", options.seed)
    data = write_rows(workdir / "train.jsonl", options.rows, options.seed + 1)
    print(f"model, data and logs in {workdir}", flush=True)
    runs: dict[str, list[Measurement]] = {name: [] for name in options.only}
    for repeat in range(options.repeats):
        for name in runs:
            out = workdir / f"run{repeat}-{name}"
            out.mkdir(parents=True)
            launch = time.time()
            if name == "trainer":
                run_torchrun_script(
                    Path(__file__).name,
                    [
                        "--worker",
                        "--model",
                        str(model),
                        "--data",
                        str(data),
                        "--out",
                        str(out),
                        "--steps",
                        str(options.steps),
                        "--learning-rate",
                        str(options.learning_rate),
                        "--seed",
                        str(options.seed),
                    ],
                    out / "run.log",
                )
            else:
                run_trainbridge(model, data, out, options.steps, options.learning_rate, options.seed)
            runs[name].append(samples_per_s(out, options.steps))
            print(
                f"[{repeat + 1}/{options.repeats}] {name:12} {runs[name][-1].per_s:7.1f} samples/s  "
                f"{runs[name][-1].per_cpu_s:7.1f} samples/CPU-s  {runs[name][-1].peak_rss_mib:6.0f} MiB peak RSS  "
                f"wall {time.time() - launch:5.1f} s",
                flush=True,
            )
    facts.append("- load average after the run: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    command = "python benchmarks/classification.py " + " ".join(sys.argv[1:] if argv is None else argv)
    section = results_section(command.strip(), facts, runs, options.steps, options.rows) if len(runs) == 2 else ""
    print(section)
    if options.out is not None and section:
        write_report(options.out, section)
        print(f"wrote {options.out}")
    if options.json is not None:
        measured = {name: [dataclasses.asdict(m) for m in side] for name, side in runs.items()}
        options.json.write_text(json.dumps({"runs": measured, "failures": []}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        run_trainer_worker(sys.argv[2:])
    else:
        sys.exit(main())
