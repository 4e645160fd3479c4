"""``GRPOTrainer``, ``RLOOTrainer`` and ``RewardTrainer`` against trl's own, in place on one process.

The drop-ins are trl's classes with trainbridge's ``train()``: trl's constructor, repeat sampler,
``_prepare_inputs`` (generation, rewards, buffering over ``steps_per_generation``), ``compute_loss`` and
``log`` run unchanged on trainbridge's loop.  Same seed, same tiny Llama, same prompts: the same completions,
so every logged value equals trl's.  Resume in the middle of a buffered generation batch is exact: the
checkpoint holds the pending batch (``trainbridge.trl.generation_buffer``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
import trl

import trainbridge
from tests.unit.test_trl_sft_trainer import _fresh_accelerate_state  # noqa: F401  (autouse: trl's state reset)
from trainbridge.core.distributed import DistributedEnv
from trainbridge.demos.rewards import answer_reward, digit_reward
from trainbridge.demos.tiny_model import arithmetic_problems

PROMPTS = [
    {"prompt": [{"role": "user", "content": f"{problem[:-1]}=?"}], "answer": answer}
    for problem, answer in arithmetic_problems(16, seed=0)
]
"""Conversational prompts with an ``answer`` column, which ``answer_reward`` reads."""

PAIRS = [{"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)} for a in range(24)]

TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
TIMING |= {f"eval_{key}" for key in ("runtime", "samples_per_second", "steps_per_second")}
"""Logged keys whose values are wall-clock times."""


def _config(cls: Any, out: Path, **extra: Any) -> Any:
    """A trl config of ``cls`` for 4 steps of 4 rows per device on CPU in float32, a log every step; ``extra``
    on top."""
    values: dict[str, Any] = dict(
        output_dir=str(out),
        report_to="none",
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        seed=5,
    )
    return cls(**{**values, **extra})


def _online_config(cls: Any, out: Path, **extra: Any) -> Any:
    online = {"num_generations": 4, "max_completion_length": 5, "learning_rate": 1e-2, "beta": 0.1}
    return _config(cls, out, **{**online, **extra})


def _values(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in log]


def _grpo(cls: Any, tiny_llama: Path, config: Any) -> Any:
    trainer = cls(
        model=str(tiny_llama),
        reward_funcs=[answer_reward, digit_reward],
        args=config,
        train_dataset=datasets.Dataset.from_list(PROMPTS),
    )
    return trainer


@pytest.mark.parametrize(
    ("name", "extra"),
    [("GRPO", {"steps_per_generation": 2}), ("RLOO", {"num_iterations": 2, "gradient_accumulation_steps": 2})],
)
def test_online_rl_logs_trls_values(
    tiny_llama: Path, tmp_path: Path, name: str, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same completions, rewards, advantages, losses, clip ratios, KL and entropies as trl's, step by step;
    the loop sums no counts over the ranks at a step (``LoopTrainer.counts_step``: trl's loss reads its own)."""
    summed: list[list[float]] = []
    sum_floats = DistributedEnv.sum_floats
    monkeypatch.setattr(
        DistributedEnv, "sum_floats", lambda env, values: summed.append(list(values)) or sum_floats(env, values)
    )
    logs = []
    for cls in (getattr(trl, f"{name}Trainer"), getattr(trainbridge, f"{name}Trainer")):
        config = _online_config(getattr(trl, f"{name}Config"), tmp_path / cls.__module__, **extra)
        trainer = _grpo(cls, tiny_llama, config)
        trainer.train()
        logs.append(trainer.state.log_history)
    assert summed == []  # no per-step collective of the loop's counts (4 steps: 4 of them when counted)
    trl_log, log = map(_values, logs)
    assert [row["step"] for row in log] == [row["step"] for row in trl_log] == [1, 2, 3, 4, 4]
    assert log[0].keys() >= {
        "completions/mean_length",
        "rewards/answer_reward/mean",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
    }
    for row, trl_row in zip(log, trl_log, strict=True):
        assert row.keys() == trl_row.keys()
        assert row == pytest.approx(trl_row, rel=1e-4, abs=1e-6), row["step"]


