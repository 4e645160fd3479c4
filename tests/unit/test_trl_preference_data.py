"""DPO rows as a real ``trl.DPOTrainer`` prepares them; the reference: a frozen model or the PEFT base."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from trainbridge.trl.preference_data import prepare_preference_dataset, reference_stats
from trainbridge.trl.sequence_logps import pack_pairs, sequence_stats

EXPLICIT = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a, b in [(1, 2), (13, 25), (7, 70), (9, 1)]
]
IMPLICIT_CHAT = [
    {
        "chosen": [{"role": "user", "content": f"{a}+{b}=?"}, {"role": "assistant", "content": str(a + b)}],
        "rejected": [{"role": "user", "content": f"{a}+{b}=?"}, {"role": "assistant", "content": str(a - b)}],
    }
    for a, b in [(1, 2), (13, 25), (7, 70)]
]
LONG_PROMPT = [*EXPLICIT, {"prompt": "123456789+123456789=", "chosen": "246913578", "rejected": "0"}]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@pytest.mark.parametrize(
    ("rows", "max_length"),
    [(EXPLICIT, 1024), (IMPLICIT_CHAT, 1024), (LONG_PROMPT, 16)],
    ids=["explicit-prompt", "implicit-prompt-chat", "prompt-fills-max_length"],
)
def test_rows_match_trl(tiny_llama: Path, tmp_path: Path, rows: list[dict[str, Any]], max_length: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, max_length=max_length)
    trainer = DPOTrainer(
        model=str(tiny_llama), args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    ours = prepare_preference_dataset(datasets.Dataset.from_list(rows), tokenizer, args)
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours[column] == trainer.train_dataset[column], column
    assert len(ours) == (len(rows) - 1 if rows is LONG_PROMPT else len(rows))


PAIRS = ([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], [[11, 2], [12, 13, 2]])


def test_reference_is_the_given_frozen_model(tiny_llama: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        next(policy.parameters()).add_(0.5)
    packed = pack_pairs(*PAIRS)
    ours = reference_stats(policy, ref, packed)
    torch.testing.assert_close(ours.logps, sequence_stats(ref, packed).logps.detach())
    assert not ours.logps.requires_grad


def test_peft_policy_without_reference_uses_its_base(tiny_llama: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    expected = sequence_stats(base, pack_pairs(*PAIRS)).logps.detach()
    policy = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()  # the adapter changes the outputs
    packed = pack_pairs(*PAIRS)
    assert not torch.allclose(sequence_stats(policy, packed).logps.detach(), expected)
    torch.testing.assert_close(reference_stats(policy, None, packed).logps, expected)
    assert not torch.allclose(sequence_stats(policy, packed).logps.detach(), expected)  # the adapter is back on


def test_no_reference_for_a_full_model_is_named(tiny_llama: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"ref_model.*precompute_ref_log_probs"):
        reference_stats(policy, None, pack_pairs(*PAIRS))
