"""``trl.decode_step``: one decode step replayed from the model's own submodules gives the model forward's
logits and cache bit for bit (Llama, Qwen2 with biases, Mistral, grouped-query attention, left pads); models
it does not replay exactly are left to their forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
)

from trainbridge.trl import decode_step

SIZES = {
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _model(config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


MODELS = {
    "llama": lambda: _model(LlamaConfig(**SIZES, attention_bias=True)),
    "qwen2": lambda: _model(Qwen2Config(**SIZES, use_sliding_window=False)),
    "mistral": lambda: _model(MistralConfig(**SIZES, sliding_window=None)),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padded", [False, True], ids=["same-length", "left-padded"])
def test_logits_and_cache_are_the_forwards(name: str, padded: bool) -> None:
    model = MODELS[name]()
    step = decode_step.for_model(model)
    assert step is not None
    lengths = [7, 4, 7] if padded else [7, 7, 7]
    mask = torch.tensor([[0] * (7 - n) + [1] * n for n in lengths])
    ids = torch.randint(3, 40, (3, 7)) * mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        for cache in (ours, theirs):
            model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        next_position = torch.tensor(lengths).unsqueeze(1)
        for _ in range(5):
            tokens = torch.randint(3, 40, (3,))
            mask = torch.cat([mask, mask.new_ones(3, 1)], dim=-1)
            expected = model(
                input_ids=tokens[:, None],
                attention_mask=mask if padded else None,
                position_ids=next_position,
                past_key_values=theirs,
                use_cache=True,
            ).logits[:, -1]
            assert torch.equal(step(tokens, next_position, mask if padded else None, ours), expected)
            next_position = next_position + 1
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)


def test_models_it_cannot_replay_exactly_keep_their_forward() -> None:
    config = LlamaConfig(**SIZES)

    class Custom(LlamaForCausalLM):
        pass

    assert decode_step.for_model(_model(config)) is not None
    assert decode_step.for_model(Custom(config)) is None  # a subclass may change the forward
    assert decode_step.for_model(AutoModelForCausalLM.from_config(config, attn_implementation="eager")) is None
    hooked = _model(config)
    hooked.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 2)
    assert decode_step.for_model(hooked) is None
    windowed = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert decode_step.for_model(_model(windowed)) is None
    assert decode_step.for_model(_model(MistralConfig(**SIZES, sliding_window=4))) is None
    assert decode_step.for_model(_model(config).model) is None  # not a causal LM


def test_the_decoder_keeps_the_replay_only_where_its_first_step_matched() -> None:
    model = MODELS["llama"]()
    ids, tokens = torch.randint(3, 40, (2, 5)), torch.randint(3, 40, (2,))
    positions = torch.full((2, 1), 5)
    for replay_differs in (False, True, "raises"):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            reference = copy.deepcopy(cache)
            expected = model(input_ids=tokens[:, None], position_ids=positions, past_key_values=reference).logits[:, -1]
            decoder = decode_step.Decoder(model)
            step = decoder.step
            assert step is not None
            if replay_differs is True:  # as a kernel routed inside the attention would
                decoder.step = lambda *args, step=step: step(*args) + 1e-6
            elif replay_differs:  # as a layout the replay does not know would
                decoder.step = lambda *args: torch.zeros(()).view(-1, 7)
            assert torch.equal(decoder(tokens, positions, None, cache), expected)
            assert (decoder.step is None) == bool(replay_differs)
            for mine, theirs in zip(cache.layers, reference.layers, strict=True):
                assert torch.equal(mine.keys, theirs.keys)
