"""LoRA through ``TrainingArgs.peft_config`` on 2 gloo ranks, for every backend (ddp, fsdp, ZeRO-2, ZeRO-3).

Per backend, two runs: a straight one (checkpoints at steps 4 and 8) and one resumed from its
``checkpoint-4`` into another folder (these are the tier's run_training runs of DeepSpeed).  All eight run in
one torchrun launch of ``scripts/lora_script.py`` (``lora_runs``), one after another, each a ``run_training``
called in place on both ranks, as a ``torchrun script.py`` calling it would (the launched workers' path is
the rest of the tier's).  Checked: the launch exits 0; the loss falls; both ranks fire the same events; the
frozen base weights at the end are bit-identical to the model on disk (fsdp with gradient checkpointing on);
every checkpoint is an adapter in PEFT's layout that ``PeftModel.from_pretrained`` loads; the resumed run ends
with the same adapter as the straight one.  The ddp case also checks ``load_best_model_at_end`` (the best
adapter, made the step-4 one by ``greater_is_better=True``, is what is merged), the merged
export (``AutoModelForCausalLM``, same logits as base + adapter) and that a ``TrainerCallback`` gets the
PEFT model as ``model`` and can ``save_pretrained`` it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.distributed.script_runs import run_checked, torchrun
from tests.distributed.training_fixtures import read_rank_files
from trainbridge import RunResult

pytestmark = pytest.mark.distributed


def losses(result) -> list[float]:
    return [r["loss"] for r in map(json.loads, Path(result.metrics_file).read_text().splitlines()) if "loss" in r]


def assert_base_untouched(model_dir: Path, out: Path) -> None:
    original = load_file(model_dir / "model.safetensors")
    frozen = load_file(out / "frozen.safetensors")
    assert set(frozen) == set(original), set(frozen) ^ set(original)
    for name, value in original.items():
        assert torch.equal(frozen[name], value), f"frozen base weight {name} changed"


def load_adapter(model_dir: Path, checkpoint: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), checkpoint)


SCRIPT = Path(__file__).parent / "scripts" / "lora_script.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = ["ddp", "fsdp", *(["deepspeed-2", "deepspeed-3"] if importlib.util.find_spec("deepspeed") else [])]


@pytest.fixture(scope="module")
def lora_runs(assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of ``CASES`` trained in one torchrun launch (``scripts/lora_script.py``); their root folder."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    command = torchrun(SCRIPT, str(assets["model"]), str(assets["train"]), str(assets["val"]), str(root), *CASES)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    run_checked(command, {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}, root)
    return root


@pytest.mark.timeout(1500)  # the set-up trains every case (lora_runs)
@pytest.mark.parametrize("backend, zero_stage", [("ddp", 2), ("fsdp", 2), ("deepspeed", 2), ("deepspeed", 3)])
def test_lora_trains_only_the_adapter_saves_peft_checkpoints_and_resumes_exactly(
    assets, lora_runs, backend, zero_stage
):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    ddp = backend == "ddp"
    folder = lora_runs / (backend if backend != "deepspeed" else f"deepspeed-{zero_stage}")
    straight_out, resumed_out = folder / "straight", folder / "resumed"
    straight, resumed = (RunResult.read(folder / f"{name}.json") for name in ("straight", "resumed"))

    curve = losses(straight)
    assert len(curve) == 4 and curve[-1] < 0.97 * curve[0], curve
    assert_base_untouched(assets["model"], straight_out)
    rank0, rank1 = read_rank_files(straight_out, "events")  # every backend through run_training: same events
    assert rank0["counts"] == rank1["counts"] and rank0["steps"] == list(range(1, 9))
    for step in (4, 8):
        checkpoint = straight_out / f"checkpoint-{step}"
        assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "adapter_config.json").is_file()
        assert not (checkpoint / "model.safetensors").exists()
    adapter = load_file(straight_out / "checkpoint-8" / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    assert any(value.abs().sum() > 0 for key, value in adapter.items() if "lora_B" in key)  # trained (B starts at 0)
    peft_model = load_adapter(assets["model"], straight_out / "checkpoint-8")
    assert sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) > 0

    assert resumed.resumed_from.endswith("checkpoint-4") and resumed.global_step == 8
    again = load_file(resumed_out / "checkpoint-8" / "adapter_model.safetensors")
    assert again.keys() == adapter.keys()
    for key in adapter:
        assert (again[key] - adapter[key]).abs().max().item() < 1e-6, key

    if ddp:
        assert (straight_out / "hf-callback-model-type").read_text() == "PeftModelForCausalLM"
        assert (straight_out / "hf-callback-adapter" / "adapter_model.safetensors").is_file()
        assert straight.best_checkpoint == str(straight_out / "checkpoint-4")
        assert straight.merged_model == str(straight_out / "merged")
        merged = AutoModelForCausalLM.from_pretrained(straight.merged_model)
        best = load_adapter(assets["model"], Path(straight.best_checkpoint)).eval()
        ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
        with torch.no_grad():
            expected = best(input_ids=ids).logits
            assert torch.allclose(merged.eval()(input_ids=ids).logits, expected, atol=1e-4)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "peft_dora" / "dora_finetuning.py"


def test_public_dora_example_runs_through_peft_config(assets, tmp_path):
    """PEFT's dora_finetuning example (ported: its command line and LoraConfig, use_dora on), 2 ranks."""
    import subprocess
    import sys

    pytest.importorskip("peft")
    command = [
        sys.executable,
        str(EXAMPLE),
        "--base_model",
        str(assets["model"]),
        "--data_path",
        str(assets["train"]),
        "--output_dir",
        str(tmp_path / "out"),
        "--use_dora",
        "--device",
        "cpu",
        "--nproc_per_node",
        "2",
        "--max_steps",
        "4",
        "--cutoff_len",
        "32",
        "--val_set_size",
        "16",
        "--eval_step",
        "2",
        "--save_step",
        "4",
        "--learning_rate",
        "1e-2",
        "--lora_dropout",
        "0.0",
        "--merge",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == 4 and summary["final_eval_loss"] is not None
    checkpoint = Path(summary["checkpoints"][-1])
    assert json.loads((checkpoint / "adapter_config.json").read_text())["use_dora"] is True
    assert any("lora_magnitude_vector" in key for key in load_file(checkpoint / "adapter_model.safetensors"))
    assert load_adapter(assets["model"], checkpoint).peft_config["default"].use_dora
    AutoModelForCausalLM.from_pretrained(summary["merged_model"])
