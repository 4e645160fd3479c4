"""Files one of our processes writes for another to load are signed: the facade's evaluation result.

A file is signed with a key only its launch knows (``launch.transport.write_signed``, the payload's HMAC), so
a file swapped or forged by someone who can write the folder is refused before it is unpickled.  (The facade's
launched ``evaluate()`` that read such a file is gone: every Trainer runs in place, ``launch.script_launch``.)
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from trainbridge.launch.transport import PayloadIntegrityError, read_signed, write_signed
from trainbridge.trainer.runner import RESULT_KEY_ENV


class RunsCode:
    """Unpickling it creates ``marker``: the proof that a forged file's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_a_signed_file_loads_and_a_swapped_or_forged_one_is_refused_unrun(tmp_path: Path) -> None:
    path, marker = tmp_path / "result.pkl", tmp_path / "ran"
    write_signed({"metrics": {"eval_loss": 1.5}}, path, "k" * 64)
    assert read_signed(path, "k" * 64, RESULT_KEY_ENV) == {"metrics": {"eval_loss": 1.5}}
    with pytest.raises(PayloadIntegrityError, match=f"key in {RESULT_KEY_ENV}"):
        read_signed(path, "other" * 13, RESULT_KEY_ENV)
    write_signed(RunsCode(marker), path, "attacker's key")  # a well-formed file under another key
    with pytest.raises(PayloadIntegrityError, match="refusing to unpickle"):
        read_signed(path, "k" * 64, RESULT_KEY_ENV)
    path.write_bytes(pickle.dumps(RunsCode(marker)))  # a bare pickle
    with pytest.raises(PayloadIntegrityError, match="not a trainbridge payload file"):
        read_signed(path, "k" * 64, RESULT_KEY_ENV)
    assert not marker.exists()


def test_writing_replaces_a_planted_link_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    path = tmp_path / "result.pkl"
    path.symlink_to(victim)
    write_signed({"metrics": {}}, path, "k")
    assert victim.read_text() == "keep" and not path.is_symlink()
    assert (path.stat().st_mode & 0o777) == 0o600
