"""The native path's processing class (``run_training``: ``modeling.load.load_processing_class``): a model folder's
multimodal processor is loaded whole and saved into checkpoints as Trainer's ``save_pretrained`` saves it; code a
folder names runs only when the user asked (``model_kwargs.trust_remote_code``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers

from tests.run_inputs import as_run
from trainbridge.core.distributed import DistributedEnv
from trainbridge.loop.loop import train
from trainbridge.modeling.load import load_processing_class, load_tokenizer


def _with_processor(tiny_llama: Path, folder: Path) -> Any:
    """A copy of the tiny Llama's folder holding LLaVA's processor (a CLIP image processor, the tokenizer, a chat
    template), built from configs; the processor."""
    shutil.copytree(tiny_llama, folder)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=8,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(folder)
    return processor


def test_a_model_folders_multimodal_processor_is_saved_into_native_checkpoints(
    args_for: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    """A folder with ``processor_config.json``: the run trains on its tokenizer's tokens and each checkpoint holds
    every file the processor's ``save_pretrained`` writes, with the same contents (a tokenizer alone was saved)."""
    processor = _with_processor(tiny_llama, tmp_path / "model")
    processor.save_pretrained(tmp_path / "saved")
    args = args_for(model_path=tmp_path / "model", max_steps=2, save_strategy="steps", save_steps=2)
    result = train(*as_run(args), DistributedEnv(), [])
    assert result.global_step == 2
    checkpoint = tmp_path / "out" / "checkpoint-2"
    for saved in (tmp_path / "saved").iterdir():
        assert (checkpoint / saved.name).read_bytes() == saved.read_bytes(), saved.name
    assert isinstance(transformers.AutoProcessor.from_pretrained(checkpoint), transformers.LlavaProcessor)
    assert isinstance(load_processing_class(args), transformers.LlavaProcessor)
    assert isinstance(load_tokenizer(args), transformers.PreTrainedTokenizerBase)  # what the data is tokenised with


def test_code_a_folders_processor_names_runs_only_when_asked(
    args_for: Any, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``processor_config.json`` mapping ``AutoProcessor`` to a module of the folder: by default the module is never
    imported (transformers' own class the config names loads); with ``model_kwargs.trust_remote_code`` it is."""
    folder = tmp_path / "model"
    _with_processor(tiny_llama, folder)
    marker = tmp_path / "ran"
    (folder / "custom_processing.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlavaProcessor\nclass CustomProcessor(LlavaProcessor):\n    pass\n"
    )
    config = json.loads((folder / "processor_config.json").read_text())
    config["auto_map"] = {"AutoProcessor": "custom_processing.CustomProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(config))
    assert type(load_processing_class(args_for(model_path=folder))) is transformers.LlavaProcessor
    assert not marker.exists()
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    asked = load_processing_class(args_for(model_path=folder, model_kwargs={"trust_remote_code": True}))
    assert type(asked).__name__ == "CustomProcessor" and marker.exists()
