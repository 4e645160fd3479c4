"""Assistant-only masks on chat templates of different structures, on a locally trained byte-level BPE.

The templates are written here after the structure of real ones: ChatML with tool calls (Qwen2.5),
Llama-3 headers with ``{% generation %}`` markers, Qwen3 (drops the reasoning of earlier turns), and
Qwen3 again with generation markers; plus the tiny demo tokenizer's own template.  Each test checks the
exact text the trained tokens decode to.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import PreTrainedTokenizerFast

from trainbridge.data import DataFormatError, open_dataset
from trainbridge.data.chat import ChatEncoder, ChatTemplateError, normalize_messages
from trainbridge.data.records import DataOptions
from trainbridge.demos.tiny_model import build_tokenizer

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

NL = "{{ '\n' }}"
"""A newline in a template (transformers renders with trim_blocks: a newline right after a tag goes)."""

CHATML = (
    "{%- if messages[0].role != 'system' %}<|im_start|>system" + NL + "You are helpful.<|im_end|>" + NL + "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant" + NL + "{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>" + NL + "{{ call.function | tojson }}" + NL + "</tool_call>"
    "{%- endfor %}<|im_end|>"
    + NL
    + "{%- elif m.role == 'tool' %}<|im_start|>user"
    + NL
    + "<tool_response>{{ m.content }}</tool_response>"
    "<|im_end|>" + NL + "{%- else %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}<|im_end|>" + NL + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL + "{%- endif %}"
)

LLAMA3_MARKED = (
    "<|begin_of_text|>"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    + NL
    + NL
    + "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}<|eot_id|>{% endgeneration %}"
    "{%- else %}{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL + "{%- endif %}"
)

QWEN3 = (
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant" + NL + "{%- if m.reasoning_content and "
    "loop.index0 > ns.last_query %}<think>"
    + NL
    + "{{ m.reasoning_content }}"
    + NL
    + "</think>"
    + NL
    + NL
    + "{%- endif %}{{ m.content }}<|im_end|>"
    + NL
    + "{%- else %}<|im_start|>{{ m.role }}"
    + NL
    + "{{ m.content }}<|im_end|>"
    + NL
    + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL + "{%- endif %}"
)

QWEN3_MARKED = QWEN3.replace(
    "<|im_start|>assistant" + NL + "{%- if m.reasoning_content",
    "<|im_start|>assistant" + NL + "{% generation %}{%- if m.reasoning_content",
).replace(
    "{{ m.content }}<|im_end|>" + NL + "{%- else %}",
    "{{ m.content }}<|im_end|>" + NL + "{% endgeneration %}{%- else %}",
)
assert QWEN3_MARKED.count("generation %}") == 2

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "two plus two"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "three plus three"},
]


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here (merges cross word and role boundaries, as real ones do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [
        json.dumps(CONVERSATION),
        "assistant user system It is What is And plus two three",
        CHATML,
        QWEN3,
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def trained_text(tokenizer: PreTrainedTokenizerFast, labels: list[int]) -> list[str]:
    """The trained tokens decoded, one string per contiguous run."""
    runs: list[list[int]] = []
    previous = False
    for label in labels:
        if label != -100:
            if not previous:
                runs.append([])
            runs[-1].append(label)
        previous = label != -100
    return [tokenizer.decode(run) for run in runs]


def encode(
    tokenizer: PreTrainedTokenizerFast,
    template: str,
    messages: list[dict],
    train_on: str = "all",
    **kwargs: object,
) -> tuple[list[int], list[int]]:
    encoder = ChatEncoder(tokenizer, template, train_on)  # type: ignore[arg-type]
    input_ids, labels = encoder.encode(normalize_messages(messages), **kwargs)  # type: ignore[arg-type]
    assert (
        input_ids
        == tokenizer.apply_chat_template(
            normalize_messages(messages), chat_template=template, tokenize=True, return_dict=True, **kwargs
        )["input_ids"]
    )
    return input_ids, labels


def test_chatml_prefix_spans_with_default_system_and_tool_calls(bpe: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
    ]
    _, labels = encode(bpe, CHATML, messages)
    assert trained_text(bpe, labels) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n',
        "It is 4.<|im_end|>\n",
    ]
    _, last = encode(bpe, CHATML, messages, train_on="last")
    assert trained_text(bpe, last) == ["It is 4.<|im_end|>\n"]


def test_generation_markers_give_the_assistant_spans(bpe: PreTrainedTokenizerFast) -> None:
    _, labels = encode(bpe, LLAMA3_MARKED, CONVERSATION)
    assert trained_text(bpe, labels) == ["It is 4.<|eot_id|>", "It is 6.<|eot_id|>"]
    _, last = encode(bpe, LLAMA3_MARKED, CONVERSATION, train_on="last")
    assert trained_text(bpe, last) == ["It is 6.<|eot_id|>"]


def test_template_dropping_earlier_reasoning_fails_on_all_turns_and_works_on_the_last(
    bpe: PreTrainedTokenizerFast,
) -> None:
    with pytest.raises(ChatTemplateError, match=r"renders the conversation up to assistant message 1 differently"):
        encode(bpe, QWEN3, CONVERSATION)
    _, last = encode(bpe, QWEN3, CONVERSATION, train_on="last")
    assert trained_text(bpe, last) == ["<think>\nthree plus three\n</think>\n\nIt is 6.<|im_end|>\n"]
    # the same template with generation markers trains on both turns as the full conversation renders them
    _, marked = encode(bpe, QWEN3_MARKED, CONVERSATION)
    assert trained_text(bpe, marked) == [
        "It is 4.<|im_end|>\n",
        "<think>\nthree plus three\n</think>\n\nIt is 6.<|im_end|>\n",
    ]


def test_tiny_tokenizer_template(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path)
    messages = [
        {"role": "user", "content": "1+2=?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "plus 4?"},
        {"role": "assistant", "content": "7"},
    ]
    input_ids, labels = encode(tokenizer, str(tokenizer.chat_template), messages)
    assert tokenizer.decode(input_ids) == "<s>user: 1+2=?\nassistant: 3</s>\nuser: plus 4?\nassistant: 7</s>\n"
    assert trained_text(tokenizer, labels) == ["3</s>\n", "7</s>\n"]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "assistant", "content": "hi"}], "roles out of order: message 0 is 'assistant'"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"},
            ],
            "roles out of order: message 1 is a second 'user'",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "system", "content": "b"},
                {"role": "assistant", "content": "c"},
            ],
            "only the first message may be",
        ),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "'tool' after 'user'"),
        ([{"role": "robot", "content": "a"}], "role 'robot'"),
        ("hello", "must be a non-empty list"),
    ],
)
def test_bad_conversations_are_named(messages: object, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        normalize_messages(messages)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_messages_jsonl_and_parquet_give_the_same_samples(tmp_path: Path, bpe: PreTrainedTokenizerFast) -> None:
    """Through ``datasets``, Arrow fills keys missing from some messages with nulls; they are dropped."""
    bpe.chat_template = CHATML
    rows = [
        {"messages": CONVERSATION[:2]},
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}],
                },
            ]
        },
    ]
    jsonl = write_jsonl(tmp_path / "chat.jsonl", rows)
    parquet = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    options = DataOptions(max_seq_len=512)
    from_jsonl, _ = open_dataset(jsonl, bpe, options, tmp_path / "cache")
    from_parquet, _ = open_dataset(parquet, bpe, options, tmp_path / "cache")
    assert from_jsonl.fetch([0, 1]) == from_parquet.fetch([0, 1])
    assert '"arguments": {"a": 2}}' in bpe.decode(from_parquet.fetch([1])[0].input_ids)


def test_bad_chat_rows_fail_before_training_with_file_line_and_counts(
    tmp_path: Path, bpe: PreTrainedTokenizerFast
) -> None:
    bpe.chat_template = QWEN3
    rows = [
        {"messages": CONVERSATION[:2]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": CONVERSATION},
        {"messages": CONVERSATION[1:]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataFormatError, match=r"chat\.jsonl:2: the conversation has no assistant message") as info:
        open_dataset(path, bpe, DataOptions(max_seq_len=512), tmp_path / "cache")
    assert info.value.counts == {
        "no assistant message": 1,
        "template re-renders earlier turns": 1,
        "roles out of order": 1,
    }
    assert "chat.jsonl:3: the chat template renders" in str(info.value)
    # last-turn training accepts the re-rendering template; the other two rows stay bad
    with pytest.raises(DataFormatError) as info:
        open_dataset(path, bpe, DataOptions(max_seq_len=512, chat_train_on="last"), tmp_path / "cache")
    assert info.value.counts == {"no assistant message": 1, "roles out of order": 1}


def test_no_chat_template_and_system_prompt_and_prompt_completion(tmp_path: Path, bpe: PreTrainedTokenizerFast) -> None:
    bpe.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[:2]}])
    with pytest.raises(DataFormatError, match=r"chat\.jsonl:1: the tokenizer has no chat template"):
        open_dataset(path, bpe, DataOptions(max_seq_len=512), tmp_path / "cache")
    # a template given in the options; a system prompt added where none is
    options = DataOptions(max_seq_len=512, chat_template=LLAMA3_MARKED, system_prompt="Be brief.")
    source, _ = open_dataset(path, bpe, options, tmp_path / "cache")
    assert bpe.decode(source.fetch([0])[0].input_ids).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    )
    # prompt/completion: strings (loss on the completion + EOS) and conversational (loss on the completion)
    path = write_jsonl(
        tmp_path / "pc.jsonl",
        [
            {"prompt": "What is 2+2?", "completion": " It is 4."},
            {
                "prompt": [{"role": "user", "content": "What is 2+2?"}],
                "completion": [{"role": "assistant", "content": "It is 4."}],
            },
        ],
    )
    source, _ = open_dataset(path, bpe, options, tmp_path / "cache")
    plain, chat = source.fetch([0, 1])
    assert trained_text(bpe, list(plain.labels)) == [" It is 4.<|endoftext|>"]
    assert trained_text(bpe, list(chat.labels)) == ["It is 4.<|eot_id|>"]


def test_shipped_chat_data_is_the_generators_and_loads_for_the_demo(tmp_path: Path) -> None:
    from trainbridge.data.sources import load_run_data
    from trainbridge.demos.demo import CHAT_DATA, demo_training_args
    from trainbridge.demos.tiny_model import write_chat_dataset

    for name, count, seed in (("chat_train.jsonl", 2000, 1), ("chat_val.jsonl", 200, 2)):
        assert (CHAT_DATA / name).read_text() == write_chat_dataset(tmp_path / name, count, seed).read_text()
    args = demo_training_args(tmp_path / "demo", max_steps=2, chat=True)
    args = args.model_copy(update={"data_cache_dir": tmp_path / "cache"})
    data = load_run_data(args, build_tokenizer(tmp_path / "tok"), report=False)
    assert (len(data.train), len(data.val or [])) == (2000, 200)
    assert data.stats[0].dropped_overlong == 0


RAISING = CHATML + "{%- if messages | length > 4 %}{{ raise_exception('conversation too long') }}{%- endif %}"
"""ChatML that refuses conversations of more than four messages (one bad row in an otherwise good batch)."""

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("template", [CHATML, LLAMA3_MARKED, QWEN3, QWEN3_MARKED, RAISING, "tiny"])
@pytest.mark.parametrize("train_on", ["all", "last"])
def test_batched_encoding_equals_one_conversation_at_a_time(
    tmp_path: Path, bpe: PreTrainedTokenizerFast, template: str, train_on: str
) -> None:
    """``encode_batch`` (renders batched, one tokenizer call) gives each row exactly ``encode``'s result or error."""
    tokenizer = build_tokenizer(tmp_path) if template == "tiny" else bpe
    template = str(tokenizer.chat_template) if template == "tiny" else template
    long = [*CONVERSATION, {"role": "user", "content": "And 4+4?"}, {"role": "assistant", "content": "It is 8."}]
    items = [
        (CONVERSATION, None, 0),
        (CONVERSATION[:2], None, 0),
        (long, None, 0),  # RAISING refuses it; QWEN3 re-renders its earlier turns
        (CONVERSATION, TOOLS, 0),  # tools: rendered on its own
        (CONVERSATION, None, 2),  # prompt/completion: trained on the completion only
        ([{"role": "user", "content": "hi"}], None, 0),  # no assistant message
        ([{"role": "system", "content": "Be brief."}, *CONVERSATION[:2]], None, 0),
    ]
    encoder = ChatEncoder(tokenizer, template, train_on)  # type: ignore[arg-type]

    def one(item: tuple[list[dict], object, int]) -> object:
        try:
            return encoder.encode(list(item[0]), item[1], assistant_from=item[2])
        except ChatTemplateError as exc:
            return f"error: {exc}"

    expected = [one(item) for item in items]
    batched = [
        f"error: {r}" if isinstance(r, ChatTemplateError) else r
        for r in encoder.encode_batch([(list(m), t, a) for m, t, a in items])
    ]
    assert batched == expected
    assert sum(isinstance(r, tuple) for r in expected) >= 3  # most rows encode; the comparison is not of errors
