"""Loading the model and tokenizer a run trains: the one place the builder gets them from.

``load_model`` is the seam for everything that changes *which* model is trained (adapters, model
kwargs, a ``model_init``): extend it here, the builder (``trainbridge.loop.build``) calls it once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainbridge.core.config import TrainingArgs


def load_tokenizer(args: TrainingArgs) -> PreTrainedTokenizerBase:
    """The run's tokenizer: ``AutoTokenizer.from_pretrained(tokenizer_path or model_path)``."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(args.resolved_tokenizer_path)
    return tokenizer


def load_model(args: TrainingArgs) -> PreTrainedModel:
    """The model to train: ``AutoModelForCausalLM.from_pretrained(model_path)`` in float32 (the engine
    casts or autocasts for mixed precision)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    return model
