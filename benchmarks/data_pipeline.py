"""Data pipeline at scale: tokenise-once cache, cached start-up, per-rank memory, vs today's loader and TRL.

    python benchmarks/data_pipeline.py [--samples 1000000] [--ranks 1 2] [--num-proc 2]
                                       [--baseline-samples N] [--trl-samples N] [--work DIR]

Generates ``--samples`` synthetic chat conversations (1-3 user/assistant turns over a small word list, a
quarter with a system message) as JSONL and the tiny tokenizer with its chat template, then measures,
each in fresh processes:

* **first run**: ``open_dataset`` on an empty cache -- read with ``datasets``, rendered with the chat
  template, assistant masks by growing prefixes, ``--num-proc`` processes, written as Arrow;
* **cached start-up** with R ranks (each ``--ranks`` value, ``--repeats`` times): R processes started
  together, each importing torch/transformers and loading the tokenizer, opening the cached data
  (memory-mapped), planning epoch 0 and collating its first step's micro-batches, as a worker's set-up
  does; wall time from spawn to ready, the data part alone (open + plan + first step), and per-rank
  RSS / USS / PSS / anonymous memory (see ``memory``), in total and for the data alone (after set-up
  minus after the imports of torch, transformers, pyarrow and trainbridge.data and the tokenizer);
* **today's loader** (before the cache): every rank parses a pre-tokenised JSONL of the same samples
  into Python ``Sample`` tuples (``--baseline-samples``, default all);
* **datasets + TRL's preparation** (of the first ``--trl-samples`` conversations, in their own file):
  ``load_dataset("json")`` then ``map`` of
  ``apply_chat_template(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`` -- what
  trl's ``SFTTrainer`` does with ``assistant_only_loss`` (a marked copy of the template) -- with the same
  processes (``--trl-samples``, default all; 0 skips).

* **CPU per conversation** (``--cpu-samples``, one process, no ``datasets``, ``time.process_time``, so
  less disturbed by other load): trainbridge's map function on raw JSON lines with the prefix-rendering
  template and with a ``{% generation %}``-marked copy, and TRL's per-row ``apply_chat_template``.

Prints one JSON object per measurement and a summary.  Run under the shared lock on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORDS = (
    "what",
    "is",
    "the",
    "sum",
    "of",
    "and",
    "plus",
    "minus",
    "times",
    "number",
    "answer",
    "please",
    "tell",
    "me",
    "how",
    "many",
    "apples",
    "pears",
    "are",
    "there",
    "in",
    "a",
    "box",
    "if",
    "we",
    "add",
    "more",
    "take",
    "away",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
)


def generate(path: Path, count: int, seed: int = 0) -> None:
    """``count`` synthetic conversations as JSONL (characters the tiny tokenizer knows)."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            messages = []
            if rng.random() < 0.25:
                messages.append({"role": "system", "content": "you are a helpful assistant."})
            for _ in range(rng.randint(1, 3)):
                question = " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + "?"
                answer = " ".join(rng.choices(WORDS, k=rng.randint(2, 16))) + "."
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared: timings need them beside)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def memory() -> dict[str, float]:
    """This process's memory in MB: ``rss``; ``uss`` (pages no other process maps -- a mapped cache page
    counts here while one rank alone has touched it); ``pss`` (shared pages divided among the processes
    mapping them); ``anon`` (anonymous memory: what the process allocated itself, never shared)."""
    import psutil

    info = psutil.Process().memory_full_info()
    out = {"rss": info.rss / 2**20, "uss": info.uss / 2**20, "pss": info.pss / 2**20}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            out["anon"] = int(line.split()[1]) / 1024
    return out


