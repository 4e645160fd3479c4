"""A checkpoint of a model with tied parameters holds each once, as ``save_pretrained`` of the live model writes
it (issue 29 failure 6): a masked LM's decoder weight and bias, tied to the embeddings and to the head's bias."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import BertForMaskedLM

from trainbridge.checkpoint.weights import fill_tied_weights, write_model_files
from trainbridge.demos.tiny_model import tiny_bert_config


def _names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return sorted(handle.keys())


def test_a_gathered_state_of_tied_parameters_is_written_as_save_pretrained_writes_it(tmp_path: Path) -> None:
    model = BertForMaskedLM(tiny_bert_config())
    model.save_pretrained(tmp_path / "live")
    gathered = {name: tensor.clone() for name, tensor in model.state_dict().items()}  # a copy per name
    for dtype in (None, torch.bfloat16):
        write_model_files(model, tmp_path / str(dtype), gathered, dtype)
        assert _names(tmp_path / str(dtype)) == _names(tmp_path / "live")
    assert "cls.predictions.decoder.weight" not in _names(tmp_path / "live")
    # read back, the tied names are filled in again
    state = {name: tensor for name, tensor in gathered.items() if name in _names(tmp_path / "live")}
    fill_tied_weights(state, model)
    assert sorted(state) == sorted(gathered)
