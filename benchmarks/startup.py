"""Where a tiny job's wall time goes: ``trainbridge train`` vs ``torchrun`` + ``transformers.Trainer``.

    python benchmarks/startup.py [--repeats 3] [--workdir /tmp/tb-startup] [--baseline-src OLD/src]

The same tiny job both ways: the tiny Llama of ``trainbridge.demos.tiny_model``, 2 CPU gloo ranks,
8 optimizer steps of 8 samples (4 per rank), no evaluation, no checkpoint, a log every 4 steps.

- trainbridge: ``trainbridge train run.yaml --nproc-per-node 2`` (the console script) as a user runs it.
- Trainer: ``python -m torch.distributed.run --nproc-per-node 2 trainer_job.py`` (a plain Trainer script).

Each command's wall time is taken from outside (subprocess start to exit).  The phases come from
timestamps the jobs write (``time.time()``, one clock on one machine):

- trainbridge: a wrapper runs the CLI in-process and stamps its start, the end of its imports, and the
  moment the launcher starts torchrun (``subprocess.Popen``); a native callback in the job stamps, on
  each rank, the worker process's creation (psutil), ``on_init_end`` (after imports, payload, process
  group and ``build_run``: tokenizer, data, model, engine) and train begin/end.
- Trainer: the script stamps its start (after interpreter start-up), the end of its imports, the model
  loaded, and train begin/end (a ``TrainerCallback``).

Phases: parent (imports, config, preflight, payload: until torchrun starts), torchrun spawn (until the
first worker exists), worker set-up (imports, process group, model and data load, until training
begins), training, teardown (last train end to the command's exit).  Worker imports alone are measured
separately (a fresh interpreter importing the worker's modules).  Peak RSS per rank (the ranks' largest
``ru_maxrss`` at train end) is reported beside the same-repetition wall ratio.  Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = 8
PEAK_RSS = "peak RSS per rank (MiB)"
"""The ranks' largest ``ru_maxrss`` at train end."""
EFFECTIVE_BATCH = 8

CLOCK_CALLBACK = '''
import json, os, resource, time
from pathlib import Path

import psutil

from trainbridge import Callback


class PhaseClock(Callback):
    """Stamps this rank's phases into clock-rank{rank}.json."""

    def __init__(self, folder):
        self.folder = folder
        self.stamps = {}

    def on_init_end(self, context, **kwargs):
        self.stamps["spawned"] = psutil.Process().create_time()
        self.stamps["init_end"] = time.time()

    def on_train_begin(self, context, **kwargs):
        self.stamps["train_begin"] = time.time()

    def on_train_end(self, context, **kwargs):
        self.stamps["train_end"] = time.time()
        self.stamps["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(self.folder, f"clock-rank{context.rank}.json").write_text(json.dumps(self.stamps))
'''

CLI_WRAPPER = """
import atexit, sys, time, json
t0 = time.time()
import trainbridge.cli as cli
import trainbridge.launch.launcher as launcher
stamps = {"start": t0, "imported": time.time()}
_popen = launcher.subprocess.Popen
def popen(*args, **kwargs):
    stamps["torchrun_start"] = time.time()
    return _popen(*args, **kwargs)
launcher.subprocess.Popen = popen
stamps_file = sys.argv[1]
atexit.register(lambda: open(stamps_file, "w").write(json.dumps(dict(stamps, end=time.time()))))
sys.argv = ["trainbridge", *sys.argv[2:]]
sys.exit(cli.main())  # as the console script runs it: main() reads sys.argv and ends the process
"""

TRAINER_JOB = """
import json, os, resource, sys, time
t0 = time.time()
import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, \\
    TrainerCallback, TrainingArguments
stamps = {"spawned": psutil.Process().create_time(), "start": t0, "imported": time.time()}
model_dir, data_file, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
rows = [json.loads(line) for line in open(data_file)]
dataset = [{"input_ids": r["input_ids"]} for r in rows]
model = AutoModelForCausalLM.from_pretrained(model_dir)
stamps["model_loaded"] = time.time()

class Clock(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        stamps["train_begin"] = time.time()
    def on_train_end(self, args, state, control, **kwargs):
        stamps["train_end"] = time.time()
        stamps["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rank = int(os.environ.get("RANK", "0"))
        open(os.path.join(out, f"clock-rank{rank}.json"), "w").write(json.dumps(stamps))

args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                         logging_steps=4, save_strategy="no", report_to="none", learning_rate=1e-3)
Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Clock()],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
"""

WORKER_IMPORTS = (
    "import trainbridge.launch.worker, trainbridge.launch.assembly, trainbridge.launch.transport, "
    "trainbridge.loop.build, trainbridge.loop.loop"
)
TRAINER_IMPORTS = (
    "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer, "
    "DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments"
)


def _prepare(workdir: Path) -> dict[str, Path]:
    import yaml

    from trainbridge.demos.tiny_model import build_tiny_llama, write_arithmetic_dataset

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "model"
    if not (model / "config.json").is_file():
        build_tiny_llama(model, seed=0)
    from transformers import AutoTokenizer

    data = write_arithmetic_dataset(
        workdir / "train.jsonl",
        STEPS * EFFECTIVE_BATCH,
        seed=1,
        fmt="tokenized",
        tokenizer=AutoTokenizer.from_pretrained(model),
    )
    (workdir / "phase_clock.py").write_text(CLOCK_CALLBACK)
    (workdir / "cli_wrapper.py").write_text(CLI_WRAPPER)
    (workdir / "trainer_job.py").write_text(TRAINER_JOB)
    config = {
        "model_path": "model",
        "data_path": "train.jsonl",
        "ckpt_output_dir": "tb_out",
        "max_steps": STEPS,
        "effective_batch_size": EFFECTIVE_BATCH,
        "max_seq_len": 64,
        "max_batch_len": 512,
        "device": "cpu",
        "logging_steps": 4,
        "save_strategy": "no",
        "save_final_checkpoint": False,
        "learning_rate": 1e-3,
        "callbacks": [{"class": "phase_clock:PhaseClock", "kwargs": {"folder": str(workdir / "tb_out")}}],
    }
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    return {"model": model, "data": data}


