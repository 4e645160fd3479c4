"""``trainbridge train`` as a user runs it: the console script, from another folder, two CPU ranks.

The dry-run plan is checked against numbers computed here from the data and the model; a real run
checks that a callback module next to the config imports in both workers, and what the console shows
(one plan, one line per log in transformers' form with and without HF callbacks, each warning once,
no library banners or weight-loading bars, no doubled rank prefixes, the end-of-run summary).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.distributed

MAX_SEQ_LEN = 32
LENGTHS = [4 + i % 9 for i in range(30)]
"""Kept samples' lengths; 3 overlong and 2 without loss tokens are added to the file."""

CALLBACKS = """
import warnings
from pathlib import Path

from transformers import TrainerCallback

from trainbridge import Callback


class Marker(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_begin(self, context, **kwargs):
        Path(self.folder, f"seen-{context.rank}").write_text("x")
        warnings.warn("tb-test-" + "warning: printed by every rank, shown once")


class QuietHF(TrainerCallback):
    pass


class FailsOnRankOne(Callback):
    def on_train_begin(self, context, **kwargs):
        if context.rank == 1:
            raise ValueError("boom-" + "on-rank-1")
"""


def _trainbridge() -> list[str]:
    script = Path(sys.executable).with_name("trainbridge")
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainbridge"]


@pytest.fixture
def project(tmp_path, tiny_llama):
    """A user's project folder: config, data and a callback module side by side; a separate working dir."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copytree(tiny_llama, folder / "model")
    rows = [
        {"input_ids": [3 + (j % 10) for j in range(n)], "labels": [3 + (j % 10) for j in range(n)]} for n in LENGTHS
    ]
    rows += [{"input_ids": [5] * 40, "labels": [5] * 40} for _ in range(3)]  # longer than MAX_SEQ_LEN
    rows += [{"input_ids": [5] * 6, "labels": [-100] * 6} for _ in range(2)]  # no loss tokens
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "my_callbacks.py").write_text(CALLBACKS)
    config = {
        "model_path": "model",
        "data_path": "train.jsonl",
        "ckpt_output_dir": "out",
        "max_seq_len": MAX_SEQ_LEN,
        "max_batch_len": 256,
        "effective_batch_size": 8,
        "num_epochs": 2,
        "device": "cpu",
        "logging_steps": 2,
        "save_strategy": "no",
        "save_final_checkpoint": False,
        "callbacks": [{"class": "my_callbacks:Marker", "kwargs": {"folder": str(folder)}}],
    }
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    return folder, cwd


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "DS_ACCELERATOR")}
    return subprocess.run(
        [*_trainbridge(), "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_dry_run_plan_matches_the_config_and_trains_nothing(project):
    from transformers import AutoModelForCausalLM

    folder, cwd = project
    proc = _run(cwd, str(folder / "run.yaml"), "--nproc_per_node", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder / "model").parameters())
    steps = math.ceil(len(LENGTHS) / 8)
    total = sum(LENGTHS)

    def count(n: float) -> str:
        return f"{n / 1e3:.2f}k" if n >= 1e3 else str(n)

    plan = out[out.index("trainbridge: run plan") :]
    assert f"{count(params)} parameters ({count(params)} trainable), float32" in plan
    assert (
        f"train.jsonl: {len(LENGTHS)} samples kept of {len(LENGTHS) + 5}; dropped: 3 longer than "
        f"max_seq_len={MAX_SEQ_LEN}, 2 without loss tokens"
    ) in plan
    assert f"{total:,} in {len(LENGTHS)} samples; length mean {total / len(LENGTHS):.1f}, max {max(LENGTHS)}" in plan
    assert f"{steps} per epoch, {2 * steps} in total over 2 epochs" in plan
    assert re.search(rf"effective batch: +8 samples, ~{total / steps:,.0f} tokens per step \(all ranks\)", plan)
    assert re.search(r"parallelism: +ddp, world size 2 \(gloo, cpu\)", plan)
    assert re.search(rf"metrics: +{re.escape(str(folder / 'out' / 'metrics.jsonl'))}", plan)
    checkpoints = re.escape(str(folder / "out" / "checkpoint-"))
    assert re.search(rf"checkpoints: +{checkpoints}<step> \(save_strategy=no\)", plan)
    assert out.count("trainbridge: run plan") == 1
    assert "resolved configuration" in out and "max_seq_len: 32" in out and "nothing was trained" in out
    assert not (folder / "out" / "metrics.jsonl").exists() and not list((folder / "out").glob("checkpoint-*"))
    assert not list(folder.glob("seen-*"))  # callbacks are not run by a dry run


@pytest.mark.parametrize("with_hf_callback", [False, True], ids=["native", "hf-callback"])
def test_console_of_a_real_run(project, with_hf_callback):
    folder, cwd = project
    args = [str(folder / "run.yaml"), "--nproc-per-node", "2", "--set", "max_steps=4"]
    if with_hf_callback:
        config = yaml.safe_load((folder / "run.yaml").read_text())
        config["callbacks"].append({"class": "my_callbacks:QuietHF"})
        (folder / "run.yaml").write_text(yaml.safe_dump(config))
    proc = _run(cwd, *args)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    # the callback module next to the config was imported in both workers (no PYTHONPATH set for it)
    assert sorted(p.name for p in folder.glob("seen-*")) == ["seen-0", "seen-1"]
    assert text.count("trainbridge: run plan") == 1
    assert text.count("tb-test-warning") == 1  # warned on both ranks, shown once
    for noise in ("Setting accelerator to CPU", "Loading weights", "Writing model shards", "[rank1]: [rank1]"):
        assert noise not in text, noise
    loss_lines = re.findall(
        r"^\{'loss': '[^']+', 'grad_norm': '[^']+', 'learning_rate': '[^']+', 'epoch': "
        r"'[^']+'.*\}$",
        text,
        flags=re.M,
    )
    assert len(loss_lines) == 2  # logging_steps=2 over 4 steps: one line per log
    assert "'train_runtime'" in text and "total_flos" not in text
    summary = proc.stdout[proc.stdout.index("trainbridge: training finished") :]
    for row in (
        "steps:",
        "4/4 (completed)",
        "training loss:",
        "(first log) ->",
        "final loss:",
        "metrics file:",
        "wall time:",
    ):
        assert row in summary, row


def test_a_worker_error_is_reported_with_its_root_cause_and_single_rank_prefixes(project):
    folder, cwd = project
    config = yaml.safe_load((folder / "run.yaml").read_text())
    config["callbacks"] = [{"class": "my_callbacks:FailsOnRankOne"}]
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    proc = _run(cwd, str(folder / "run.yaml"), "--nproc-per-node", "2", "--set", "max_steps=2")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "[rank1]: [rank1]" not in text
    final = [line for line in proc.stderr.splitlines() if line.startswith("trainbridge: training failed")]
    assert len(final) == 1 and "rank 1" in final[0] and "ValueError: boom-on-rank-1" in final[0], text
    # torchrun's own report (its log lines, the ChildFailedError "Root Cause" summary) is in the run's launch
    # log, which the error names, not on the console
    for torchrun_text in ("multiprocessing/api.py", "failed (exitcode", "Root Cause", "worker group failed"):
        assert torchrun_text not in text, torchrun_text
    log = folder / "out" / "logs" / "launch.log"
    assert f"Full log (torchrun's own report, every rank's error): {log}" in proc.stderr, text
    logged = log.read_text()
    assert "Root Cause (first observed failure)" in logged and "boom-on-rank-1" in logged
