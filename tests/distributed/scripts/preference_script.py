"""An ORPO / CPO / SimPO script on trl's config (used by test_trl_reference_free.py).

Run as ``torchrun --nproc_per_node=2 preference_script.py OUT KINDS [real]`` (KINDS: orpo, cpo or simpo, or
several, comma-separated: each trained in turn in the same processes, into ``OUT/<KIND>``); ``real`` uses trl's
own trainer from ``trl.experimental`` (the reference), else trainbridge's drop-in.  Rank 0 writes
``OUT/<KIND>/summary.json``: global_step, the logged rows' steps and keys, the checkpoint's files.
"""

import json
import sys
from pathlib import Path

import datasets

from trainbridge.demos.tiny_model import build_tiny_llama_once

real = "real" in sys.argv[3:]
root = Path(sys.argv[1])
model_dir = root.parent / "tiny-model"
build_tiny_llama_once(model_dir)
rows = [{"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)} for a in range(32)]


def train(kind: str, out: Path) -> None:
    if kind == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config

        if real:
            from trl.experimental.orpo import ORPOTrainer as PreferenceTrainer
        else:
            from trainbridge import ORPOTrainer as PreferenceTrainer
    else:
        from trl.experimental.cpo import CPOConfig as Config

        if real:
            from trl.experimental.cpo import CPOTrainer as PreferenceTrainer
        else:
            from trainbridge import CPOTrainer as PreferenceTrainer

    extra = {"loss_type": "simpo", "cpo_alpha": 0.5} if kind == "simpo" else {}
    config = Config(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=2,
        save_steps=4,
        bf16=False,
        use_cpu=True,
        report_to="none",
        max_length=32,
        disable_tqdm=True,
        learning_rate=1e-3,
        **extra,
    )
    trainer = PreferenceTrainer(model=str(model_dir), args=config, train_dataset=datasets.Dataset.from_list(rows))
    trainer.train()
    if trainer.is_world_process_zero():
        state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
        summary = {
            "global_step": state["global_step"],
            "rows": [[row["step"], sorted(row)] for row in state["log_history"]],
            "files": sorted(p.name for p in (out / "checkpoint-4").iterdir()),
            "losses": [row["loss"] for row in state["log_history"] if "loss" in row],
        }
        (out / "summary.json").write_text(json.dumps(summary))


for each in sys.argv[2].split(","):
    train(each, root / each)
