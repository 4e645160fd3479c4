"""What ``trl_dpo.py`` and ``trl_sft.py`` add to trl's scripts, identically on both sides: per rank, the
wall and CPU seconds of the ``train()`` call and the peak memory.

The benchmark copies this file beside the script and adds ``import script_probe;
script_probe.wrap(Trainer class)`` after the script's trainer import.  When ``train()`` returns, each
rank writes ``probe-rank{rank}.json`` into ``$BENCH_PROBE_DIR``: ``rank``, ``train_wall_s``,
``train_cpu_s`` (this process and any children it waited for, over the call), ``peak_rss_mib``
(``ru_maxrss`` of this process, and of its largest child if it ran any) and, on CUDA, ``peak_cuda_mib``
(``torch.cuda.max_memory_allocated``).  ``wrap_generation`` (``trl_grpo.py``) adds ``generate_s`` and
``generated_tokens``: the wall seconds in, and the completion tokens returned by, a trainer's generation method.

The drivers' side is here too: ``write_script_copies`` writes trl's script as shipped and ported, each
with the probe and this file beside it; ``run_script`` runs one under torchrun (or py-spy) with the
settings both benchmarks share; ``run_configurations`` runs the configurations interleaved (or each once
under py-spy); ``measure`` reads the probe files of a run, ``summary`` prints the medians and
same-repetition ratios, ``pyspy_prefix``/``top_functions`` profile a run with py-spy.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RANKS = 2
"""gloo ranks of every benchmark run (``torchrun --nproc_per_node``)."""


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def wrap(trainer_class: Any) -> None:
    """Time ``trainer_class.train`` and report this rank's probe line when it returns."""
    train = trainer_class.train

    @functools.wraps(train)
    def timed_train(self: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.time(), _cpu_seconds()
        result = train(self, *args, **kwargs)
        record = {
            "rank": int(os.environ.get("RANK", "0")),
            "train_wall_s": time.time() - wall,
            "train_cpu_s": _cpu_seconds() - cpu,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        }
        record.update(_generation)
        import torch

        if torch.cuda.is_available():
            record["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
        folder = Path(os.environ.get("BENCH_PROBE_DIR", "."))
        (folder / f"probe-rank{record['rank']}.json").write_text(json.dumps(record))
        return result

    trainer_class.train = timed_train


def write_script_copies(root: Path, script: str, trainer: str, probes: Sequence[str] = ("wrap",)) -> dict[str, Path]:
    """trl's ``scripts/{script}`` as shipped (``"trl"``) and with only ``trainer``'s import changed to
    trainbridge's (``"trainbridge"``), each with ``script_probe.<probe>(trainer)`` for each of ``probes``
    (``wrap``, ``wrap_generation``) after the import, written into ``root`` with this file beside them;
    their paths."""
    import trl

    source = (Path(trl.__file__).parent / "scripts" / script).read_text()
    helpers = "get_dataset, get_peft_config, get_quantization_config"
    original = f"    from trl import {trainer}, {helpers}\n"
    if original not in source:
        raise SystemExit(f"trl's {script} changed its import line (expected {original.strip()!r})")
    ported = f"    from trainbridge import {trainer}\n    from trl import {helpers}\n"
    probe = "    import script_probe\n\n" + "".join(f"    script_probe.{name}({trainer})\n" for name in probes)
    stem = Path(script).stem
    copies = {"trl": root / f"{stem}_trl.py", "trainbridge": root / f"{stem}_trainbridge.py"}
    copies["trl"].write_text(source.replace(original, original + probe))
    copies["trainbridge"].write_text(source.replace(original, ported + probe))
    shutil.copy(Path(__file__), root / "script_probe.py")
    return copies


def run_script(
    script: Path, model: Path, dataset: Path, out: Path, settings: dict[str, Any], profile: Path | None = None
) -> tuple[list[dict[str, Any]], float, Path]:
    """Run a script of ``write_script_copies`` under ``torchrun --nproc_per_node=RANKS`` (and py-spy with
    ``profile``) on CPU in float32, no saving, no reporting, logging once at the end; ``settings`` are the
    benchmark's own ``--name value`` options (``max_steps`` included).  Returns the log dicts the script
    printed, its ``train_runtime`` and the folder of the ranks' probe files."""
    steps = settings["max_steps"]
    fixed = {"logging_steps": steps, "save_strategy": "no", "bf16": "false", "use_cpu": "true", "report_to": "none",
             "dtype": "float32", "disable_tqdm": "true", "gradient_checkpointing": "false"}  # fmt: skip
    options: list[str] = []
    for name, value in {**fixed, **settings}.items():
        if value is True:
            options.append(f"--{name}")
        elif isinstance(value, list | tuple):  # an option of several values (nargs="+")
            options += [f"--{name}", *map(str, value)]
        else:
            options.append(f"--{name}={value}")
    from trainbridge.launch.launcher import free_port

    port = free_port()
    command = [
        *([] if profile is None else pyspy_prefix(profile)),
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}", f"--master_port={port}",
        str(script), f"--model_name_or_path={model}", f"--dataset_name={dataset}", f"--output_dir={out}", *options,
    ]  # fmt: skip
    probes = out.with_name(f"{out.name}-probes")
    probes.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_PROBE_DIR": str(probes)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=script.parent, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} {options} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    printed = [
        ast.literal_eval(line[line.index("{") : line.rindex("}") + 1])  # the printed log dicts
        for line in done.stdout.splitlines() + done.stderr.splitlines()
        if line.lstrip().startswith("{'")
    ]
    runtime = next(float(m["train_runtime"]) for m in printed if "train_runtime" in m)
    return printed, runtime, probes


