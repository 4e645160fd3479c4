"""The per-sample sdpa attention for padding-free rows: same loss and gradients as transformers' sdpa,
switched on only where exact, transparent for padded batches, generation and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, PreTrainedModel

from tests.unit.test_collate_loss import VOCAB, make_samples, tiny_llama, tiny_opt
from trainbridge.data import collate_padded, collate_padding_free, token_loss_sum
from trainbridge.modeling import VARLEN_SDPA, enable_varlen_sdpa, packed_row_tokens

LENGTHS = [9, 3, 14, 6, 11]


def loss_and_grads(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss_sum, _ = token_loss_sum(model, batch)
    loss_sum.backward()
    return loss_sum.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same(a: tuple[float, list[torch.Tensor]], b: tuple[float, list[torch.Tensor]]) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    assert len(a[1]) == len(b[1])
    for grad_a, grad_b in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(grad_a, grad_b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("row_tokens", [None, 20], ids=["one-row", "balanced-rows"])
def test_packed_rows_give_sdpa_loss_and_gradients(row_tokens: int | None) -> None:
    """The layout the loop trains on: one packed row (or rows padded with a dummy sequence), GQA heads."""
    batch = collate_padding_free(make_samples(LENGTHS), row_tokens=row_tokens)
    model = tiny_llama("sdpa")
    reference = loss_and_grads(model, batch)
    assert enable_varlen_sdpa(model, max_seq_len=64)
    assert model.config._attn_implementation == VARLEN_SDPA
    assert_same(loss_and_grads(model, batch), reference)


def test_equals_each_sample_run_alone() -> None:
    model = tiny_llama("sdpa")
    assert enable_varlen_sdpa(model, max_seq_len=64)
    samples = make_samples(LENGTHS)
    with torch.no_grad():
        packed, _ = token_loss_sum(model, collate_padding_free(samples))
        alone = sum(token_loss_sum(model, collate_padding_free([s]))[0] for s in samples)
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5)


def test_padded_batches_and_stacked_rows_keep_sdpa_results() -> None:
    """An attention mask goes through transformers' sdpa path; equal-length ``[k, L]`` rows run plain causal."""
    model = tiny_llama("sdpa")
    padded = collate_padded(make_samples(LENGTHS), pad_token_id=0)
    stacked = collate_padding_free(make_samples([8, 8, 8]))
    assert "position_ids" not in stacked
    references = [loss_and_grads(model, batch) for batch in (padded, stacked)]
    assert enable_varlen_sdpa(model, max_seq_len=64)
    for batch, reference in zip((padded, stacked), references, strict=True):
        assert_same(loss_and_grads(model, batch), reference)


def test_generation_with_kv_cache_is_unchanged() -> None:
    """A callback that calls ``generate`` (KV cache, left padding) gets what sdpa gives."""
    model = tiny_llama("sdpa").eval()
    prompts = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attention_mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    reference = model.generate(prompts, attention_mask=attention_mask, **kwargs)
    assert enable_varlen_sdpa(model, max_seq_len=64)
    assert torch.equal(model.generate(prompts, attention_mask=attention_mask, **kwargs), reference)


def test_loop_drops_the_row_cap_once_enabled() -> None:
    model = tiny_llama("sdpa")
    assert packed_row_tokens(model) is not None
    assert enable_varlen_sdpa(model, max_seq_len=64)
    assert packed_row_tokens(model) is None


def test_not_enabled_where_it_would_not_be_exact_or_needed() -> None:
    assert not enable_varlen_sdpa(tiny_llama("eager"), max_seq_len=64)
    assert not enable_varlen_sdpa(tiny_opt(), max_seq_len=64)  # OPT does not keep packed samples apart
    torch.manual_seed(0)
    mistral = AutoModelForCausalLM.from_config(
        MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, sliding_window=16),
        attn_implementation="sdpa",
    )
    assert not enable_varlen_sdpa(mistral, max_seq_len=64)  # a 16-token window acts within 64 tokens
    assert mistral.config._attn_implementation == "sdpa"
    assert enable_varlen_sdpa(mistral, max_seq_len=16)  # ... and not within 16


def test_a_probe_mismatch_keeps_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainbridge.modeling.varlen_attention as varlen

    monkeypatch.setattr(varlen, "_PROBE_SEGMENTS", (7, 5, 9))
    original = varlen._segments.bounds

    def wrong_bounds(position_ids: torch.Tensor) -> list[list[int]]:  # attend across samples
        return [[0, position_ids.shape[1]] for _ in range(position_ids.shape[0])]

    monkeypatch.setattr(varlen._segments, "bounds", wrong_bounds)
    model = tiny_llama("sdpa")
    assert not enable_varlen_sdpa(model, max_seq_len=64)
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(varlen._segments, "bounds", original)


def test_checkpoint_config_does_not_name_it(tmp_path: Path) -> None:
    model = tiny_llama("sdpa")
    assert enable_varlen_sdpa(model, max_seq_len=64)
    model.save_pretrained(tmp_path)
    assert VARLEN_SDPA not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert reloaded.config._attn_implementation == "sdpa"


def test_sample_boundaries_are_computed_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer shares the boundaries of one forward (on CUDA each computation is a host sync),
    also for stacked equal-length rows, where the model's own position_ids are one shared row."""
    from trainbridge.modeling import varlen_attention

    computed: list[tuple[int, ...]] = []
    original = varlen_attention._SegmentCache.bounds

    class CountingCache(varlen_attention._SegmentCache):
        def bounds(self, position_ids: torch.Tensor) -> list[list[int]]:
            if not (self._ref is not None and self._ref() is position_ids):
                computed.append(tuple(position_ids.shape))
            return original(self, position_ids)

    monkeypatch.setattr(varlen_attention, "_segments", CountingCache())
    model = tiny_llama("sdpa")
    assert model.config.num_hidden_layers > 1
    stacked = collate_padding_free(make_samples([7, 7, 7]))
    packed = collate_padding_free(make_samples(LENGTHS))
    references = [loss_and_grads(model, batch) for batch in (stacked, packed)]
    assert enable_varlen_sdpa(model, max_seq_len=64)
    computed.clear()
    for batch, reference in zip((stacked, packed), references, strict=True):
        assert_same(loss_and_grads(model, batch), reference)
    assert computed == [(1, 7), (1, sum(LENGTHS))]
