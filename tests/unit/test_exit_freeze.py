"""A script run in place ends with the interpreter's own exit; ``core.distributed``'s exit hook freezes every
object last (``gc.freeze``), so the final collections and module teardown skip them, while exit handlers
registered later still run and the standard streams are flushed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, gc, sys
from trainbridge.core import distributed

atexit.register(distributed._at_exit)  # as _leave_at_exit registers it when a process group starts
out = open(sys.argv[1], "w")
atexit.register(lambda: out.write(f"later handler ran; frozen before it: {gc.get_freeze_count()}\\n") or out.close())
print("unflushed", end="")
"""


def test_the_exit_hook_freezes_after_the_handlers_registered_later(tmp_path: Path) -> None:
    marker = tmp_path / "marker.txt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "unflushed"
    assert marker.read_text() == "later handler ran; frozen before it: 0\n"  # handlers run last-in, first-out


def test_the_exit_hook_freezes_what_is_alive() -> None:
    check = "import gc; from trainbridge.core import distributed; distributed._at_exit(); print(gc.get_freeze_count())"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True)
    assert int(done.stdout) > 1000
