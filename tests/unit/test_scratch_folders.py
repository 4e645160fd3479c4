"""Temporary folders a run creates are removed when the run ends, also when it fails or is killed.

The model-loss rows (``data.rows.open_rows``) convert their files to Arrow in a ``trainbridge-rows-*``
folder: one per process, removed at its exit, swept by the next process once a killed one left it;
the launcher's data check removes its own at once.  Each process here runs in a temporary directory of
its own (``TMPDIR``), so the count of folders left is exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

from trainbridge.data.rows import ROWS_SCRATCH_PREFIX

OPEN_ROWS = """
import os, signal, sys
from pathlib import Path
from trainbridge.data.rows import open_rows, process_rows_folder

rows = open_rows(Path(sys.argv[1]), None, 16)
assert len(rows) == 3 and process_rows_folder().is_dir()
print(process_rows_folder(), flush=True)
if sys.argv[2] == "error":
    raise RuntimeError("the run fails after its rows were opened")
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _rows_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [1, 2, 3], "labels": [1, 2, 3]}) + "\n" for _ in range(3)))
    return path


def _run(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "open_rows.py"
    script.write_text(textwrap.dedent(OPEN_ROWS))
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(scratch_root), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run(
        [sys.executable, str(script), str(_rows_file(tmp_path)), how], env=env, capture_output=True, text=True
    )


def _left(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(ROWS_SCRATCH_PREFIX))


def test_a_rows_folder_is_removed_when_its_process_fails_and_swept_after_a_kill(tmp_path):
    killed = _run(tmp_path, "killed")
    assert killed.returncode == -9
    assert _left(tmp_path) == [Path(killed.stdout.strip()).name]  # no exit handler ran: left for the next
    failed = _run(tmp_path, "error")  # a run that fails after opening its rows
    assert failed.returncode == 1 and "the run fails" in failed.stderr, failed.stderr[-2000:]
    assert Path(failed.stdout.strip()).parent == tmp_path / "tmp"  # it was there while the rows were used
    assert _left(tmp_path) == [], f"left behind: {_left(tmp_path)}"


def test_the_launchers_data_check_keeps_no_rows_folder(tmp_path, monkeypatch):
    from trainbridge.launch import data_check

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    rows = _rows_file(tmp_path)
    args = SimpleNamespace(data_path=rows, val_data_path=None, eval_data_paths={"held": rows}, max_seq_len=16)
    data_check._check_items(args, None)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_forked_child_leaves_its_parents_rows_folder_alone(tmp_path):
    """A child forked after the folder was made inherits its exit handler; the child's exit must not remove
    the folder its parent still uses, the parent's exit does."""
    from trainbridge.core.scratch import _remove_if_owner

    folder = tmp_path / f"{ROWS_SCRATCH_PREFIX}x"
    folder.mkdir()
    owner = os.getpid()
    child = os.fork()
    if child == 0:  # the child runs the inherited handler as its exit would
        try:
            _remove_if_owner(folder, owner)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert folder.is_dir()
    _remove_if_owner(folder, owner)
    assert not folder.exists()
