"""Collators, padding-free support detection and the token-sum loss normalisation on a tiny Llama."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    DataCollatorWithFlattening,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PreTrainedModel,
)

from trainbridge.data import Sample, collate_padded, collate_padding_free, plan_epoch, token_loss_sum
from trainbridge.modeling import model_supports_padding_free, packed_row_tokens

VOCAB = 64


def tiny_llama(attn_implementation: str = "sdpa") -> PreTrainedModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def tiny_opt() -> PreTrainedModel:
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def make_samples(lengths: list[int], seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for length in lengths:
        ids = tuple(rng.randrange(1, VOCAB) for _ in range(length))
        prompt = rng.randrange(0, length // 2 + 1)  # mask a prompt prefix, like chat data
        samples.append(Sample(ids, (-100,) * prompt + ids[prompt:]))
    return samples


SAMPLES = make_samples([5, 9, 3, 12, 7, 4, 10, 6])


def test_padding_free_matches_transformers_flattening_collator() -> None:
    batch = collate_padding_free(SAMPLES[:3])
    reference = DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": list(s.input_ids), "labels": list(s.labels)} for s in SAMPLES[:3]]
    )
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for key in batch:
        assert batch[key].dtype == torch.long
        assert batch[key].device.type == "cpu"
        assert torch.equal(batch[key], reference[key]), key
    assert batch["input_ids"].shape == (1, 17)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]]
    assert [batch["labels"][0, start].item() for start in (0, 5, 14)] == [-100, -100, -100]


def test_padding_free_dummy_micro_batch() -> None:
    batch = collate_padding_free([])
    assert batch["input_ids"].tolist() == [[0]]
    assert batch["labels"].tolist() == [[-100]]
    assert batch["position_ids"].tolist() == [[0]]


def test_padded_collator_right_pads() -> None:
    samples = [Sample((5, 6, 7), (-100, 6, 7)), Sample((8, 9), (8, 9))]
    batch = collate_padded(samples, pad_token_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, 9, -100]]
    dummy = collate_padded([], pad_token_id=3)
    assert dummy["input_ids"].tolist() == [[3]]
    assert dummy["labels"].tolist() == [[-100]]


def test_supports_padding_free_detection() -> None:
    assert model_supports_padding_free(tiny_llama("sdpa"))
    assert model_supports_padding_free(tiny_llama("eager"))
    gpt2 = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    assert model_supports_padding_free(AutoModelForCausalLM.from_config(gpt2))
    # OPT and Bloom build their causal mask without position_ids: packed samples would see each other
    assert not model_supports_padding_free(tiny_opt())
    bloom = BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)
    assert not model_supports_padding_free(AutoModelForCausalLM.from_config(bloom))
    assert not model_supports_padding_free(torch.nn.Linear(2, 2))


def separate_loss(model: PreTrainedModel, samples: list[Sample]) -> torch.Tensor:
    return sum(token_loss_sum(model, collate_padding_free([s]))[0] for s in samples)  # type: ignore[return-value]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_row_equals_samples_run_separately(attn_implementation: str) -> None:
    model = tiny_llama(attn_implementation).eval()
    with torch.no_grad():
        packed, count = token_loss_sum(model, collate_padding_free(SAMPLES))
        padded, padded_count = token_loss_sum(model, collate_padded(SAMPLES, pad_token_id=0))
        separate = separate_loss(model, SAMPLES)
    assert count == padded_count == sum(s.loss_tokens for s in SAMPLES)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, separate, rtol=1e-5, atol=1e-5)


def test_packing_leaks_across_samples_when_unsupported() -> None:
    """The reason for the detection: OPT's packed row differs from its separate runs."""
    model = tiny_opt().eval()
    with torch.no_grad():
        packed, _ = token_loss_sum(model, collate_padding_free(SAMPLES))
        separate = separate_loss(model, SAMPLES)
    assert abs(packed.item() - separate.item()) > 1e-3


