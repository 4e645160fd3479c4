"""trl's SFT metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) against trl's fused LM head."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trainbridge.trl.token_metrics import TokenMetrics, token_metric_sums


def test_sums_match_trls_fused_head() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(4, 40, (3, 9))
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[2, 6:] = -100
    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    with torch.no_grad():
        out = fused(input_ids=input_ids, labels=labels, fused_lm_head=True)
        entropy, hits, tokens = token_metric_sums(model(input_ids=input_ids).logits, labels).tolist()
    assert tokens == out.label_mask.sum().item()
    assert entropy == pytest.approx(out.entropy.sum().item(), rel=1e-5)
    assert hits == out.is_top1.sum().item()


def test_logging_rule_is_trls() -> None:
    metrics = TokenMetrics()
    metrics.add([2.0, 1.0, 4.0], input_tokens=10)
    metrics.add([3.0, 3.0, 3.0], input_tokens=7)
    assert metrics.log() == {"num_tokens": 17.0, "entropy": pytest.approx(0.75), "mean_token_accuracy": 0.625}
    metrics.add([0.0, 0.0, 0.0], input_tokens=5)
    assert metrics.log() == {"num_tokens": 22.0, "entropy": 0.0, "mean_token_accuracy": 0.0}
