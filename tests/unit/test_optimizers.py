"""Trainer's ``optim`` names and ``lr_scheduler_type`` values: each builds the right class and steps; bad or
unavailable ones fail before launch naming the field, the value and what to do."""

from __future__ import annotations

import importlib.util
from typing import get_args

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers.training_args import OptimizerNames

from tests.run_inputs import as_run
from trainbridge.core.config.checks import CUDA_ONLY, OPTIMIZER_PACKAGES
from trainbridge.core.config.names import SchedulerName
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.porting import parse_optim_args
from trainbridge.loop.loop import train
from trainbridge.parallel.optim import build_optimizer, build_scheduler, decay_parameter_names

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_SCHEDULEFREE = importlib.util.find_spec("schedulefree") is not None


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def _installed(name: str) -> bool:
    package = next((p for key, p in OPTIMIZER_PACKAGES.items() if name.startswith(key)), None)
    return package is None or importlib.util.find_spec(package) is not None


def test_the_config_names_are_transformers_own() -> None:
    from transformers import SchedulerType

    from trainbridge.core.config.names import OptimizerName

    assert list(get_args(OptimizerName)) == [o.value for o in OptimizerNames]
    assert list(get_args(SchedulerName)) == [s.value for s in SchedulerType]


OPTIM_ARGS = {"sgd": "momentum=0.9,nesterov=True", "rmsprop": "alpha=0.9,centered=True", "adagrad": "lr_decay=0.01"}