def gradients(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_gradients(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_is_independent_of_ranks_and_micro_batches() -> None:
    model = tiny_llama()
    total = sum(s.loss_tokens for s in SAMPLES)

    # one rank, one micro-batch of 8
    loss_sum, count = token_loss_sum(model, collate_padding_free(SAMPLES))
    assert count == total
    (loss_sum / total).backward()
    reference = gradients(model)

    # 2 ranks x 4 samples, simulated: each rank's loss is sum / global_tokens * world_size, and DDP
    # averages the ranks' gradients
    world_size = 2
    rank_grads = []
    for rank in range(world_size):
        loss_sum, _ = token_loss_sum(model, collate_padding_free(SAMPLES[rank * 4 : rank * 4 + 4]))
        (loss_sum / total * world_size).backward()
        rank_grads.append(gradients(model))
    ddp = {name: sum(g[name] for g in rank_grads) / world_size for name in reference}
    assert_same_gradients(ddp, reference)

    # 4 accumulated micro-batches of 2, padded this time
    for start in range(0, 8, 2):
        loss_sum, _ = token_loss_sum(model, collate_padded(SAMPLES[start : start + 2], pad_token_id=0))
        (loss_sum / total).backward()
    assert_same_gradients(gradients(model), reference)


def test_gradient_from_a_planned_step_matches_single_batch() -> None:
    """The step plan's micro-batches (with dummies) on 3 simulated ranks give the one-batch gradient."""
    model = tiny_llama()
    (step,) = plan_epoch(
        [s.length for s in SAMPLES],
        [s.loss_tokens for s in SAMPLES],
        effective_batch_size=8,
        world_size=3,
        max_batch_len=18,
        seed=0,
        epoch=0,
        padded=False,
    ).steps
    assert any(not micro for rank in step.micro_batches for micro in rank), "expected a dummy micro-batch"
    loss_sum, _ = token_loss_sum(model, collate_padding_free(SAMPLES))
    (loss_sum / step.loss_tokens).backward()
    reference = gradients(model)
    rank_grads = []
    for rank_micro_batches in step.micro_batches:
        for micro in rank_micro_batches:
            batch = collate_padding_free([SAMPLES[i] for i in micro])
            loss_sum, _ = token_loss_sum(model, batch)
            (loss_sum / step.loss_tokens * step.world_size).backward()
        rank_grads.append(gradients(model))
    averaged = {name: sum(g[name] for g in rank_grads) / step.world_size for name in reference}
    assert_same_gradients(averaged, reference)


@pytest.mark.parametrize("collate", ["padding_free", "padded"])
def test_dummy_micro_batch_gives_zero_loss_and_gradients_for_every_parameter(collate: str) -> None:
    model = tiny_llama()
    batch = collate_padding_free([]) if collate == "padding_free" else collate_padded([], pad_token_id=0)
    loss_sum, count = token_loss_sum(model, batch)
    assert count == 0
    assert loss_sum.item() == 0.0
    assert loss_sum.requires_grad
    loss_sum.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert torch.count_nonzero(parameter.grad) == 0, name


def test_equal_length_samples_are_stacked_rows_with_the_same_loss() -> None:
    same = make_samples([6, 6, 6], seed=3)
    batch = collate_padding_free(same)
    assert set(batch) == {"input_ids", "labels"}  # plain causal rows: no packed mask path
    assert batch["input_ids"].shape == (3, 6)
    assert batch["labels"][:, 0].tolist() == [-100, -100, -100]
    model = tiny_llama().eval()
    with torch.no_grad():
        stacked, count = token_loss_sum(model, batch)
        separate = separate_loss(model, same)
    assert count == sum(s.loss_tokens for s in same)
    torch.testing.assert_close(stacked, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_capped_rows_give_the_loss_and_gradients_of_one_packed_row(attn_implementation: str) -> None:
    total = sum(s.length for s in SAMPLES)  # 56 tokens, 8 samples
    batch = collate_padding_free(SAMPLES, row_tokens=20)
    rows, width = batch["input_ids"].shape
    assert rows == 3 and width < total
    assert (batch["labels"] != -100).sum() == sum(s.loss_tokens for s in SAMPLES)
    model = tiny_llama(attn_implementation)
    gradients = []
    for layout in (collate_padding_free(SAMPLES), batch):
        loss_sum, count = token_loss_sum(model, layout)
        loss_sum.backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
        assert count == sum(s.loss_tokens for s in SAMPLES)
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-4, atol=1e-5)


def test_row_cap_makes_at_most_one_row_per_sample_and_only_when_exceeded() -> None:
    assert collate_padding_free(SAMPLES, row_tokens=1)["input_ids"].shape[0] == len(SAMPLES)
    assert collate_padding_free(SAMPLES, row_tokens=56)["input_ids"].shape == (1, 56)
    assert packed_row_tokens(tiny_llama("sdpa")) == packed_row_tokens(tiny_llama("eager")) == 512
    assert packed_row_tokens(torch.nn.Linear(1, 1)) is None
