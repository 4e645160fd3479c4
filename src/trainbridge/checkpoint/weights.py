"""A checkpoint's model weights: written in Hugging Face layout, read back into a live engine.

The HF-layout files (``model.safetensors`` or shards + index, ``config.json``; a PEFT model's adapter
files instead) are what ``from_pretrained`` loads.  At resume the model's own weights come from the
checkpoint's ``dcp/`` when it keeps them there (``engine_state.load_model_state``: each rank reads its
shards, in the training dtype), else from the HF-layout files, read in full on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from trainbridge.checkpoint.engine_state import load_model_state
from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.layout import (
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    SAFE_WEIGHTS_FILE,
    SAFE_WEIGHTS_INDEX_FILE,
)
from trainbridge.checkpoint.weights_dtype import cast_for_export
from trainbridge.modeling.adapter_state import adapter_state_for_model
from trainbridge.modeling.load import is_peft_model

if TYPE_CHECKING:
    from trainbridge.parallel.engine import TrainingEngine


def write_model_files(
    model: Any, folder: Path, state: dict[str, torch.Tensor], weights_dtype: torch.dtype | None
) -> None:
    """The model's full ``state`` in Hugging Face layout into ``folder`` (rank 0): in ``weights_dtype``
    when given, except a PEFT adapter, written in its training dtype."""
    if not is_peft_model(model):
        state = without_tied_copies(state, model)
    if weights_dtype is not None and not is_peft_model(model):
        save_pretrained_as(model, folder, cast_for_export(state, weights_dtype), weights_dtype)
    else:
        model.save_pretrained(folder, state_dict=state)


def without_tied_copies(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` without the other names of a tied parameter (``lm_head.weight`` tied to the embeddings, a masked
    LM's decoder weight and bias), its first name kept: what ``save_pretrained`` writes from the live model, whose
    tied names share one tensor.  A gathered full state dict holds a copy per name, which it would write twice
    (the inverse of ``fill_tied_weights``)."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    dropped = set()
    for names in aliases.values():
        present = [n for n in names if n in state]
        dropped.update(present[1:])
    return {name: value for name, value in state.items() if name not in dropped} if dropped else state


def save_pretrained_as(model: Any, folder: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """``model.save_pretrained(folder, state_dict=state)`` with ``config.json`` recording ``dtype`` (the dtype
    of ``state``; ``save_pretrained`` would record the live parameters' dtype), so that
    ``from_pretrained(folder, dtype="auto")`` loads it as written."""
    model.save_pretrained(folder, state_dict=state)
    config_file = folder / CONFIG_FILE
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_safetensors_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The full state dict saved by ``save_pretrained`` in ``directory`` (single file or sharded), on CPU."""
    index = directory / SAFE_WEIGHTS_INDEX_FILE
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in shard_names:
            state.update(load_file(str(directory / name), device="cpu"))
        return state
    single = directory / SAFE_WEIGHTS_FILE
    if not single.is_file():
        raise CheckpointError(f"{str(directory)!r} has neither {SAFE_WEIGHTS_FILE} nor {SAFE_WEIGHTS_INDEX_FILE}")
    return load_file(str(single), device="cpu")


def fill_tied_weights(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Add the names ``save_pretrained`` left out for tied parameters (e.g. ``lm_head.weight`` tied to the
    embeddings), taking the value saved under another name of the same parameter."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        present = [n for n in names if n in state]
        if present:
            for name in names:
                state.setdefault(name, state[present[0]])


def load_model_weights(path: Path, engine: TrainingEngine) -> None:
    """Load only the model weights of checkpoint ``path`` into the live model on every rank (collective):
    the full model, or for a PEFT model its adapter (the frozen base is left as it is).  The model's own
    weights from ``dcp/`` when the checkpoint holds them (each rank reading its shards, in the training
    dtype: exact even beside a bf16 export), else the HF-layout weights, read in full on every rank."""
    path = Path(path)
    adapter_file = path / ADAPTER_WEIGHTS_FILE
    if is_peft_model(engine.unwrapped) != adapter_file.is_file():
        raise CheckpointError(
            f"{str(path)!r} holds {'a PEFT adapter' if adapter_file.is_file() else 'a full model'} but the run "
            f"trains {'a PEFT model' if is_peft_model(engine.unwrapped) else 'a full model'}; resume or restore "
            "from a checkpoint of the same kind of run"
        )
    if load_model_state(engine, path):
        return
    if adapter_file.is_file():
        saved = load_file(str(adapter_file), device="cpu")
        engine.load_model_state_dict(adapter_state_for_model(engine.unwrapped, saved), strict=False)
        return
    state = read_safetensors_weights(path)
    fill_tied_weights(state, engine.unwrapped)
    engine.load_model_state_dict(state)
