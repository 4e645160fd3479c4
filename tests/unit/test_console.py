"""``console_to``: this process's and its children's console into a file, restored afterwards."""

import os
import subprocess
import sys

from trainbridge.launch.console import console_to


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
