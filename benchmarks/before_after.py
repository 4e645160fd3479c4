"""The performance targets before and after a change, in one run: the same benchmark arms for both trees, interleaved.

    python benchmarks/before_after.py [--before REV] [--repeats 2] [--steps 30] [--dpo-steps 12] [--sft-steps 20]

``--before`` (default: the parent of the first commit whose message names issue 39, 40 or 41, i.e. the tree
before this round's work) is checked out into a temporary ``git worktree``; "after" is this working tree.  Both
run this tree's benchmark scripts (``throughput.py``, ``trl_sft.py``, ``trl_dpo.py``, ``classification.py``:
the same measurement code), with ``PYTHONPATH`` naming the side's ``src`` so that trainbridge (in the driver and
in every torchrun rank) is the side's.  The references (the bare DDP loop, ``transformers.Trainer``, trl) do not
depend on trainbridge: each repetition runs them once, beside both sides' trainbridge arms (which side goes first
alternates by repetition), and each side's ratio is taken against the reference of the same repetition.

Prints, per target, each side's same-repetition ratio (median and min-max over the repetitions) by wall clock
and per CPU second, each side's peak RSS per rank, and a before/after table.  ``--tiny`` runs 3-step versions
of everything once (a check that the runner works, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
SIDES = ("before", "after")
ISSUES = r"issue \(39\|40\|41\)"
"""The round's issues: ``--before`` defaults to the parent of the first commit naming one."""


@dataclass(frozen=True)
class Target:
    """A ratio the brief sets: trainbridge's arm over a reference arm of the same benchmark, at least ``goal``."""

    name: str
    benchmark: str
    arm: str
    reference: str
    goal: float


@dataclass(frozen=True)
class Benchmark:
    """One benchmark script, its trainbridge arms and its reference arms (``--only`` values)."""

    name: str
    script: str
    ours: tuple[str, ...]
    references: tuple[str, ...]


BENCHMARK_LIST = (
    Benchmark(
        "throughput", "throughput.py", ("tb_fixed", "tb_var"), ("bare", "trainer_padded_var", "trainer_flat_var")
    ),
    Benchmark("sft", "trl_sft.py", ("trainbridge",), ("trl packing (bfd)",)),
    Benchmark("dpo", "trl_dpo.py", ("trainbridge",), ("trl",)),
    Benchmark("classification", "classification.py", ("trainbridge",), ("trainer",)),
)
TARGETS = (
    Target("fixed lengths / bare DDP (tokens)", "throughput", "tb_fixed", "bare", 1.02),
    Target("variable lengths / Trainer padded (tokens)", "throughput", "tb_var", "trainer_padded_var", 1.4),
    Target("variable lengths / Trainer flattening (tokens)", "throughput", "tb_var", "trainer_flat_var", 1.15),
    Target("SFT / trl bfd packing (tokens)", "sft", "trainbridge", "trl packing (bfd)", 1.15),
    Target("DPO / trl (pairs)", "dpo", "trainbridge", "trl", 1.3),
    Target("classifier / Trainer (samples)", "classification", "trainbridge", "trainer", 1.0),
)

Runs = dict[str, dict[str, float]]
"""One invocation's measurement of each arm: ``per_s``, ``per_cpu_s``, ``peak_rss_mib``."""


def default_before() -> str:
    """The parent of the first commit (oldest first) whose message names issue 39, 40 or 41."""
    first = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", f"--grep={ISSUES}", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not first:
        raise SystemExit("no commit names issue 39, 40 or 41: pass --before REV")
    return first[0] + "^"


def checkout(rev: str, where: Path) -> str:
    """``rev`` as a detached worktree at ``where``; its full hash."""
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(where), rev], cwd=REPO, check=True)
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True
    ).stdout.strip()


def invoke(bench: Benchmark, arms: Sequence[str], src: Path, options: argparse.Namespace, work: Path) -> Runs:
    """One run of ``arms`` of ``bench`` (this tree's script) with trainbridge from ``src``."""
    steps = {"throughput": options.steps, "sft": options.sft_steps, "dpo": options.dpo_steps}
    command = [sys.executable, str(BENCHMARKS / bench.script), "--repeats", "1", "--only", *arms]
    command += ["--steps", str(steps.get(bench.name, options.steps))]
    result = work / "result.json"
    if bench.name in ("throughput", "classification"):
        command += ["--workdir", str(work), "--json", str(result)]
    if bench.name == "sft":
        command += ["--samples", str(max(200, 16 * options.sft_steps))]
    if bench.name == "dpo":
        command += ["--pairs", str(max(100, 16 * options.dpo_steps))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(BENCHMARKS)])}
    work.mkdir(parents=True, exist_ok=True)
    log = work / "driver.log"
    with log.open("w") as out:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}; see {log}")
    if result.is_file():
        record = json.loads(result.read_text())
        if record["failures"]:
            raise RuntimeError(f"{bench.name}: {record['failures'][0]}")
        runs = {arm: values[0] for arm, values in record["runs"].items()}
    else:  # trl_sft.py / trl_dpo.py: their results as JSON, the last line printed
        runs = {arm: values[0] for arm, values in json.loads(text.strip().splitlines()[-1]).items()}
    missing = set(arms) - set(runs)
    if missing:
        raise RuntimeError(f"{bench.name}: no measurement of {sorted(missing)}; see {log}")
    return runs


