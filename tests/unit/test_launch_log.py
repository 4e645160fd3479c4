"""torchrun's own report goes to the run's launch log, not the console; the error the user sees names it.

The agent runs in-process here with ``torch.distributed.run.main`` replaced by a fake that does what
torchrun does when a worker fails: logs "failed (exitcode: 1) ..." under ``torch.distributed`` (whose
stderr handler torch installs) and raises the real ``ChildFailedError`` (whose text is torchrun's
"Root Cause (first observed failure)" summary).
"""

from __future__ import annotations

import json
import logging

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainbridge.launch import agent, lifeline

TORCHRUN_LINE = "failed (exitcode: 1) local_rank: 1 (pid: 4242) of binary: python"


class ConsoleHandler(logging.Handler):
    """Stands in for the stderr handler torch gives ``torch.distributed``: records what reaches it."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def torchrun_console():
    """torch's ``torch.distributed`` logger with a recording console handler; restored after the test."""
    logger = logging.getLogger(agent.TORCHRUN_LOGGER)
    saved = logger.handlers[:], logger.propagate, logger.level
    console = ConsoleHandler()
    logger.handlers = [console]
    yield console
    for handler in logger.handlers:
        if handler is not console:
            handler.close()
    logger.handlers, logger.propagate, logger.level = saved


@pytest.fixture
def failing_torchrun(tmp_path, monkeypatch):
    error_file = tmp_path / "error-rank1.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "ValueError: boom",
                    "extraInfo": {
                        "py_callstack": "Traceback (most recent call last):\nValueError: boom\n",
                        "timestamp": "100",
                    },
                }
            }
        )
    )

    def torchrun_main(argv):
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").error(TORCHRUN_LINE)
        failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(error_file))
        raise ChildFailedError(name="trainbridge.launch.worker", failures={1: failure})

    monkeypatch.setattr(agent, "torchrun_main", torchrun_main)
    monkeypatch.delenv(lifeline.LAUNCHER_ENV, raising=False)
    monkeypatch.setenv(agent.FAILURES_FILE_ENV, str(tmp_path / "failures.json"))


def test_a_failure_leaves_torchrun_report_in_the_launch_log_only(
    tmp_path, monkeypatch, capfd, torchrun_console, failing_torchrun
):
    log = tmp_path / "launch.log"
    monkeypatch.setenv(agent.LAUNCH_LOG_ENV, str(log))
    assert agent.main([]) == 1
    assert torchrun_console.lines == []
    console = "".join(capfd.readouterr())
    for torchrun_text in ("exitcode", "Root Cause", "worker group failed", "ChildFailedError", "4242"):
        assert torchrun_text not in console, console
    text = log.read_text()
    assert TORCHRUN_LINE in text
    assert "worker group failed (1 rank(s) observed failing)" in text
    assert "Root Cause (first observed failure)" in text and "ValueError: boom" in text
    (record,) = json.loads((tmp_path / "failures.json").read_text())
    assert (record["rank"], record["exitcode"], record["error_file"]) == (1, 1, str(tmp_path / "error-rank1.json"))


def test_without_a_launch_log_torchrun_keeps_the_console(monkeypatch, capfd, torchrun_console, failing_torchrun):
    monkeypatch.delenv(agent.LAUNCH_LOG_ENV, raising=False)
    assert agent.main([]) == 1
    assert torchrun_console.lines == [TORCHRUN_LINE]
    assert "trainbridge: worker group failed (1 rank(s) observed failing)" in capfd.readouterr().err
