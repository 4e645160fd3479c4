"""fp16 and torch_compile on two gloo ranks, through the loop (Trainer's ``fp16=True`` / ``torch_compile``).

One spawn of two processes (``run_on_ranks``) runs, one after another in the same process group: on DDP and
on FSDP2 an fp16 run of 4 steps saving at 2 and 4, then a run resumed from its checkpoint-2; and an fp16
DDP run with the decoder layers under ``torch.compile``.  The single-process fp16 run of the same settings
(in this process) is the reference of the losses.  (Trainer's own fp16 cannot be the reference here:
accelerate on CPU neither autocasts nor scales under ``fp16=True``.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import run_on_ranks
from tests.distributed.training_fixtures import base_args
from tests.run_inputs import as_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = 4
BACKENDS = ("ddp", "fsdp")


def fp16_args(assets: dict[str, Path], out: Path, **more: Any) -> Any:
    fields = dict(mixed_precision="fp16", nonfinite_policy="warn", max_steps=STEPS, logging_steps=1)
    return base_args(assets, out, **{**fields, "save_total_limit": None, **more})


def losses(out: Path) -> dict[int, float]:
    """The logged training loss of each step (``metrics.jsonl``)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r and "step" in r}


def _run(args: Any, env: Any) -> dict[str, Any]:
    from trainbridge.launch.assembly import assemble_callbacks
    from trainbridge.loop.loop import train

    result = train(*as_run(args), env, assemble_callbacks(*as_run(args)))
    return {"global_step": result.global_step, "resumed_from": result.resumed_from}


def _fp16_runs(env: Any, assets: dict[str, Path], root: Path) -> dict[str, Any]:
    """On each rank: per backend a saving run and a run resumed from its checkpoint-2, then compiled DDP;
    what each engine held (scaler, autocast) is read from the runs' files by the test."""
    found: dict[str, Any] = {}
    for backend in BACKENDS:
        saving = fp16_args(assets, root / backend, distributed_backend=backend, save_strategy="steps", save_steps=2)
        found[backend] = _run(saving, env)
        checkpoint = root / backend / "checkpoint-2"
        resumed = fp16_args(
            assets, root / f"{backend}-resumed", distributed_backend=backend, save_strategy="steps",
            save_steps=STEPS, resume_from_checkpoint=str(checkpoint),
        )  # fmt: skip
        found[f"{backend}-resumed"] = _run(resumed, env)
    compiled = fp16_args(assets, root / "ddp-compiled", compile=True, compile_backend="aot_eager", max_steps=2)
    found["ddp-compiled"] = _run(compiled, env)
    found["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return found


@pytest.fixture(scope="module")
def fp16_runs(assets, tmp_path_factory) -> tuple[Path, list[dict[str, Any]], dict[int, float]]:
    from trainbridge.core.distributed import DistributedEnv

    root = tmp_path_factory.mktemp("fp16")
    ranks = run_on_ranks(_fp16_runs, assets, root, timeout=480)
    _run(fp16_args(assets, root / "single"), DistributedEnv())
    return root, ranks, losses(root / "single")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_on_two_ranks_trains_like_one_process_and_resumes_exactly(fp16_runs, backend) -> None:
    """fp16 autocast + gradient scaler (FSDP2: the sharded one) on 2 ranks: the losses of the one-process fp16
    run of the same batches; ``scaler.pt`` in each checkpoint; resumed from checkpoint-2, the weights and
    the scaler of checkpoint-4 are the uninterrupted run's, bit for bit."""
    root, ranks, single = fp16_runs
    assert [r[backend]["global_step"] for r in ranks] == [STEPS, STEPS]
    ours = losses(root / backend)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert ours[STEPS] < ours[1]
    for step, loss in single.items():
        assert ours[step] == pytest.approx(loss, rel=2e-3), (step, ours, single)
    straight, resumed = root / backend / f"checkpoint-{STEPS}", root / f"{backend}-resumed" / f"checkpoint-{STEPS}"
    assert all(r[f"{backend}-resumed"]["resumed_from"].endswith("checkpoint-2") for r in ranks)
    scalers = [torch.load(c / "scaler.pt", weights_only=True) for c in (root / backend / "checkpoint-2", straight)]
    assert scalers[0]["scale"] == 65536.0 and scalers[0]["_growth_tracker"] == 2
    assert scalers[1]["_growth_tracker"] == STEPS  # no overflow: every step applied
    assert torch.load(resumed / "scaler.pt", weights_only=True) == scalers[1]  # counted on from checkpoint-2's
    weights = [load_file(str(c / "model.safetensors")) for c in (straight, resumed)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=0, msg=name)
    assert losses(root / f"{backend}-resumed") == {s: ours[s] for s in range(3, STEPS + 1)}


def test_torch_compile_on_two_ddp_ranks_keeps_the_losses(fp16_runs) -> None:
    """``torch_compile`` (decoder layers under ``torch.compile``, aot_eager: the traced forward and backward
    graphs, without a C compiler) on 2 DDP ranks with fp16: the eager run's losses."""
    root, ranks, _ = fp16_runs
    assert [r["ddp-compiled"]["global_step"] for r in ranks] == [2, 2]
    assert all(r["compiled_graphs"] > 0 for r in ranks)  # the decoder layers did run through torch.compile
    compiled, eager = losses(root / "ddp-compiled"), losses(root / "ddp")
    assert sorted(compiled) == [1, 2]
    for step, loss in compiled.items():
        assert loss == pytest.approx(eager[step], rel=1e-3), (compiled, eager)
