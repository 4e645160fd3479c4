"""trl's own ``trl/scripts/kto.py``, as shipped in the trl wheel, with only the trainer import changed, under
``torchrun --nproc_per_node=2`` on a tiny local Llama and local unpaired rows, against the
unchanged script: the same ``global_step``, log steps, logged keys (trl's KTO metrics) and checkpoint files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.launch.launcher import free_port

pytestmark = pytest.mark.distributed

trl = pytest.importorskip("trl")

TRL_KTO = Path(trl.__file__).parent / "scripts" / "kto.py"
KTO_IMPORT = "    from trl import KTOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
KTO_PORTED_IMPORT = (
    "    from trainbridge import KTOTrainer\n"
    "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
)
TRAINBRIDGE_FILES = {"COMPLETE", "manifest.json", "training_state.json"}
"""What a trainbridge checkpoint adds: the completion marker, file hashes, callback and loop state."""


def _run(root: Path, script: str) -> tuple[int, list[tuple[int, frozenset[str]]], set[str], list[dict]]:
    out = root / f"out-{script}"
    args = {
        "model_name_or_path": root / "model",
        "dataset_name": root / "rows",
        "output_dir": out,
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "logging_steps": 2,
        "save_steps": 4,
        "bf16": "false",
        "use_cpu": "true",
        "report_to": "none",
        "max_length": 32,
        "dtype": "float32",
        "disable_tqdm": "true",
        "learning_rate": 1e-2,  # the policy moves away from the reference: the KL term is in play
        "undesirable_weight": 0.2,
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    command += [str(root / script), *(f"--{key}={value}" for key, value in args.items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    rows = [(row["step"], frozenset(row) - {"step"}) for row in state["log_history"]]
    files = {p.name for p in (out / "checkpoint-4").iterdir()}
    return state["global_step"], rows, files, state["log_history"]


def test_trl_kto_script_with_the_import_changed(tmp_path: Path) -> None:
    from trainbridge.demos.tiny_model import build_tiny_llama

    build_tiny_llama(tmp_path / "model")
    source = TRL_KTO.read_text()
    assert KTO_IMPORT in source, "trl's kto.py changed its import line"
    (tmp_path / "kto_trl.py").write_text(source)
    (tmp_path / "kto_trainbridge.py").write_text(source.replace(KTO_IMPORT, KTO_PORTED_IMPORT))
    (tmp_path / "rows").mkdir()
    with (tmp_path / "rows" / "train.jsonl").open("w") as f:
        for a in range(32):  # unpaired rows; batches of 4 rows, batch k on rank k % 2
            desirable = a % 2 == 1 or (a // 4) % 2 == 1  # rank 1's batches all desirable: its KL differs
            completion = "ok" if desirable else str(a * 3 + 1)  # one desirable answer: its log-prob rises everywhere
            f.write(json.dumps({"prompt": f"{a}+{a % 7}=", "completion": completion, "label": desirable}) + "\n")
    trl_step, trl_rows, trl_files, trl_log = _run(tmp_path, "kto_trl.py")
    global_step, rows, files, log = _run(tmp_path, "kto_trainbridge.py")
    assert global_step == trl_step == 4
    assert [step for step, _ in rows] == [step for step, _ in trl_rows] == [2, 4]
    for (_, keys), (_, trl_keys) in zip(rows, trl_rows, strict=True):
        assert keys == trl_keys
        assert {"kl", "rewards/chosen", "rewards/margins", "logps/rejected", "logits/chosen", "num_tokens"} <= keys
    assert files - TRAINBRIDGE_FILES == trl_files
    assert log[-1]["kl"] > 0
    # trl's sequential batches in trl's order on both ranks: the same rows, so the same values
    for row, trl_row in zip(log, trl_log, strict=True):
        for key in ("loss", "kl", "rewards/margins", "logps/chosen", "entropy", "num_tokens"):
            assert row[key] == pytest.approx(trl_row[key], rel=1e-3, abs=1e-5), (row["step"], key)
