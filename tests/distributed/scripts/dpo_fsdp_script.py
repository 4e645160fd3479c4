"""A DPO script under FSDP2 with ``sync_ref_model`` (used by tests/distributed/test_dpo_reference.py).

``torchrun --nproc-per-node 2 dpo_fsdp_script.py OUT``: trainbridge's ``DPOTrainer`` with ``fsdp="full_shard"``,
trl's default reference (a second load of the model's path), ``sync_ref_model`` mixing the whole policy into the
reference after every step (``ref_model_mixup_alpha=1``), and trl's ``evaluate()`` after training.  Each rank
writes ``result-rank{r}.json``: the reference's parameter types and this rank's share of its elements, whether
the step scored with trl's own ``ref_model``, the logged training values and the evaluation's metrics.
"""

import json
import os
import sys
from pathlib import Path

import datasets
from torch.distributed.tensor import DTensor
from trl import DPOConfig

from trainbridge import DPOTrainer
from trainbridge.demos.tiny_model import build_tiny_llama_once

out = Path(sys.argv[1])
model_dir = build_tiny_llama_once(out.parent / "tiny-model")
rows = [{"prompt": f"{a}+{a % 5}=", "chosen": str(a + a % 5), "rejected": str(3 * a + 2)} for a in range(16)]
args = DPOConfig(
    output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3, logging_steps=1,
    save_strategy="no", learning_rate=5e-2, beta=0.5, max_length=16, sync_ref_model=True, ref_model_sync_steps=1,
    ref_model_mixup_alpha=1.0, use_cpu=True, report_to="none", disable_tqdm=True, bf16=False,
    gradient_checkpointing=False, fsdp="full_shard", model_init_kwargs={"dtype": "float32"}, seed=3,
)  # fmt: skip
trainer = DPOTrainer(
    model=str(model_dir),
    args=args,
    train_dataset=datasets.Dataset.from_list(rows),
    eval_dataset=datasets.Dataset.from_list(rows[:8]),
)
trainer.train()
metrics = trainer.evaluate()
reference = list(trainer.ref_model.parameters())
rank = int(os.environ["RANK"])
step = trainer._loop.step
result = {
    "reference_dtensor": all(isinstance(p, DTensor) for p in reference),
    "reference_local_share": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in reference)
    / sum(p.numel() for p in reference),
    "step_scores_with_trls_reference": step.ref_model is trainer.ref_model,
    "logged": [row for row in trainer.state.log_history if "loss" in row],
    "eval": metrics,
}
(out / f"result-rank{rank}.json").write_text(json.dumps(result))
