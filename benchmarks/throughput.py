"""Training throughput of trainbridge vs ``transformers.Trainer`` vs a bare DDP loop, in one run.

    python benchmarks/throughput.py [--steps 40] [--repeats 2] [--out docs/benchmarks.md]

Builds the 3.2M-parameter benchmark Llama (``trainbridge.demos.tiny_model.build_benchmark_llama``), its
character tokenizer and two pre-tokenized JSONL data sets, deterministic from ``--seed``: fixed-length
(every sample 128 tokens) and variable-length (lengths uniform in 32..128, mean 80).  Then runs every
configuration of ``CONFIGS`` with 2 gloo ranks (``OMP_NUM_THREADS=1`` each), one after the other, the
whole list ``--repeats`` times (interleaved, so slow phases of a shared machine hit every configuration):
bare DDP and Trainer runs under ``torchrun --nproc_per_node=2``, trainbridge runs through
``run_training(TrainingArgs(...), TorchrunArgs(nproc_per_node=2))`` with a Hugging Face callback attached.

Every run takes ``--steps`` optimizer steps of 8 samples (4 per rank), same learning rate, same seed.
Every rank records ``time.time()`` and ``time.process_time()`` at every optimizer step end and its
non-padding tokens.  Throughput is ``non-padding tokens of steps 2..N / (t_N - t_1)`` (all ranks, rank 0's
clock); the CPU-normalised throughput divides the same tokens by the ranks' mean CPU seconds over those
steps (steadier on a shared machine); start-up is launch (the driver starting torchrun or calling
``run_training``) to the end of step 1.  The tables (best run of each configuration, ratios) are printed and written
between the result markers of ``--out``; text outside the markers (the analysis) is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from trainbridge.launch.console import console_to

BENCHMARKS_DIR = Path(__file__).resolve().parent
WORLD_SIZE = 2
SAMPLES_PER_STEP = 8
"""Samples per optimizer step, both ranks together (4 per rank, no gradient accumulation)."""
SEQ_LEN = 128
"""Length of every fixed-length sample, and the longest variable-length one."""
VARIABLE_MIN_LEN = 32
"""Shortest variable-length sample: lengths are uniform in ``VARIABLE_MIN_LEN..SEQ_LEN`` (mean 80)."""
FIRST_TOKEN_ID = 4
"""Sample token ids are drawn from ``FIRST_TOKEN_ID..vocab-1`` (ids 0..3 are the special tokens)."""
RESULTS_BEGIN = "<!-- throughput results: begin (written by benchmarks/throughput.py) -->"
RESULTS_END = "<!-- throughput results: end -->"

Runner = Literal["bare", "trainer", "trainbridge"]
DataKind = Literal["fixed", "variable"]
Metric = Literal["tokens_per_s", "tokens_per_cpu_s"]
METRIC_UNITS: dict[Metric, str] = {"tokens_per_s": "tokens/s", "tokens_per_cpu_s": "tokens/CPU-s"}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration: who trains, on which data, with which options."""

    key: str
    """Short name used in file names and to pick configurations (``--only``)."""
    label: str
    """Row label of the table."""
    runner: Runner
    data: DataKind
    trainer_collator: Literal["padding", "flattening"] = "padding"
    trainer_tuned: bool = False
    trainbridge_packing: Literal["padding_free", "padded"] = "padding_free"
    trainbridge_max_batch_len: int = 4 * SEQ_LEN
    """Token budget of one micro-batch on one rank; the default holds a rank's 4 samples in one micro-batch."""
    trainbridge_varlen_sdpa: bool = True
    """``TrainingArgs.varlen_sdpa``: padding-free rows attend per sample (``False``: transformers' masked sdpa)."""
    environment: tuple[tuple[str, str], ...] = ()
    """Variables set for this run's processes only."""


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("bare", "bare DDP loop", "bare", "fixed"),
    BenchConfig("trainer_default", "Trainer default", "trainer", "fixed"),
    BenchConfig("trainer_tuned", "Trainer tuned", "trainer", "fixed", trainer_tuned=True),
    BenchConfig("tb_fixed", "trainbridge padding-free + HF callback", "trainbridge", "fixed"),
    BenchConfig(
        "tb_fixed_padded", "trainbridge padded + HF callback", "trainbridge", "fixed", trainbridge_packing="padded"
    ),
    BenchConfig("trainer_padded_var", "Trainer padded (default collator)", "trainer", "variable"),
    BenchConfig(
        "trainer_flat_var",
        "Trainer DataCollatorWithFlattening (tuned)",
        "trainer",
        "variable",
        trainer_collator="flattening",
        trainer_tuned=True,
    ),
    BenchConfig("tb_var", "trainbridge padding-free + HF callback", "trainbridge", "variable"),
    BenchConfig(
        "tb_var_masked",
        "trainbridge padding-free, masked sdpa (varlen_sdpa=False)",
        "trainbridge",
        "variable",
        trainbridge_varlen_sdpa=False,
    ),
    BenchConfig(
        "tb_var_padded", "trainbridge padded + HF callback", "trainbridge", "variable", trainbridge_packing="padded"
    ),
)
"""Every configuration, in run order; fixed-length ones first."""

