"""torchrun worker for tests/distributed/test_engines.py.

Usage: ``torchrun --nproc_per_node=2 engine_worker.py '<json list of specs>'``, each spec with the keys
``backend``, ``zero_stage``, ``model_dir``, ``data_file`` and ``out_dir`` (optional: ``mixed_precision``,
``fsdp_gradient_sync``).  The specs run one after another in the same two processes and process group (one
launch for every engine: each launch costs seconds of start-up), each from a fresh model.

Each rank trains a tiny model for a few optimizer steps on fixed data (two micro-batches per rank per
step, varying lengths), checks the result against a single-process reference that runs every rank's
micro-batches itself, saves a checkpoint with ``CheckpointManager``, and checks that resuming from it
reproduces the next step exactly.  Findings go to each spec's ``out_dir/result_{rank}.json``; the test
asserts them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from trainbridge.checkpoint.engine_state import has_model_state
from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.modeling.load import build_skeleton
from trainbridge.parallel.build import build_engine
from trainbridge.parallel.engine import TrainingEngine

STEPS = 3
MICRO_BATCHES = 2
VOCAB = 64


def make_micro_batches(world_size: int) -> list[list[torch.Tensor]]:
    """``batches[rank][i]``: a ``[1, length]`` token tensor; the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(1234)
    return [
        [torch.randint(0, VOCAB, (1, 6 + 3 * rank + 2 * i), generator=generator) for i in range(MICRO_BATCHES)]
        for rank in range(world_size)
    ]


def token_ce_sum(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = module(input_ids=ids).logits.float()
    return F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")


def train_step(
    engine: TrainingEngine, batches: list[torch.Tensor], global_tokens: int, scale: int, max_norm: float | None
) -> tuple[float, float]:
    """One optimizer step over ``batches``; returns (this rank's CE sum, grad norm)."""
    ce_total = 0.0
    for i, ids in enumerate(batches):
        with engine.micro_batch(is_last=i == len(batches) - 1), engine.autocast():
            ce = token_ce_sum(engine.module, ids.to(engine.env.device))
        engine.backward(ce / global_tokens * scale)
        ce_total += float(ce.detach())
    if engine.kind != "deepspeed":  # deepspeed clips in its step with the configured norm only
        measured = float(engine.clip_grad_norm(None))  # type: ignore[arg-type]
    device_norm = engine.clip_grad_norm(max_norm)
    if engine.kind != "deepspeed":
        assert isinstance(device_norm, torch.Tensor) and device_norm.device == engine.env.device, device_norm
        norm = float(device_norm)
        if abs(measured - norm) > 1e-6 * max(norm, 1.0):
            raise AssertionError(f"clip_grad_norm(None) measured {measured}, clip_grad_norm({max_norm}) saw {norm}")
    else:
        assert device_norm is None  # DeepSpeed clips in its step and reports the norm after it
    engine.optimizer_step()
    if device_norm is None:
        norm = float(engine.reported_grad_norm())  # type: ignore[arg-type]
    engine.scheduler_step()
    engine.zero_grad()
    return ce_total, norm


def local_full_weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """Every rank's view of the full weights (collective for sharded backends); test-only gathering."""
    from torch.distributed.tensor import DTensor

    if engine.kind == "deepspeed" and engine.zero_stage == 3:
        import deepspeed

        params = list(engine.unwrapped.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().clone().float() for n, p in engine.unwrapped.named_parameters()}
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().float()
        for n, p in engine.unwrapped.named_parameters()
    }


def check_weights_from_rank0(
    model_dir: Path,
    args: TrainingArgs,
    env: DistributedEnv,
    every_rank: TrainingEngine,
    batches: list[list[torch.Tensor]],
    global_tokens: int,
    total_steps: int,
    step: bool = False,
) -> dict[str, Any]:
    """FSDP2 built from rank 0's weights (the other ranks from a meta skeleton) vs ``every_rank`` (every rank
    loaded them): parameters, buffers, tied weights, and (``step``: on both, once) a step's loss."""
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir)
        if env.is_world_process_zero
        else build_skeleton(model_dir, args.model_kwargs)
    )
    skeleton_was_meta = all(p.is_meta for p in model.parameters())
    engine = build_engine(model, args, env, total_steps, weights_from_rank0=True)
    unwrapped = engine.unwrapped
    found: dict[str, Any] = {
        "skeleton_was_meta": skeleton_was_meta,
        "param_max_diff": max_diff(local_full_weights(engine), local_full_weights(every_rank)),
        "buffer_max_diff": max(
            float((a - b).abs().max()) for a, b in zip(unwrapped.buffers(), every_rank.unwrapped.buffers(), strict=True)
        ),
        "tied": unwrapped.get_output_embeddings().weight is unwrapped.get_input_embeddings().weight,
        "tied_in_reference": (
            every_rank.unwrapped.get_output_embeddings().weight is every_rank.unwrapped.get_input_embeddings().weight
        ),
    }
    if step:
        ce, norm = train_step(engine, batches[env.rank], global_tokens, env.world_size, args.max_grad_norm)
        reference_ce, reference_norm = train_step(
            every_rank, batches[env.rank], global_tokens, env.world_size, args.max_grad_norm
        )
        found["loss"] = env.sum_floats([ce])[0]
        found["reference_loss"] = env.sum_floats([reference_ce])[0]
        found["norm"], found["reference_norm"] = norm, reference_norm
        found["after_step_max_diff"] = max_diff(local_full_weights(engine), local_full_weights(every_rank))
    return found


