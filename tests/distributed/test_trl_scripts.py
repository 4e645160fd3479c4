"""trl's own ``trl/scripts/sft.py``, as shipped in the trl wheel, with only the trainer import changed.

The script is copied from the installed trl with ``from trl import SFTTrainer`` replaced by ``from
trainbridge import SFTTrainer`` and run under ``torchrun --nproc_per_node=2`` and plain ``python`` on a
tiny local Llama and local chat data, with ``--packing`` (trl's ``bfd`` bins) and evaluation at steps;
the unchanged script runs under torchrun as the reference.  The runs give the same checkpoint layout,
log steps, epochs, ``global_step`` and logged keys (trl's SFT metrics among them, ``eval_`` ones too).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

trl = pytest.importorskip("trl")

TRL_SFT = Path(trl.__file__).parent / "scripts" / "sft.py"
ORIGINAL_IMPORT = "    from trl import SFTTrainer, get_dataset, get_peft_config, get_quantization_config\n"
PORTED_IMPORT = (
    "    from trainbridge import SFTTrainer\n"
    "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
)
TRAINBRIDGE_FILES = {"COMPLETE", "manifest.json", "training_state.json"}
"""What a trainbridge checkpoint adds: the completion marker, file hashes, callback and loop state."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainbridge.demos.tiny_model import build_tiny_llama, write_chat_dataset

    root = tmp_path_factory.mktemp("trl-scripts")
    build_tiny_llama(root / "model")
    (root / "data").mkdir()
    write_chat_dataset(root / "data" / "train.jsonl", 48, seed=0)
    write_chat_dataset(root / "data" / "test.jsonl", 8, seed=1)
    source = TRL_SFT.read_text()
    assert ORIGINAL_IMPORT in source, "trl's sft.py changed its import line"
    (root / "sft_trl.py").write_text(source)
    (root / "sft_trainbridge.py").write_text(source.replace(ORIGINAL_IMPORT, PORTED_IMPORT))
    return root


