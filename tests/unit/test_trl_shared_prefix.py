"""``trl.shared_prefix``: completions scored with each prompt run once give trl's padded forward's log-probs,
entropies and gradients, and the GRPO/RLOO drop-ins take that path on a text model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trainbridge.trl import shared_prefix

COMPLETION = 6


def _batch(prompts: list[list[int]], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """trl's layout: prompts left-padded, completions right-padded to ``COMPLETION``, masks beside them."""
    width = max(len(p) for p in prompts)
    ids, mask = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        left, right = width - len(prompt), COMPLETION - len(completion)
        ids.append([0] * left + prompt + completion + [0] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
    return torch.tensor(ids), torch.tensor(mask)


def _trl_scores(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """trl's own ``_get_per_token_logps_and_entropies`` forward (one padded batch)."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-COMPLETION] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -COMPLETION:], out.entropy[:, -COMPLETION:]


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


@pytest.mark.parametrize("shared", [True, False], ids=["prompts-repeated", "prompts-distinct"])
def test_values_and_gradients_equal_trls_padded_forward(model: torch.nn.Module, shared: bool) -> None:
    """Prompts of different lengths (left pads), completions of 0..6 tokens (right pads), rows of a prompt not
    adjacent: the same log-probs and entropies (zero on pads) and the same gradients."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (n,), generator=generator).tolist() for n in (7, 3, 5)]
    lengths = [6, 1, 0, 4, 6, 2, 5, 3]
    rows = [prompts[i % 3] if shared else [*prompts[i % 3], i + 4] for i in range(8)]
    completions = [torch.randint(4, 40, (n,), generator=generator).tolist() for n in lengths]
    ids, mask = _batch(rows, completions)
    packed = shared_prefix.pack_groups(ids, mask, COMPLETION)
    assert packed is not None and packed.input_ids.size(0) == (3 if shared else 8)
    expected, expected_entropy = _trl_scores(model, ids, mask)
    logps, entropy = shared_prefix.shared_prefix_logps(model, packed, compute_entropy=True)
    assert entropy is not None
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-5)
    assert (logps[mask[:, -COMPLETION:] == 0] == 0).all()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(expected.shape, generator=generator)
    theirs = torch.autograd.grad((expected * weights).sum(), params)
    ours = torch.autograd.grad((logps * weights).sum(), params)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_masks_not_in_trls_form_are_left_to_trl() -> None:
    """A zero inside a completion's mask (not one run of ones) or an empty prompt: no layout (trl's forward)."""
    ids, mask = _batch([[5, 6], [5, 6]], [[7, 8, 9], [7]])
    assert shared_prefix.pack_groups(ids, mask, COMPLETION) is not None
    holed = mask.clone()
    holed[0, -COMPLETION + 1] = 0
    assert shared_prefix.pack_groups(ids, holed, COMPLETION) is None
    empty = mask.clone()
    empty[1, :-COMPLETION] = 0
    assert shared_prefix.pack_groups(ids, empty, COMPLETION) is None


def test_applies_to_sdpa_and_eager_text_models_only(tiny_llama: Path) -> None:
    """The trainer tests' tiny Llama takes the layout under sdpa and eager (so test_trl_online_rl compares this
    path with trl's); a sliding window shorter than the batch, or flex attention, does not."""
    for implementation in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=implementation)
        assert shared_prefix.applies(model, 64)
    model.config.sliding_window = 16
    assert not shared_prefix.applies(model, 64) and shared_prefix.applies(model, 16)
    assert not shared_prefix.applies(torch.nn.Linear(2, 2), 64)
