"""QLoRA on 2 gloo ranks: a 4-bit (bitsandbytes NF4) base, ``prepare_model_for_kbit_training``, LoRA on top.

Through ``run_training`` (``model_kwargs.quantization_config``): the loss falls, every checkpoint holds the
adapter and the adapter's optimizer state only (never the quantised base), and a run resumed from
``checkpoint-4`` ends with the same adapter as the straight run; ``merge_adapter_at_end`` merges into the
full-precision base.  These three runs (straight, resumed, FSDP) run in one spawn of two processes
(``qlora_runs``), each a ``run_training`` called in place on both ranks.  Through the ``Trainer`` facade
(``scripts/qlora_script.py``, a 4-bit ``PeftModel`` passed in): under ``torchrun`` on 2 ranks and as
``python script.py`` self-launching 2, side by side with real Trainer on 2 DDP ranks, the script's own model
gets the trained adapter back.
One launch style: ``python script.py`` is re-executed under torchrun at the import, so it runs this same
code (test_script_launch and test_trainer_own_code check the two styles)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import run_on_ranks
from tests.distributed.script_runs import run_script
from tests.distributed.training_fixtures import base_args, make_assets
from tests.run_inputs import run_training
from trainbridge import Callback, TorchrunArgs
from trainbridge.launch.launcher import free_port

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
SCRIPT = Path(__file__).parent / "scripts" / "qlora_script.py"
TWO = TorchrunArgs(nproc_per_node=2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


class RecordPackedWeights(Callback):
    """Each rank writes the type of every 4-bit layer's weight at train end to ``packed-rank{r}.json``."""

    def on_train_end(self, context, **kwargs):
        kinds = [type(m.weight).__name__ for m in context.unwrapped_model.modules() if type(m).__name__ == "Linear4bit"]
        (context.args.ckpt_output_dir / f"packed-rank{context.rank}.json").write_text(json.dumps(kinds))


def four_bit(**kwargs):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, **kwargs
    )


def losses(result) -> list[float]:
    return [r["loss"] for r in map(json.loads, Path(result.metrics_file).read_text().splitlines()) if "loss" in r]


COMMON = dict(
    peft_config=LORA,
    learning_rate=1e-2,
    gradient_checkpointing=True,
    max_steps=8,
    logging_steps=2,
    save_strategy="steps",
    save_steps=4,
)


def _train_every_run(env, assets, root: Path) -> dict:
    """On each rank: the DDP run every test compares with (8 steps, checkpoints at 4 and 8, the merged export at
    the end), the run resumed from its checkpoint-4, and the FSDP run of a base stored as ``bnb_4bit_quant_storage``."""
    quantization = {"quantization_config": four_bit()}
    straight = run_training(
        base_args(assets, root / "straight", merge_adapter_at_end=True, model_kwargs=quantization, **COMMON), TWO
    )
    checkpoint_4 = root / "straight" / "checkpoint-4"
    resumed = run_training(
        base_args(assets, root / "resumed", resume_from_checkpoint=checkpoint_4, model_kwargs=quantization, **COMMON),
        TWO,
    )
    storage = {"quantization_config": four_bit(bnb_4bit_quant_storage=torch.bfloat16)}
    fsdp_args = base_args(
        assets,
        root / "fsdp",
        distributed_backend="fsdp",
        model_kwargs=storage,
        callbacks=[RecordPackedWeights()],
        **COMMON,
    )
    return {"straight": straight, "resumed": resumed, "fsdp": run_training(fsdp_args, TWO)}


@pytest.fixture(scope="module")
def qlora_runs(assets, tmp_path_factory) -> tuple[Path, dict]:
    """The three ``run_training`` runs in one spawn of two processes; their root folder and rank 0's results."""
    root = tmp_path_factory.mktemp("qlora")
    return root, run_on_ranks(_train_every_run, assets, root, timeout=900, collective_timeout_s=600)[0]


def test_qlora_trains_the_adapter_saves_only_the_adapter_and_resumes_exactly(assets, qlora_runs):
    root, runs = qlora_runs
    straight = runs["straight"]
    curve = losses(straight)
    assert len(curve) == 4 and curve[-1] < 0.97 * curve[0], curve

    checkpoint = Path(straight.metrics_file).parent / "checkpoint-8"
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "dcp").exists()
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(adapter)  # moments for the adapter's weights, nothing else
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(assets["model"], quantization_config=four_bit())
    assert PeftModel.from_pretrained(base, checkpoint).get_base_model().is_loaded_in_4bit
    merged = AutoModelForCausalLM.from_pretrained(straight.merged_model)  # into the full-precision base
    assert not getattr(merged, "is_loaded_in_4bit", False) and merged.dtype == torch.float32

    resumed = runs["resumed"]
    assert resumed.resumed_from.endswith("checkpoint-4") and resumed.global_step == 8
    again = load_file(root / "resumed" / "checkpoint-8" / "adapter_model.safetensors")
    assert again.keys() == adapter.keys()
    for key in adapter:
        assert torch.equal(again[key], adapter[key]), key


def test_fsdp2_shards_a_base_stored_as_bnb_4bit_quant_storage_and_trains_as_ddp(qlora_runs):
    """The FSDP-QLoRA recipe: 4-bit weights packed in a float storage are sharded like any frozen weight."""
    root, runs = qlora_runs
    for rank in (0, 1):
        kinds = json.loads((root / "fsdp" / f"packed-rank{rank}.json").read_text())
        assert kinds and set(kinds) == {"DTensor"}, kinds  # every 4-bit weight sharded
    assert losses(runs["fsdp"]) == pytest.approx(losses(runs["straight"]), abs=1e-4)
    adapter = load_file(root / "fsdp" / "checkpoint-8" / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)


def _torchrun(*args: str) -> list[str]:
    port = str(free_port())
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, *args]


@pytest.fixture(scope="module")
def real_trainer(assets, tmp_path_factory) -> dict:
    """The same script under real ``transformers.Trainer`` on 2 DDP ranks (bitsandbytes 0.50 trains 4-bit on CPU)."""
    out = tmp_path_factory.mktemp("qlora-real") / "out"
    return run_script(_torchrun(str(SCRIPT), str(assets["model"]), str(out), "real"), out)


def test_a_qlora_trainer_script_runs_with_its_import_changed(assets, tmp_path, real_trainer):
    out = tmp_path / "out"
    summary = run_script(_torchrun(str(SCRIPT), str(assets["model"]), str(out)), out)
    assert summary["global_step"] == real_trainer["global_step"] == 6
    assert len(summary["losses"]) == len(real_trainer["losses"]) == 3
    assert summary["still_4bit"] and summary["trained_lora_b"]  # the script's model got the adapter back
    assert summary["checkpoints"].keys() == real_trainer["checkpoints"].keys() == {"checkpoint-3", "checkpoint-6"}
    for name, trainer_files in real_trainer["checkpoints"].items():
        files = set(summary["checkpoints"][name])
        assert set(trainer_files) <= files, set(trainer_files) - files  # every file Trainer writes, adapters only
        assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= files, files
        assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files), files
    # same kind of loss as Trainer's (a 4-bit causal LM's token cross-entropy), not bit-equal: data order differs
    assert summary["losses"][0] == pytest.approx(real_trainer["losses"][0], rel=0.1)