def sha(weights: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise KeyError(f"different keys: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def main(specs: list[dict[str, Any]]) -> None:
    env = DistributedEnv.initialize(device="cpu", timeout_s=120)
    for spec in specs:
        run_spec(spec, env)
        env.barrier()
    env.teardown()


def run_spec(spec: dict[str, Any], env: DistributedEnv) -> None:
    """One engine configuration, from a fresh model: train, compare, checkpoint, resume, rotate."""
    out_dir = Path(spec["out_dir"])
    args = TrainingArgs(
        model_path=Path(spec["model_dir"]),
        data_path=Path(spec["data_file"]),
        ckpt_output_dir=out_dir / "ckpt",
        distributed_backend=spec["backend"],
        deepspeed_zero_stage=spec["zero_stage"],
        mixed_precision=spec.get("mixed_precision", "no"),
        fsdp_gradient_sync=spec.get("fsdp_gradient_sync", "every_micro_batch"),
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        device="cpu",
    )
    total_steps = STEPS + 4
    result: dict[str, Any] = {"rank": env.rank}
    batches = make_micro_batches(env.world_size)
    global_tokens = sum(ids.shape[1] - 1 for rank_batches in batches for ids in rank_batches)

    torch.manual_seed(0)
    engine = build_engine(AutoModelForCausalLM.from_pretrained(args.model_path), args, env, total_steps)
    engine.verify()
    result["describe"] = engine.describe()

    # verify() must catch a model that is not wrapped as configured.
    real_module = engine.module
    engine.module = torch.nn.Linear(2, 2)
    try:
        engine.verify()
        result["verify_catches_fallback"] = False
    except RuntimeError:
        result["verify_catches_fallback"] = True
    engine.module = real_module

    if engine.kind == "fsdp":
        from torch.distributed.tensor import DTensor

        params = list(engine.module.parameters())
        result["all_params_dtensor"] = all(isinstance(p, DTensor) for p in params)
        full_numel = sum(p.numel() for p in params)
        result["local_shard_fraction"] = sum(p.to_local().numel() for p in params) / full_numel
        # generate() on the sharded model with a different length per rank and no synced_gpus, as trl's GRPO
        # calls it: transformers must see the model as FSDP-managed, or the rank that finishes first leaves
        # the other's per-layer all-gathers unmatched (a hang)
        prompt = torch.tensor([[1, 2, 3]], device=env.device)
        new_tokens = 2 + 3 * env.rank
        generated = engine.module.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        result["generated_new_tokens"] = [generated.shape[1] - prompt.shape[1], new_tokens]

    if engine.kind == "fsdp":
        result["from_rank0"] = [
            check_weights_from_rank0(Path(spec["model_dir"]), args, env, engine, batches, global_tokens, total_steps)
        ]
        tied_dir = out_dir / "tied_model"
        if env.is_world_process_zero:
            config = AutoConfig.from_pretrained(spec["model_dir"])
            config.tie_word_embeddings = True
            torch.manual_seed(1)
            AutoModelForCausalLM.from_config(config).save_pretrained(tied_dir)
        env.barrier()
        torch.manual_seed(0)
        tied = build_engine(AutoModelForCausalLM.from_pretrained(tied_dir), args, env, total_steps)
        result["from_rank0"].append(
            check_weights_from_rank0(tied_dir, args, env, tied, batches, global_tokens, total_steps, step=True)
        )

    # Single-process reference: all ranks' micro-batches through one plain model.
    reference = build_engine(AutoModelForCausalLM.from_pretrained(args.model_path), args, DistributedEnv(), total_steps)
    every_batch = [ids for rank_batches in batches for ids in rank_batches]

    losses, norms, reference_norms = [], [], []
    for _ in range(STEPS):
        ce, norm = train_step(engine, batches[env.rank], global_tokens, env.world_size, args.max_grad_norm)
        losses.append(env.sum_floats([ce])[0] / global_tokens)
        norms.append(norm)
        _, reference_norm = train_step(reference, every_batch, global_tokens, 1, args.max_grad_norm)
        reference_norms.append(reference_norm)
    result.update(losses=losses, grad_norms=norms, reference_grad_norms=reference_norms, lr=engine.current_lr())
    if engine.kind == "deepspeed":
        result["deepspeed_reported_norm"] = float(engine.module.get_global_grad_norm())

    weights = local_full_weights(engine)
    reference_weights = {n: p.detach().float() for n, p in reference.unwrapped.named_parameters()}
    result["weights_sha"] = sha(weights)
    result["max_diff_vs_reference"] = max_diff(weights, reference_weights)
    if env.is_world_process_zero:
        torch.save(weights, out_dir / "final_weights.pt")
    if engine.kind == "fsdp":
        result["optimizer_fused"] = all(g.get("fused") for g in engine.optimizer.param_groups)

    # Checkpoint at step STEPS, then one more step: the uninterrupted continuation.
    manager = CheckpointManager(args.ckpt_output_dir, env, save_total_limit=None)
    checkpoint = manager.save(
        engine, None, STEPS, {"global_step": STEPS, "rank_count": env.world_size}, {"note.txt": "hello"}
    )
    # The same state with the HF-layout weights exported in bf16 (the training weights are fp32).
    bf16_manager = CheckpointManager(out_dir / "bf16", env, save_total_limit=None, weights_dtype=torch.bfloat16)
    bf16_checkpoint = bf16_manager.save(engine, None, STEPS, {"global_step": STEPS}, {})
    # checkpoint_async: the dcp/ part is written in the background while the next step trains (below);
    # published after it, it must still hold the state of step STEPS.
    async_manager = CheckpointManager(out_dir / "async", env, save_total_limit=None, weights_dtype=torch.bfloat16)
    pending = async_manager.begin_save(engine, None, STEPS, {"global_step": STEPS}, {}, background=True)
    result["async_background_write"] = pending.background_write is not None
    saved_state = engine.full_model_state_dict()
    lr_at_checkpoint = engine.current_lr()
    train_step(engine, batches[env.rank], global_tokens, env.world_size, args.max_grad_norm)
    continued = local_full_weights(engine)
    async_checkpoint = async_manager.finish_save(pending)

    # Resume: a fresh model from the original weights, the checkpoint loaded, the same step.
    torch.manual_seed(0)
    resumed = build_engine(AutoModelForCausalLM.from_pretrained(args.model_path), args, env, total_steps)
    training_state = manager.load(checkpoint, resumed)
    result["training_state"] = training_state
    result["resumed_lr_matches"] = resumed.current_lr() == lr_at_checkpoint
    train_step(resumed, batches[env.rank], global_tokens, env.world_size, args.max_grad_norm)
    result["resume_max_diff"] = max_diff(local_full_weights(resumed), continued)
    # where resume reads the weights: the checkpoint's own shards (FSDP2, a lower-precision export) or not
    result["model_state_in_dcp"] = {
        "plain": has_model_state(resumed, checkpoint),
        "bf16": has_model_state(resumed, bf16_checkpoint),
    }
    resumed_from = {"bf16": bf16_checkpoint, "async": async_checkpoint}
    for name, path in resumed_from.items():  # each from the original weights again
        torch.manual_seed(0)
        again = build_engine(AutoModelForCausalLM.from_pretrained(args.model_path), args, env, total_steps)
        manager.load(path, again)
        train_step(again, batches[env.rank], global_tokens, env.world_size, args.max_grad_norm)
        result[f"{name}_resume_max_diff"] = max_diff(local_full_weights(again), continued)
    if env.is_world_process_zero:
        from safetensors.torch import load_file

        result["bf16_export_dtypes"] = sorted(
            {str(t.dtype) for t in load_file(bf16_checkpoint / "model.safetensors").values()}
        )
        result["bf16_checkpoint_files"] = sorted(p.name for p in bf16_checkpoint.iterdir())
    result["latest"] = str(manager.latest())

    if env.is_world_process_zero:
        assert saved_state is not None
        from_disk = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
        result["from_pretrained_max_diff"] = max_diff(from_disk, saved_state)
        result["checkpoint_files"] = sorted(p.name for p in checkpoint.iterdir())
    else:
        result["full_state_on_other_rank"] = saved_state is not None

    # Rotation is collective: rank 0 deletes, every rank learns what went and lists the same.
    rotating = CheckpointManager(args.ckpt_output_dir, env, save_total_limit=1)
    rotating.save(resumed, None, STEPS + 1, {"global_step": STEPS + 1}, {})
    result["rotated_away"] = [p.name for p in rotating.rotate()]
    result["after_rotation"] = [p.name for p in rotating.list_checkpoints()]

    (out_dir / f"result_{env.rank}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    from trainbridge.launch.process_exit import exit_now

    main(json.loads(sys.argv[1]))
    # as trainbridge's own worker: skip C++ static teardown, where gloo's threads can abort a finished
    # process ("terminate called without an active exception"; seen once on this test under load)
    exit_now(0)
