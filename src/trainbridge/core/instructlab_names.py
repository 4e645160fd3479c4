"""instructlab-training's ``TrainingArgs`` field names that trainbridge spells differently.

``TrainingArgs`` rejects unknown fields; for these names the error says what to write instead, so an
instructlab configuration ports by renaming (``run_training`` also takes instructlab's argument order).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INSTRUCTLAB_FIELDS: dict[str, str] = {
    "random_seed": "seed=<int>",
    "is_padding_free": "packing='padding_free' (True) or packing='padded' (False); 'auto' picks for the model",
    "keep_last_checkpoint_only": "save_total_limit=1",
    "lora": "peft_config=peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])",
    "fsdp_options": "distributed_backend='fsdp' (FSDP2; sharding follows the model's decoder layers)",
    "deepspeed_options": "distributed_backend='deepspeed' and deepspeed_zero_stage=1|2|3",
    "disable_flash_attn": "model_kwargs={'attn_implementation': 'sdpa'} (or 'eager')",
    "accelerate_full_state_at_epoch": "checkpoint_at_epoch=True (every checkpoint holds the full training state)",
    "data_output_dir": "nothing: data is tokenised by the workers (no separate processing step); remove it",
    "process_data": "nothing: data is tokenised by the workers; remove it",
    "chat_tmpl_path": "tokenizer_path=<folder whose tokenizer carries the chat template>",
    "use_dolomite": "nothing: models are loaded with transformers; remove it",
    "use_liger": "nothing: the loss is computed by trainbridge (token-level cross entropy); remove it",
    "mock_data": "nothing: give a data_path; remove it",
    "mock_data_len": "nothing: give a data_path; remove it",
    "num_warmup_steps": "warmup_steps=<int>",
}
"""instructlab field -> what to set in ``trainbridge.TrainingArgs`` instead."""


def check_instructlab_names(data: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming trainbridge's equivalents when ``data`` uses instructlab field names."""
    found = [name for name in data if name in INSTRUCTLAB_FIELDS]
    if found:
        hints = "; ".join(f"{name}: use {INSTRUCTLAB_FIELDS[name]}" for name in found)
        raise ValueError(f"instructlab field name(s) {found} are not TrainingArgs fields here. {hints}")
