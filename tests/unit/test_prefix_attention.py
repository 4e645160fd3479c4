"""``modeling.prefix_attention``: rows of a shared prompt and its completions' segments attended over the scores
each segment sees (the prompt and itself) give the full-mask forward's values and gradients, without a call over
the whole row, gradient checkpointing included; the model stays sdpa for everything else (the decode replay
included); eager attention is left as it is."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainbridge.modeling import prefix_attention
from trainbridge.trl import decode_step, shared_prefix

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


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "gradient-checkpointing"])
def test_values_and_gradients_equal_the_full_masks_without_a_call_over_the_whole_row(
    monkeypatch: pytest.MonkeyPatch, checkpointed: bool
) -> None:
    """Under gradient checkpointing (trl's default) the backward recomputes each layer with the same layout."""
    model, packed = _model(), _packed()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
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
    assert prefix_attention.prefix_layout(model, packed.attention_mask, packed.layout)
    ours = _scored(model, packed)
    grads = torch.autograd.grad((ours * weights).sum(), params)
    assert query_lengths and max(query_lengths) < packed.input_ids.shape[1]  # never the whole row
    assert len(query_lengths) == 2 * 3 * 2 * (2 if checkpointed else 1)  # 2 calls x 3 rows x 2 layers, recomputed
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_model_stays_sdpa_for_every_other_call() -> None:
    """Switched once to ``PREFIX_SDPA``: a padded batch's logits are sdpa's bit for bit and the decode replay
    still applies; eager attention is left as it is."""
    model, packed = _model(), _packed()
    ids = torch.randint(3, 40, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        assert prefix_attention.prefix_layout(model, packed.attention_mask, packed.layout)
        assert model.config._attn_implementation == prefix_attention.PREFIX_SDPA
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
    assert decode_step.for_model(model) is not None
    eager = _model("eager")
    assert not prefix_attention.prefix_layout(eager, packed.attention_mask, packed.layout)
    assert eager.config._attn_implementation == "eager"
