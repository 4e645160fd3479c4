"""QLoRA end to end on the machine's devices: a 4-bit NF4 base, LoRA, ``run_training`` under DDP and FSDP2.

    python benchmarks/qlora_gpu.py [--device cuda] [--nproc N] [--steps 8] [--hidden 512] [--layers 4]

Builds a Llama of ``--hidden``/``--layers`` from a config (no hub), then, on ``--nproc`` ranks (default:
every visible GPU, 1 on CPU): ``ddp`` with the default ``uint8`` packing, and ``fsdp`` with
``bnb_4bit_quant_storage`` equal to the compute dtype (the FSDP-QLoRA recipe; on one rank the engine runs
the bare model, so FSDP2 needs ``--nproc`` >= 2).  Each run resumes once from its ``checkpoint-4``.
Prints one JSON line per run: losses, whether the resumed adapter equals the straight one, checkpoint
files, peak CUDA memory of rank 0.  Exit status 1 when a run fails or a resume is not exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


class PeakMemory:
    """Rank 0 writes its peak CUDA memory (MiB) at train end to ``peak_mib.txt``."""

    def on_train_end(self, context, **kwargs):  # a trainbridge Callback hook (see main: wrapped there)
        if context.rank == 0 and torch.cuda.is_available():
            (context.args.ckpt_output_dir / "peak_mib.txt").write_text(str(torch.cuda.max_memory_allocated() >> 20))


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file
    from transformers import BitsAndBytesConfig

    from trainbridge import Callback, TorchrunArgs, TrainingArgs, run_training
    from trainbridge.demos.tiny_model import build_tiny_llama, write_arithmetic_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--nproc", type=int, default=max(torch.cuda.device_count(), 1))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    options = parser.parse_args(argv)
    cuda = options.device == "cuda"
    compute = torch.bfloat16 if cuda else torch.float32

    class Peak(PeakMemory, Callback):
        pass

    root = Path(tempfile.mkdtemp(prefix="qlora-"))
    model = build_tiny_llama(
        root / "model",
        hidden_size=options.hidden,
        num_layers=options.layers,
        num_heads=max(options.hidden // 64, 1),
        intermediate_size=options.hidden * 4,
    )
    data = write_arithmetic_dataset(root / "train.jsonl", 512, seed=1)
    backends = {"ddp": torch.uint8, "fsdp": compute} if options.nproc > 1 else {"ddp": torch.uint8}
    failed = False
    for backend, storage in backends.items():
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_quant_storage=storage,
        )
        common = dict(
            model_path=model,
            data_path=data,
            device=options.device,
            distributed_backend=backend,
            model_kwargs={"quantization_config": quantization},
            peft_config={"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "lora_dropout": 0.0},
            gradient_checkpointing=True,
            mixed_precision="bf16" if cuda else "no",
            max_seq_len=64,
            max_batch_len=256,
            effective_batch_size=16 * options.nproc,
            learning_rate=5e-3,
            lr_scheduler="constant",
            max_steps=options.steps,
            logging_steps=2,
            save_strategy="steps",
            save_steps=4,
            disable_tqdm=True,
            seed=3,
        )
        launch = TorchrunArgs(nproc_per_node=options.nproc)
        row: dict = {
            "backend": backend,
            "quant_storage": str(storage),
            "device": options.device,
            "nproc": options.nproc,
        }
        try:
            straight = run_training(TrainingArgs(ckpt_output_dir=root / backend, **common), launch, callbacks=[Peak()])
            resumed = run_training(
                TrainingArgs(
                    ckpt_output_dir=root / f"{backend}-resumed",
                    **common,
                    resume_from_checkpoint=root / backend / "checkpoint-4",
                ),
                launch,
            )
            last = f"checkpoint-{options.steps}"
            a = load_file(root / backend / last / "adapter_model.safetensors")
            b = load_file(root / f"{backend}-resumed" / last / "adapter_model.safetensors")
            metrics = [json.loads(line) for line in Path(straight.metrics_file).read_text().splitlines()]
            peak = root / backend / "peak_mib.txt"
            row.update(
                losses=[round(r["loss"], 4) for r in metrics if "loss" in r],
                resume_exact=a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
                checkpoint_files=sorted(p.name for p in (root / backend / last).iterdir()),
                peak_cuda_mib=int(peak.read_text()) if peak.is_file() else None,
                resumed=resumed.global_step,
            )
            failed |= not row["resume_exact"]
        except Exception as exc:  # one line per run, the next still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            failed = True
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
