"""``python script.py`` against ``torchrun script.py`` and ``transformers.Trainer``, and the time to the first
optimizer step by phase, with peak memory (issue 40, items 2, 3 and 5).

    python benchmarks/launch.py [--repeats 3] [--tasks 1] [--steps 12] [--kinds lm classify]
                                [--workdir /tmp/tb-launch] [--baseline-src OLD/src] [--only trainer tb_torchrun ...]

One Trainer script (written into the work folder) imports what a ported script imports (datasets, torch,
transformers), then its Trainer, tokenises an in-place ``datasets.Dataset`` with ``map``, loads a tiny model and
trains ``--tasks`` Trainers in turn (``--steps`` optimizer steps each, 4 rows per rank per step), 2 CPU gloo ranks.
Two kinds: ``lm``, the tiny Llama of ``trainbridge.demos.tiny_model`` with ``DataCollatorForLanguageModeling``
(trainbridge: the padding-free token path, its in-place rows through the data cache); ``classify``, a tiny
``BertForSequenceClassification`` with ``DataCollatorWithPadding`` (the model's own loss on sample batches).
Each kind runs, interleaved, as:

- ``trainer``: ``torchrun --nproc-per-node 2 script.py ... real`` (``transformers.Trainer``);
- ``tb_torchrun``: ``torchrun --nproc-per-node 2 script.py`` (``trainbridge.Trainer``);
- ``tb_python``: ``TRAINBRIDGE_NPROC_PER_NODE=2 python script.py``;
- ``tb_python_reexec``: the same with ``TRAINBRIDGE_SCRIPT_FORK=0`` (always re-executed under torchrun);
- with ``--baseline-src``, ``base_torchrun`` and ``base_python``: the same from an older ``src/`` (before/after
  in one run).

Per run: the wall time from outside (start to exit), the CPU seconds of the whole process tree (user + sys of
the waited-for children, ``RUSAGE_CHILDREN``) and the peak RSS per rank (the ranks' largest ``ru_maxrss``).  The
script stamps ``time.time()`` on every rank: its start (after the interpreter's start-up), its imports done, the
data tokenised, the model loaded, the Trainer built, and the first optimizer step's end (a ``TrainerCallback``),
so the phases to the first step are: launch + imports (from the command's start: under ``python`` this includes
the parent's imports and the re-execution or fork), data, model, Trainer built (preflight), first step
(``train()`` until the first optimizer step ends: trainbridge's own tokenisation of the rows is in it).  The
ranks' latest stamp counts.  ``TRAINBRIDGE_DATA_CACHE`` is a folder of the work folder, emptied at start: the
first repetition tokenises, the later ones hit the cache.  Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import json, os, resource, sys, time
T0 = time.time()
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, \\
    DataCollatorForLanguageModeling, DataCollatorWithPadding, TrainerCallback, TrainingArguments

if "real" in sys.argv[5:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems

stamps = {"start": T0, "imported": time.time()}
out, tasks, steps, kind = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model_dir = out.parent / ("tiny-model" if kind == "lm" else "tiny-bert")
tokenizer = AutoTokenizer.from_pretrained(model_dir)
problems = arithmetic_problems(8 * steps, 0)
if kind == "lm":
    train = datasets.Dataset.from_dict({"text": [p + a for p, a in problems]}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )
else:  # classification: is the answer even
    rows = {"text": [p + a for p, a in problems], "label": [int(a.strip()[-1]) % 2 for _, a in problems]}
    train = datasets.Dataset.from_dict(rows).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=64), batched=True, remove_columns=["text"]
    )
stamps["data"] = time.time()
if kind == "lm":
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
else:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    collator = DataCollatorWithPadding(tokenizer)
stamps["model"] = time.time()


class FirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        stamps.setdefault("first_step", time.time())


for task in range(tasks):
    args = TrainingArguments(
        output_dir=str(out / f"task{task}"), per_device_train_batch_size=4, max_steps=steps, logging_steps=4,
        save_strategy="no", learning_rate=1e-3, use_cpu=True, report_to="none", disable_tqdm=True, seed=task,
    )
    trainer = Trainer(model=model, args=args, data_collator=collator, train_dataset=train, callbacks=[FirstStep()])
    stamps.setdefault("trainer", time.time())
    trainer.train()
stamps["end"] = time.time()
stamps["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
(out / f"stamps-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(stamps))
if "real" in sys.argv[5:]:
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)
"""