EXPERIMENTS: tuple[BenchConfig, ...] = (
    BenchConfig(
        "tb_fixed_kept",
        "trainbridge padding-free, freed heap kept (MALLOC_TRIM/MMAP_THRESHOLD_)",
        "trainbridge",
        "fixed",
        environment=(("MALLOC_TRIM_THRESHOLD_", str(1 << 30)), ("MALLOC_MMAP_THRESHOLD_", str(32 << 20))),
    ),
    BenchConfig(
        "tb_var_256",
        "trainbridge padding-free, max_batch_len=256",
        "trainbridge",
        "variable",
        trainbridge_max_batch_len=256,
    ),
    BenchConfig(
        "tb_var_192",
        "trainbridge padding-free, max_batch_len=192",
        "trainbridge",
        "variable",
        trainbridge_max_batch_len=192,
    ),
)
"""Further settings, run with ``--experiments``: glibc's allocator told to keep a step's freed heap for the next
step (trim threshold 1 GiB, mmap threshold 32 MiB: fewer page faults per step in one process, slower than glibc's
defaults on 2 DDP ranks here, so not trainbridge's default), smaller token budgets (gradient accumulation)."""
ALL_CONFIGS = CONFIGS + EXPERIMENTS


@dataclass(frozen=True)
class Assets:
    """The model directory and the two data files every run reads."""

    model: Path
    fixed: Path
    variable: Path

    def data(self, kind: DataKind) -> Path:
        """The data file of ``kind``."""
        return self.fixed if kind == "fixed" else self.variable


@dataclass(frozen=True)
class Measurement:
    """One run of one configuration."""

    config: BenchConfig
    repeat: int
    """Repetition of the whole list this run belongs to (0-based)."""
    tokens_per_s: float
    """Non-padding tokens of steps 2..N (all ranks) / (t_N - t_1)."""
    tokens_per_cpu_s: float
    """Non-padding tokens of steps 2..N / the ranks' mean CPU seconds over those steps: the throughput the
    run would have with one uncontended core per rank (less sensitive to other load on the machine)."""
    start_to_first_step_s: float
    """Launch to the end of optimizer step 1 (rank 0)."""
    wall_s: float
    """Launch to exit of the whole run."""
    tokens: int
    """Non-padding tokens of steps 2..N."""
    peak_rss_mib: float = 0.0
    """The largest peak RSS of a rank (``ru_maxrss`` at train end; 0 when the run did not record it)."""


