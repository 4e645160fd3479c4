"""Tiny local Llama models, a tiny BERT config, a character tokenizer and a learnable arithmetic data set.

Used by the demo, the tests, the benchmarks and the compat scenarios: everything is built from a
config on disk (no model hub), saved with ``save_pretrained`` and loaded back with ``from_pretrained``
exactly like a downloaded model.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import BertConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens, ids 0..3 in this order."""

CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*=?:.,\n"
"""Every character the tokenizer knows (one token each); anything else is ``<unk>``."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""The tiny tokenizer's chat template: ``<s>user: 12+35=?\nassistant: 47</s>\n``; no generation markers,
so assistant spans are found by rendering growing prefixes (``trainbridge.data.chat``)."""


@dataclass(frozen=True)
class TinyLlamaSize:
    """Shape of a tiny Llama model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


TINY = TinyLlamaSize(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
"""The default test/demo model: 91,968 parameters with the 76-token character vocabulary."""

BENCHMARK_3M = TinyLlamaSize(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688)
"""The benchmark model: 3,203,328 parameters with the 76-token character vocabulary
(4 x 791,040 per layer + 2 x 76 x 256 untied embeddings + 256 final norm)."""


def build_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer, save it to ``directory`` and load it back with ``AutoTokenizer``.

    One token per character of ``CHARACTERS`` plus ``<pad> <s> </s> <unk>``; encoding adds ``<s>``
    in front (like Llama), decoding joins characters back without separators; ``CHAT_TEMPLATE`` renders
    conversations.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=4096,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    if not isinstance(loaded, PreTrainedTokenizerFast):
        raise TypeError(f"{directory} loaded as {type(loaded).__name__}, expected a fast tokenizer")
    return loaded


def build_tiny_llama(
    directory: str | Path,
    *,
    hidden_size: int = TINY.hidden_size,
    num_layers: int = TINY.num_layers,
    num_heads: int = TINY.num_heads,
    intermediate_size: int = TINY.intermediate_size,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised Llama (seeded) and its tokenizer in ``directory``; return the directory.

    The result loads with ``AutoModelForCausalLM.from_pretrained(directory)`` and
    ``AutoTokenizer.from_pretrained(directory)`` like a real model (safetensors weights).
    ``vocab_size`` defaults to the tokenizer's.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    tokenizer = build_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def build_tiny_llama_once(directory: str | Path) -> Path:
    """``build_tiny_llama(directory)`` unless it exists, safe for several processes at once (each rank of a
    script): each builds into its own folder and the first rename publishes it."""
    import os
    import shutil

    directory = Path(directory)
    if not directory.exists():
        staging = directory.with_name(f"{directory.name}.{os.getpid()}")
        build_tiny_llama(staging)
        try:
            staging.rename(directory)
        except OSError:  # another process published first
            shutil.rmtree(staging)
    return directory


def tiny_bert_config(vocab_size: int = 80, **overrides: Any) -> BertConfig:
    """A tiny BERT (hidden 32, one layer, two heads, 64 positions, 2 labels) for the encoder models of the
    tests, compat scenarios and examples; ``overrides`` are further ``BertConfig`` keywords (``pad_token_id``,
    dropout...)."""
    from transformers import BertConfig

    shape: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
    )
    return BertConfig(vocab_size=vocab_size, **{**shape, **overrides})


def build_benchmark_llama(directory: str | Path, *, seed: int = 0) -> Path:
    """Build the ``BENCHMARK_3M`` model (3,203,328 parameters) in ``directory``."""
    return build_tiny_llama(
        directory,
        hidden_size=BENCHMARK_3M.hidden_size,
        num_layers=BENCHMARK_3M.num_layers,
        num_heads=BENCHMARK_3M.num_heads,
        intermediate_size=BENCHMARK_3M.intermediate_size,
        seed=seed,
    )


def arithmetic_problems(n: int, seed: int, max_operand: int = 99) -> list[tuple[str, str]]:
    """``n`` deterministic ``(prompt, answer)`` pairs such as ``("12+35=", "47")``."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        problems.append((f"{a}+{b}=", str(a + b)))
    return problems


def write_arithmetic_dataset(
    path: str | Path,
    n: int,
    seed: int,
    fmt: Literal["text", "tokenized"] = "text",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write ``n`` addition problems as JSONL; the same ``(n, seed)`` always gives the same file.

    ``fmt="text"``: ``{"text": "12+35=47"}`` lines.  ``fmt="tokenized"``: ``{"input_ids", "labels"}``
    lines, ``<s>`` + problem + ``</s>``, with ``labels`` -100 on ``<s>`` and the ``12+35=`` prompt, so
    only the answer and ``</s>`` are trained on (needs ``tokenizer``).
    """
    if fmt == "tokenized" and tokenizer is None:
        raise ValueError("write_arithmetic_dataset: fmt='tokenized' needs a tokenizer")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for prompt, answer in arithmetic_problems(n, seed):
        if fmt == "text":
            lines.append(json.dumps({"text": prompt + answer}))
            continue
        assert tokenizer is not None
        prompt_ids = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
        answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        lines.append(
            json.dumps(
                {
                    "input_ids": prompt_ids + answer_ids,
                    "labels": [-100] * len(prompt_ids) + answer_ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def arithmetic_conversations(n: int, seed: int, max_operand: int = 99) -> list[dict[str, object]]:
    """``n`` deterministic chat samples: one or two addition questions, the assistant answering each.

    ``{"messages": [{"role": "user", "content": "12+35=?"}, {"role": "assistant", "content": "47"},
    ...]}``; a quarter carry a system message, the second question adds to the first answer.
    """
    rng = random.Random(seed)
    samples: list[dict[str, object]] = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        messages = [{"role": "user", "content": f"{a}+{b}=?"}, {"role": "assistant", "content": str(a + b)}]
        if rng.random() < 0.5:
            c = rng.randint(0, max_operand)
            messages += [{"role": "user", "content": f"plus {c}?"}, {"role": "assistant", "content": str(a + b + c)}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": "you add numbers."})
        samples.append({"messages": messages})
    return samples


def write_chat_dataset(path: str | Path, n: int, seed: int) -> Path:
    """Write ``arithmetic_conversations(n, seed)`` as JSONL (the demo's chat data set is this, shipped)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(sample) + "\n" for sample in arithmetic_conversations(n, seed)))
    return path


def write_prompt_dataset(path: str | Path, n: int, seed: int, max_operand: int = 99) -> Path:
    """Write ``n`` conversational addition prompts for online RL (GRPO, RLOO) as JSONL:
    ``{"prompt": [{"role": "user", "content": "12+35=?"}], "answer": "47"}``; the ``answer`` column is handed
    to reward functions such as ``trainbridge.demos.rewards.answer_reward``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = (
        {"prompt": [{"role": "user", "content": f"{problem[:-1]}=?"}], "answer": answer}
        for problem, answer in arithmetic_problems(n, seed, max_operand)
    )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
