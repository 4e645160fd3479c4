"""``trl.sampling``: each distinct prompt prefilled once, then the decode loop, samples what ``generate`` samples
with trl's generation config, from the same random stream; other configs are left to ``generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trainbridge.trl import sampling

PAD, EOS = 0, 2


def _config(**settings: Any) -> GenerationConfig:
    """trl's generation config (``GRPOTrainer.__init__``) with ``settings`` over its defaults."""
    base = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
    return GenerationConfig(
        max_new_tokens=12, pad_token_id=PAD, eos_token_id=[EOS], cache_implementation=None, disable_compile=True,
        **{**base, **settings},
    )  # fmt: skip


def _generate(model: torch.nn.Module, prompts: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    """trl's path: left-padded prompts through ``generate``, each completion through its first EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in out]


@pytest.mark.parametrize(
    "settings", [{}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}, {"min_p": 0.05}], ids=["trl", "warped", "min-p"]
)
def test_samples_what_generate_samples(tiny_llama: Path, settings: dict[str, Any]) -> None:
    """One prompt repeated, and two prompts of different lengths interleaved (left pads): the same completions
    as ``generate`` at the same seed, and the random stream left where ``generate`` leaves it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.generation_config.eos_token_id = EOS
    config = _config(**settings)
    assert sampling.supported(config, model.generation_config)
    short, long = [1, 5, 9, 11], [1, 7, 8, 9, 10, 12, 13, 5]
    for prompts in ([long] * 6, [short, long] * 3):
        with torch.no_grad():
            torch.manual_seed(7)
            expected, after = _generate(model, prompts, config), torch.rand(2)
            torch.manual_seed(7)
            ours = sampling.sample_completions(model, prompts, config, PAD, [EOS])
            assert ours == expected
            assert torch.equal(torch.rand(2), after)


def test_other_settings_are_left_to_generate() -> None:
    """Beams, a repetition penalty, greedy decoding, n-gram blocking or a model config's own processor: not
    supported (trl's ``generate`` runs)."""
    assert sampling.supported(_config(), GenerationConfig(output_attentions=False, num_beams=1))
    for config in (_config(repetition_penalty=1.2), _config(do_sample=False), _config(no_repeat_ngram_size=2)):
        assert not sampling.supported(config, None)
    assert not sampling.supported(_config(), GenerationConfig(num_beams=4))
    assert not sampling.supported(_config(), GenerationConfig(bad_words_ids=[[5]]))
