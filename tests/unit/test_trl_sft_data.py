"""trl's SFT data formats and options give the rows a real ``trl.SFTTrainer`` builds.

Each case builds trl's ``SFTTrainer`` on a tiny local Llama and compares its ``train_dataset`` with
``prepare_sft_dataset``'s rows (for packed strategies: trl's packed rows are our samples end to end, cut
at trl's ``seq_lengths``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from trainbridge.hf.porting import HFPortingWarning
from trainbridge.trl.sft_data import prepare_sft_dataset, sft_data_settings

GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TEXT = [{"text": f"{a}+{b}={a + b}"} for a, b in [(1, 2), (13, 25), (7, 70), (99, 1), (5, 5), (42, 8)]]
PROMPT_COMPLETION = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(1, 2), (13, 25), (7, 70), (9, 1)]]
MESSAGES = [
    {
        "messages": [
            {"role": "user", "content": f"{a}+{b}=?"},
            {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": "and x2?"},
            {"role": "assistant", "content": str(2 * (a + b))},
        ]
    }
    for a, b in [(1, 2), (13, 25), (7, 70)]
]
QUESTIONS = [{"question": f"{a}*{b}", "answer": str(a * b)} for a, b in [(3, 4), (12, 12), (6, 7)]]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """trl's trainer fills accelerate's process-wide state; leave none behind."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _trl_rows(
    tiny_llama: Path, tmp_path: Path, data: list[dict[str, Any]], formatting_func: Any = None, **config: Any
) -> tuple[Any, Any, SFTConfig]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    if config.get("assistant_only_loss"):
        tokenizer.chat_template = GENERATION_TEMPLATE
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", bf16=False, use_cpu=True, **config)
    trainer = SFTTrainer(
        model=str(tiny_llama),
        args=args,
        train_dataset=datasets.Dataset.from_list(data),
        processing_class=tokenizer,
        formatting_func=formatting_func,
    )
    return trainer.train_dataset, tokenizer, args


CASES = [
    ("text", TEXT, {}),
    ("text-max_length", TEXT, {"max_length": 5}),
    ("text-field", [{"body": r["text"]} for r in TEXT], {"dataset_text_field": "body"}),
    ("prompt-completion", PROMPT_COMPLETION, {}),
    ("prompt-completion-full-loss", PROMPT_COMPLETION, {"completion_only_loss": False}),
    ("messages", MESSAGES, {}),
    ("messages-assistant-only", MESSAGES, {"assistant_only_loss": True}),
    ("text-wrapped", TEXT, {"packing": True, "packing_strategy": "wrapped", "max_length": 8}),
]


@pytest.mark.parametrize(("data", "config"), [(d, c) for _, d, c in CASES], ids=[n for n, _, _ in CASES])
def test_rows_match_trl(tiny_llama: Path, tmp_path: Path, data: list[dict[str, Any]], config: dict[str, Any]) -> None:
    theirs, tokenizer, args = _trl_rows(tiny_llama, tmp_path, data, **config)
    ours = prepare_sft_dataset(datasets.Dataset.from_list(data), tokenizer, args)
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    if config.get("assistant_only_loss") or ("prompt" in data[0] and config.get("completion_only_loss") is None):
        assert any(-100 in labels for labels in ours["labels"])  # the masking did something


def test_formatting_func_matches_trl(tiny_llama: Path, tmp_path: Path) -> None:
    def formatting_func(example: dict[str, Any]) -> str:
        return f"Q: {example['question']} A: {example['answer']}"

    theirs, tokenizer, args = _trl_rows(tiny_llama, tmp_path, QUESTIONS, formatting_func=formatting_func)
    ours = prepare_sft_dataset(datasets.Dataset.from_list(QUESTIONS), tokenizer, args, formatting_func)
    assert ours["input_ids"] == theirs["input_ids"]


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_bfd_packing_keeps_trls_bins(tiny_llama: Path, tmp_path: Path, strategy: str) -> None:
    """Each of trl's bins is one sample of several sequences: the same rows, labels and ``seq_lengths``,
    and no warning (the counts are trl's)."""
    data = [*TEXT, {"text": "123456789+987654321=1111111110"}]  # longer than a bin: truncated or split
    theirs, tokenizer, args = _trl_rows(
        tiny_llama, tmp_path, data, packing=True, packing_strategy=strategy, max_length=16
    )
    assert any(len(lengths) > 1 for lengths in theirs["seq_lengths"])  # trl's bins hold several sequences
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)
        ours = prepare_sft_dataset(datasets.Dataset.from_list(data), tokenizer, args)
    assert ours.column_names == ["input_ids", "labels", "seq_lengths"]
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    assert ours["seq_lengths"] == theirs["seq_lengths"]
    assert sft_data_settings(args, 16)["max_seq_len"] == 16


def test_assistant_only_loss_needs_conversations(tiny_llama: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, assistant_only_loss=True)
    with pytest.raises(ValueError, match="assistant_only_loss"):
        prepare_sft_dataset(datasets.Dataset.from_list(TEXT), tokenizer, args)