def _clocks(folder: Path) -> list[dict[str, float]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("clock-rank*.json"))]


def _run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    start = time.time()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall


def run_trainbridge(workdir: Path, src: Path | None = None) -> dict[str, float]:
    out = workdir / "tb_out"
    for old in out.glob("clock-rank*.json"):
        old.unlink()
    stamps_file = workdir / "cli_stamps.json"
    launched = time.time()
    env = (
        None
        if src is None
        else {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(src), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
            ),
        }
    )
    wall = _run(
        [
            sys.executable,
            str(workdir / "cli_wrapper.py"),
            str(stamps_file),
            "train",
            "run.yaml",
            "--nproc-per-node",
            "2",
        ],
        workdir,
        env,
    )
    parent = json.loads(stamps_file.read_text())
    ranks = _clocks(out)
    return {
        "wall": wall,
        "interpreter": parent["start"] - launched,
        "parent imports": parent["imported"] - parent["start"],
        "config, preflight, payload": parent["torchrun_start"] - parent["imported"],
        "torchrun spawn": min(r["spawned"] for r in ranks) - parent["torchrun_start"],
        "worker set-up": max(r["train_begin"] for r in ranks) - min(r["spawned"] for r in ranks),
        "training": max(r["train_end"] for r in ranks) - max(r["train_begin"] for r in ranks),
        "teardown": launched + wall - max(r["train_end"] for r in ranks),
        PEAK_RSS: max(r["peak_rss_mib"] for r in ranks),
    }


def run_trainer(workdir: Path, paths: dict[str, Path]) -> dict[str, float]:
    out = workdir / "hf_out"
    out.mkdir(exist_ok=True)
    for old in out.glob("clock-rank*.json"):
        old.unlink()
    launched = time.time()
    wall = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(workdir / "trainer_job.py"),
            str(paths["model"]),
            str(paths["data"]),
            str(out),
            str(STEPS),
        ],
        workdir,
    )
    ranks = _clocks(out)
    return {
        "wall": wall,
        "interpreter": 0.0,
        "parent imports": 0.0,
        "config, preflight, payload": 0.0,
        "torchrun spawn": min(r["spawned"] for r in ranks) - launched,
        "worker set-up": max(r["train_begin"] for r in ranks) - min(r["spawned"] for r in ranks),
        "training": max(r["train_end"] for r in ranks) - max(r["train_begin"] for r in ranks),
        "teardown": launched + wall - max(r["train_end"] for r in ranks),
        PEAK_RSS: max(r["peak_rss_mib"] for r in ranks),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _import_time(statement: str) -> float:
    start = time.time()
    subprocess.run([sys.executable, "-c", statement], check=True, capture_output=True)
    return time.time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tb-startup"))
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also time trainbridge from this source folder (e.g. an older commit's src/, "
        "from `git archive`), interleaved with the others: before/after in one table",
    )
    options = parser.parse_args(argv)
    workdir = options.workdir.resolve()
    paths = _prepare(workdir)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {"trainbridge train": [], "torchrun + Trainer": []}
    if options.baseline_src:
        runs = {"trainbridge train (baseline)": [], **runs}
    imports: dict[str, list[float]] = {
        "trainbridge worker imports": [],
        "Trainer script imports": [],
        "trainbridge train --help": [],
    }
    for _ in range(options.repeats):  # interleaved, so a slow phase of the machine hits both
        if options.baseline_src:
            runs["trainbridge train (baseline)"].append(run_trainbridge(workdir, options.baseline_src.resolve()))
        runs["trainbridge train"].append(run_trainbridge(workdir))
        runs["torchrun + Trainer"].append(run_trainer(workdir, paths))
        imports["trainbridge worker imports"].append(_import_time(WORKER_IMPORTS))
        imports["Trainer script imports"].append(_import_time(TRAINER_IMPORTS))
        imports["trainbridge train --help"].append(
            _import_time(
                "import sys; sys.argv = ['trainbridge', 'train', '--help']\n"
                "import contextlib, io\nimport trainbridge.cli as c\n"
                "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
                "    c.main(['train', '--help'])"
            )
        )
    print(
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPU cores; "
        f"load average (1, 5, 15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}, after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"- python {platform.python_version()}; {options.repeats} interleaved repetitions; median (min..max) s\n")
    phases = list(runs["trainbridge train"][0])
    if options.baseline_src:
        print(f"- baseline: trainbridge from {options.baseline_src}")
    print(f"| phase | {' | '.join(runs)} |\n|---|{'---|' * len(runs)}")
    for phase in phases:
        cells = []
        for records in runs.values():
            values = [r[phase] for r in records]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})")
        print(f"| {phase} | {' | '.join(cells)} |")
    print()
    ours, theirs = runs["trainbridge train"], runs["torchrun + Trainer"]
    for key in ("wall", PEAK_RSS):  # same-repetition ratios, the peak memory beside the wall time
        ratios = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]
        print(f"- trainbridge train / torchrun + Trainer, {key}: {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}..{max(ratios):.2f})")  # fmt: skip
    for name, values in imports.items():
        print(f"- {name} (fresh interpreter): {statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f})")


if __name__ == "__main__":
    main()
