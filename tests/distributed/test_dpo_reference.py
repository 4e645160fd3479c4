"""DPO's default reference (a frozen copy of the policy) on 2 gloo ranks: under FSDP2 it is sharded like the
policy (DTensor parameters, each rank holding part of them), and the run's losses and rewards equal the
DDP run's, where each rank holds a whole copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from tests.distributed.training_fixtures import base_args
from trainbridge import TorchrunArgs, run_training
from trainbridge.trl.dpo_step import DPOStepFactory

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


class RecordingFactory(DPOStepFactory):
    """The DPO step factory, writing what each rank's reference holds to ``ref-rank{r}.json``."""

    def __call__(self, model: Any, tokenizer: Any, args: Any, env: Any) -> Any:
        step = super().__call__(model, tokenizer, args, env)
        params = list(step.ref_model.parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        record = {
            "kinds": sorted({type(p).__name__ for p in params}),
            "local": local,
            "full": sum(p.numel() for p in params),
            "trainable": any(p.requires_grad for p in params),
        }
        (Path(args.ckpt_output_dir) / f"ref-rank{env.rank}.json").write_text(json.dumps(record))
        return step


def _factory(model_path: Path) -> RecordingFactory:
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from trainbridge.trl.preference_data import prepare_preference_dataset
    from trainbridge.trl.preference_loss import DPOLossSettings

    rows = [{"prompt": f"{a}+{a % 5}=", "chosen": str(a + a % 5), "rejected": str(3 * a + 2)} for a in range(16)]
    config = DPOConfig(output_dir="unused", report_to="none", use_cpu=True, max_length=16, beta=0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs = prepare_preference_dataset(datasets.Dataset.from_list(rows), tokenizer, config)
    return RecordingFactory(pairs, DPOLossSettings.from_config(config), 2, 1, config.max_length, seed=3)


def _logged(out: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "rewards/margins" in row]


def test_fsdp2_shards_the_reference_like_the_policy_and_trains_as_ddp(assets: dict[str, Path], tmp_path: Path) -> None:
    runs = {}
    for backend in ("ddp", "fsdp"):
        out = tmp_path / backend
        args = base_args(
            assets, out, train_step=_factory(assets["model"]), distributed_backend=backend, max_steps=4, logging_steps=1
        )
        run_training(args, TorchrunArgs(nproc_per_node=2), timeout_s=420)
        runs[backend] = (_logged(out), [json.loads((out / f"ref-rank{r}.json").read_text()) for r in (0, 1)])
    (ddp_logs, ddp_refs), (fsdp_logs, fsdp_refs) = runs["ddp"], runs["fsdp"]
    assert all(ref["kinds"] == ["Parameter"] and ref["local"] == ref["full"] for ref in ddp_refs)
    for ref in fsdp_refs:
        assert ref["kinds"] == ["DTensor"] and not ref["trainable"]
        assert ref["local"] < 0.75 * ref["full"]  # a shard, not a copy of the whole model
    assert sum(ref["local"] for ref in fsdp_refs) >= fsdp_refs[0]["full"]
    assert [row["step"] for row in fsdp_logs] == [row["step"] for row in ddp_logs] == [1, 2, 3, 4]
    assert abs(ddp_logs[-1]["rewards/margins"]) > 1e-4  # the policy moved away from the reference
    for ours, theirs in zip(fsdp_logs, ddp_logs, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-5), (ours["step"], key)
