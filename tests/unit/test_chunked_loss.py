"""The chunked linear cross entropy and the loss head (issue 16): exact to the standard loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, CohereConfig, LlamaConfig, PreTrainedModel

from trainbridge.data import collate_padded, collate_padding_free, token_loss_sum
from trainbridge.data.loss import (
    chunked_linear_cross_entropy,
    install_loss_head,
    resolve_loss_implementation,
)
from trainbridge.modeling import enable_varlen_sdpa, sample_segments
from trainbridge.parallel.fsdp import fsdp_unit_groups

from .test_collate_loss import VOCAB, make_samples, tiny_llama


@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 1000])
def test_chunked_cross_entropy_equals_full_logits(chunk_tokens: int) -> None:
    torch.manual_seed(0)
    # fp32, as a model's hidden states and weights are; the reference is the loop's standard loss.
    hidden = torch.randn(37, 24, requires_grad=True)
    weight = torch.randn(50, 24, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    labels[::5] = -100
    reference = F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=-100, reduction="sum")
    reference.backward()
    expected = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    loss = chunked_linear_cross_entropy(hidden, weight, labels, bias, chunk_tokens=chunk_tokens)
    (loss * 3.0).backward()  # the upstream gradient is applied
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-5)
    for got, want in zip((hidden.grad, weight.grad, bias.grad), expected, strict=True):
        torch.testing.assert_close(got, want * 3.0, rtol=1e-5, atol=1e-5)


def test_chunked_cross_entropy_holds_one_chunk_of_logits() -> None:
    """The saved tensors are the inputs and one fp32 value per row, never a [N, V] block."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    labels = torch.randint(0, 1000, (64,))
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    assert all(shape.numel() < 64 * 1000 for shape in saved), saved
    assert torch.Size([64]) in saved  # the per-row log-sum-exp


def loss_and_grads(model: PreTrainedModel, batch: dict, segments: bool = False) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    if segments:
        with sample_segments(batch):
            loss, n = token_loss_sum(model, batch)
    else:
        loss, n = token_loss_sum(model, batch)
    loss.backward()
    return float(loss.detach()) / n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["packed", "padded", "stacked"])
def test_loss_head_gives_the_standard_loss_and_gradients(layout: str) -> None:
    samples = make_samples([7, 7, 7] if layout == "stacked" else [5, 9, 3, 12])
    batch = collate_padded(samples, 0) if layout == "padded" else collate_padding_free(samples)
    model = tiny_llama()
    reference = loss_and_grads(model, batch)
    assert install_loss_head(model, "chunked", chunk_tokens=5)
    got = loss_and_grads(model, batch)
    assert got[0] == pytest.approx(reference[0], rel=1e-6)
    assert got[1].keys() == reference[1].keys()
    for name in got[1]:
        torch.testing.assert_close(got[1][name], reference[1][name], rtol=1e-5, atol=1e-6, msg=name)
    # Outside token_loss_sum the model is unchanged: full logits, as generate() needs.
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape[-1] == VOCAB


def test_loss_head_with_varlen_sdpa_and_known_segments() -> None:
    batch = collate_padding_free(make_samples([5, 9, 3, 12]))
    model = tiny_llama()
    reference = loss_and_grads(model, batch)
    assert enable_varlen_sdpa(model, max_seq_len=64)
    assert install_loss_head(model, "chunked", chunk_tokens=8)
    got = loss_and_grads(model, batch, segments=True)
    assert got[0] == pytest.approx(reference[0], rel=1e-5)
    for name in got[1]:
        torch.testing.assert_close(got[1][name], reference[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_loss_head_refuses_models_that_post_process_logits() -> None:
    config = CohereConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        logit_scale=0.5,
    )
    cohere = AutoModelForCausalLM.from_config(config)  # logits = lm_head(h) * logit_scale
    assert not install_loss_head(cohere, "chunked")
    assert not install_loss_head(tiny_llama(), "standard")


def test_loss_implementation_resolution() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_loss_implementation("auto", cpu) == "standard"
    assert resolve_loss_implementation("auto", cuda) in ("liger", "chunked")
    assert resolve_loss_implementation("chunked", cpu) == "chunked"
    with pytest.raises(ValueError, match="loss_implementation: 'liger' needs CUDA"):
        resolve_loss_implementation("liger", cpu)


def test_collate_carries_sequence_lengths_and_flash_kwargs() -> None:
    from transformers import DataCollatorWithFlattening

    samples = make_samples([5, 9, 3])
    batch = collate_padding_free(samples, flash_kwargs=True)
    assert batch.seq_lens == ((5, 9, 3),)
    reference = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": list(s.input_ids), "labels": list(s.labels)} for s in samples]
    )
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(batch[key], reference[key].to(batch[key].dtype)), key
        assert batch[key].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == reference["max_length_q"] == 9
    # Balanced rows: each row's lengths, the padding tail as one more sequence; no flash kwargs.
    rows = collate_padding_free(make_samples([30, 20, 25, 10]), row_tokens=50, flash_kwargs=True)
    assert rows.seq_lens is not None and len(rows.seq_lens) == 2
    assert all(sum(row) == rows["input_ids"].shape[1] for row in rows.seq_lens)
    assert "cu_seq_lens_q" not in rows
    assert collate_padding_free(make_samples([6, 6])).seq_lens is None
    assert "cu_seq_lens_q" not in collate_padding_free(samples)


