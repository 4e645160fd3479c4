"""The README's demo and a ported Trainer script, run as an ordinary user with umask 002 in their home.

Root's umask 022 hides what a login user meets: Debian and Ubuntu give them umask 002 and a user-private
group, so every folder they make is 0775.  As root (CI) the user is created when missing and commands run
as that user (``ordinary_user``); the project's venv is made reachable for them when it is not.  Each run
happens in a folder the user made with ``mkdir`` (0775), and the folders the run creates must be private.
"""

from __future__ import annotations

import os
import shutil
import stat
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.demo_run import DEMO_STEPS, assert_the_demo_trained_and_only_our_lines_show, login_user_can_run
from tests.distributed.ordinary_user import User, ordinary_user, run_as, user_runtime

pytestmark = pytest.mark.distributed

PORTED_SCRIPT = """
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once

model_dir = build_tiny_llama_once("tiny")
tokenizer = AutoTokenizer.from_pretrained(model_dir)
texts = [problem + answer for problem, answer in arithmetic_problems(32, seed=1)]
train = Dataset.from_dict({"text": texts}).map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
args = TrainingArguments(
    output_dir="hfout", max_steps=2, per_device_train_batch_size=4, save_strategy="no", report_to="none",
    use_cpu=True, logging_steps=1,
)
trainer = Trainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    args=args,
    train_dataset=train,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
print("ported-script-trained", trainer.train().global_step, flush=True)
trainer.save_model()
"""


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    if not login_user_can_run():
        pytest.skip(
            "your primary group has other members, so umask 002 makes your folders theirs to write; run as root "
            "(the test creates a user with a private group) or as a user with a private group"
        )
    found = ordinary_user()
    yield found
    if found.uid is None:
        shutil.rmtree(found.home, ignore_errors=True)


@pytest.fixture(scope="module")
def runtime(user):
    with user_runtime(user) as made:
        yield made


@pytest.fixture
def workdir(user, runtime) -> Iterator[Path]:
    """A folder the user made in their home with ``mkdir`` (umask 002: 0775, their private group)."""
    folder = user.home / f"trainbridge-test-{uuid.uuid4().hex[:8]}"
    made = run_as(user, ["mkdir", str(folder)], runtime, user.home)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(folder.stat().st_mode) == 0o775
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ran(result) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"


def test_the_readme_demo_runs_for_a_login_user_with_umask_002(user, runtime, workdir):
    """The README's ``trainbridge demo`` (12 steps) as a login user: it trains, the console has our lines only,
    it ends with the metrics plot (``demo_run``'s checks, the demo's one run in the suite), and what it made is
    private."""
    result = run_as(user, ["trainbridge", "demo", "--max-steps", str(DEMO_STEPS)], runtime, workdir, timeout=600)
    assert result.returncode == 0, _ran(result)
    assert_the_demo_trained_and_only_our_lines_show(result.stdout, result.stderr, workdir / "demo_output")
    assert _mode(workdir / "demo_output") == 0o700  # made by the demo: private whatever the umask
    assert _mode(workdir / "demo_output" / "run") == 0o700
    assert _mode(workdir / "demo_output" / "run" / "metrics.jsonl") == 0o600  # in a folder of its own too
    assert _mode(workdir / "demo_output" / "model" / "config.json") == 0o600


def test_a_ported_trainer_script_runs_under_python_for_a_login_user_with_umask_002(user, runtime, workdir):
    script = workdir / "train.py"
    script.write_text(textwrap.dedent(PORTED_SCRIPT))
    if user.uid is not None:
        os.chown(script, user.uid, user.gid or -1)
    result = run_as(user, ["python", "train.py"], runtime, workdir, env={"TRAINBRIDGE_NPROC_PER_NODE": "2"})
    assert result.returncode == 0, _ran(result)
    assert "ported-script-trained 2" in result.stdout, _ran(result)
    assert _mode(workdir / "hfout") == 0o700  # the output_dir trainbridge made: private whatever the umask
    assert (workdir / "hfout" / "config.json").is_file()
