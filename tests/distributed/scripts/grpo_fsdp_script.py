"""A GRPO script under FSDP2 (used by tests/distributed/test_grpo_fsdp.py).

``torchrun --nproc-per-node 2 grpo_fsdp_script.py OUT``: trainbridge's ``GRPOTrainer`` with ``fsdp="full_shard"``,
a reference model (``beta``), a generation batch buffered over two steps and a checkpoint at step 3 (in the
middle of a generation batch); tiny Llama, completions sampled with ``generate`` on the sharded policy.  Each
rank writes ``result-rank{r}.json``: the policy's and the reference's parameter types and this rank's share of
the reference's elements, the logged ``kl`` and losses, and the global step.
"""

import json
import os
import sys
from pathlib import Path

import datasets
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from trainbridge import GRPOTrainer
from trainbridge.demos.rewards import answer_reward, digit_reward
from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once

out = Path(sys.argv[1])
model_dir = build_tiny_llama_once(out.parent / "tiny-model")
prompts = [{"prompt": problem[:-1] + "=", "answer": answer} for problem, answer in arithmetic_problems(32, seed=0)]
args = GRPOConfig(
    output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=4,
    steps_per_generation=2, logging_steps=1, save_strategy="steps", save_steps=3, beta=0.1, learning_rate=1e-2,
    use_cpu=True, report_to="none", disable_tqdm=True, bf16=False, gradient_checkpointing=False, fsdp="full_shard",
    seed=3,
)  # fmt: skip
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    reward_funcs=[answer_reward, digit_reward],
    args=args,
    train_dataset=datasets.Dataset.from_list(prompts),
    processing_class=AutoTokenizer.from_pretrained(model_dir),
)
trainer.train()
reference = list(trainer.ref_model.parameters())
rank = int(os.environ["RANK"])
result = {
    "policy_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
    "reference_dtensor": all(isinstance(p, DTensor) for p in reference),
    "reference_local_share": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in reference)
    / sum(p.numel() for p in reference),
    "kl": [row["kl"] for row in trainer.state.log_history if "kl" in row],
    "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
    "global_step": trainer.state.global_step,
}
(out / f"result-rank{rank}.json").write_text(json.dumps(result))
