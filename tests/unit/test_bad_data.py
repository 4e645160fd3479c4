"""Bad data is named before launch (issue 24 finding 8), and a shared data cache cannot be poisoned
(finding 10): each case names ``file:line`` and what is wrong, never a raw exception."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trainbridge.data.cache import entry_problem, open_tokenized
from trainbridge.data.inputs import DataInputError
from trainbridge.data.records import DataOptions
from trainbridge.data.sources import data_options
from trainbridge.data.types import DataFormatError
from trainbridge.launch.checks import check_data_file

GOOD = b'{"input_ids": [1, 2, 3]}\n'


def _open(tmp_path: Path, data: bytes, **options) -> object:
    """The samples of ``tmp_path/train.jsonl`` holding ``data`` (written only when it differs, so a second
    call finds the same cache key)."""
    path = tmp_path / "train.jsonl"
    if not path.is_file() or path.read_bytes() != data:
        path.write_bytes(data)
    return open_tokenized(path, None, DataOptions(max_seq_len=64, **options), None, tmp_path / "cache")


# ------------------------------------------------------------------------------------ the launcher's sniff
def test_a_first_line_longer_than_the_sniffed_megabyte_is_not_called_empty(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"input_ids": [' + b"1, " * 600_000 + b"1]}\n" + GOOD)
    assert path.stat().st_size > 1 << 20
    assert check_data_file("data_path", path) is None
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert "is empty" in str(check_data_file("data_path", tmp_path / "empty.jsonl"))


def test_a_deeply_nested_first_line_is_a_named_problem(tmp_path: Path) -> None:
    path = tmp_path / "nested.jsonl"
    path.write_bytes(b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    assert f"{path}:1: not a JSON line" in str(check_data_file("data_path", path))


# ------------------------------------------------------------------------------------------ the data layer
@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "a value is nested too deeply to parse"),
        (b'{"input_ids": [1, ' + b"9" * 5000 + b"]}", "a value is too large to parse"),
        (b'{"input_ids": [1, 99999999999999999999999]}', "does not fit the cache's int32 token columns"),
    ],
    ids=["nested", "digits", "int32"],
)
def test_nested_and_oversized_values_are_reported_by_file_and_line(tmp_path: Path, row: bytes, expected: str):
    with pytest.raises(DataFormatError) as caught:
        _open(tmp_path, GOOD + row + b"\n")
    assert str(caught.value).startswith(f"{tmp_path / 'train.jsonl'}:2: ")
    assert expected in str(caught.value)


def test_non_utf8_bytes_are_reported_with_their_line(tmp_path: Path) -> None:
    with pytest.raises(DataInputError, match=r"train\.jsonl:3: not UTF-8 text \(byte 0xff at column 13\)"):
        _open(tmp_path, GOOD + GOOD + b'{"text": "ab\xff"}\n')


def test_token_ids_at_or_above_the_vocabulary_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"train\.jsonl:2: token id 32 is not below the model's vocabulary size"):
        _open(tmp_path, GOOD + b'{"input_ids": [1, 32]}\n', vocab_size=32)
    samples, _ = _open(tmp_path, GOOD + b'{"input_ids": [1, 31]}\n', vocab_size=32)
    assert len(samples) == 2


def test_the_run_checks_token_ids_against_its_models_vocabulary(run_files: dict[str, Path]) -> None:
    from trainbridge.core.config import TrainingArgs

    args = TrainingArgs(model_path=run_files["model"], data_path=run_files["train"], ckpt_output_dir=run_files["out"])
    assert data_options(args).vocab_size == 32  # the model's config.json
    assert data_options(args).key()["vocab_size"] == 32  # a cache built without the check is not reused


# ------------------------------------------------------------------------------------------ the data cache
def _entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]  # not the lock folder
    return entry


def test_cache_entries_are_private(tmp_path: Path) -> None:
    old = os.umask(0o002)  # a login user's
    try:
        _open(tmp_path, GOOD)
    finally:
        os.umask(old)
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700  # a missing cache folder too
    entry = _entry(tmp_path / "cache")
    assert entry.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in entry.iterdir()} == {0o600}
    assert entry_problem(entry) is None


@pytest.mark.parametrize("tamper", ["writable", "foreign"])
def test_a_poisoned_cache_entry_is_not_used(tmp_path: Path, tamper: str) -> None:
    """Another user's (or an others-writable) entry under the run's key: passed over, the data tokenised
    again into this user's own entry, never read."""
    samples, _ = _open(tmp_path, GOOD)
    entry = _entry(tmp_path / "cache")
    del samples
    # the poison: the same key, other tokens (as another user would build from their own file)
    poison = tmp_path / "poison"
    poison.mkdir()
    _poisoned, _ = open_tokenized(
        _write(poison / "p.jsonl", b'{"input_ids": [7, 7, 7, 7, 7]}\n'),
        None,
        DataOptions(max_seq_len=64),
        None,
        poison / "cache",
    )
    for item in entry.iterdir():
        item.unlink()
    for item in _entry(poison / "cache").iterdir():
        os.replace(item, entry / item.name)
    if tamper == "writable":
        entry.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the entry to another uid")
        for item in [entry, *entry.iterdir()]:
            os.chown(item, 4321, 4321)
    assert entry_problem(entry) is not None
    samples, stats = _open(tmp_path, GOOD)
    assert [list(samples[k].input_ids) for k in range(len(samples))] == [[1, 2, 3]]
    assert Path(str(stats.cache)).name.endswith(f"-uid{os.geteuid()}")


def test_a_planted_entry_under_this_users_fallback_name_fails_naming_it(tmp_path: Path) -> None:
    _open(tmp_path, GOOD)
    entry = _entry(tmp_path / "cache")
    entry.chmod(0o777)
    fallback = entry.with_name(f"{entry.name}-uid{os.geteuid()}")
    fallback.mkdir(mode=0o777)
    fallback.chmod(0o777)
    (fallback / "meta.json").write_text(json.dumps({}))
    with pytest.raises(DataInputError, match=r"is not trusted: .* writable by others"):
        _open(tmp_path, GOOD)


def test_a_planted_lock_link_in_a_shared_cache_is_neither_followed_nor_in_the_way(tmp_path: Path) -> None:
    """Another user plants a link where the build lock of the run's key would be, and one where this user's
    lock folder goes: the first is not used (the lock is in this user's own folder), the second fails naming
    it; the file a link points to is never opened (an older ``filelock`` truncated it)."""
    from trainbridge.data.cache import cache_key

    victim = tmp_path / "bashrc"
    victim.write_text("mine\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    path = _write(tmp_path / "train.jsonl", GOOD)
    key = cache_key(path, None, None, DataOptions(max_seq_len=64))
    (cache / f"{key}.lock").symlink_to(victim)  # the lock's place in a shared cache folder
    samples, stats = _open(tmp_path, GOOD)
    assert len(samples) == 1 and not stats.cache_hit
    assert victim.read_text() == "mine\n" and (cache / f"{key}.lock").is_symlink()
    lock_folder = cache / f".locks-uid{os.geteuid()}"
    assert lock_folder.is_dir() and lock_folder.stat().st_mode & 0o777 == 0o700

    other = tmp_path / "other"
    other.mkdir()
    other.chmod(0o777)
    _write(tmp_path / "train.jsonl", GOOD + GOOD)  # another key: a build, under the lock
    shutil.rmtree(lock_folder)
    lock_folder.symlink_to(other)
    with pytest.raises(DataInputError, match=r"lock folder .*\.locks-uid\d+ is a symbolic link"):
        _open(tmp_path, GOOD + GOOD)
    assert list(other.iterdir()) == []


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