@pytest.mark.parametrize("name", [o.value for o in OptimizerNames])
def test_each_installed_optimizer_takes_trainers_first_step(args_for, tmp_path, name):
    """Every ``OptimizerNames`` value whose package is installed: the class, groups and first two steps'
    updates of Trainer's own ``create_optimizer`` (issue 41; rmsprop, adagrad, ademamix... were refused)."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    if not _installed(name):
        pytest.skip(f"{name}: its package is not installed (the refusal is tested below)")
    if name in ("lomo", "adalomo"):
        pytest.skip(f"{name}: it updates in its fused backward, not in step (tests/unit/test_backward_updates.py)")
    if name in CUDA_ONLY and not torch.cuda.is_available():
        pytest.skip(f"{name}: CUDA only (refused on CPU before launch, below)")
    if name == "galore_adafactor_layerwise":
        pytest.skip(f"{name}: Trainer cannot build it (refused before launch, below)")
    hf = TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, report_to="none", optim=name, weight_decay=0.1,
        learning_rate=1e-2, optim_args=OPTIM_ARGS.get(name), optim_target_modules=["proj"],
    )  # fmt: skip
    torch.manual_seed(0)
    reference_model, model = Tiny(), Tiny()
    model.load_state_dict(reference_model.state_dict())
    try:
        reference = Trainer(model=reference_model, args=hf).create_optimizer()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    args = args_for(
        optim=name, weight_decay=0.1, learning_rate=1e-2, optim_args=parse_optim_args(hf.optim_args),
        optim_target_modules=["proj"], adam_beta1=hf.adam_beta1, adam_beta2=hf.adam_beta2, adam_epsilon=hf.adam_epsilon,
        max_batch_len=256,  # one micro-batch per step, as a layer-wise optimizer needs
    )  # fmt: skip
    ours = build_optimizer(model, args, decay_parameter_names(model))
    assert type(ours) is type(reference)
    assert [g.get("weight_decay") for g in ours.param_groups] == [g.get("weight_decay") for g in reference.param_groups]
    x = torch.randn(4, 16)
    for _ in range(2):
        for m, optimizer in ((reference_model, reference), (model, ours)):
            optimizer.zero_grad()
            m(x).pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(reference_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(Tiny().parameters(), model.parameters(), strict=True))


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
def test_a_run_trains_with_a_paged_8bit_optimizer_and_resumes_its_state(args_for):
    result = train(
        *as_run(args_for(optim="paged_adamw_8bit", max_steps=4, save_strategy="steps", save_steps=2)),
        DistributedEnv(),
        [],
    )
    assert result.global_step == 4 and result.train_loss is not None
    resumed = train(
        *as_run(
            args_for(
                optim="paged_adamw_8bit",
                max_steps=4,
                save_strategy="steps",
                save_steps=2,
                resume_from_checkpoint="auto",
            )
        ),
        DistributedEnv(),
        [],
    )
    assert resumed.resumed_from is not None and resumed.resumed_from.endswith("checkpoint-4")


def test_a_bad_optim_name_fails_naming_the_field_the_value_and_the_choices(args_for):
    with pytest.raises(ValidationError) as info:
        args_for(optim="adamw_apex_fused")
    message = str(info.value)
    assert "optim" in message and "adamw_apex_fused" in message and "paged_adamw_32bit" in message


@pytest.mark.skipif(HAS_SCHEDULEFREE, reason="schedulefree is installed")
def test_an_unavailable_library_is_named_with_what_to_install(args_for, monkeypatch):
    with pytest.raises(
        ValidationError,
        match=r"optim='schedule_free_adamw': needs the schedulefree package; "
        r"pip install schedulefree",
    ):
        args_for(optim="schedule_free_adamw")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(
        ValidationError,
        match=r"optim='paged_adamw_8bit': needs the bitsandbytes package; "
        r"pip install 'trainbridge\[qlora\]'",
    ):
        args_for(optim="paged_adamw_8bit")


def test_deepspeed_keeps_its_own_optimizer(args_for):
    with pytest.raises(ValidationError, match=r"optim='sgd': DeepSpeed steps its own AdamW"):
        args_for(optim="sgd", distributed_backend="deepspeed")
    args_for(optim="adamw_torch", distributed_backend="deepspeed")


METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")
SCHEDULE_KWARGS = {
    "cosine_with_min_lr": {"min_lr_rate": 0.1},
    "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
    "warmup_stable_decay": {"num_decay_steps": 4},
}


@pytest.mark.parametrize("name", [n for n in get_args(SchedulerName) if n not in METRIC_SCHEDULES])
def test_each_schedule_is_transformers_own(args_for, name):
    from transformers import SchedulerType, get_scheduler

    assert name in {s.value for s in SchedulerType}
    args = args_for(lr_scheduler=name, warmup_steps=2, lr_scheduler_kwargs=SCHEDULE_KWARGS.get(name, {}))
    model = Tiny()
    ours = build_scheduler(torch.optim.SGD(model.parameters(), lr=args.learning_rate), args, total_steps=10)
    reference = get_scheduler(
        name,
        torch.optim.SGD(Tiny().parameters(), lr=args.learning_rate),
        num_warmup_steps=2,
        num_training_steps=10,
        scheduler_specific_kwargs=SCHEDULE_KWARGS.get(name),
    )
    assert type(ours) is type(reference)
    for _ in range(10):
        assert ours.get_last_lr() == pytest.approx(reference.get_last_lr())
        ours.optimizer.step(), ours.step()
        reference.optimizer.step(), reference.step()


@pytest.mark.parametrize("name", METRIC_SCHEDULES)
def test_a_metric_schedule_steps_on_each_evaluation_as_trainers_does(args_for, name):
    """``reduce_lr_on_plateau`` / ``greedy`` (refused before issue 41) step once per evaluation, on
    ``eval_loss``, never per optimizer step; without an evaluation they are refused before launch."""
    from trainbridge.core.callback import Callback

    seen: list[tuple[float, float]] = []

    class Record(Callback):
        def on_evaluate(self, context, **kwargs):
            seen.append((kwargs["metrics"]["eval_loss"], context.lr_scheduler.last_epoch))

    from trainbridge.launch.assembly import assemble_callbacks

    args = args_for(
        lr_scheduler=name, max_steps=4, eval_strategy="steps", eval_steps=2, learning_rate=1e-3, callbacks=[Record()]
    )
    result = train(*as_run(args), DistributedEnv(), assemble_callbacks(*as_run(args)))
    assert result.global_step == 4
    # the schedule steps after the user callbacks' on_evaluate, once per evaluation (last_epoch counts them)
    assert [epoch for _, epoch in seen] == [0, 1]
    with pytest.raises(ValidationError, match=rf"lr_scheduler='{name}': it steps on the evaluation metric"):
        args_for(lr_scheduler=name)


@pytest.fixture
def low_rank_installed(monkeypatch):
    """GaLore / APOLLO / LOMO count as installed, so the engine refusals are reached without their packages."""
    real = importlib.util.find_spec
    fake = ("galore_torch", "apollo_torch", "lomo_optim")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in fake else real(name, *a))


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"optim": "galore_adamw_layerwise", "distributed_backend": "fsdp"}, "distributed_backend='fsdp'"),
        ({"optim": "apollo_adamw_layerwise", "distributed_backend": "deepspeed"}, "distributed_backend='deepspeed'"),
        ({"optim": "galore_adamw", "distributed_backend": "fsdp"}, "FSDP2 shards"),
        ({"optim": "apollo_adamw", "distributed_backend": "fsdp"}, "FSDP2 shards"),
        ({"optim": "galore_adafactor_layerwise", "mixed_precision": "fp16", "nonfinite_policy": "warn"}, "scaler"),
        ({"optim": "lomo", "mixed_precision": "fp16", "nonfinite_policy": "warn"}, "scaler"),
        ({"optim": "galore_adafactor_layerwise"}, "relative_step=True"),
        ({"optim": "galore_adamw_8bit", "device": "cpu"}, "needs a CUDA device"),
        ({"optim": "galore_adamw_8bit_layerwise", "device": "cpu"}, "needs a CUDA device"),
        ({"optim": "adalomo", "device": "cpu"}, "needs a CUDA device"),
    ],
)
def test_optimizer_engine_combinations_that_cannot_work_are_refused_before_launch(
    args_for, low_rank_installed, fields, needle
):
    """Layer-wise optimizers only with plain DDP; they and LOMO without fp16's scaler; GaLore / APOLLO not on
    FSDP2's shards; what Trainer cannot build or run here: one line naming the field, the value and the fix."""
    with pytest.raises(ValidationError) as info:
        args_for(**fields)
    message = str(info.value)
    assert f"optim={fields['optim']!r}" in message and needle in message and "use " in message