def _run(
    assets: Path,
    script: str,
    output: str,
    launcher: list[str],
    data: str = "data",
    extra: tuple[str, ...] = (),
    nproc: int = 1,
    max_length: int | None = 64,
) -> Path:
    """``script`` run by ``launcher`` with the shared arguments and ``extra``; ``nproc``: the ranks
    trainbridge's self-launch starts under plain python; ``max_length``: ``None`` for the configs without
    it (GRPO's and RLOO's)."""
    out = assets / output
    args = [
        "--model_name_or_path",
        str(assets / "model"),
        "--dataset_name",
        str(assets / data),
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "2",
        "--save_steps",
        "4",
        "--bf16",
        "false",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        *(() if max_length is None else ("--max_length", str(max_length))),
        "--dtype",
        "float32",
        "--disable_tqdm",
        "true",
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TRAINBRIDGE_NPROC_PER_NODE": str(nproc),
    }
    done = subprocess.run(
        [*launcher, str(assets / script), *args], env=env, capture_output=True, text=True, timeout=540, cwd=assets
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _torchrun(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]


def _summary(out: Path) -> tuple[int, list[tuple[int, frozenset[str]]], set[str]]:
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    rows = [(row["step"], frozenset(row) - {"step"}) for row in state["log_history"]]
    _epochs[out] = [(row["step"], round(row["epoch"], 6)) for row in state["log_history"]]
    return state["global_step"], rows, {p.name for p in (out / "checkpoint-4").iterdir()}


_epochs: dict[Path, list[tuple[int, float]]] = {}
"""The (step, epoch) of each logged row of a run's ``checkpoint-4``, by output folder (``_summary``)."""

SFT_PACKED_EVAL = (
    "--packing",
    "true",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "2",
    "--per_device_eval_batch_size",
    "2",
)
"""``sft.py --packing --eval_strategy steps``: steps train trl's bins; evaluations log trl's ``eval_`` metrics."""


def _launcher(launch: str) -> list[str]:
    from tests.distributed.conftest import free_port

    return _torchrun(free_port()) if launch == "torchrun" else [sys.executable]


@pytest.mark.parametrize("launch", ["torchrun", "python"])
def test_trl_sft_script_with_the_import_changed(assets: Path, launch: str) -> None:
    """Under plain python both run one process, in place (one process on a CPU machine)."""
    trl_out = _run(assets, "sft_trl.py", f"out-trl-{launch}", _launcher(launch), extra=SFT_PACKED_EVAL)
    trl_step, trl_rows, trl_files = _summary(trl_out)
    out = _run(assets, "sft_trainbridge.py", f"out-{launch}", _launcher(launch), extra=SFT_PACKED_EVAL)
    global_step, rows, files = _summary(out)
    assert global_step == trl_step == 4
    assert [step for step, _ in rows] == [step for step, _ in trl_rows] == [2, 2, 4, 4]
    assert _epochs[out] == _epochs[trl_out]  # trl's bins per step: the same steps per epoch
    for (_, keys), (_, trl_keys) in zip(rows, trl_rows, strict=True):
        assert keys == trl_keys  # trl's entropy, mean_token_accuracy and num_tokens among them
        assert "num_tokens" in keys or {"eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"} <= keys
    assert files - TRAINBRIDGE_FILES == trl_files
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()  # save_model at the end


TRL_DPO = Path(trl.__file__).parent / "scripts" / "dpo.py"
DPO_IMPORT = "    from trl import DPOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
DPO_PORTED_IMPORT = (
    "    from trainbridge import DPOTrainer\n"
    "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
)


DPO_RUNS = {
    "torchrun-eval": (
        "torchrun",
        ("--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4"),
    ),
    "python-peft": ("python", ("--use_peft", "true", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj")),
}
"""Each DPO run: the launcher and the script's extra arguments (two runs, to keep the suite short; plain
python runs with ``--use_peft``).  Under plain python trl runs one process in place and trainbridge's
script runs again under torchrun, 2 ranks (``TRAINBRIDGE_NPROC_PER_NODE=2``); with 32 pairs of 4 per rank both reach
``max_steps`` 4 in an epoch."""


@pytest.fixture(scope="module")
def dpo_assets(assets: Path) -> Path:
    source = TRL_DPO.read_text()
    assert DPO_IMPORT in source, "trl's dpo.py changed its import line"
    (assets / "dpo_trl.py").write_text(source)
    (assets / "dpo_trainbridge.py").write_text(source.replace(DPO_IMPORT, DPO_PORTED_IMPORT))
    pairs = assets / "pairs"
    pairs.mkdir(exist_ok=True)
    for split, offset, count in (("train", 0, 32), ("test", 100, 6)):
        with (pairs / f"{split}.jsonl").open("w") as f:
            for a in range(offset, offset + count):
                row = {"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)}
                f.write(json.dumps(row) + "\n")
    return assets


def _rng_files_as_one(files: set[str]) -> set[str]:
    """Trainer writes ``rng_state.pth`` on one process, ``rng_state_<rank>.pth`` on several."""
    return {"rng_state*.pth" if re.fullmatch(r"rng_state(_\d+)?\.pth", name) else name for name in files}


@pytest.mark.parametrize("run", list(DPO_RUNS))
def test_trl_dpo_script_with_the_import_changed(dpo_assets: Path, run: str) -> None:
    """trl's ``dpo.py`` against the unchanged script: the reference a frozen copy of the policy (with
    ``--use_peft``, the base with the adapter disabled; checkpoints and the final save hold the adapter
    only, as trl writes them), evaluated at trl's steps with trl's ``eval_`` keys."""
    launch, extra = DPO_RUNS[run]
    outs = [
        _run(dpo_assets, script, f"out-{run}-{script}", _launcher(launch), "pairs", extra, nproc=2)
        for script in ("dpo_trl.py", "dpo_trainbridge.py")
    ]
    (trl_step, trl_rows, trl_files), (global_step, rows, files) = map(_summary, outs)
    assert global_step == trl_step == 4
    assert [step for step, _ in rows] == [step for step, _ in trl_rows]
    assert [step for step, _ in rows] == ([2, 2, 4, 4] if "eval" in run else [2, 4])
    for (_, keys), (_, trl_keys) in zip(rows, trl_rows, strict=True):
        assert keys == trl_keys
        assert {"rewards/chosen", "rewards/margins", "logps/rejected", "logits/chosen"} <= keys or {
            "eval_loss",
            "eval_rewards/margins",
            "eval_logps/chosen",
            "eval_logits/rejected",
        } <= keys
    assert _rng_files_as_one(files - TRAINBRIDGE_FILES) == _rng_files_as_one(trl_files)
    final = {p.name for p in outs[1].iterdir() if p.is_file()}
    assert final >= {p.name for p in outs[0].iterdir() if p.is_file()}  # trainer.save_model at the end
    if "peft" in run:
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files | final
