"""CheckpointManager on one process: HF layout, exact resume, atomicity, latest(), rotation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.layout import COMPLETE_MARKER
from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.weights import read_safetensors_weights
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.parallel.build import build_engine
from trainbridge.parallel.engine import TrainingEngine

VOCAB = 48


def save_tiny_llama(directory: Path, tie_word_embeddings: bool = False) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture()
def args(tmp_path: Path) -> TrainingArgs:
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return TrainingArgs(
        model_path=save_tiny_llama(tmp_path / "model"),
        data_path=data,
        ckpt_output_dir=tmp_path / "out",
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler="linear",
        warmup_steps=1,
        device="cpu",
    )


@pytest.fixture()
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def new_engine(args: TrainingArgs, model_path: Path | None = None) -> TrainingEngine:
    model = AutoModelForCausalLM.from_pretrained(model_path or args.model_path)
    return build_engine(model, args, DistributedEnv(), total_steps=10)


def train_step(engine: TrainingEngine, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB, (1, 9), generator=generator) for _ in range(2)]
    for i, ids in enumerate(batches):
        with engine.micro_batch(is_last=i == 1), engine.autocast():
            loss = engine.module(input_ids=ids, labels=ids).loss / 2
        engine.backward(loss)
    engine.clip_grad_norm(1.0)
    engine.optimizer_step()
    engine.scheduler_step()
    engine.zero_grad()


def weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.unwrapped.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def fake_checkpoint(output_dir: Path, step: int, complete: bool = True) -> Path:
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / COMPLETE_MARKER).write_text(f"{step}\n")
    return path


# ---------------------------------------------------------------------- layout and resume
def test_checkpoint_is_a_hugging_face_model_directory(args: TrainingArgs, tokenizer: PreTrainedTokenizerFast) -> None:
    engine = new_engine(args)
    train_step(engine, seed=1)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    state = {"global_step": 1, "epoch": 0.5, "sampler": {"position": 4}, "callbacks": {"early": [1, 2]}}

    path = manager.save(engine, tokenizer, 1, state, {"trainer_state.json": '{"global_step": 1}'})

    assert path == args.ckpt_output_dir / "checkpoint-1"
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path).state_dict(), weights(engine))
    assert AutoTokenizer.from_pretrained(path)("w3 w5")["input_ids"] == [3, 5]
    assert json.loads((path / "training_state.json").read_text()) == state
    assert json.loads((path / "trainer_state.json").read_text()) == {"global_step": 1}
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        COMPLETE_MARKER,
    ):  # one process: Trainer's name
        assert (path / name).is_file(), name
    assert [p.name for p in args.ckpt_output_dir.iterdir()] == ["checkpoint-1"], "temporary folder left behind"


def test_resume_reproduces_the_uninterrupted_step(args: TrainingArgs) -> None:
    engine = new_engine(args)
    train_step(engine, seed=1)
    train_step(engine, seed=2)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    path = manager.save(engine, None, 2, {"global_step": 2}, {})
    train_step(engine, seed=3)
    uninterrupted = weights(engine)

    resumed = new_engine(args)  # original weights, fresh optimizer: everything must come from the checkpoint
    assert manager.load(path, resumed) == {"global_step": 2}
    assert resumed.current_lr() == pytest.approx(manager_lr_after_steps(args, 2))
    train_step(resumed, seed=3)

    assert_same_weights(weights(resumed), uninterrupted)


def manager_lr_after_steps(args: TrainingArgs, steps: int) -> float:
    """Linear schedule, 1 warm-up step over 10: the LR after ``steps`` scheduler steps."""
    return args.learning_rate * (10 - steps) / (10 - 1)


def test_resume_without_optimizer_state_differs(args: TrainingArgs) -> None:
    # Guards the test above: loading weights alone (fresh AdamW moments) does not reproduce the step.
    engine = new_engine(args)
    train_step(engine, seed=1)
    train_step(engine, seed=2)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    path = manager.save(engine, None, 2, {"global_step": 2}, {})
    train_step(engine, seed=3)

    weights_only = new_engine(args)
    manager.load_model_weights(path, weights_only)
    train_step(weights_only, seed=3)
    assert any(not torch.equal(a, b) for a, b in zip(weights(weights_only).values(), weights(engine).values()))


def test_rng_states_are_restored(args: TrainingArgs) -> None:
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    path = manager.save(new_engine(args), None, 1, {}, {})
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    manager.restore_rng(path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == drawn


def test_tied_embeddings_round_trip(args: TrainingArgs, tmp_path: Path) -> None:
    tied_model = save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    engine = new_engine(args, tied_model)
    train_step(engine, seed=1)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    path = manager.save(engine, None, 1, {}, {})

    resumed = new_engine(args, tied_model)
    manager.load(path, resumed)
    assert resumed.unwrapped.lm_head.weight is resumed.unwrapped.model.embed_tokens.weight
    assert_same_weights(weights(resumed), weights(engine))


# ---------------------------------------------------------------------- atomicity and latest()
def test_latest_ignores_temporary_and_incomplete_folders(args: TrainingArgs) -> None:
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    assert manager.latest() is None
    saved = manager.save(new_engine(args), None, 2, {}, {})
    leftover = args.ckpt_output_dir / ".tmp-checkpoint-9"
    leftover.mkdir()
    (leftover / COMPLETE_MARKER).write_text("9\n")
    fake_checkpoint(args.ckpt_output_dir, 7, complete=False)
    (args.ckpt_output_dir / "checkpoint-notanumber").mkdir()

    assert manager.latest() == saved
    assert manager.list_checkpoints() == [saved]

    manager.save(new_engine(args), None, 3, {}, {})
    assert not leftover.exists(), "the next save removes an interrupted save's temporary folder"
    assert manager.latest() == args.ckpt_output_dir / "checkpoint-3"


def test_crash_mid_save_leaves_previous_checkpoint_whole(args: TrainingArgs, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = new_engine(args)
    train_step(engine, seed=1)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    first = manager.save(engine, None, 1, {"global_step": 1}, {})
    first_weights = weights(engine)
    train_step(engine, seed=2)

    def disk_full() -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(engine, "optimizer_state_dict", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        manager.save(engine, None, 2, {"global_step": 2}, {})
    with pytest.raises(CheckpointError):  # re-saving step 1 fails too: the old checkpoint-1 must survive
        manager.save(engine, None, 1, {"global_step": 1, "again": True}, {})

    assert manager.latest() == first
    assert manager.list_checkpoints() == [first]
    restored = new_engine(args)
    assert manager.load(first, restored) == {"global_step": 1}
    assert_same_weights(weights(restored), first_weights)


def test_resaving_a_step_replaces_it(args: TrainingArgs) -> None:
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    engine = new_engine(args)
    manager.save(engine, None, 1, {"version": 1}, {})
    train_step(engine, seed=1)
    path = manager.save(engine, None, 1, {"version": 2}, {})

    assert json.loads((path / "training_state.json").read_text()) == {"version": 2}
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path).state_dict(), weights(engine))
    assert sorted(p.name for p in args.ckpt_output_dir.iterdir()) == ["checkpoint-1"]


def test_unserialisable_training_state_is_a_clear_error(args: TrainingArgs) -> None:
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        manager.save(new_engine(args), None, 1, {"tensor": torch.ones(1)}, {})
    assert manager.latest() is None


def test_load_rejects_an_incomplete_checkpoint(args: TrainingArgs) -> None:
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None)
    incomplete = fake_checkpoint(args.ckpt_output_dir, 4, complete=False)
    with pytest.raises(CheckpointError, match=r"checkpoint-4.*not a complete checkpoint"):
        manager.load(incomplete, new_engine(args))


# ---------------------------------------------------------------------- rotation
@pytest.mark.parametrize(
    ("limit", "protected_step", "kept"),
    [
        (2, None, [4, 5]),
        (2, 1, [1, 5]),
        (3, 2, [2, 4, 5]),
        (1, 2, [2, 5]),  # transformers keeps the newest too, so a resume stays possible
        (1, 5, [5]),
        (None, None, [1, 2, 3, 4, 5]),
    ],
)
def test_rotation_keeps_newest_and_protected(
    tmp_path: Path, limit: int | None, protected_step: int | None, kept: list[int]
) -> None:
    manager = CheckpointManager(tmp_path, DistributedEnv(), save_total_limit=limit)
    paths = {step: fake_checkpoint(tmp_path, step) for step in range(1, 6)}
    protected = {paths[protected_step]} if protected_step else set()

    deleted = manager.rotate(protected)

    assert manager.list_checkpoints() == [paths[s] for s in kept]
    assert deleted == [paths[s] for s in range(1, 6) if s not in kept]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"checkpoint-{s}" for s in kept)


def test_rotation_ignores_incomplete_folders(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, DistributedEnv(), save_total_limit=1)
    incomplete = fake_checkpoint(tmp_path, 9, complete=False)
    fake_checkpoint(tmp_path, 1)
    newest = fake_checkpoint(tmp_path, 2)
    manager.rotate()
    assert manager.list_checkpoints() == [newest]
    assert incomplete.exists()


# ---------------------------------------------------------------------- export dtype
def test_bf16_export_of_fp32_training_resumes_exactly_from_the_sharded_state(args: TrainingArgs) -> None:
    from safetensors.torch import load_file

    engine = new_engine(args)
    train_step(engine, seed=1)
    train_step(engine, seed=2)
    manager = CheckpointManager(
        args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, weights_dtype=torch.bfloat16
    )
    path = manager.save(engine, None, 2, {"global_step": 2}, {})
    saved = weights(engine)
    train_step(engine, seed=3)
    uninterrupted = weights(engine)

    # the HF-layout weights really are bf16, say so in config.json, and load with from_pretrained
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    exported = AutoModelForCausalLM.from_pretrained(path)
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    assert_same_weights(exported.state_dict(), {k: v.to(torch.bfloat16) for k, v in saved.items()})
    assert (path / "dcp" / ".metadata").is_file(), "the fp32 weights are kept beside the bf16 export"

    resumed = new_engine(args)
    manager.load(path, resumed)
    assert_same_weights(weights(resumed), saved)
    train_step(resumed, seed=3)
    assert_same_weights(weights(resumed), uninterrupted)

    # restoring weights alone (load_best_model_at_end, ctx.restore_model_weights) reads them exactly too
    weights_only = new_engine(args)
    manager.load_model_weights(path, weights_only)
    assert_same_weights(weights(weights_only), saved)

    # guard: the bf16 files alone would not have resumed exactly
    from_export = new_engine(args)
    from_export.load_model_state_dict(read_safetensors_weights(path))
    assert any(not torch.equal(a, b) for a, b in zip(weights(from_export).values(), saved.values()))


def test_an_export_in_the_parameters_dtype_keeps_no_extra_copy(args: TrainingArgs) -> None:
    engine = new_engine(args)
    manager = CheckpointManager(
        args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, weights_dtype=torch.float32
    )
    path = manager.save(engine, None, 1, {}, {})
    assert not (path / "dcp").exists()
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"


def test_checkpoint_weights_dtype_auto_is_what_the_model_folder_records(args: TrainingArgs, tmp_path: Path) -> None:
    from trainbridge.checkpoint.weights_dtype import checkpoint_weights_dtype

    fp32 = AutoModelForCausalLM.from_pretrained(args.model_path)
    assert checkpoint_weights_dtype(args, fp32) == torch.float32  # the tiny model records float32
    bf16_folder = tmp_path / "bf16"
    fp32.to(torch.bfloat16).save_pretrained(bf16_folder)
    assert json.loads((bf16_folder / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype="float32")  # trained in fp32
    bf16_args = args.model_copy(update={"model_path": bf16_folder})
    assert checkpoint_weights_dtype(bf16_args, loaded) == torch.bfloat16
    assert (
        checkpoint_weights_dtype(bf16_args.model_copy(update={"checkpoint_weights_dtype": "float32"}), loaded)
        == torch.float32
    )
    # no folder (model_init): the parameters' dtype
    assert checkpoint_weights_dtype(args.model_copy(update={"model_path": None}), loaded) == torch.float32


def test_only_a_narrowing_export_counts_as_lossy() -> None:
    from trainbridge.checkpoint.weights_dtype import exports_lossy

    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert exports_lossy(fp32, torch.bfloat16) and exports_lossy(bf16, torch.float16)
    assert not exports_lossy(bf16, torch.float32) and not exports_lossy(fp32, torch.float32)
    assert not exports_lossy(fp32, None)
