"""Trainer's ``optim`` names and ``lr_scheduler_type`` values: each builds the right class and steps; bad or
unavailable ones fail before launch naming the field, the value and what to do."""

from __future__ import annotations

import importlib.util
from typing import get_args

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from trainbridge.core.config.names import OptimizerName, SchedulerName
from trainbridge.core.distributed import DistributedEnv
from trainbridge.loop.loop import train
from trainbridge.parallel.optim import build_optimizer, build_scheduler, decay_parameter_names

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_SCHEDULEFREE = importlib.util.find_spec("schedulefree") is not None


def _class(name: str) -> tuple[str, dict]:
    """The class ``name`` builds (module-qualified) and attributes it must have."""
    if name in ("adamw_torch", "adamw_torch_fused"):
        return "torch.optim.adamw.AdamW", {}
    if name == "sgd":
        return "torch.optim.sgd.SGD", {}
    if name == "adafactor":
        return "transformers.optimization.Adafactor", {}
    if name.startswith("schedule_free_"):
        kind = {"adamw": "AdamW", "radam": "RAdam", "sgd": "SGD"}[name.removeprefix("schedule_free_")]
        return f"schedulefree.{kind}ScheduleFree", {}
    bits = 32 if name.endswith("32bit") else 8
    cls = "Lion" if "lion" in name else "AdamW"
    return f"bitsandbytes.optim.{cls.lower()}.{cls}", {"optim_bits": bits, "is_paged": name.startswith("paged_")}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


@pytest.mark.parametrize("name", get_args(OptimizerName))
def test_each_optim_name_builds_its_class_and_steps(args_for, name):
    if name.startswith("schedule_free_") and not HAS_SCHEDULEFREE:
        pytest.skip("schedulefree is not installed (its missing-package error is tested below)")
    if not name.startswith(("adamw_torch", "sgd", "adafactor", "schedule_free_")) and not HAS_BNB:
        pytest.skip("bitsandbytes is not installed")
    extra = {"optim_args": {"momentum": 0.9}} if name == "sgd" else {}
    args = args_for(optim=name, weight_decay=0.1, **extra)
    model = Tiny()
    optimizer = build_optimizer(model, args, decay_parameter_names(model))
    expected, attributes = _class(name)
    assert f"{type(optimizer).__module__}.{type(optimizer).__qualname__}" == expected
    if attributes:  # bitsandbytes: the state's bits in .args, paging on the optimizer
        assert (optimizer.args.optim_bits, optimizer.is_paged) == (attributes["optim_bits"], attributes["is_paged"])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]  # no decay on bias and norm
    if name == "sgd":
        assert optimizer.param_groups[0]["momentum"] == 0.9
    if name.startswith("adamw_torch"):
        assert optimizer.defaults["fused"]
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 16)).pow(2).mean().backward()
    optimizer.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
def test_a_run_trains_with_a_paged_8bit_optimizer_and_resumes_its_state(args_for):
    result = train(
        args_for(optim="paged_adamw_8bit", max_steps=4, save_strategy="steps", save_steps=2), DistributedEnv(), []
    )
    assert result.global_step == 4 and result.train_loss is not None
    resumed = train(
        args_for(
            optim="paged_adamw_8bit", max_steps=4, save_strategy="steps", save_steps=2, resume_from_checkpoint="auto"
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


SCHEDULE_KWARGS = {
    "cosine_with_min_lr": {"min_lr_rate": 0.1},
    "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
    "warmup_stable_decay": {"num_decay_steps": 4},
}


@pytest.mark.parametrize("name", get_args(SchedulerName))
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
