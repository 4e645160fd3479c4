"""What ``trainbridge demo`` must show, checked on one real run (``test_ordinary_user`` runs it as a login user
with umask 002; ``test_launcher_torchrun`` runs it as the current user only where no login user can be made)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from trainbridge.core.run_dir import result_file
from trainbridge.launch.console import OWN_LOG_LINE
from trainbridge.loop.result import RunResult

DEMO_STEPS = 12
"""``trainbridge demo --max-steps 12``: checkpoints at 9 (the demo's cadence) and 12, a loss that falls."""

TQDM_BAR = re.compile(r"\s*\d+%\|[^|]*\| *\d+/\d+ \[[^\]]*\]")
"""One state of a tqdm bar (the training bar, transformers' evaluation bar), as the console shows it."""


def library_lines(stdout: str, stderr: str) -> list[str]:
    """The console lines a library printed, of a run's stdout and stderr.  Ours: on stderr, the progress bars and
    the log lines of ``trainbridge.*`` loggers (``launch.console.OWN_LOG_LINE``); on stdout, the lines our
    command prints (``trainbridge ...`` lines, their two-space-indented rows: plan, summary) and the training
    logs in transformers' form (``{'loss': ...}``).  Anything else (a ``warnings`` line, another logger's
    record, a library's print) is a library's."""
    found = []
    for line in stdout.splitlines():
        if line and not re.match(r"trainbridge\b|  \S|\{'", line):
            found.append(line)
    for line in stderr.splitlines():
        for piece in re.split(r"\r|\x1b\[A", TQDM_BAR.sub("\r", line)):  # bars redraw with \r and cursor-up
            if piece.strip() and not OWN_LOG_LINE.match(piece):
                found.append(piece)
    return found


def assert_the_demo_trained_and_only_our_lines_show(stdout: str, stderr: str, output_dir: Path) -> None:
    """``trainbridge demo --max-steps 12 --output-dir output_dir`` as a newcomer runs it: the loss falls, and the
    console has our lines only (no bitsandbytes import warnings though nothing is quantised, no deprecation
    warnings of our torch calls); it ends with a picture of this run's metrics (``trainbridge plot``)."""
    assert library_lines(stdout, stderr) == [], stderr
    result = RunResult.read(result_file(output_dir / "run"))
    assert (result.global_step, result.max_steps) == (DEMO_STEPS, DEMO_STEPS)
    records = [json.loads(line) for line in Path(result.metrics_file).read_text().splitlines()]
    losses = [record["loss"] for record in records if "loss" in record]
    assert losses[-1] < losses[0] - 0.5, losses
    assert [os.path.basename(c) for c in result.checkpoints] == ["checkpoint-9", "checkpoint-12"]
    assert "trainbridge demo finished" in stdout
    png = Path(result.metrics_file).with_name("metrics.png")
    assert f"plot:            {png}" in stdout
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000


def login_user_can_run() -> bool:
    """Whether ``test_ordinary_user`` runs (as root, or as a user whose primary group is theirs alone)."""
    from trainbridge.core.private_files import private_group

    return os.geteuid() == 0 or private_group(os.getgid(), os.getuid())