def spread(values: Sequence[float]) -> str:
    """``median (min-max)``."""
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="before_after.py", description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="the BEFORE revision (default: see the module doc)")
    parser.add_argument("--repeats", type=int, default=2, help="repetitions, interleaved")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of throughput/classification runs")
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--dpo-steps", type=int, default=12)
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHMARK_LIST], default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs here (default: a temporary folder)")
    parser.add_argument("--tiny", action="store_true", help="3-step runs, one repetition: checks the runner only")
    options = parser.parse_args(argv)
    if options.tiny:
        options.repeats, options.steps, options.sft_steps, options.dpo_steps = 1, 3, 3, 3
    work = options.workdir or Path(tempfile.mkdtemp(prefix="tb-before-after-"))
    work.mkdir(parents=True, exist_ok=True)
    before_tree = Path(tempfile.mkdtemp(prefix="tb-before-tree-")) / "tree"
    before = checkout(options.before or default_before(), before_tree)
    after = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    after += " + uncommitted changes" if dirty.stdout.strip() else ""
    sources = {"before": before_tree / "src", "after": REPO / "src"}
    benchmarks = [b for b in BENCHMARK_LIST if options.only is None or b.name in options.only]
    print(f"before: {before} (worktree {before_tree})\nafter:  {after}\nlogs in {work}", flush=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    # measured[repeat][side][benchmark][arm]; the references are measured with the "after" side's invocation
    measured: list[dict[str, dict[str, Runs]]] = []
    started = time.time()
    try:
        for repeat in range(options.repeats):
            row: dict[str, dict[str, Runs]] = {side: {} for side in SIDES}
            for bench in benchmarks:
                order = SIDES if repeat % 2 == 0 else SIDES[::-1]
                for side in order:
                    arms = [*bench.references, *bench.ours] if side == "after" else list(bench.ours)
                    folder = work / f"r{repeat}-{bench.name}-{side}"
                    try:
                        row[side][bench.name] = invoke(bench, arms, sources[side], options, folder)
                    except RuntimeError as error:
                        print(f"[{repeat + 1}/{options.repeats}] {bench.name} {side}: FAILED: {error}", flush=True)
                        continue
                    line = ", ".join(f"{arm} {r['per_s']:,.1f}/s" for arm, r in row[side][bench.name].items())
                    print(f"[{repeat + 1}/{options.repeats}] {bench.name:14} {side:6} {line}", flush=True)
            measured.append(row)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=REPO, check=False)
        shutil.rmtree(before_tree.parent, ignore_errors=True)
    print(f"\n{time.time() - started:.0f} s; load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(report(measured, benchmarks, before, after, options))
    return 0


def report(
    measured: list[dict[str, dict[str, Runs]]],
    benchmarks: Sequence[Benchmark],
    before: str,
    after: str,
    options: argparse.Namespace,
) -> str:
    """The markdown tables: each target's ratios per side, then before against after."""
    names = {b.name for b in benchmarks}
    lines = [
        f"before {before[:10]}, after {after[:10]}; {options.repeats} interleaved repetition(s); steps: throughput and "
        f"classification {options.steps}, SFT {options.sft_steps}, DPO {options.dpo_steps}; same-repetition ratios, "
        "median (min-max); peak RSS: the largest rank's, median MiB",
        "",
        "| target | goal | side | wall ratio | per-CPU-s ratio | peak RSS ours / reference (MiB) | met (wall median) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    medians: dict[tuple[str, str], float] = {}
    for target in (t for t in TARGETS if t.benchmark in names):
        for side in SIDES:
            wall, cpu, ours, theirs = [], [], [], []
            for row in measured:
                mine = row[side].get(target.benchmark, {}).get(target.arm)
                reference = row["after"].get(target.benchmark, {}).get(target.reference)
                if mine is None or reference is None:
                    continue
                wall.append(mine["per_s"] / reference["per_s"])
                cpu.append(mine["per_cpu_s"] / reference["per_cpu_s"])
                ours.append(mine["peak_rss_mib"])
                theirs.append(reference["peak_rss_mib"])
            memory = f"{statistics.median(ours):,.0f} / {statistics.median(theirs):,.0f}" if ours else "n/a"
            met = ("yes" if statistics.median(wall) >= target.goal else "no") if wall else "n/a"
            if wall:
                medians[(target.name, side)] = statistics.median(wall)
            lines.append(
                f"| {target.name} | >= {target.goal}x | {side} | {spread(wall)} | {spread(cpu)} | {memory} | {met} |"
            )
    lines += ["", "| target | before (wall median) | after (wall median) | after / before |"]
    lines += ["| --- | --- | --- | --- |"]
    for target in (t for t in TARGETS if t.benchmark in names):
        b, a = medians.get((target.name, "before")), medians.get((target.name, "after"))
        change = f"{a / b:.2f}x" if a is not None and b is not None else "n/a"
        lines.append(f"| {target.name} | {f'{b:.2f}x' if b else 'n/a'} | {f'{a:.2f}x' if a else 'n/a'} | {change} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
