"""``modeling.prefix_attention``: rows of a shared prompt and its completions' segments attended over the scores
each segment sees (the prompt and itself) give the full-mask forward's values and gradients, without a call over
the whole row; it stands aside where it cannot apply (eager attention, gradient checkpointing)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainbridge.modeling import prefix_attention
from trainbridge.trl import shared_prefix

COMPLETION = 6


def _model(implementation: str = "sdpa") -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation)


def _packed() -> shared_prefix.PromptGroups:
    """Three prompts of 7, 3 and 5 tokens (left pads), completions of 0..6 tokens (right pads), rows of a prompt
    not adjacent: three rows of different lengths and prefixes."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (n,), generator=generator).tolist() for n in (7, 3, 5)]
    completions = [torch.randint(4, 40, (n,), generator=generator).tolist() for n in (6, 1, 0, 4, 6, 2, 5, 3)]
    width = 7
    ids, mask = [], []
    for index, completion in enumerate(completions):
        prompt = prompts[index % 3]
        left, right = width - len(prompt), COMPLETION - len(completion)
        ids.append([0] * left + prompt + completion + [0] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
    packed = shared_prefix.pack_groups(torch.tensor(ids), torch.tensor(mask), COMPLETION)
    assert packed is not None
    return packed


def _scored(model: Any, packed: shared_prefix.PromptGroups) -> torch.Tensor:
    """The logits of every scored position (the completion tokens), in the packed layout."""
    logits = model(
        input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids
    ).logits
    return logits[packed.groups, packed.shifted]


def test_values_and_gradients_equal_the_full_masks_without_a_call_over_the_whole_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, packed = _model(), _packed()
    expected = _scored(model, packed)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    expected_grads = torch.autograd.grad((expected * weights).sum(), params)
    query_lengths: list[int] = []
    sdpa = prefix_attention.sdpa_attention_forward

    def spy(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        query_lengths.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(prefix_attention, "sdpa_attention_forward", spy)
    with prefix_attention.prefix_layout(model, packed.attention_mask, packed.layout) as applied:
        ours = _scored(model, packed)
    assert applied and model.config._attn_implementation == "sdpa"  # switched back
    assert query_lengths and max(query_lengths) < packed.input_ids.shape[1]  # never the whole row
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad((ours * weights).sum(), params), expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_it_stands_aside_for_eager_attention_and_for_a_checkpointed_backward() -> None:
    packed = _packed()
    with prefix_attention.prefix_layout(_model("eager"), packed.attention_mask, packed.layout) as applied:
        assert not applied
    model = _model()
    model.gradient_checkpointing_enable()
    model.train()
    with prefix_attention.prefix_layout(model, packed.attention_mask, packed.layout) as applied:
        assert not applied  # the recomputation in the backward would run outside the layout
    with torch.no_grad(), prefix_attention.prefix_layout(model, packed.attention_mask, packed.layout) as applied:
        assert applied  # no backward: old-policy and reference log-probs
