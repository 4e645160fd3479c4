"""The per-sample sdpa attention for padding-free rows: same loss and gradients as transformers' sdpa,
switched on only where exact, transparent for padded batches, generation and checkpoints."""

from __future__ import annotations

import itertools
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
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
        ),
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


WIDE_LENGTHS = [3, 30, 5, 28, 9, 17, 2, 30]


@pytest.mark.parametrize("row_tokens", [None, 40], ids=["one-row", "balanced-rows"])
def test_each_samples_logits_are_its_own_and_its_padded_ones(row_tokens: int | None) -> None:
    """Packed row (or balanced rows with a pad sequence) vs each sample run alone vs a padded batch: the
    same logits for every sample, and the masked sdpa row's loss and gradients (GQA heads, lengths that
    differ widely)."""
    from trainbridge.data.loss import forward_logits
    from trainbridge.modeling import sample_segments

    samples = make_samples(WIDE_LENGTHS)
    packed = collate_padding_free(samples, row_tokens=row_tokens)
    model = tiny_llama("sdpa")
    reference = loss_and_grads(model, packed)
    with torch.no_grad():
        padded_logits = forward_logits(model, collate_padded(samples, pad_token_id=0))
    assert enable_varlen_sdpa(model, max_seq_len=64)
    assert_same(loss_and_grads(model, packed), reference)
    with torch.no_grad(), sample_segments(packed):
        logits = forward_logits(model, packed)
        alone = [forward_logits(model, collate_padding_free([sample]))[0] for sample in samples]
    index_of = {tuple(sample.input_ids): index for index, sample in enumerate(samples)}
    seen = set()
    for row, lengths in enumerate(packed.seq_lens):
        for start, end in itertools.pairwise([0, *itertools.accumulate(lengths)]):
            index = index_of.get(tuple(packed["input_ids"][row, start:end].tolist()))
            if index is not None:  # not a balanced row's pad sequence
                seen.add(index)
                torch.testing.assert_close(logits[row, start:end], alone[index], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(logits[row, start:end], padded_logits[index, : end - start])
    assert seen == set(range(len(samples)))


# ---------------------------------------------------------------- torch's varlen kernel (CUDA, half precision)
def _reference_varlen_kernel(calls: list[dict[str, object]]):
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` with its layout: ``[T, H, D]`` inputs cut at
    ``cu_seq``; causal attention per segment.  Records each call's arguments."""
    import itertools

    import torch.nn.functional as F

    def kernel(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        cuts = cu_seq_q.tolist()
        calls.append(
            {
                "cu_seq": cuts,
                "same_cu": cu_seq_k is cu_seq_q,
                "max": (max_q, max_k),
                "window": window_size,
                "gqa": enable_gqa,
                "dtype": cu_seq_q.dtype,
            }
        )
        pieces = [
            F.scaled_dot_product_attention(
                query[a:b].transpose(0, 1),
                key[a:b].transpose(0, 1),
                value[a:b].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=enable_gqa,
            ).transpose(0, 1)
            for a, b in itertools.pairwise(cuts)
        ]
        return torch.cat(pieces)

    return kernel


@pytest.mark.parametrize("row_tokens", [None, 20], ids=["one-row", "balanced-rows"])
def test_torch_varlen_kernel_gets_every_sample_in_one_call(
    row_tokens: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel applies (CUDA, bf16) the rows are flattened and cut at ``cu_seq`` from the batch's own
    sample lengths: one kernel call per layer, causal, GQA heads passed on, same loss and gradients as sdpa."""
    from trainbridge.modeling import varlen_attention

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(varlen_attention, "torch_varlen_kernel", lambda: _reference_varlen_kernel(calls))
    monkeypatch.setattr(varlen_attention, "_kernel_applies", lambda query, dropout_p: True)
    batch = collate_padding_free(make_samples(LENGTHS), row_tokens=row_tokens)
    model = tiny_llama("sdpa")
    reference = loss_and_grads(model, batch)
    assert enable_varlen_sdpa(model, max_seq_len=64, probe=False)
    calls.clear()
    with varlen_attention.sample_segments(batch):
        got = loss_and_grads(model, batch)
    assert_same(got, reference)
    assert len(calls) == model.config.num_hidden_layers
    rows, length = batch["input_ids"].shape
    expected = [
        r * length + start for r, row in enumerate(batch.seq_lens) for start in [0, *itertools.accumulate(row)][:-1]
    ] + [rows * length]
    assert calls[0]["cu_seq"] == expected
    assert calls[0]["same_cu"] and calls[0]["dtype"] == torch.int32
    assert calls[0]["max"] == (max(max(row) for row in batch.seq_lens),) * 2
    assert calls[0]["window"] == (-1, 0) and calls[0]["gqa"] is True


def test_a_kernel_that_cannot_run_falls_back_to_per_sample_sdpa(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from trainbridge.modeling import varlen_attention

    def unsupported(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(varlen_attention, "torch_varlen_kernel", lambda: unsupported)
    monkeypatch.setattr(
        varlen_attention, "_kernel_applies", lambda query, dropout_p: varlen_attention._kernel_works is not False
    )
    monkeypatch.setattr(varlen_attention, "_kernel_works", None)
    batch = collate_padding_free(make_samples(LENGTHS))
    model = tiny_llama("sdpa")
    reference = loss_and_grads(model, batch)
    assert enable_varlen_sdpa(model, max_seq_len=64, probe=False)
    with caplog.at_level("WARNING"):
        assert_same(loss_and_grads(model, batch), reference)
    assert varlen_attention._kernel_works is False
    assert "Ampere" in caplog.text


def test_the_kernel_applies_only_on_cuda_in_half_precision_without_dropout() -> None:
    from trainbridge.modeling.varlen_attention import _kernel_applies

    assert not _kernel_applies(torch.zeros(1, 2, 4, 8), 0.0)  # CPU
    assert not _kernel_applies(torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16), 0.0)  # CPU, bf16
    if torch.cuda.is_available():
        cuda = torch.zeros(1, 2, 4, 8, device="cuda", dtype=torch.bfloat16)
        assert not _kernel_applies(cuda.float(), 0.0)
        assert not _kernel_applies(cuda, 0.1)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="torch's varlen flash kernel needs a CUDA GPU with compute capability >= 8.0",
)
def test_torch_varlen_kernel_on_a_gpu_matches_per_sample_sdpa() -> None:
    """On a real GPU: bf16 loss and gradients through the kernel equal the per-sample sdpa path's."""
    from trainbridge.modeling import varlen_attention

    batch = {k: v.cuda() for k, v in collate_padding_free(make_samples(LENGTHS)).items()}
    model = tiny_llama("sdpa").cuda().to(torch.bfloat16)
    assert enable_varlen_sdpa(model, max_seq_len=64, probe=False)
    bounds = [[0, *itertools.accumulate(LENGTHS)]]
    q = torch.randn(1, 4, sum(LENGTHS), 8, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, sum(LENGTHS), 8, device="cuda", dtype=torch.bfloat16)
    assert varlen_attention._kernel_applies(q, 0.0)
    fast = varlen_attention._torch_varlen_forward(q, k, k, bounds, None, True)
    slow = varlen_attention._per_sample_forward(q, k, k, bounds, 0.0, None, True)
    torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)
    loss, _ = token_loss_sum(model, batch)
    loss.backward()
    assert varlen_attention._kernel_works is True


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_row_of_equal_length_samples_is_one_call_with_each_samples_values(
    kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fixed-length data: a packed row of samples of one length attends in one batched sdpa call (no split, no
    concatenation), with the outputs and gradients of one call per sample bit for bit (GQA too); a row of
    mixed lengths still calls once per sample."""
    from trainbridge.modeling import varlen_attention

    torch.manual_seed(0)
    heads, length, samples, dim = 4, 16, 3, 8
    query = torch.randn(1, heads, samples * length, dim, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, samples * length, dim, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, samples * length, heads, dim)
    bounds = [[0, length, 2 * length, 3 * length]]
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return sdpa(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(varlen_attention.F, "scaled_dot_product_attention", counted)
    out = varlen_attention._per_sample_forward(query, key, value, bounds, 0.0, None, kv_heads != heads)
    out.backward(grad)
    assert calls == [samples]
    fast = [out.detach(), *(t.grad for t in (query, key, value))]
    for t in (query, key, value):
        t.grad = None
    pieces = [
        sdpa(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        for q, k, v in zip(*(t.split(length, dim=2) for t in (query, key, value)), strict=True)
    ]
    alone = torch.cat(pieces, dim=2).transpose(1, 2).contiguous()
    alone.backward(grad)
    for a, b in zip(fast, [alone.detach(), *(t.grad for t in (query, key, value))], strict=True):
        assert a is not None and b is not None and torch.equal(a, b)
    calls.clear()
    varlen_attention._per_sample_forward(query, key, value, [[0, 10, 48]], 0.0, None, kv_heads != heads)
    assert calls == [1, 1]