# ------------------------------------------------------------------------------------------ children
def child_tokenize(work: Path, num_proc: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from trainbridge.data import open_dataset
    from trainbridge.data.records import DataOptions

    tokenizer = AutoTokenizer.from_pretrained(work / "tok")
    start = time.perf_counter()
    source, stats = open_dataset(
        work / "chat.jsonl", tokenizer, DataOptions(max_seq_len=1024, num_proc=num_proc), work / "cache"
    )
    return {
        "seconds": time.perf_counter() - start,
        "samples": len(source),
        "tokens": stats.tokens,
        "cache_hit": stats.cache_hit,
        "cache": stats.cache,
    }


def child_startup(work: Path, rank: int, world: int) -> dict[str, Any]:
    """A worker's data set-up, timed by phase; memory of the data alone = after set-up minus after imports."""
    started = time.perf_counter()
    import pyarrow.ipc  # noqa: F401  (libraries, a fixed cost: imported before the "data alone" baseline;
    import torch  # noqa: F401  a worker has torch and transformers imported before it touches data)
    from transformers import AutoTokenizer

    from trainbridge.data import collate_padding_free, open_dataset
    from trainbridge.data.loader import TrainBatches
    from trainbridge.data.records import DataOptions

    tokenizer = AutoTokenizer.from_pretrained(work / "tok")
    imported_at = time.perf_counter()
    imported = memory()
    source, stats = open_dataset(work / "chat.jsonl", tokenizer, DataOptions(max_seq_len=1024), work / "cache")
    opened_at = time.perf_counter()
    batches = TrainBatches(
        source,
        collate_padding_free,
        effective_batch_size=64,
        world_size=world,
        rank=rank,
        max_batch_len=4096,
        seed=0,
        padded=False,
    )
    planned_at = time.perf_counter()
    first = batches.micro_batches(batches.plan.steps[0])
    done_at = time.perf_counter()
    after = memory()
    return {
        "cache_hit": stats.cache_hit,
        "samples": len(source),
        "micro_batches": len(first),
        "imports_s": imported_at - started,
        "open_s": opened_at - imported_at,
        "plan_s": planned_at - opened_at,
        "first_step_s": done_at - planned_at,
        **{f"{kind}_mb": value for kind, value in after.items()},
        **{f"imported_{kind}_mb": value for kind, value in imported.items()},
        **{f"data_{kind}_mb": after[kind] - imported[kind] for kind in after},
    }


def child_today(work: Path) -> dict[str, Any]:
    """The loader before the cache: every rank parses the whole pre-tokenised JSONL into tuples."""
    import torch  # noqa: F401  (today's workers had torch imported before loading)

    from trainbridge.data import Sample

    imported = memory()
    start = time.perf_counter()
    samples = []
    with (work / "pretokenized.jsonl").open("rb") as handle:
        for raw in handle:
            record = json.loads(raw)
            samples.append(Sample(tuple(record["input_ids"]), tuple(record["labels"])))
    lengths = [s.length for s in samples]
    loss_tokens = [s.loss_tokens for s in samples]
    seconds = time.perf_counter() - start
    after = memory()
    return {
        "seconds": seconds,
        "samples": len(samples),
        "tokens": sum(lengths),
        "loss": sum(loss_tokens),
        "rss_mb": after["rss"],
        "data_rss_mb": after["rss"] - imported["rss"],
        "data_anon_mb": after["anon"] - imported["anon"],
    }


def marked_template(template: str) -> str:
    """The tiny tokenizer's template with ``{% generation %}`` around assistant text (what TRL needs)."""
    marked = template.replace(
        "{{ message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}",
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] }}{{ eos_token }}{% endgeneration %}{% else %}"
        "{{ message['content'] }}{% endif %}",
    )
    assert marked != template, "the tiny template changed; update the marked copy"
    return marked


