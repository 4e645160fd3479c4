"""trl's own ``grpo.py``, ``rloo.py`` and ``reward.py``, as shipped in the trl wheel, with only the trainer import
changed, against the unchanged script under ``torchrun --nproc_per_node=2``.

Tiny local Llama, local data: conversational prompts with an ``answer`` column that the dotted-path reward
functions read (``trainbridge.demos.rewards`` copied beside the scripts as ``rewards.py``), generation with
``transformers`` ``generate`` on CPU, a few completion tokens.  GRPO runs under torchrun with a reference model
(``beta``) and a generation batch buffered over two steps (``steps_per_generation=2``); RLOO under plain python
(``TRAINBRIDGE_NPROC_PER_NODE=2``: two ranks) with two iterations per generation; the reward model under torchrun
with evaluation.  Each gives trl's ``global_step``, epochs, log steps, logged keys and checkpoint files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.distributed.test_trl_scripts import TRAINBRIDGE_FILES, _epochs, _launcher, _rng_files_as_one, _run, _summary

pytestmark = pytest.mark.distributed

trl = pytest.importorskip("trl")

SCRIPTS = Path(trl.__file__).parent / "scripts"
PORTED = {
    name: (
        f"    from trl import {trainer}, get_dataset, get_peft_config, get_quantization_config\n",
        f"    from trainbridge import {trainer}\n"
        "    from trl import get_dataset, get_peft_config, get_quantization_config\n",
    )
    for name, trainer in (("grpo", "GRPOTrainer"), ("rloo", "RLOOTrainer"), ("reward", "RewardTrainer"))
}
"""Each script's trainer import in the trl wheel, and the one line that replaces it."""

ONLINE = (
    *("--num_generations", "4", "--max_completion_length", "6", "--learning_rate", "1e-2"),
    *("--reward_funcs", "rewards.answer_reward", "rewards.digit_reward"),
)
"""GRPO's and RLOO's shared arguments: 4 completions of up to 6 tokens per prompt, two dotted-path rewards (one
reading the ``answer`` column); a large learning rate, so the policy moves from the reference and the old policy."""

RUNS = {
    "grpo": ("torchrun", "prompts", (*ONLINE, "--beta", "0.1", "--steps_per_generation", "2")),
    "rloo": ("python", "prompts", (*ONLINE, "--beta", "0.05", "--num_iterations", "2")),
    "reward": (
        "torchrun",
        "pairs",
        (
            *("--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4"),
            *("--center_rewards_coefficient", "0.01", "--learning_rate", "1e-3"),
        ),
    ),
}
"""Each script: how trainbridge's copy is launched, its data and its arguments beyond ``_run``'s shared ones
(4 steps of 4 per device, a log every 2, a checkpoint at 4)."""

TRL_KEYS = {
    "grpo": {
        *("completions/mean_length", "completions/clipped_ratio", "completions/mean_terminated_length"),
        *("rewards/answer_reward/mean", "rewards/digit_reward/mean", "reward", "reward_std", "frac_reward_zero_std"),
        *("clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "kl", "entropy", "num_tokens"),
    },
    "reward": {"accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"},
}
"""Keys trl's trainers add to every training log (RLOO's are GRPO's)."""
TRL_KEYS["rloo"] = TRL_KEYS["grpo"]


@pytest.fixture(scope="module")
def rl_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainbridge.demos import rewards
    from trainbridge.demos.tiny_model import build_tiny_llama, write_prompt_dataset

    root = tmp_path_factory.mktemp("trl-rl-scripts")
    build_tiny_llama(root / "model")
    write_prompt_dataset(root / "prompts" / "train.jsonl", 32, seed=0)
    shutil.copy(rewards.__file__, root / "rewards.py")
    (root / "pairs").mkdir()
    for split, offset, count in (("train", 0, 32), ("test", 100, 8)):
        with (root / "pairs" / f"{split}.jsonl").open("w") as f:
            for a in range(offset, offset + count):  # conversational pairs with an explicit prompt
                row = {
                    "prompt": [{"role": "user", "content": f"{a}+{a % 7}=?"}],
                    "chosen": [{"role": "assistant", "content": str(a + a % 7)}],
                    "rejected": [{"role": "assistant", "content": str(a * 3 + 1)}],
                }
                f.write(json.dumps(row) + "\n")
    for name, (original, ported) in PORTED.items():
        source = (SCRIPTS / f"{name}.py").read_text()
        assert original in source, f"trl's {name}.py changed its import line"
        (root / f"{name}_trl.py").write_text(source)
        (root / f"{name}_trainbridge.py").write_text(source.replace(original, ported))
    return root


@pytest.mark.parametrize("name", list(RUNS))
def test_trl_rl_script_with_the_import_changed(rl_assets: Path, name: str) -> None:
    launch, data, extra = RUNS[name]
    max_length = 64 if name == "reward" else None
    trl_out = _run(rl_assets, f"{name}_trl.py", f"out-{name}-trl", _launcher("torchrun"), data, extra, 2, max_length)
    out = _run(rl_assets, f"{name}_trainbridge.py", f"out-{name}", _launcher(launch), data, extra, 2, max_length)
    (trl_step, trl_rows, trl_files), (global_step, rows, files) = _summary(trl_out), _summary(out)
    assert global_step == trl_step == 4
    assert [step for step, _ in rows] == [step for step, _ in trl_rows]
    assert [step for step, _ in rows] == ([2, 2, 4, 4] if name == "reward" else [2, 4])
    assert _epochs[out] == _epochs[trl_out]  # trl's repeat sampler: the same prompts per step and per epoch
    for (_, keys), (_, trl_keys) in zip(rows, trl_rows, strict=True):
        assert keys == trl_keys
        assert TRL_KEYS[name] <= keys or {"eval_loss", "eval_accuracy", "eval_margin"} <= keys
    # trl's _save_checkpoint override: the checkpoint also keeps the model's own weights in dcp/ (save_overrides)
    assert _rng_files_as_one(files - TRAINBRIDGE_FILES - {"dcp"}) == _rng_files_as_one(trl_files)
    final = {p.name for p in out.iterdir() if p.is_file()}
    assert final >= {p.name for p in trl_out.iterdir() if p.is_file()}  # save_model and trl's model card
    trl_log = json.loads((trl_out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    log = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    first_loss = (log[0]["loss"], trl_log[0]["loss"])
    # trl's batches in trl's order, and (GRPO, RLOO) each rank samples its completions from trl's seed + rank (the
    # script's live model is not re-seeded): the same loss
    assert first_loss[0] == pytest.approx(first_loss[1], rel=1e-3, abs=1e-4), first_loss