def run_configurations(
    names: Sequence[str],
    repeats: int,
    run_one: Callable[[str, int, Path | None], dict[str, float]],
    unit: str,
    profile: Path | None = None,
) -> dict[str, list[dict[str, float]]] | None:
    """``run_one(name, run number, py-spy file or None)`` for each of ``names``, ``repeats`` times
    interleaved (each line printed as it comes); with ``profile``, each once under py-spy into that folder
    with its top functions beside it (None is returned: profiles are not timings)."""
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        for number, name in enumerate(names):
            stacks = profile / f"{name.replace(' ', '_').replace('(', '').replace(')', '')}.txt"
            run_one(name, number, stacks)
            stacks.with_name(stacks.stem + "-top.txt").write_text(top_functions(stacks))
            print(f"{name}: profile in {stacks}", flush=True)
        return None
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for repeat in range(repeats):
        for number, name in enumerate(names):
            r = run_one(name, repeat * len(names) + number, None)
            results[name].append(r)
            print(f"{name}: {r['per_s']:.2f} {unit}/s, {r['per_cpu_s']:.2f} {unit}/CPU-s, "
                  f"{r['peak_rss_mib']:.0f} MiB peak RSS per rank", flush=True)  # fmt: skip
    return results


_generation: dict[str, float] = {}
"""This rank's generation totals (``wrap_generation``), written into its probe record."""


def wrap_generation(trainer_class: Any, method: str = "_generate_single_turn") -> None:
    """Time ``trainer_class.<method>`` (trl's GRPO/RLOO generation: returns ``(completion_ids, logprobs)``)
    and count the completion tokens it returns."""
    generate = getattr(trainer_class, method)
    _generation.update(generate_s=0.0, generated_tokens=0.0)

    @functools.wraps(generate)
    def timed_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = generate(self, *args, **kwargs)
        _generation["generate_s"] += time.time() - start
        _generation["generated_tokens"] += sum(len(ids) for ids in result[0])
        return result

    setattr(trainer_class, method, timed_generate)