def test_known_segments_replace_reading_position_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``sample_segments`` the per-sample attention never reads boundaries from the device."""
    import trainbridge.modeling.varlen_attention as varlen

    model = tiny_llama()
    batches = [
        collate_padding_free(make_samples(lengths), row_tokens=rows)
        for lengths, rows in (([5, 9, 3], None), ([7, 7, 7], None), ([30, 20, 25, 10], 50))
    ]
    references = [loss_and_grads(model, b)[0] for b in batches]
    assert enable_varlen_sdpa(model, max_seq_len=64)

    def must_not_read(position_ids: torch.Tensor) -> list[list[int]]:
        raise AssertionError("boundaries read from position_ids")

    monkeypatch.setattr(varlen._segments, "bounds", must_not_read)
    for batch, reference in zip(batches, references, strict=True):
        assert loss_and_grads(model, batch, segments=True)[0] == pytest.approx(reference, rel=1e-5)
    with pytest.raises(AssertionError, match="boundaries read"):
        loss_and_grads(model, batches[0])  # without the metadata it would have to read them


def test_fsdp_unit_groups() -> None:
    untied = tiny_llama()
    names = [name for name, _ in fsdp_unit_groups(untied)]
    assert names == ["embeddings", "decoder layer 0", "decoder layer 1", "norm + output layer"]
    assert fsdp_unit_groups(untied)[-1][1] == [untied.model.norm, untied.lm_head]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    tied = AutoModelForCausalLM.from_config(config)
    assert [name for name, _ in fsdp_unit_groups(tied)] == ["decoder layer 0", "decoder layer 1"]


def test_mixed_precision_auto_is_fp32_on_cpu_and_bf16_on_capable_cuda(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainbridge.core.config import TrainingArgs

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text("{}\n")
    args = TrainingArgs(model_path=tmp_path / "m", data_path=tmp_path / "d.jsonl", ckpt_output_dir=tmp_path / "o")
    assert args.mixed_precision == "auto"
    assert args.mixed_precision_for("cpu") == "no"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert args.mixed_precision_for("cuda") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert args.mixed_precision_for("cuda") == "no"
    assert args.model_copy(update={"mixed_precision": "no"}).mixed_precision_for("cuda") == "no"


def test_cuda_defaults_keep_a_user_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from trainbridge.core.distributed import CUDA_ALLOC_CONF_DEFAULT, apply_cuda_defaults

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        apply_cuda_defaults()
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF_DEFAULT
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
        apply_cuda_defaults()
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_compile_decoder_layers_keeps_the_loss() -> None:
    from trainbridge.parallel.build import compile_decoder_layers

    batch = collate_padding_free(make_samples([5, 9, 3]))
    model = tiny_llama()
    reference = loss_and_grads(model, batch)[0]
    assert compile_decoder_layers(model, backend="eager") == 2
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert loss_and_grads(model, batch)[0] == pytest.approx(reference, rel=1e-6)


def test_loss_head_on_a_peft_model() -> None:
    from peft import LoraConfig, get_peft_model

    batch = collate_padding_free(make_samples([5, 9, 3]))
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    reference = loss_and_grads(model, batch)
    assert install_loss_head(model, "chunked", chunk_tokens=4)
    got = loss_and_grads(model, batch)
    assert got[0] == pytest.approx(reference[0], rel=1e-6)
    assert got[1].keys() == reference[1].keys() and got[1]  # the LoRA weights' gradients
    for name in got[1]:
        torch.testing.assert_close(got[1][name], reference[1][name], rtol=1e-5, atol=1e-6, msg=name)