def test_resume_in_the_middle_of_a_generation_batch_is_exact(tiny_llama: Path, tmp_path: Path) -> None:
    """A checkpoint between two generations (``steps_per_generation=2``: after step 1 or 3) holds the pending
    batch; resumed there, step 4 trains on the completions step 3 generated and logs what the run that was not
    interrupted logs.  A checkpoint at a generation boundary (2) holds trl's files only, and the resumed run
    generates what the uninterrupted run generated (RNG and sampler position restored)."""
    from trainbridge.trl.generation_buffer import PENDING_FILE

    pending = PENDING_FILE.format(rank=0)
    config = _online_config(
        trl.GRPOConfig, tmp_path / "whole", steps_per_generation=2, save_strategy="steps", save_steps=1
    )
    trainer = _grpo(trainbridge.GRPOTrainer, tiny_llama, config)
    trainer.train()
    whole = _values(trainer.state.log_history)
    assert [(tmp_path / "whole" / f"checkpoint-{step}" / pending).is_file() for step in (1, 2, 3, 4)] == [
        True,
        False,
        True,
        False,
    ]
    for checkpoint in (3, 2):  # from 3: the latest (resume_from_checkpoint=True); from 2: by path
        if checkpoint == 3:
            shutil.rmtree(tmp_path / "whole" / "checkpoint-4")
        config = _online_config(
            trl.GRPOConfig, tmp_path / "whole", steps_per_generation=2, save_strategy="steps", save_steps=1
        )
        resumed = _grpo(trainbridge.GRPOTrainer, tiny_llama, config)
        resumed.train(resume_from_checkpoint=True if checkpoint == 3 else str(tmp_path / "whole" / "checkpoint-2"))
        after = [row for row in _values(resumed.state.log_history) if row["step"] > checkpoint and "loss" in row]
        expected = [row for row in whole if row["step"] > checkpoint and "loss" in row]
        assert [row["step"] for row in after] == [row["step"] for row in expected]
        for row, uninterrupted in zip(after, expected, strict=True):
            assert row == pytest.approx(uninterrupted, rel=1e-5, abs=1e-7), (checkpoint, row["step"])


def test_reward_model_logs_trls_values(tiny_llama: Path, tmp_path: Path) -> None:
    """trl's pair loss with ``center_rewards_coefficient``, its ``accuracy`` and ``margin``, in training and in
    evaluation (trl's ``evaluate`` over its collator's padded pairs), equal to trl's."""
    logs = []
    for cls in (trl.RewardTrainer, trainbridge.RewardTrainer):
        config = _config(
            trl.RewardConfig,
            tmp_path / cls.__module__,
            per_device_eval_batch_size=4,
            max_length=32,
            learning_rate=1e-3,
            center_rewards_coefficient=0.01,
            eval_strategy="steps",
            eval_steps=2,
        )
        trainer = cls(
            model=str(tiny_llama),
            args=config,
            train_dataset=datasets.Dataset.from_list(PAIRS[:16]),
            eval_dataset=datasets.Dataset.from_list(PAIRS[16:]),
        )
        trainer.train()
        logs.append(trainer.state.log_history)
    trl_log, log = map(_values, logs)
    assert [row["step"] for row in log] == [row["step"] for row in trl_log] == [1, 2, 2, 3, 4, 4, 4]
    assert {"accuracy", "margin", "mean_reward"} <= log[0].keys() and {"eval_accuracy", "eval_margin"} <= log[2].keys()
    for row, trl_row in zip(log, trl_log, strict=True):
        assert row.keys() == trl_row.keys()
        assert row == pytest.approx(trl_row, rel=1e-4, abs=1e-6), row["step"]


def test_the_drop_ins_are_trls_classes_trained_by_the_loop() -> None:
    """Every method trl's class defines is trl's own (GRPO/RLOO's ``training_step`` and ``_save_checkpoint`` run
    trl's after restoring or saving the pending generation batch; their completion scoring runs each prompt
    once, test_trl_shared_prefix, and is trl's for anything else); ``train`` is the loop's."""
    from trainbridge.trainer.facade import LoopTrainer

    for name in ("GRPOTrainer", "RLOOTrainer", "RewardTrainer"):
        ours, theirs = getattr(trainbridge, name), getattr(trl, name)
        assert issubclass(ours, theirs) and issubclass(ours, LoopTrainer)
        trl_methods = [m for m, value in vars(theirs).items() if callable(value)]
        assert {"__init__", "compute_loss", "log"} <= set(trl_methods)
        for method in trl_methods:
            own = ("training_step", "_save_checkpoint", "__init__", "log", "evaluate")
            if method in (*own, "_get_per_token_logps_and_entropies", "_generate_single_turn"):
                continue  # run trl's own through super(): checked by the runs above
            assert getattr(ours, method) is getattr(theirs, method), (name, method)
        assert "train" not in vars(theirs) and ours.train.__module__ != "trl"
