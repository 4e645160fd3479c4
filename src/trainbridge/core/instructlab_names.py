"""instructlab-training's ``TrainingArgs`` field names that trainbridge spells differently.

An instructlab configuration (its README's ``TrainingArgs(...)``, a saved config dict) ports with its
import changed: a field with an exact equivalent here is translated (``random_seed`` -> ``seed``...) with
one ``InstructlabNameWarning`` naming ours, a field that has no meaning here (``data_output_dir``: no
separate data-processing step) is dropped with a warning, and a field that needs a decision (``lora``,
``deepspeed_options``, ``mock_data``...) fails, the error saying what to write instead.  Where instructlab's
field and ours are both given, ours must be left out (an error says so).  ``run_training`` also takes
instructlab's argument order and keyword ``torch_args``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


class InstructlabNameWarning(UserWarning):
    """An instructlab-training field name was translated to trainbridge's (or dropped as meaningless here)."""


def _packing(value: Any) -> dict[str, Any]:
    return {"packing": "padding_free" if value else "padded"}


TRANSLATED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "random_seed": lambda v: {"seed": v},
    "num_warmup_steps": lambda v: {"warmup_steps": v},
    "is_padding_free": _packing,
    "keep_last_checkpoint_only": lambda v: {"save_total_limit": 1} if v else {},
    "data_output_dir": lambda v: {},  # tokenised by the workers into the data cache: no processing step
    "process_data": lambda v: {},
}
"""instructlab field -> the trainbridge fields it becomes ({} : dropped, it has no meaning here)."""

INSTRUCTLAB_FIELDS: dict[str, str] = {
    "random_seed": "seed=<int>",
    "num_warmup_steps": "warmup_steps=<int>",
    "is_padding_free": "packing='padding_free' (True) or packing='padded' (False); 'auto' picks for the model",
    "keep_last_checkpoint_only": "save_total_limit=1",
    "data_output_dir": "nothing: data is tokenised by the workers (no separate processing step); remove it",
    "process_data": "nothing: data is tokenised by the workers; remove it",
    "lora": "peft_config=peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])",
    "fsdp_options": "distributed_backend='fsdp' (FSDP2; sharding follows the model's decoder layers)",
    "deepspeed_options": "distributed_backend='deepspeed' and deepspeed_zero_stage=1|2|3",
    "disable_flash_attn": "model_kwargs={'attn_implementation': 'sdpa'} (or 'eager')",
    "accelerate_full_state_at_epoch": "checkpoint_at_epoch=True (every checkpoint holds the full training state)",
    "chat_tmpl_path": "tokenizer_path=<folder whose tokenizer carries the chat template>",
    "use_dolomite": "nothing: models are loaded with transformers; remove it",
    "use_liger": "nothing: the loss is computed by trainbridge (token-level cross entropy); remove it",
    "mock_data": "nothing: give a data_path; remove it",
    "mock_data_len": "nothing: give a data_path; remove it",
}
"""instructlab field -> what to set in ``trainbridge.TrainingArgs`` instead (the warning's or error's text)."""


def translate_instructlab_names(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with instructlab's names translated (see the module doc); raises ``ValueError`` naming our
    equivalents for the names that cannot be translated, or when a translated field is also given as ours."""
    out = dict(data)
    untranslatable = [name for name in out if name in INSTRUCTLAB_FIELDS and name not in TRANSLATED]
    if untranslatable:
        hints = "; ".join(f"{name}: use {INSTRUCTLAB_FIELDS[name]}" for name in untranslatable)
        raise ValueError(f"instructlab field name(s) {untranslatable} are not TrainingArgs fields here. {hints}")
    for name in [n for n in out if n in TRANSLATED]:
        fields = TRANSLATED[name](out.pop(name))
        clash = sorted(f for f in fields if f in out)
        if clash:
            raise ValueError(f"{name} (instructlab's name) and {', '.join(clash)} (trainbridge's) are both given; "
                             f"keep only {', '.join(clash)}")
        out.update(fields)
        hint = INSTRUCTLAB_FIELDS[name]
        message = (f"{name} is instructlab-training's name: use {hint}" if fields else
                   f"{name} (instructlab-training) is ignored here: {hint.removeprefix('nothing: ')}")
        warnings.warn(message, InstructlabNameWarning, stacklevel=2)
    return out