def measure(units: float, runtime: float, folder: Path, ranks: int) -> dict[str, float]:
    """Units per second of ``runtime`` (the framework's own ``train_runtime``: Trainer starts it after its
    set-up inside ``train()``), per second of the whole ``train()`` call (the slowest rank's: set-up included,
    what the script waits for), units per CPU second (the ranks' mean over ``train()``) and the largest peak
    RSS of a rank, from the ranks' probe files in ``folder`` (``wrap``)."""
    probes = [json.loads((folder / f"probe-rank{rank}.json").read_text()) for rank in range(ranks)]
    cpu = statistics.mean(p["train_cpu_s"] for p in probes)
    result = {
        "per_s": units / runtime,
        "per_train_s": units / max(p["train_wall_s"] for p in probes),
        "per_cpu_s": units / cpu,
        "peak_rss_mib": max(max(p["peak_rss_mib"], p["children_peak_rss_mib"]) for p in probes),
    }
    if all("generate_s" in p for p in probes):
        generate_s = statistics.mean(p["generate_s"] for p in probes)  # the ranks generate at the same time
        result["gen_tokens_per_s"] = sum(p["generated_tokens"] for p in probes) / generate_s
        result["generate_share"] = generate_s / statistics.mean(p["train_wall_s"] for p in probes)
    if any("peak_cuda_mib" in p for p in probes):
        result["peak_cuda_mib"] = max(p.get("peak_cuda_mib", 0.0) for p in probes)
    return result


def pyspy_prefix(profile: Path) -> list[str]:
    """``py-spy record`` of the launcher and every rank it starts, collapsed stacks into ``profile``."""
    return [
        shutil.which("py-spy") or "py-spy",
        "record",
        "--subprocesses",
        "--format",
        "raw",
        "--rate",
        "50",
        "-o",
        str(profile),
        "--",
    ]


def top_functions(profile: Path, limit: int = 25) -> str:
    """The functions with most samples in a collapsed-stack file: own (leaf) samples and inclusive samples,
    as a share of the samples of the ranks' training (stacks through ``train``)."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        if not any("timed_train (" in frame for frame in frames):
            continue
        count = int(count_text)
        total += count
        names = [
            frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
            for frame in frames
        ]
        own[names[-1]] = own.get(names[-1], 0) + count
        for name in set(names):
            inclusive[name] = inclusive.get(name, 0) + count
    lines = [f"{total} samples in train()", "own %  | function"]
    lines += [f"{100 * n / total:5.1f} | {name}" for name, n in sorted(own.items(), key=lambda kv: -kv[1])[:limit]]
    lines += ["inclusive % | function"]
    lines += [
        f"{100 * n / total:5.1f} | {name}" for name, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:limit]
    ]
    return "\n".join(lines)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(results: dict[str, list[dict[str, float]]], comparisons: list[tuple[str, str]], unit: str) -> list[str]:
    """Median and range per configuration, then the same-repetition ratios of each ``(ours, theirs)``."""
    lines = [
        f"| configuration | {unit}/s (median) | range | {unit}/CPU-s (median) | range | peak RSS per rank, MiB (max) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        wall = [r["per_s"] for r in runs]
        cpu = [r["per_cpu_s"] for r in runs]
        memory = max(r["peak_rss_mib"] for r in runs)
        lines.append(
            f"| {name} | {statistics.median(wall):.2f} | {min(wall):.2f}-{max(wall):.2f} | "
            f"{statistics.median(cpu):.2f} | {min(cpu):.2f}-{max(cpu):.2f} | {memory:.0f} |"
        )
    for ours, theirs in comparisons:
        if ours not in results or theirs not in results:
            continue
        labels = (
            ("per_s", "wall clock"),
            ("per_train_s", "whole train() call, slowest rank"),
            ("per_cpu_s", "CPU-normalised"),
        )
        for key, label in labels:
            pairs = [(a, b) for a, b in zip(results[ours], results[theirs], strict=False) if key in a and key in b]
            if not pairs:
                continue
            ratios = [a[key] / b[key] for a, b in pairs]
            lines.append(
                f"{ours} / {theirs}, {label}: same-repetition median {statistics.median(ratios):.2f}x "
                f"(range {min(ratios):.2f}-{max(ratios):.2f}; {', '.join(f'{x:.2f}' for x in ratios)})"
            )
        memory = [a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(results[ours], results[theirs], strict=False)]
        lines.append(f"{ours} / {theirs}, peak RSS per rank: {', '.join(f'{x:.2f}' for x in memory)}")
    return lines