@dataclass
class Results:
    """Every measurement, grouped by configuration key, in run order."""

    runs: dict[str, list[Measurement]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    """One line per run that failed (configuration, repetition, error, log): reported, not measured."""

    def add(self, measurement: Measurement) -> None:
        """Record one run."""
        self.runs.setdefault(measurement.config.key, []).append(measurement)

    def best(self, key: str, metric: Metric = "tokens_per_s") -> Measurement | None:
        """The run of ``key`` with the highest ``metric`` (noise on a shared machine only slows runs down)."""
        runs = self.runs.get(key)
        return max(runs, key=lambda m: getattr(m, metric)) if runs else None

    def paired_ratios(self, key: str, reference: str, metric: Metric) -> list[float]:
        """``metric`` of ``key`` / that of ``reference`` in the same repetition, for every repetition
        where both ran: configurations of one repetition run minutes apart, so these ratios see less of
        a shared machine's slow phases than a ratio of two best runs does."""
        references = {m.repeat: getattr(m, metric) for m in self.runs.get(reference, [])}
        return [getattr(m, metric) / references[m.repeat] for m in self.runs.get(key, []) if m.repeat in references]


# ----------------------------------------------------------------------------- assets
def write_samples(path: Path, lengths: Sequence[int], vocab_size: int, seed: int) -> Path:
    """Write pre-tokenized samples (``input_ids`` and ``labels`` = ``input_ids``) of ``lengths``."""
    rng = random.Random(seed)
    lines = []
    for length in lengths:
        ids = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(length)]
        lines.append(json.dumps({"input_ids": ids, "labels": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def build_assets(root: Path, steps: int, seed: int) -> Assets:
    """Model, tokenizer, fixed and variable data under ``root`` (exactly ``steps`` steps of samples)."""
    from trainbridge.demos.tiny_model import build_benchmark_llama

    model = build_benchmark_llama(root / "model", seed=seed)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    count = steps * SAMPLES_PER_STEP
    rng = random.Random(seed)
    variable_lengths = [rng.randint(VARIABLE_MIN_LEN, SEQ_LEN) for _ in range(count)]
    return Assets(
        model=model,
        fixed=write_samples(root / "fixed.jsonl", [SEQ_LEN] * count, vocab_size, seed + 1),
        variable=write_samples(root / "variable.jsonl", variable_lengths, vocab_size, seed + 2),
    )


# ----------------------------------------------------------------------------- running one configuration


WORKER_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
"""Set in this process (so every run inherits it): one intra-op thread per rank, no tokenizer threads."""


def run_torchrun_script(script: str, script_args: list[str], log_path: Path) -> None:
    """``python -m torch.distributed.run --nproc-per-node 2 benchmarks/<script> ...``; raises on failure."""
    from trainbridge.launch.launcher import free_port

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD_SIZE),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(BENCHMARKS_DIR / script),
        *script_args,
    ]
    with log_path.open("ab") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise RuntimeError(f"{script} failed with exit code {completed.returncode}; see {log_path}")


def train_with_callbacks(fields: dict[str, object], callbacks: list[object], log_path: Path) -> None:
    """``run_training(TrainingArgs(**fields), 2 ranks, callbacks=callbacks)``, its output into ``log_path``; a tree
    from before ``run_training`` took ``callbacks`` (``before_after.py``'s BEFORE side) takes them as a field."""
    from trainbridge import TorchrunArgs, TrainingArgs, run_training

    torchrun = TorchrunArgs(nproc_per_node=WORLD_SIZE)
    with console_to(log_path):
        try:
            run_training(TrainingArgs(**fields), torchrun, timeout_s=600, callbacks=callbacks)  # type: ignore[arg-type]
        except TypeError as error:  # raised before any launch
            if "'callbacks'" not in str(error):
                raise
            run_training(TrainingArgs(**fields, callbacks=callbacks), torchrun, timeout_s=600)  # type: ignore[arg-type]


def run_trainbridge(
    config: BenchConfig, assets: Assets, steps: int, learning_rate: float, seed: int, out: Path, log_path: Path
) -> None:
    """``run_training`` with the ``StepClock`` HF callback (driven by trainbridge's HuggingFaceCallbacks)."""
    from trainer_run import LOGGING_STEPS, StepClock

    fields: dict[str, object] = dict(
        model_path=assets.model,
        data_path=assets.data(config.data),
        ckpt_output_dir=out,
        max_seq_len=SEQ_LEN,
        max_batch_len=config.trainbridge_max_batch_len,
        effective_batch_size=SAMPLES_PER_STEP,
        packing=config.trainbridge_packing,
        varlen_sdpa=config.trainbridge_varlen_sdpa,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler="constant",
        seed=seed,
        device="cpu",
        logging_steps=LOGGING_STEPS,
        save_strategy="no",
        save_final_checkpoint=False,
        include_num_input_tokens_seen="non_padding",  # StepClock reads state.num_input_tokens_seen (real tokens)
    )
    train_with_callbacks(fields, [StepClock(str(out))], log_path)


def run_config(
    config: BenchConfig, assets: Assets, steps: int, learning_rate: float, seed: int, out: Path, repeat: int
) -> Measurement:
    """Run ``config`` once (repetition ``repeat``) into the fresh folder ``out`` and measure it."""
    out.mkdir(parents=True)
    log_path = out / "run.log"
    common = [
        "--model",
        str(assets.model),
        "--data",
        str(assets.data(config.data)),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--learning-rate",
        str(learning_rate),
        "--seed",
        str(seed),
    ]
    saved = {name: os.environ.get(name) for name, _ in config.environment}
    os.environ.update(config.environment)
    launch = time.time()
    try:
        run_runner(config, assets, common, steps, learning_rate, seed, out, log_path)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return measure(config, repeat, out, steps, launch, time.time() - launch)


def run_runner(
    config: BenchConfig,
    assets: Assets,
    common: list[str],
    steps: int,
    learning_rate: float,
    seed: int,
    out: Path,
    log_path: Path,
) -> None:
    """Start ``config``'s runner (bare loop, Trainer script or ``run_training``) and wait for it."""
    if config.runner == "bare":
        run_torchrun_script("bare_ddp.py", common, log_path)
    elif config.runner == "trainer":
        extra = ["--collator", config.trainer_collator] + (["--tuned"] if config.trainer_tuned else [])
        run_torchrun_script("trainer_run.py", common + extra, log_path)
    else:
        run_trainbridge(config, assets, steps, learning_rate, seed, out, log_path)


def measure(config: BenchConfig, repeat: int, out: Path, steps: int, launch: float, wall_s: float) -> Measurement:
    """Throughput and start-up of a finished run from its ``clock-rank*.json`` files."""
    clocks = [json.loads((out / f"clock-rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    times = clocks[0]["step_end_times"]
    if len(times) != steps:
        raise RuntimeError(f"{config.key}: rank 0 recorded {len(times)} step ends, expected {steps} ({out})")
    if clocks[0]["local_tokens"] is not None:
        per_step = [sum(clock["local_tokens"][k] for clock in clocks) for k in range(steps)]
        tokens = sum(per_step[1:])
    else:  # trainbridge: num_input_tokens_seen (all ranks) at step 2 begin = tokens of step 1
        tokens = clocks[0]["tokens_seen_at_train_end"] - clocks[0]["tokens_seen_at_step_begin"][1]
    cpu_seconds = statistics.mean(c["step_end_cpu_times"][-1] - c["step_end_cpu_times"][0] for c in clocks)
    return Measurement(
        config=config,
        repeat=repeat,
        tokens_per_s=tokens / (times[-1] - times[0]),
        tokens_per_cpu_s=tokens / cpu_seconds,
        start_to_first_step_s=times[0] - launch,
        wall_s=wall_s,
        tokens=tokens,
        peak_rss_mib=max(c.get("peak_rss_mib", 0.0) for c in clocks),
    )


# ----------------------------------------------------------------------------- report
def machine_facts() -> list[str]:
    """Lines describing the machine and library versions."""
    import torch
    import transformers

    import trainbridge

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    return [
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}",
        f"- python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trainbridge {trainbridge.__version__ if hasattr(trainbridge, '__version__') else 'dev'}",
        f"- 2 gloo ranks, OMP_NUM_THREADS=1 each; load average before the run: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]


def _ratio(value: float, reference: Measurement | None, metric: Metric) -> str:
    return f"{value / getattr(reference, metric):.2f}" if reference else "-"


def results_table(results: Results, metric: Metric) -> list[str]:
    """Markdown table of the best run (by ``metric``) of each configuration, with ratios of ``metric`` and that
    run's peak RSS per rank (the references' are in their own rows)."""
    bare, default, tuned, padded = (
        results.best(k, metric) for k in ("bare", "trainer_default", "trainer_tuned", "trainer_padded_var")
    )
    lines = [
        f"| data | configuration | {METRIC_UNITS[metric]} | vs bare | vs Trainer default | vs Trainer tuned "
        "| vs Trainer padded | start → step 1 (s) | peak RSS per rank (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in ALL_CONFIGS:
        run = results.best(config.key, metric)
        if run is None:
            continue
        value = getattr(run, metric)
        fixed = config.data == "fixed"
        lines.append(
            f"| {config.data} | {config.label} | {value:,.0f} "
            f"| {_ratio(value, bare, metric) if fixed else '-'} "
            f"| {_ratio(value, default, metric) if fixed else '-'} "
            f"| {_ratio(value, tuned, metric) if fixed else '-'} "
            f"| {'-' if fixed else _ratio(value, padded, metric)} "
            f"| {run.start_to_first_step_s:.1f} | {run.peak_rss_mib:,.0f} |"
        )
    return lines


PAIRED_REFERENCES: dict[DataKind, tuple[tuple[str, str], ...]] = {
    "fixed": (("bare", "vs bare"), ("trainer_default", "vs Trainer default"), ("trainer_tuned", "vs Trainer tuned")),
    "variable": (("trainer_padded_var", "vs Trainer padded"), ("trainer_flat_var", "vs Trainer flattening")),
}
"""The references each configuration of a data kind is compared with in ``paired_table``."""


def _ratio_summary(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def paired_table(results: Results, metric: Metric) -> list[str]:
    """Markdown table: each trainbridge configuration's same-repetition ratios (median, range) to the
    references of its data kind (``PAIRED_REFERENCES``), with both sides' peak RSS per rank (median over
    repetitions) and its same-repetition ratio beside each."""
    lines = [
        "| data | configuration | reference | ratio, median (min–max) over repetitions "
        "| peak RSS per rank, MiB (reference) | peak RSS ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for config in ALL_CONFIGS:
        if config.runner != "trainbridge" or config.key not in results.runs:
            continue
        for reference, label in PAIRED_REFERENCES[config.data]:
            if reference not in results.runs:
                continue
            ratios = results.paired_ratios(config.key, reference, metric)
            memory = _median_rss(results, config.key), _median_rss(results, reference)
            references = {m.repeat: m.peak_rss_mib for m in results.runs.get(reference, []) if m.peak_rss_mib > 0}
            memory_ratios = [
                m.peak_rss_mib / references[m.repeat] for m in results.runs[config.key] if m.repeat in references
            ]
            lines.append(
                f"| {config.data} | {config.label} | {label} | {_ratio_summary(ratios)} "
                f"| {memory[0]:,.0f} ({memory[1]:,.0f}) | {_ratio_summary(memory_ratios)} |"
            )
    return lines


def _median_rss(results: Results, key: str) -> float:
    """The median over repetitions of a configuration's largest peak RSS per rank (0: not measured)."""
    values = [m.peak_rss_mib for m in results.runs.get(key, [])]
    return statistics.median(values) if values else 0.0


def runs_table(results: Results) -> list[str]:
    """Markdown table of every run (tokens/s and start-up per repetition)."""
    lines = [
        "| configuration | tokens/s per run | median | tokens/CPU-s per run | start → step 1 per run (s) "
        "| peak RSS per rank per run (MiB) |",
        "|---|---|---:|---|---|---|",
    ]
    for config in ALL_CONFIGS:
        runs = results.runs.get(config.key)
        if not runs:
            continue
        lines.append(
            f"| {config.data}: {config.label} | {', '.join(f'{m.tokens_per_s:,.0f}' for m in runs)} "
            f"| {statistics.median(m.tokens_per_s for m in runs):,.0f} "
            f"| {', '.join(f'{m.tokens_per_cpu_s:,.0f}' for m in runs)} "
            f"| {', '.join(f'{m.start_to_first_step_s:.1f}' for m in runs)} "
            f"| {', '.join(f'{m.peak_rss_mib:,.0f}' for m in runs)} |"
        )
    return lines


def results_section(results: Results, command: str, facts: list[str], steps: int, repeats: int) -> str:
    """The generated part of the report (between the markers)."""
    return "\n".join(
        [
            RESULTS_BEGIN,
            "",
            "```",
            command,
            "```",
            "",
            *facts,
            f"- {steps} optimizer steps per run, 8 samples per step (4 per rank), tokens/s over steps 2..{steps}; "
            f"{repeats} repetition(s) interleaved; each table shows each configuration's best run by its metric",
            "",
            "Wall clock (non-padding tokens of steps 2..N / (t_N - t_1)):",
            "",
            *results_table(results, "tokens_per_s"),
            "",
            "CPU-normalised (the same tokens / the ranks' mean CPU seconds over those steps):",
            "",
            *results_table(results, "tokens_per_cpu_s"),
            "",
            "Same-repetition ratios of trainbridge (each run / the reference's run of the same repetition), "
            "wall clock:",
            "",
            *paired_table(results, "tokens_per_s"),
            "",
            "Same-repetition ratios, CPU-normalised:",
            "",
            *paired_table(results, "tokens_per_cpu_s"),
            "",
            "Every run:",
            "",
            *runs_table(results),
            "",
            *(
                ["Failed runs (not measured):", "", *(f"- {line}" for line in results.failures), ""]
                if results.failures
                else []
            ),
            RESULTS_END,
        ]
    )


def write_report(path: Path, section: str) -> None:
    """Replace the result markers' content in ``path`` (create the file with a heading if missing)."""
    text = (
        path.read_text() if path.exists() else "# Throughput benchmark\n\n" + RESULTS_BEGIN + "\n" + RESULTS_END + "\n"
    )
    start, end = text.find(RESULTS_BEGIN), text.find(RESULTS_END)
    if start < 0 or end < start:
        text = text.rstrip() + "\n\n" + section + "\n"
    else:
        text = text[:start] + section + text[end + len(RESULTS_END) :]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ----------------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Build the assets, run every configuration ``--repeats`` times, print and write the table."""
    parser = argparse.ArgumentParser(prog="throughput.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (>= 3)")
    parser.add_argument("--repeats", type=int, default=2, help="repetitions of the whole list, interleaved")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", choices=[c.key for c in ALL_CONFIGS], help="run only these configurations")
    parser.add_argument(
        "--experiments", action="store_true", help="also run EXPERIMENTS (trainbridge with smaller token budgets)"
    )
    parser.add_argument("--out", type=Path, default=None, help="markdown report to update (e.g. docs/benchmarks.md)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep model, data and logs here")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's measurement here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile rank 0 of Trainer/trainbridge runs (profile-rank0.pstats; slows them)",
    )
    options = parser.parse_args(argv)
    if options.steps < 3:
        parser.error("--steps must be at least 3")
    os.environ.update(WORKER_ENVIRONMENT)
    if options.profile:
        from trainer_run import PROFILE_ENV

        os.environ[PROFILE_ENV] = "1"
    candidates = ALL_CONFIGS if options.experiments or options.only else CONFIGS
    selected = [c for c in candidates if not options.only or c.key in options.only]
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="trainbridge-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    assets = build_assets(workdir / "assets", options.steps, options.seed)
    print(f"assets and logs in {workdir}", flush=True)
    results = Results()
    for repeat in range(options.repeats):
        for config in selected:
            out = workdir / f"run{repeat}-{config.key}"
            try:
                measurement = run_config(
                    config, assets, options.steps, options.learning_rate, options.seed, out, repeat
                )
            except Exception as error:  # a failed run is reported, the others still run
                reason = str(error).splitlines()[0]
                results.failures.append(
                    f"{config.data}: {config.label}, repetition {repeat + 1}: {reason} (log: {out / 'run.log'})"
                )
                print(
                    f"[{repeat + 1}/{options.repeats}] {config.data:8} {config.label:45} FAILED: {reason}", flush=True
                )
                continue
            results.add(measurement)
            print(
                f"[{repeat + 1}/{options.repeats}] {config.data:8} {config.label:45} "
                f"{measurement.tokens_per_s:8,.0f} tokens/s {measurement.tokens_per_cpu_s:8,.0f} tokens/CPU-s  "
                f"start->step1 {measurement.start_to_first_step_s:5.1f} s  "
                f"wall {measurement.wall_s:5.1f} s",
                flush=True,
            )
    command = "python benchmarks/throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
    section = results_section(results, command.strip(), facts, options.steps, options.repeats)
    print()
    print("\n".join(results_table(results, "tokens_per_s")))
    print()
    print("\n".join(results_table(results, "tokens_per_cpu_s")))
    print()
    print("\n".join(paired_table(results, "tokens_per_s")))
    print()
    print("\n".join(paired_table(results, "tokens_per_cpu_s")))
    if options.out is not None:
        write_report(options.out, section)
        print(f"\nwrote {options.out}")
    if options.json is not None:
        measured = {key: [_measured(m) for m in runs] for key, runs in results.runs.items()}
        options.json.write_text(json.dumps({"runs": measured, "failures": results.failures}))
    return 0


def _measured(measurement: Measurement) -> dict[str, float]:
    """``--json``'s record of one run (``before_after.py`` reads it)."""
    return {
        "per_s": measurement.tokens_per_s,
        "per_cpu_s": measurement.tokens_per_cpu_s,
        "peak_rss_mib": measurement.peak_rss_mib,
    }


if __name__ == "__main__":
    sys.exit(main())
