"""``console_to``: this process's and its children's console into a file, restored afterwards; ``whole_lines``:
a worker's line leaves in one write."""

import io
import os
import subprocess
import sys

from trainbridge.launch.console import console_to, whole_lines


def test_console_to_captures_python_and_child_output_then_restores(tmp_path, capfd):
    log = tmp_path / "console.log"
    log.write_text("earlier\n")
    print("before", flush=True)
    with console_to(log):
        os.write(1, b"from fd 1\n")  # (pytest replaces sys.stdout; a script's print writes to fd 1)
        os.write(2, b"from fd 2\n")
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
    print("after", flush=True)
    assert log.read_text().splitlines() == ["earlier", "from fd 1", "from fd 2", "from a child"]
    out, err = capfd.readouterr()
    assert out == "before\nafter\n" and err == ""


class _Writes(io.RawIOBase):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def test_under_python_u_each_printed_line_is_one_write(monkeypatch):
    """``python -u`` (torchrun's workers) writes print's text and newline apart; another rank's line written
    between them joins the two (seen in CI: ``[rank1]: hello from 1hello from 0``)."""
    raw = _Writes()
    stream = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)  # as PYTHONUNBUFFERED builds stdout
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)
    whole_lines()
    print("hello from 0")
    print("a", "b", file=sys.stderr)
    assert raw.writes == [b"hello from 0\n", b"a b\n"]
