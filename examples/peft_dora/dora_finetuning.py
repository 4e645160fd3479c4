"""DoRA / LoRA fine-tuning through ``TrainingArgs.peft_config`` (a port of PEFT's dora_finetuning example).

Same command line and ``LoraConfig`` as huggingface/peft's ``examples/dora_finetuning/dora_finetuning.py``
(Apache-2.0); see README.md next to this file for the source and for what differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peft import LoraConfig

from trainbridge import TorchrunArgs, TrainingArgs, run_training

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GRADIENT_ACCUMULATION_STEPS = 16  # the original's TrainingArguments value


def training_args(options: argparse.Namespace) -> TrainingArgs:
    """The original's LoraConfig and TrainingArguments, as trainbridge ``TrainingArgs``."""
    lora_config = LoraConfig(
        use_dora=options.use_dora,
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        target_modules=(
            options.lora_target_modules.split(",") if options.lora_target_modules else DEFAULT_TARGET_MODULES
        ),
        lora_dropout=options.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model_kwargs: dict = {}
    if options.quantize:  # QDoRA: 4-bit NF4 base, as the original configures it (needs CUDA)
        from transformers import BitsAndBytesConfig

        model_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype="bfloat16",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type="nf4",
        )
    samples = sum(1 for line in Path(options.data_path).read_text().splitlines() if line.strip())
    validation_split = min(options.val_set_size / samples, 0.5) if options.val_set_size and samples else 0.0
    cuda = options.device == "cuda"
    return TrainingArgs(
        model_path=options.base_model,
        data_path=options.data_path,
        ckpt_output_dir=options.output_dir,
        peft_config=lora_config,
        model_kwargs=model_kwargs,
        gradient_checkpointing=options.quantize,
        merge_adapter_at_end=options.merge,
        num_epochs=options.num_epochs,
        max_steps=options.max_steps,
        effective_batch_size=options.batch_size * GRADIENT_ACCUMULATION_STEPS * options.nproc_per_node,
        max_seq_len=options.cutoff_len,
        max_batch_len=max(options.cutoff_len, 4096),
        overlong_policy="truncate",
        learning_rate=options.learning_rate,
        lr_scheduler="linear",
        warmup_steps=min(100, max((options.max_steps or 100) // 10, 1)),
        weight_decay=0.01,
        logging_steps=options.eval_step,
        validation_split=validation_split,
        eval_strategy="steps" if validation_split else "no",
        eval_steps=options.eval_step if validation_split else None,
        save_strategy="steps",
        save_steps=options.save_step,
        save_total_limit=2,
        mixed_precision="bf16" if cuda else "no",
        device=options.device,
        disable_tqdm=True,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune LLaMA with DoRA and PEFT (trainbridge port)")
    parser.add_argument("--base_model", type=str, required=True, help="Base model folder")
    parser.add_argument("--data_path", type=str, required=True, help="JSONL file of {'text': ...} lines")
    parser.add_argument("--output_dir", type=str, default="path/to/output", help="Output directory")
    parser.add_argument("--batch_size", type=int, default=1, help="Batch size")
    parser.add_argument("--num_epochs", type=int, default=1, help="Number of training epochs")
    parser.add_argument("--learning_rate", type=float, default=3e-4, help="Learning rate")
    parser.add_argument("--cutoff_len", type=int, default=512, help="Cutoff length for tokenization")
    parser.add_argument("--val_set_size", type=int, default=500, help="Validation set size")
    parser.add_argument("--use_dora", action="store_true", help="Apply Dora")
    parser.add_argument("--quantize", action="store_true", help="Use quantization")
    parser.add_argument("--eval_step", type=int, default=10, help="Evaluation step interval")
    parser.add_argument("--save_step", type=int, default=100, help="Save step interval")
    parser.add_argument("--device", type=str, default="auto", choices=["auto", "cpu", "cuda"], help="Device")
    parser.add_argument("--lora_r", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lora_alpha", type=int, default=16, help="LoRA alpha")
    parser.add_argument("--lora_dropout", type=float, default=0.05, help="LoRA dropout rate")
    parser.add_argument("--lora_target_modules", type=str, default=None, help="Comma-separated LoRA target modules")
    parser.add_argument("--hub_model_id", type=str, default="path/to/repo", help="(ignored: no network)")
    parser.add_argument("--push_to_hub", action="store_true", help="(ignored: no network)")
    # trainbridge additions
    parser.add_argument("--nproc_per_node", type=int, default=1, help="Worker processes (torchrun)")
    parser.add_argument("--max_steps", type=int, default=None, help="Stop after this many optimizer steps")
    parser.add_argument("--merge", action="store_true", help="Also write the merged model to output_dir/merged")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    options = parse(argv)
    result = run_training(training_args(options), TorchrunArgs(nproc_per_node=options.nproc_per_node))
    print(
        json.dumps(
            {
                "global_step": result.global_step,
                "train_loss": result.train_loss,
                "final_eval_loss": result.final_eval_loss,
                "checkpoints": result.checkpoints,
                "merged_model": result.merged_model,
            }
        )
    )


if __name__ == "__main__":
    main()
