"""``modeling.saving.without_deepspeed_import``: saving a model imports DeepSpeed only when the process uses it
(transformers' ``save_pretrained`` unwraps through accelerate, which imports ``deepspeed`` when installed)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import pytest
import torch
from accelerate.utils import other

from trainbridge.modeling.saving import without_deepspeed_import


class _NoDeepSpeed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed`` (availability checks still see it installed) but fails the test on loading it."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "deepspeed":
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def exec_module(self, module):
        raise AssertionError(f"imported {module.__name__}")


@pytest.fixture
def deepspeed_unimported(monkeypatch):
    """A process where ``deepspeed`` was never imported, and importing it fails the test."""
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoDeepSpeed(), *sys.meta_path])
    monkeypatch.setattr(other, "is_deepspeed_available", lambda: True)  # installed, as in CI


def test_unwrapping_imports_no_deepspeed_inside_the_scope(deepspeed_unimported):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(AssertionError, match="imported deepspeed"):  # what accelerate does unscoped
        other.extract_model_from_parallel(model)
    with without_deepspeed_import():
        assert other.extract_model_from_parallel(model) is model
        with without_deepspeed_import():  # reentrant
            assert other.extract_model_from_parallel(model) is model
        assert other.extract_model_from_parallel(model) is model
    with pytest.raises(AssertionError):  # restored on exit
        other.extract_model_from_parallel(model)


def test_save_pretrained_imports_no_deepspeed_inside_the_scope(deepspeed_unimported, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(config)
    with without_deepspeed_import():
        model.save_pretrained(tmp_path, state_dict=model.state_dict())
    assert (tmp_path / "model.safetensors").is_file()


def test_deepspeed_in_use_is_still_unwrapped(monkeypatch):
    """Once ``deepspeed`` is imported, accelerate's own check runs unchanged: an engine is unwrapped."""

    class Engine(torch.nn.Module):  # stands for deepspeed.DeepSpeedEngine
        def __init__(self, module):
            super().__init__()
            self.module = module

    fake = type(sys)("deepspeed")
    fake.DeepSpeedEngine = Engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setattr(other, "is_deepspeed_available", lambda: True)
    inner = torch.nn.Linear(2, 2)
    with without_deepspeed_import():
        assert other.extract_model_from_parallel(Engine(inner)) is inner


def test_the_trainer_imports_no_distributed_checkpoint_until_a_dcp_folder_is_used(tmp_path):
    """``from trainbridge import Trainer`` leaves ``torch.distributed.checkpoint`` (and the elastic agent it
    pulls in, ~0.15 s) unimported; a checkpoint folder without ``dcp/`` is read without it; one with ``dcp/``
    imports it (``checkpoint.engine_state``)."""
    import subprocess

    code = (
        "import sys\nfrom pathlib import Path\nfrom trainbridge import Trainer\n"
        "from trainbridge.checkpoint.engine_state import _dcp_holds\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint'))\n"
        "assert not loaded(), loaded()\n"
        f"folder = Path({str(tmp_path)!r})\n"
        "assert not _dcp_holds(folder / 'dcp', 'optimizer') and not loaded(), loaded()\n"
        "(folder / 'dcp').mkdir(); (folder / 'dcp' / '.metadata').write_bytes(b'not a pickle')\n"
        "try:\n    _dcp_holds(folder / 'dcp', 'optimizer')\nexcept Exception as exc:\n    print(type(exc).__name__)\n"
        "assert loaded()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "CheckpointError"  # the metadata was read (and refused) through dcp_io
