"""Exit-time aborts: many consecutive short 2-rank runs, counting the ones that do not exit 0.

    nice -n 19 python benchmarks/exit_stress.py [--runs 200] [--kinds demo script] [--workdir DIR]

Each run is a short real job on 2 CPU gloo ranks, started as a user starts it, and its exit status read:

- ``demo``: ``trainbridge demo --max-steps 2`` (run_training: trainbridge's launcher, torchrun, its workers);
- ``script``: ``torchrun --nproc-per-node 2 ported.py``, a ``transformers.Trainer`` script whose import was
  changed to ``from trainbridge import Trainer`` (in place: the script's processes are the ranks), 2 steps,
  ending as scripts do, without ``trainer.end()`` or ``os._exit``.

A run whose output has gloo's "terminate called without an active exception" (or a rank killed by SIGABRT)
counts as an abort; any other non-zero exit as a failure (its output is kept in the work folder).  Not a test
and not in CI: it takes minutes per run on the shared 2-core machine.  Run it niced; report the count of runs,
aborts and failures with the load (``uptime``) it ran under.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ABORT = "terminate called without an active exception"

PORTED = """
import sys
from pathlib import Path

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once

out = Path(sys.argv[1])
model_dir = build_tiny_llama_once(out.parent / "tiny-model")
tokenizer = AutoTokenizer.from_pretrained(model_dir)
texts = [p + a for p, a in arithmetic_problems(32, 1)]
train = datasets.Dataset.from_dict({"text": texts}).map(lambda b: tokenizer(b["text"]), batched=True,
                                                        remove_columns=["text"])
args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                         save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=train,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
print("ported script done", flush=True)
"""


def free_port() -> int:
    from trainbridge.launch.launcher import free_port as port

    return port()


def command(kind: str, workdir: Path, run: int) -> list[str]:
    out = workdir / kind / f"run-{run}"
    if kind == "demo":
        trainbridge = Path(sys.executable).with_name("trainbridge")
        return [str(trainbridge), "demo", "--output-dir", str(out), "--max-steps", "2"]
    script = workdir / "ported.py"
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), str(script), str(out)]  # fmt: skip


def classify(proc: subprocess.CompletedProcess[str]) -> str:
    output = proc.stdout + proc.stderr
    if ABORT in output or "SIGABRT" in output or proc.returncode in (-6, 134):
        return "abort"
    return "ok" if proc.returncode == 0 else "failure"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="runs of each kind")
    parser.add_argument("--kinds", nargs="+", choices=["demo", "script"], default=["demo", "script"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tb-exit-stress"))
    parser.add_argument("--out", type=Path, help="also write the counts as JSON here")
    options = parser.parse_args()
    workdir = options.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "ported.py").write_text(PORTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    counts = {kind: {"runs": 0, "ok": 0, "abort": 0, "failure": 0} for kind in options.kinds}
    start = time.monotonic()
    for run in range(1, options.runs + 1):
        for kind in options.kinds:  # interleaved, so both kinds see the same load
            proc = subprocess.run(command(kind, workdir, run), env=env, capture_output=True, text=True, timeout=900)
            outcome = classify(proc)
            counts[kind]["runs"] += 1
            counts[kind][outcome] += 1
            if outcome == "ok":
                shutil.rmtree(workdir / kind / f"run-{run}", ignore_errors=True)
            else:
                (workdir / f"{kind}-run-{run}-{outcome}.log").write_text(proc.stdout + proc.stderr)
            tally = "  ".join(
                f"{k}: {c['abort']} aborts, {c['failure']} failures in {c['runs']}" for k, c in counts.items()
            )
            print(
                f"{time.monotonic() - start:7.0f}s {kind:6} run {run}: {outcome:7} rc={proc.returncode}  {tally}",
                flush=True,
            )
    load = os.getloadavg()
    print(json.dumps({"counts": counts, "loadavg": load}, indent=1))
    if options.out:
        options.out.write_text(json.dumps({"counts": counts, "loadavg": load}, indent=1))


if __name__ == "__main__":
    main()
