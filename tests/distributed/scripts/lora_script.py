"""torchrun script for tests/distributed/test_peft.py: LoRA through ``TrainingArgs.peft_config``, every backend.

Usage: ``torchrun --nproc-per-node 2 lora_script.py MODEL TRAIN VAL ROOT CASE...`` (a case: ``ddp``, ``fsdp``,
``deepspeed-2``, ``deepspeed-3``; ZeRO-3 last, it sets process-wide state), with the repository root on
``PYTHONPATH``.  Per case, one after another in the same two processes and process group (one launch for
every case: each launch costs seconds of start-up): a straight run (checkpoints at steps 4 and 8) into
``ROOT/CASE/straight`` and a run resumed from its ``checkpoint-4`` into ``ROOT/CASE/resumed``, each a
``run_training`` called in place on both ranks, as a ``torchrun script.py`` calling it would.  Rank 0 writes
each run's ``RunResult`` to ``ROOT/CASE/{straight,resumed}.json``; the callbacks below write what the test
reads.  The test asserts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tests.distributed.training_fixtures import EventCounter, base_args
from tests.run_inputs import run_training
from transformers import TrainerCallback

from trainbridge import Callback, TorchrunArgs

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
BACKENDS = {"ddp": ("ddp", 2), "fsdp": ("fsdp", 2), "deepspeed-2": ("deepspeed", 2), "deepspeed-3": ("deepspeed", 3)}


class DumpFrozenWeights(Callback):
    """At train end, gathers every frozen parameter (FSDP2 DTensor, ZeRO-3 partition or plain) and rank 0
    writes them under the base model's names to ``frozen.safetensors``."""

    def on_train_end(self, context, **kwargs):
        from safetensors.torch import save_file

        out = {}
        for name, param in context.unwrapped_model.named_parameters():
            if param.requires_grad:
                continue
            if hasattr(param, "full_tensor"):
                tensor = param.full_tensor()
            elif hasattr(param, "ds_id"):
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    tensor = param.detach().clone()
            else:
                tensor = param.detach()
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            out[key] = tensor.to("cpu", copy=True).contiguous()
        if context.rank == 0:
            save_file(out, str(context.args.ckpt_output_dir / "frozen.safetensors"))


class SavesTheModelItIsGiven(TrainerCallback):
    """A Hugging Face callback that writes ``model`` (a PeftModel, as under Trainer) at train begin."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            out = Path(args.output_dir)
            (out / "hf-callback-model-type").write_text(type(model).__name__)
            model.save_pretrained(out / "hf-callback-adapter")


def settings(assets: dict[str, Path], backend: str, zero_stage: int) -> dict[str, Any]:
    """The settings both runs of a backend share."""
    common: dict[str, Any] = dict(
        distributed_backend=backend,
        deepspeed_zero_stage=zero_stage,
        peft_config=LORA,
        learning_rate=1e-2,
        max_steps=8,
        logging_steps=2,
        save_strategy="steps",
        save_steps=4,
    )
    if backend == "fsdp":  # activation checkpointing applied before fully_shard, with a frozen base
        common.update(gradient_checkpointing=True)
    if backend == "ddp":  # best tracking and the merged export of the best adapter ("best": the step-4 one, on purpose)
        common.update(
            val_data_path=assets["val"],
            eval_strategy="steps",
            eval_steps=4,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            greater_is_better=True,
            merge_adapter_at_end=True,
        )
    return common


def main(model: str, train: str, val: str, root: str, *cases: str) -> None:
    assets = {"model": Path(model), "train": Path(train), "val": Path(val)}
    two = TorchrunArgs(nproc_per_node=2)  # not used in place: torchrun's world decides
    for case in cases:
        backend, zero_stage = BACKENDS[case]
        common = settings(assets, backend, zero_stage)
        folder = Path(root) / case
        callbacks = [DumpFrozenWeights(), EventCounter(), *([SavesTheModelItIsGiven()] if backend == "ddp" else [])]
        straight = run_training(base_args(assets, folder / "straight", callbacks=callbacks, **common), two)
        checkpoint_4 = folder / "straight" / "checkpoint-4"
        resumed_args = base_args(assets, folder / "resumed", resume_from_checkpoint=checkpoint_4, **common)
        resumed = run_training(resumed_args, two)
        if os.environ["RANK"] == "0":
            straight.write(folder / "straight.json")
            resumed.write(folder / "resumed.json")


if __name__ == "__main__":
    main(*sys.argv[1:])
