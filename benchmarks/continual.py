"""Wall time of a continual-learning Trainer script (issue 29, failure 7): three Trainers in turn, each ``train()``
then ``evaluate()``, with only the import changed.

    python benchmarks/continual.py [--tasks 3] [--repeats 1] [--workdir /tmp/tb-continual]

The script (written into the work folder) trains the tiny Llama of ``trainbridge.demos.tiny_model`` on one task
after another (a new ``Trainer`` per task on the same model: 16 arithmetic rows, 4 steps of 4 per rank, a
checkpoint at the end, an evaluation of 8 rows), on 2 CPU gloo ranks.  It runs three ways:

- ``trainer``: ``torchrun --nproc-per-node 2 script.py real`` (``transformers.Trainer``);
- ``tb_torchrun``: ``torchrun --nproc-per-node 2 script.py`` (``trainbridge.Trainer``);
- ``tb_python``: ``TRAINBRIDGE_NPROC_PER_NODE=2 python script.py`` (re-executed under torchrun once, at the
  import, so one launch runs every call).

Each command's wall time is taken from outside (start to exit); the script also stamps each call's time and every
rank its peak RSS (``ru_maxrss``), reported beside the same-repetition wall ratios to Trainer.  The
load (``uptime``) is printed before and after.  Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import json, os, resource, sys, time
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

if "real" in sys.argv[3:]:
    from transformers import Trainer
else:
    from trainbridge import Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once

out, tasks = Path(sys.argv[1]), int(sys.argv[2])
model_dir = build_tiny_llama_once(out.parent / "tiny-model")
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)


def rows(n, seed):
    texts = [p + a for p, a in arithmetic_problems(n, seed)]
    return datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )


calls = []
for task in range(tasks):
    args = TrainingArguments(
        output_dir=str(out / f"task{task}"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=4,
        logging_steps=2,
        save_steps=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        seed=task,
    )
    trainer = Trainer(model=model, args=args, data_collator=collator, train_dataset=rows(16, task),
                      eval_dataset=rows(8, 100 + task))
    start = time.time()
    trainer.train()
    calls.append({"call": f"train{task}", "s": time.time() - start})
    start = time.time()
    trainer.evaluate()
    calls.append({"call": f"evaluate{task}", "s": time.time() - start})
rank = int(os.environ.get("RANK", "0"))
if rank == 0:
    (out / "calls.json").write_text(json.dumps(calls))
(out / f"peak-rss-rank{rank}.json").write_text(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
if "real" in sys.argv[3:]:
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)
"""


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tb-continual"))
    options = parser.parse_args()
    options.workdir.mkdir(parents=True, exist_ok=True)
    script = options.workdir / "continual.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    ways = {
        "trainer": ([*torchrun, str(script)], ["real"], {}),
        "tb_torchrun": ([*torchrun, str(script)], [], {}),
        "tb_python": ([sys.executable, str(script)], [], {"TRAINBRIDGE_NPROC_PER_NODE": "2"}),
    }
    print("load before:", load())
    walls: dict[str, list[float]] = {name: [] for name in ways}
    peaks: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(options.repeats):
        for name, (command, extra, more_env) in ways.items():  # interleaved: the load drifts alike for each
            out = options.workdir / f"{name}-{repeat}"
            start = time.time()
            proc = subprocess.run(
                [*command, str(out), str(options.tasks), *extra],
                env={**env, **more_env},
                capture_output=True,
                text=True,
            )
            wall = time.time() - start
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            walls[name].append(wall)
            peaks[name].append(max(json.loads(path.read_text()) for path in out.glob("peak-rss-rank*.json")))
            calls = json.loads((out / "calls.json").read_text())
            inside = ", ".join(f"{c['call']} {c['s']:.1f}" for c in calls)
            print(
                f"{name:12s} repeat {repeat}: wall {wall:6.1f} s, peak RSS per rank {peaks[name][-1]:.0f} MiB; "
                f"calls (s): {inside}",
                flush=True,
            )
    print("load after:", load())
    for name, values in walls.items():
        spread = f" (min {min(values):.1f}, max {max(values):.1f})" if len(values) > 1 else ""
        print(f"{name:12s} median wall {statistics.median(values):6.1f} s{spread}, median peak RSS per rank "
              f"{statistics.median(peaks[name]):.0f} MiB")  # fmt: skip
    for name in ("tb_torchrun", "tb_python"):  # same-repetition ratios to Trainer, the peak memory beside
        wall = [a / b for a, b in zip(walls[name], walls["trainer"], strict=True)]
        rss = [a / b for a, b in zip(peaks[name], peaks["trainer"], strict=True)]
        print(f"{name} / trainer: wall {statistics.median(wall):.2f} ({min(wall):.2f}..{max(wall):.2f}), "
              f"peak RSS per rank {statistics.median(rss):.2f} ({min(rss):.2f}..{max(rss):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
