"""DPO's reference on 2 gloo ranks under FSDP2.  The step factory's default reference (a frozen copy of the
policy) is sharded like the policy (DTensor parameters, each rank holding part of them), and the run's losses and
rewards equal the DDP run's, where each rank holds a whole copy.  ``DPOTrainer``'s reference is trl's own
``ref_model``, sharded in place (``trl.trl_loop.ShardedReference``) and shared by the step, trl's
``SyncRefModelCallback`` and trl's evaluation (``scripts/dpo_fsdp_script.py``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from tests.distributed.script_runs import run_checked, torchrun
from tests.distributed.training_fixtures import base_args
from tests.run_inputs import run_training
from trainbridge import TorchrunArgs
from trainbridge.core.config.loss import OwnStep
from trainbridge.trl.dpo_step import DPOStepFactory

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


class RecordingFactory(DPOStepFactory):
    """The DPO step factory, writing what each rank's reference holds to ``ref-rank{r}.json``."""

    def __call__(self, model: Any, tokenizer: Any, args: Any, env: Any, plan: Any) -> Any:
        step = super().__call__(model, tokenizer, args, env, plan)
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
            assets,
            out,
            loss=OwnStep(_factory(assets["model"])),
            distributed_backend=backend,
            max_steps=4,
            logging_steps=1,
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


SCRIPT = Path(__file__).parent / "scripts" / "dpo_fsdp_script.py"


def test_dpo_trainer_shares_trls_sharded_reference_with_sync_and_evaluation(tmp_path: Path) -> None:
    """``sync_ref_model`` with alpha 1 makes the reference the policy after every step: each training step starts
    from policy == reference (loss log 2), and trl's ``evaluate()`` after training, scoring with the same
    (sharded, synced) reference, finds margins 0."""
    out = tmp_path / "out"
    run_checked(torchrun(SCRIPT, str(out)), {**os.environ, "OMP_NUM_THREADS": "1"}, out)
    results = [json.loads((out / f"result-rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert result["step_scores_with_trls_reference"]  # no copy: the step scores with trl's ref_model
        assert result["reference_dtensor"], "each rank holds a whole reference model"
        assert result["reference_local_share"] < 0.75
        assert [row["step"] for row in result["logged"]] == [1, 2, 3]
        assert all(row["loss"] == pytest.approx(math.log(2), abs=1e-4) for row in result["logged"])
        assert abs(result["eval"]["eval_rewards/margins"]) < 1e-5  # the synced reference: the trained policy
        assert result["eval"]["eval_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert sum(r["reference_local_share"] for r in results) == pytest.approx(1.0)