def test_the_combinations_that_work_are_accepted(args_for, low_rank_installed):
    args_for(optim="galore_adamw_layerwise", max_batch_len=256)
    args_for(optim="galore_adamw_layerwise", training_step="model_loss", per_device_batch_size=8)
    args_for(optim="galore_adamw_8bit", device="cuda")
    args_for(optim="lomo", distributed_backend="fsdp")  # one process: the engine runs its fused backward
    args_for(optim="galore_adamw", distributed_backend="ddp")
    args_for(optim="apollo_adamw", mixed_precision="fp16", nonfinite_policy="warn")
    json_optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # DeepSpeed's: optim unused
    args_for(optim="lomo", distributed_backend="deepspeed", deepspeed_config=json_optimizer)


def test_a_layerwise_optimizer_on_two_processes_is_refused_before_launch(args_for, low_rank_installed, monkeypatch):
    """Trainer's "Layer-wise ... does not support DDP" and "... does not support gradient accumulation":
    ``run_training`` refuses them from the process count and the batch fields (nothing launched), a worker
    in place from ``WORLD_SIZE``, ``Trainer.train()`` from its world (below)."""
    from trainbridge import TorchrunArgs, run_training
    from trainbridge.core.config.checks import check_world

    args = args_for(optim="galore_adamw_layerwise", max_batch_len=256)
    check_world(args, 1)
    accumulating = {
        "effective_batch_size=8 x max_seq_len=32 > max_batch_len=64": args_for(optim="galore_adamw_layerwise"),
        "effective_batch_size=8 > per_device_batch_size=4": args_for(
            optim="galore_adamw_layerwise", training_step="model_loss", per_device_batch_size=4
        ),
    }
    for what, refused in accumulating.items():
        with pytest.raises(ValueError, match=rf"cannot accumulate gradients over micro-batches \({what}\).*; use one"):
            run_training(refused, TorchrunArgs(nproc_per_node=1))
    with pytest.raises(ValueError, match=r"optim='galore_adamw_layerwise': layer-wise optimizers cannot run on 2 "):
        run_training(args, TorchrunArgs(nproc_per_node=2))
    lomo = args_for(optim="lomo")  # several micro-batches: each updates, as under Trainer
    check_world(lomo, 1)
    with pytest.raises(ValueError, match=r"optim='lomo': .*fused backward.* cannot run on 2 processes; run one"):
        run_training(lomo, TorchrunArgs(nproc_per_node=2))
    with pytest.raises(ValueError, match=r"on 4 processes.*nproc_per_node=1.*optim='galore_adamw'"):
        run_training(args, TorchrunArgs(nproc_per_node=2, nnodes="1:2"))
    assert not (args.ckpt_output_dir).exists()
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"cannot run on 2 processes"):
        run_training(args)


