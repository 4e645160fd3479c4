"""trainbridge's ``GRPOTrainer`` under FSDP2 on 2 gloo ranks (``scripts/grpo_fsdp_script.py``): generation with
``transformers`` ``generate`` on the sharded policy (synced forwards), the reference model sharded as the policy
(``trl.trl_loop.ShardedReference``), a checkpoint in the middle of a generation batch."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_checked, torchrun
from trainbridge.trl.generation_buffer import PENDING_FILE

pytestmark = pytest.mark.distributed

pytest.importorskip("trl")

SCRIPT = Path(__file__).parent / "scripts" / "grpo_fsdp_script.py"


def test_grpo_under_fsdp2_shards_the_reference_like_the_policy(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run_checked(torchrun(SCRIPT, str(out)), env, out)
    results = [json.loads((out / f"result-rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert result["global_step"] == 4
        assert result["policy_dtensor"]
        assert result["reference_dtensor"], "each rank holds a whole reference model"
        assert result["reference_local_share"] < 0.75
        assert len(result["kl"]) == 4 and all(math.isfinite(kl) for kl in result["kl"])
        assert result["kl"][-1] > 0  # the policy moved away from the (sharded) reference, which scored it
    assert sum(r["reference_local_share"] for r in results) == pytest.approx(1.0)
    assert results[0]["losses"] == results[1]["losses"]  # logged values are the ranks' reduced ones
    for rank in range(2):  # step 3 is in the middle of a generation batch: its rest is in the checkpoint
        assert (out / "checkpoint-3" / PENDING_FILE.format(rank=rank)).exists()