PHASES = (
    ("launch + imports", "launched", "imported"),
    ("data", "imported", "data"),
    ("model", "data", "model"),
    ("Trainer built", "model", "trainer"),
    ("first step", "trainer", "first_step"),
    ("to first step", "launched", "first_step"),
    ("rest of the run", "first_step", "exited"),
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(command: list[str], env: dict[str, str], out: Path) -> dict[str, float]:
    """Run one configuration; its wall and CPU seconds and its phases (the ranks' latest stamps)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("stamps-rank*.json"):
        old.unlink()
    cpu = _children_cpu()
    launched = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    exited = time.time()
    cpu = _children_cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"{command} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("stamps-rank*.json"))]
    if len(ranks) != 2:
        raise SystemExit(f"{command}: {len(ranks)} ranks wrote their stamps, not 2:\n{proc.stderr[-3000:]}")
    stamps = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    stamps.update(launched=launched, exited=exited)
    record = {"wall": exited - launched, "cpu": cpu, "peak RSS per rank (MiB)": stamps["peak_rss_mib"]}
    record.update({name: stamps[end] - stamps[start] for name, start, end in PHASES})
    return record


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def build_models(workdir: Path) -> None:
    """The tiny Llama (``lm``) and a tiny ``BertForSequenceClassification`` (``classify``), each with the
    character tokenizer, built once into the work folder."""
    import torch
    from transformers import BertForSequenceClassification

    from trainbridge.demos.tiny_model import build_tiny_llama_once, build_tokenizer, tiny_bert_config

    build_tiny_llama_once(workdir / "tiny-model")
    bert = workdir / "tiny-bert"
    if not (bert / "config.json").exists():
        tokenizer = build_tokenizer(bert)
        torch.manual_seed(0)
        config = tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        BertForSequenceClassification(config).save_pretrained(bert)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=1, help="Trainers trained in turn by the script")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per Trainer")
    parser.add_argument("--kinds", nargs="+", default=["lm", "classify"], choices=["lm", "classify"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tb-launch"))
    parser.add_argument("--baseline-src", type=Path, help="an older trainbridge src/ (e.g. from `git archive`)")
    parser.add_argument("--only", nargs="+", help="run only these configurations")
    options = parser.parse_args(argv)
    workdir = options.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "script.py"
    script.write_text(SCRIPT)
    build_models(workdir)
    cache = workdir / "data-cache"  # trainbridge's in-place data cache: cold on the first repetition
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINBRIDGE_DATA_CACHE": str(cache)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH"):
        env.pop(name, None)
    python_env = {**env, "TRAINBRIDGE_NPROC_PER_NODE": "2"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    python = [sys.executable, str(script)]
    ways: dict[str, tuple[list[str], list[str], dict[str, str]]] = {
        "trainer": (torchrun, ["real"], env),
        "tb_torchrun": (torchrun, [], env),
        "tb_python": (python, [], python_env),
        "tb_python_reexec": (python, [], {**python_env, "TRAINBRIDGE_SCRIPT_FORK": "0"}),
    }
    if options.baseline_src:
        base = {"PYTHONPATH": str(options.baseline_src.resolve())}
        ways["base_torchrun"] = (torchrun, [], {**env, **base})
        ways["base_python"] = (python, [], {**python_env, **base})
    if options.only:
        ways = {name: way for name, way in ways.items() if name in options.only}
    print(f"- load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    records: dict[str, dict[str, list[dict[str, float]]]] = {k: {name: [] for name in ways} for k in options.kinds}
    for repeat in range(options.repeats):
        for kind in options.kinds:
            for name, (command, extra, way_env) in ways.items():  # interleaved: the load drifts alike for each
                out = workdir / f"{kind}-{name}-{repeat}"
                argv_ = [*command, str(out), str(options.tasks), str(options.steps), kind, *extra]
                record = run_once(argv_, way_env, out)
                records[kind][name].append(record)
                print(
                    f"  {kind:8s} {name:16s} repeat {repeat}: wall {record['wall']:6.2f} s, cpu {record['cpu']:6.2f}"
                    f" s, to first step {record['to first step']:6.2f} s, peak RSS/rank "
                    f"{record['peak RSS per rank (MiB)']:.0f} MiB",
                    flush=True,
                )
    print(f"- load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for kind, by_way in records.items():
        print(
            f"\n### {kind}: {options.tasks} Trainer(s) x {options.steps} steps, 2 gloo ranks, {options.repeats} "
            f"interleaved repetitions; median (min..max) s\n"
        )
        print(f"| | {' | '.join(by_way)} |\n|---|{'---|' * len(by_way)}")
        for key in ["wall", "cpu", *(name for name, _, _ in PHASES), "peak RSS per rank (MiB)"]:
            print(f"| {key} | {' | '.join(_cell([r[key] for r in rs]) for rs in by_way.values())} |")
        print()
        for reference in ("tb_torchrun", "trainer"):
            if reference not in by_way:
                continue
            for name in by_way:
                if name == reference:
                    continue
                for key in ("wall", "cpu", "to first step", "peak RSS per rank (MiB)"):
                    ratios = [r[key] / ref[key] for r, ref in zip(by_way[name], by_way[reference], strict=True)]
                    print(f"- {kind} {name} / {reference} {key}: {_cell(ratios)} (same-repetition ratios)")


if __name__ == "__main__":
    main()
