"""Which weights of a PEFT model make up its adapter, and under which names PEFT saves them.

A ``PeftModel``'s parameters are named ``base_model.model.<path>.lora_A.default.weight``; PEFT's
``adapter_model.safetensors`` stores them as ``base_model.model.<path>.lora_A.weight`` (the adapter name
removed), plus ``modules_to_save`` copies and, for a resized vocabulary, the embeddings.  Checkpoints
gather only these weights (not the frozen base) and load them back into a wrapped, possibly sharded,
model under its own parameter names.  The mapping is PEFT's own: ``get_peft_model_state_dict`` is run on
a state dict whose values are the model's keys, so whatever it selects and renames is exactly what PEFT
would save.
"""

from __future__ import annotations

from typing import Any

import torch

from trainbridge.modeling.load import is_peft_model


def adapter_key_map(model: Any) -> dict[str, str] | None:
    """``{saved key: model key}`` of ``model``'s active adapter; None when ``model`` is no PeftModel or its
    method keeps its weights outside the model's state dict (prompt learning)."""
    if not is_peft_model(model):
        return None
    from peft import get_peft_model_state_dict

    keys = {key: key for key in model.state_dict().keys()}  # noqa: SIM118 (keys only, no tensor is touched)
    mapping = get_peft_model_state_dict(model, state_dict=keys, adapter_name=model.active_adapter)
    if not all(isinstance(value, str) for value in mapping.values()):
        return None
    return dict(mapping)


def adapter_weight_names(model: Any) -> set[str] | None:
    """The model keys of the adapter's weights (what a checkpoint must gather); None: gather everything."""
    mapping = adapter_key_map(model)
    return None if mapping is None else set(mapping.values())


def adapter_state_for_model(model: Any, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of an ``adapter_model.safetensors`` under ``model``'s own keys.  ``KeyError`` names weights
    that do not fit; ``ValueError`` for a model whose adapter is not a set of its own weights."""
    mapping = adapter_key_map(model)
    if mapping is None:
        raise ValueError(f"{type(model).__name__}: no adapter weights in the model's state dict to load into")
    unknown = sorted(set(saved) - set(mapping))
    missing = sorted(set(mapping) - set(saved))
    if unknown or missing:
        raise KeyError(
            f"adapter weights do not match the model's adapter: not in the model {unknown[:5]}, "
            f"missing from the checkpoint {missing[:5]}"
        )
    return {mapping[key]: value for key, value in saved.items()}