def child_cpu(work: Path, count: int) -> dict[str, Any]:
    """CPU time per conversation in one process, no ``datasets``: trainbridge's map function (JSON line ->
    masked ids, the prefix-rendering template and a marked one) against TRL's per-row preparation."""
    from transformers import AutoTokenizer

    from trainbridge.data.cache import MAP_BATCH_SIZE
    from trainbridge.data.records import DataOptions, RowEncoder

    tokenizer = AutoTokenizer.from_pretrained(work / "tok")
    template = str(tokenizer.chat_template)
    with (work / "chat.jsonl").open() as handle:
        lines = [line for _, line in zip(range(count), handle)]
    out: dict[str, Any] = {"samples": len(lines)}
    for name, chosen in (("trainbridge_prefixes", template), ("trainbridge_marked", marked_template(template))):
        encoder = RowEncoder("chat.jsonl", True, tokenizer, DataOptions(max_seq_len=1024), chosen)
        start = time.process_time()
        for first in range(0, len(lines), MAP_BATCH_SIZE):
            batch = lines[first : first + MAP_BATCH_SIZE]
            encoder({"text": batch}, list(range(first, first + len(batch))))
        out[f"{name}_cpu_us"] = (time.process_time() - start) / len(lines) * 1e6
    tokenizer.chat_template = marked_template(template)
    start = time.process_time()
    for line in lines:
        tokenizer.apply_chat_template(
            json.loads(line)["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    out["trl_cpu_us"] = (time.process_time() - start) / len(lines) * 1e6
    return out


def child_trl(work: Path, num_proc: int, count: int) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "tok")
    tokenizer.chat_template = marked_template(str(tokenizer.chat_template))
    datasets.disable_progress_bars()
    start = time.perf_counter()
    dataset = datasets.load_dataset(
        "json", data_files=str(work / "trl.jsonl"), split="train", cache_dir=str(work / "hf-cache")
    )
    assert len(dataset) == count
    loaded = time.perf_counter()

    def tokenize(example: dict[str, Any]) -> dict[str, Any]:
        out = tokenizer.apply_chat_template(
            example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    dataset = dataset.map(tokenize, remove_columns=["messages"], num_proc=num_proc if num_proc > 1 else None)
    done = time.perf_counter()
    return {
        "seconds": done - start,
        "load_s": loaded - start,
        "map_s": done - loaded,
        "samples": len(dataset),
        "rss_mb": memory()["rss"],
    }


# ------------------------------------------------------------------------------------------ parent
def run_child(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env)


def result_of(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"child failed ({process.returncode}): {out[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--baseline-samples", type=int)
    parser.add_argument("--trl-samples", type=int)
    parser.add_argument(
        "--cpu-samples",
        type=int,
        default=20_000,
        help="conversations for the one-process CPU-time comparison (0 skips)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="cached start-ups per rank count")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainbridge-data-bench"))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    options = parser.parse_args()
    work = options.work
    if options.child:
        kind, *rest = options.child
        if kind == "tokenize":
            result = child_tokenize(work, int(rest[0]))
        elif kind == "startup":
            result = child_startup(work, int(rest[0]), int(rest[1]))
        elif kind == "today":
            result = child_today(work)
        elif kind == "cpu":
            result = child_cpu(work, int(rest[0]))
        else:
            result = child_trl(work, int(rest[0]), int(rest[1]))
        print(json.dumps(result), flush=True)
        return

    from trainbridge.demos.tiny_model import build_tokenizer

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    generate(work / "chat.jsonl", options.samples)
    build_tokenizer(work / "tok")
    size_mb = (work / "chat.jsonl").stat().st_size / 2**20
    report: dict[str, Any] = {
        "samples": options.samples,
        "jsonl_mb": round(size_mb, 1),
        "generate_s": round(time.perf_counter() - start, 1),
        "num_proc": options.num_proc,
        "loadavg_start": loadavg(),
    }
    print(json.dumps(report), flush=True)

    first = result_of(run_child(["--work", str(work), "--child", "tokenize", str(options.num_proc)], env))
    report["first_run_tokenise_s"] = round(first["seconds"], 1)
    report["tokens"] = first["tokens"]
    cache_mb = sum(f.stat().st_size for f in Path(first["cache"]).iterdir()) / 2**20
    report["cache_mb"] = round(cache_mb, 1)
    print(json.dumps({"first_run": first, "cache_mb": cache_mb}), flush=True)

    for world in options.ranks:
        walls, data_s = [], []
        for _ in range(options.repeats):
            spawned = time.perf_counter()
            children = [
                run_child(["--work", str(work), "--child", "startup", str(r), str(world)], env) for r in range(world)
            ]
            results = [result_of(c) for c in children]
            walls.append(time.perf_counter() - spawned)
            data_s.append(max(r["open_s"] + r["plan_s"] + r["first_step_s"] for r in results))
            assert all(r["cache_hit"] for r in results), "cached start-up tokenised"
            print(json.dumps({"world": world, "wall_s": walls[-1], "loadavg": loadavg(), "ranks": results}), flush=True)
        report[f"cached_startup_s_{world}_ranks"] = [round(w, 2) for w in walls]
        report[f"cached_startup_data_s_{world}_ranks"] = [round(d, 3) for d in data_s]
        for kind in ("rss", "uss", "pss", "anon"):
            report[f"per_rank_{kind}_mb_{world}_ranks"] = [round(r[f"{kind}_mb"]) for r in results]
            report[f"per_rank_data_{kind}_mb_{world}_ranks"] = [round(r[f"data_{kind}_mb"], 1) for r in results]

    baseline = options.baseline_samples if options.baseline_samples is not None else options.samples
    if baseline:
        _write_pretokenized(Path(first["cache"]), work / "pretokenized.jsonl", baseline)
        spawned = time.perf_counter()
        children = [run_child(["--work", str(work), "--child", "today"], env) for _ in range(max(options.ranks))]
        results = [result_of(c) for c in children]
        report["today_samples"] = baseline
        report[f"today_startup_s_{max(options.ranks)}_ranks"] = round(time.perf_counter() - spawned, 1)
        report["today_per_rank_data_rss_mb"] = [round(r["data_rss_mb"]) for r in results]
        report["today_per_rank_s"] = [round(r["seconds"], 1) for r in results]
        print(json.dumps({"today": results}), flush=True)

    trl = options.trl_samples if options.trl_samples is not None else options.samples
    if trl:
        with (work / "chat.jsonl").open() as source, (work / "trl.jsonl").open("w") as head:
            head.writelines(line for _, line in zip(range(trl), source))
        result = result_of(run_child(["--work", str(work), "--child", "trl", str(options.num_proc), str(trl)], env))
        report["trl_samples"] = trl
        report["trl_prepare_s"] = round(result["seconds"], 1)
        report["trl_load_s"] = round(result["load_s"], 1)
        report["trl_map_s"] = round(result["map_s"], 1)
        print(json.dumps({"trl": result}), flush=True)
    if options.cpu_samples:
        result = result_of(run_child(["--work", str(work), "--child", "cpu", str(options.cpu_samples)], env))
        report.update(
            {key: round(value) if key.endswith("_us") else value for key, value in result.items() if key != "samples"}
        )
        report["cpu_samples"] = result["samples"]
        print(json.dumps({"cpu": result}), flush=True)
    report["loadavg_end"] = loadavg()
    print("SUMMARY " + json.dumps(report), flush=True)


def _write_pretokenized(cache: Path, path: Path, count: int) -> None:
    """The cache's samples as today's pre-tokenised JSONL (``input_ids``, ``labels``)."""
    import pyarrow as pa

    meta = json.loads((cache / "meta.json").read_text())
    written = 0
    with path.open("w") as handle:
        for name in meta["files"]:
            table = pa.ipc.open_stream(pa.memory_map(str(cache / name))).read_all()
            for batch in table.select(["input_ids", "labels", "status"]).to_batches(10_000):
                for ids, labels, status in zip(*(batch.column(i).to_pylist() for i in range(3))):
                    if status == 0:
                        handle.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
                        written += 1
                        if written == count:
                            return


if __name__ == "__main__":
    main()