def test_a_trainer_script_gets_trainers_layerwise_refusals_from_train(tiny_llama, tmp_path, low_rank_installed):
    """``trainbridge.Trainer``: a layer-wise optimizer on a world of 2, or with gradient accumulation, is
    refused when ``train()`` builds its job, before anything runs (Trainer refuses both in create_optimizer)."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from trainbridge import Trainer
    from trainbridge.trainer import job_args

    def trainer(**more):
        hf = TrainingArguments(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, optim="galore_adamw_layerwise",
            optim_target_modules=["q_proj"], max_steps=2, **more,
        )  # fmt: skip
        return Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_llama), args=hf, train_dataset=ROWS)

    ROWS = [{"input_ids": [1, 2, 3, 4]}] * 8
    job_args.training_job(trainer(), 1, None)
    with pytest.raises(ValueError, match=r"optim='galore_adamw_layerwise': layer-wise optimizers cannot run on 2 "):
        job_args.training_job(trainer(), 2, None)
    with pytest.raises(ValueError, match=r"cannot accumulate gradients over micro-batches"):
        job_args.training_job(trainer(gradient_accumulation_steps=2), 1, None)


@pytest.mark.parametrize("name", ["galore_adamw", "apollo_adamw"])
def test_a_low_rank_optimizer_resumes_with_its_projectors(args_for, tmp_path, name):
    """GaLore / APOLLO keep a gradient projector object per projected weight: saved at step 2 and read back with
    ``weights_only`` (its class allowed), the resumed run's step-4 weights are the uninterrupted run's."""
    from safetensors.torch import load_file

    if not _installed(name):
        pytest.skip(f"{name}: its package is not installed")
    fields = dict(
        optim=name, optim_target_modules=["q_proj", "v_proj"], optim_args={"rank": 4}, max_batch_len=256,
        save_strategy="steps", save_steps=2,
    )  # fmt: skip
    train(*as_run(args_for(out="whole", max_steps=4, **fields)), DistributedEnv(), [])
    train(*as_run(args_for(out="parts", max_steps=2, **fields)), DistributedEnv(), [])
    resumed = train(
        *as_run(args_for(out="parts", max_steps=4, resume_from_checkpoint="auto", **fields)), DistributedEnv(), []
    )
    assert resumed.resumed_from is not None and resumed.resumed_from.endswith("checkpoint-2")
    whole, parts = (load_file(tmp_path / out / "checkpoint-4" / "model.safetensors") for out in ("whole", "parts"))
    for key, value in whole.items():
        torch.testing.assert_close(parts[key], value, rtol=0, atol=0, msg=key)
