"""The tiny local model, its character tokenizer and the arithmetic data: real HF round trips, deterministic."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainbridge.demos.tiny_model import (
    BENCHMARK_3M,
    SPECIAL_TOKENS,
    build_tiny_llama,
    build_tokenizer,
    write_arithmetic_dataset,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_tokenizer_round_trip(tmp_path):
    built = build_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "12+35=47\nWhat is 3*4? 12."
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character, plus <s>
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert built(text).input_ids == ids
    assert [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token] == list(SPECIAL_TOKENS)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert tokenizer("é", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]


def test_model_loads_like_a_hub_model(model_dir):
    assert (model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    batch = tokenizer(["1+1=2", "10+10=20"], return_tensors="pt", padding=True)
    out = model(**batch, labels=batch.input_ids)
    assert out.logits.shape == (2, batch.input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(out.loss)


def test_same_seed_gives_same_weights(model_dir, tmp_path):
    again = build_tiny_llama(tmp_path / "again", seed=3)
    other = build_tiny_llama(tmp_path / "other", seed=4)
    a, b, c = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (model_dir, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_benchmark_size_parameter_count():
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=76,
        hidden_size=BENCHMARK_3M.hidden_size,
        intermediate_size=BENCHMARK_3M.intermediate_size,
        num_hidden_layers=BENCHMARK_3M.num_layers,
        num_attention_heads=BENCHMARK_3M.num_heads,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 3_203_328


def test_text_dataset_is_deterministic_and_correct(tmp_path):
    first = write_arithmetic_dataset(tmp_path / "a.jsonl", 50, seed=7).read_text()
    second = write_arithmetic_dataset(tmp_path / "b.jsonl", 50, seed=7).read_text()
    other = write_arithmetic_dataset(tmp_path / "c.jsonl", 50, seed=8).read_text()
    assert first == second and first != other
    for line in first.splitlines():
        problem, answer = json.loads(line)["text"].split("=")
        left, right = problem.split("+")
        assert int(left) + int(right) == int(answer)


def test_tokenized_dataset_masks_the_prompt(model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = write_arithmetic_dataset(tmp_path / "tok.jsonl", 20, seed=1, fmt="tokenized", tokenizer=tokenizer)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        ids, labels = record["input_ids"], record["labels"]
        assert len(ids) == len(labels)
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        prompt_length = tokenizer.decode(ids, skip_special_tokens=True).index("=") + 2  # <s> + "a+b="
        assert labels[:prompt_length] == [-100] * prompt_length
        assert labels[prompt_length:] == ids[prompt_length:]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        write_arithmetic_dataset(tmp_path / "x.jsonl", 1, seed=0, fmt="tokenized")
