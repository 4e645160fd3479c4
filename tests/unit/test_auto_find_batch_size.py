"""``auto_find_batch_size`` in one process, as Trainer: a model whose forward runs out of memory above 2 items
a batch makes Trainer's own search (``find_executable_batch_size``) start the run again with int(0.9 x) the
batch size, 4 -> 3 -> 2; ours trains with 2 too, with Trainer's losses and ``state.train_batch_size``."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification

from tests.unit.test_random_stream import VariableRows, pad
from trainbridge import Trainer


def _out_of_memory_above_two(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    if kwargs["input_ids"].shape[0] > 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_auto_find_batch_size_retries_with_trainers_smaller_batch(tmp_path: Path, arguments_for: Any) -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = BertForSequenceClassification(config)
    results: list[tuple[list[float], int]] = []
    for cls in (transformers.Trainer, Trainer):
        args = arguments_for(
            cls,
            output_dir=str(tmp_path / cls.__module__),
            per_device_train_batch_size=4,
            auto_find_batch_size=True,
            max_steps=4,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=3,
        )
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=VariableRows(16), data_collator=pad)
        trainer.model.register_forward_pre_hook(_out_of_memory_above_two, with_kwargs=True)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        results.append((losses, trainer.state.train_batch_size))
    assert results[0][1] == results[1][1] == 2
    assert len(results[1][0]) == 4 and results[1][0] == pytest.approx(results[0][0], rel=1e-6)


def test_a_resumed_search_starts_from_the_checkpoint_the_loop_resumes_from(tmp_path: Path, arguments_for: Any) -> None:
    """A run searched down to 2 items saves checkpoints 2 and 4; checkpoint 4 then records 3 items and so no
    longer verifies.  Resumed with ``resume_from_checkpoint=True``, the loop skips it and resumes from checkpoint 2,
    and the search starts from checkpoint 2's size: no training forward of 3 items, no out-of-memory error."""
    import json

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = BertForSequenceClassification(config)
    sizes: list[int] = []

    def out_of_memory_above_two(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        sizes.append(kwargs["input_ids"].shape[0])
        _out_of_memory_above_two(module, args, kwargs)

    def trained(max_steps: int, resume: bool) -> Any:
        args = arguments_for(
            Trainer,
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            auto_find_batch_size=True,
            max_steps=max_steps,
            save_steps=2,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=copy.deepcopy(model), args=args, train_dataset=VariableRows(16), data_collator=pad)
        trainer.model.register_forward_pre_hook(out_of_memory_above_two, with_kwargs=True)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    trained(4, resume=False)
    newest = tmp_path / "checkpoint-4" / "trainer_state.json"
    state = json.loads(newest.read_text())
    assert state["train_batch_size"] == 2
    newest.write_text(json.dumps({**state, "train_batch_size": 3}))
    sizes.clear()
    trainer = trained(6, resume=True)
    assert trainer.state.global_step == 6 and trainer.state.train_batch_size == 2
    assert sizes and set(sizes) == {2}  # before: one forward of 3 (checkpoint 4's), out of memory, then 2


def _out_of_memory_above_20_tokens(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    if kwargs["input_ids"].numel() > 20:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_the_token_path_searches_the_batch_its_max_batch_len_follows(tmp_path: Path, arguments_for: Any) -> None:
    """transformers' own collator (the padding-free token path, micro-batches of at most ``max_batch_len`` =
    batch x longest tokens, two a step): a forward out of memory above 20 tokens ends the search at Trainer's
    size."""
    from trainbridge.demos.tiny_model import build_tiny_llama_once

    folder = build_tiny_llama_once(tmp_path / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = [{"input_ids": tokenizer("ab+12" * 2)["input_ids"][:9]} for _ in range(16)]
    sizes = []
    for cls in (transformers.Trainer, Trainer):
        args = arguments_for(
            cls,
            output_dir=str(tmp_path / cls.__module__),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            auto_find_batch_size=True,
            max_steps=2,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = cls(model=model, args=args, train_dataset=rows, data_collator=collator, processing_class=tokenizer)
        trainer.model.register_forward_pre_hook(_out_of_memory_above_20_tokens, with_kwargs=True)
        trainer.train()
        sizes.append((trainer.state.train_batch_size, trainer.state.global_step))
    assert sizes[1] == sizes[0] == (2, 2)


@pytest.mark.parametrize("where", ["forward", "loss", "backward"])
def test_on_several_ranks_only_an_error_before_the_backward_is_retried(where: str) -> None:
    """The agreed search (``hf.batch_size_search.agreed``; one process here, where its all-reduce is the identity):
    an out-of-memory error in a training forward of the DDP engine's model or in its loss is retried with Trainer's
    smaller size; one in the backward ends the search with an error naming it (the ranks could not agree on it).
    The 2-rank run: tests/distributed/test_facade_data.py::test_auto_find_batch_size_is_agreed_by_the_ranks_and_..."""
    from transformers.trainer_utils import find_executable_batch_size

    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.hf.batch_size_search import UnagreedOutOfMemory, agreed

    model = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(kind="ddp", unwrapped=model)
    sizes: list[int] = []

    def out_of_memory(at: str) -> None:
        if sizes[-1] > 3 and where == at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def attempt(batch_size: int, agreeing: Any) -> int:
        sizes.append(batch_size)
        (callback,) = agreeing(SimpleNamespace(engine=engine))
        loss = model(torch.ones(batch_size, 2, requires_grad=True)).sum()
        out_of_memory("loss")
        callback.on_before_backward(None, loss=loss)  # as the loop fires it
        loss.backward()
        return batch_size

    model.register_forward_pre_hook(lambda module, args: out_of_memory("forward"))
    model.register_full_backward_pre_hook(lambda module, grad: out_of_memory("backward"))
    search = find_executable_batch_size(agreed(attempt, DistributedEnv()), 4, True)
    if where != "backward":
        assert search() == 3 and sizes == [4, 3]
    else:
        with pytest.raises(UnagreedOutOfMemory, match="rank 0 ran out of memory after a training forward and its loss"):
            search()
        assert sizes == [4]
