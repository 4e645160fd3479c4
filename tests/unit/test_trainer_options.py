"""``TrainingArguments`` options Trainer acts on, each honoured in place (one rank) and compared with real
``transformers.Trainer`` where the two can be compared:

- ``skip_memory_metrics=False``: ``train()``'s metrics gain Trainer's ``init_mem_*`` / ``train_mem_*`` keys;
- ``data_seed``: Trainer's sample order (its seeded sampler), micro-batch for micro-batch;
- ``torch_empty_cache_steps``: the device cache is emptied where Trainer empties it, as often;
- ``save_only_model``: checkpoints with Trainer's files (no optimizer, scheduler or RNG state), and a resume
  from one as Trainer's (weights and step restored, optimizer and schedule fresh); ``output_dir`` then holds
  Trainer's entries, our own files in its ``trainbridge/`` folder;
- ``enable_jit_checkpoint``: SIGTERM writes a checkpoint at the next step boundary and stops;
- ``ignore_data_skip``: a resume restarts the epoch's data from its first batch, as Trainer's;
- ``train_sampling_strategy``: Trainer's samplers' orders (``group_by_length``, ``batch_rebalance``, ``sequential``);
- ``dataloader_in_order``: the worker ``DataLoader``'s ``in_order``, as Trainer's;
- a fresh Trainer resuming a checkpoint of another model configuration (``architectures`` set by the save)
  is warned, not refused, as Trainer resumes."""

from __future__ import annotations

import copy
import itertools
import logging
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

from trainbridge import Trainer
from trainbridge.core.run_dir import OWN_FILES_DIR
from trainbridge.demos.tiny_model import build_tiny_llama_once


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, datasets.Dataset]:
    folder = build_tiny_llama_once(tmp_path_factory.mktemp("options") / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        ids = tokenizer("".join(rng.choice("12+ab") for _ in range(rng.randint(4, 9))))["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer, datasets.Dataset.from_list(rows)


def _collate(tokenizer: Any) -> Any:
    """A function of the script's: Trainer's sample batches (the datasets' items), not our token batches."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def collate(items: list[Any]) -> Any:
        return collator(items)

    return collate


def _trainer(
    cls: type,
    llama: tuple[Any, Any, datasets.Dataset],
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: Any = None,
    callbacks: list[Any] | None = None,
    collator: Any = None,
    eval_dataset: Any = None,
    **arguments: Any,
) -> Any:
    base, tokenizer, rows = llama
    launcher = ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")
    for name, _ in launcher:  # TrainingArguments would start a process group under a launcher's variables
        monkeypatch.delenv(name, raising=False)
    args = TrainingArguments(
        output_dir=str(out),
        **{
            "per_device_train_batch_size": 2,
            "max_steps": 2,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "use_cpu": True,
            "disable_tqdm": True,
            **arguments,
        },
    )
    if cls is Trainer:  # in place, as under a launcher (after the arguments)
        for name, value in launcher:
            monkeypatch.setenv(name, value)
    return cls(
        model=model if model is not None else copy.deepcopy(base),
        args=args,
        train_dataset=rows,
        eval_dataset=eval_dataset,
        data_collator=collator or _collate(tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def _input_ids(kwargs: dict[str, Any]) -> Any:
    return kwargs["input_ids"].tolist()


def _forward_inputs(
    llama: tuple[Any, Any, datasets.Dataset],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    read: Callable[[dict[str, Any]], Any] = _input_ids,
    **arguments: Any,
) -> list[list[Any]]:
    """Trainer's run, then ours (``_trainer(..., **arguments)`` under ``tmp_path``): what ``read`` takes from each
    forward's keyword arguments, in order."""
    seen: list[list[Any]] = []
    for cls in (transformers.Trainer, Trainer):
        trainer = _trainer(cls, llama, tmp_path / cls.__module__, monkeypatch, **arguments)
        seen.append([])
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs, into=seen[-1]: into.append(read(kwargs)), with_kwargs=True
        )
        trainer.train()
    return seen


class LastLog(TrainerCallback):
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs = dict(logs)


MEMORY_METRICS = {  # TrainerMemoryTracker's on CPU, as Trainer's train() returns and logs them
    "before_init_mem_cpu",
    "init_mem_cpu_alloc_delta",
    "init_mem_cpu_peaked_delta",
    "train_mem_cpu_alloc_delta",
    "train_mem_cpu_peaked_delta",
}


def test_memory_metrics_are_trainers(llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer's own tracker: its metrics in train()'s and in the final on_log (Trainer adds them before its log)."""
    last = LastLog()
    trainer = _trainer(Trainer, llama, tmp_path, monkeypatch, max_steps=1, skip_memory_metrics=False, callbacks=[last])
    metrics = trainer.train().metrics
    assert {k for k in metrics if "_mem_" in k} == MEMORY_METRICS
    assert set(last.logs) >= MEMORY_METRICS
    assert trainer._memory_tracker.cur_stage is None  # stopped: a later evaluate() tracks its own stage


def test_data_seed_gives_trainers_order(llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two epochs of 4 micro-batches of 4 in Trainer's order: its sampler seeded with data_seed (+ epoch)."""
    seen = _forward_inputs(
        llama, tmp_path, monkeypatch, max_steps=8, per_device_train_batch_size=4, seed=3, data_seed=11
    )
    assert len(seen[1]) == 8 and seen[1] == seen[0]


def test_empty_cache_steps_as_trainers(llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 0 and 2 of 4, two micro-batches each: emptied four times, as Trainer's training_step does."""
    import accelerate.utils.memory

    counts: list[int] = []
    for cls, where in ((transformers.Trainer, transformers.trainer), (Trainer, accelerate.utils.memory)):
        counts.append(0)
        monkeypatch.setattr(where, "clear_device_cache", lambda *a, **k: counts.__setitem__(-1, counts[-1] + 1))
        trainer = _trainer(
            cls,
            llama,
            tmp_path / cls.__module__,
            monkeypatch,
            max_steps=4,
            gradient_accumulation_steps=2,
            torch_empty_cache_steps=2,
        )
        trainer.train()
    assert counts == [4, 4]


def _files(checkpoint: Path) -> set[str]:
    return {p.name for p in checkpoint.iterdir()}


def test_save_only_model_checkpoints_and_resumes_as_trainers(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ours_only = {"COMPLETE", "manifest.json", "training_state.json"}
    files, steps, entries = [], [], []
    for cls in (transformers.Trainer, Trainer):
        out = tmp_path / cls.__module__
        saving = dict(save_strategy="steps", save_steps=2, save_only_model=True)
        with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):  # none yet
            _trainer(cls, llama, out, monkeypatch, **saving).train(resume_from_checkpoint=True)
        _trainer(cls, llama, out, monkeypatch, **saving).train()
        files.append(_files(out / "checkpoint-2") - ours_only)
        with caplog.at_level(logging.WARNING):
            resumed = _trainer(cls, llama, out, monkeypatch, **saving, max_steps=3).train(resume_from_checkpoint=True)
        steps.append(resumed.global_step)
        entries.append(_files(out))
    assert files[1] == files[0] and not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & files[1]
    assert steps == [3, 3]
    # output_dir holds what Trainer writes there; our own files are in its trainbridge/ folder
    assert entries[1] == entries[0] | {OWN_FILES_DIR}
    assert {"metrics.jsonl", "result.json", "control"} <= _files(tmp_path / Trainer.__module__ / OWN_FILES_DIR)
    assert "a checkpoint of the model alone (save_only_model)" in caplog.text


@pytest.mark.parametrize("remove", [False, True])
def test_remove_unused_columns_hands_the_model_trainers_columns(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remove: bool
) -> None:
    """A column the model's forward does not name (``weight``) with transformers' own collator: Trainer hands it
    to the model when ``remove_unused_columns=False`` (its collator pads every column) and drops it otherwise.
    Ours does the same: such a column moves the run from the token path to Trainer's sample batches."""
    _, tokenizer, rows = llama
    weighted = rows.add_column("weight", list(range(len(rows))))
    seen: list[list[bool]] = []
    for cls in (transformers.Trainer, Trainer):
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        out = tmp_path / cls.__module__
        trainer = _trainer(cls, llama, out, monkeypatch, collator=collator, remove_unused_columns=remove)
        trainer.train_dataset = weighted
        seen.append([])
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen[-1].append("weight" in kwargs), with_kwargs=True
        )
        trainer.train()
    assert set(seen[1]) == set(seen[0]) == {not remove}  # (True: ours stays on the token step's micro-batches)


class AskToStop(TrainerCallback):
    """``trainbridge control OUTPUT_DIR stop`` from "another shell" at step 2."""

    def __init__(self, out: Path) -> None:
        self.out, self.answer = out, ""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from trainbridge.launch.control_command import send_control

        if state.global_step == 2:
            self.answer = send_control(self.out, "stop")


def test_control_and_plot_find_a_trainer_runs_own_files(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Trainer script holds no launcher lock: ``trainbridge control OUTPUT_DIR`` reaches it through rank 0's
    listener in ``output_dir/trainbridge/control/``; ``trainbridge plot OUTPUT_DIR`` finds its metrics there."""
    from trainbridge.callbacks import external_control
    from trainbridge.launch.control_command import NoRunningJobError, send_control
    from trainbridge.report.plot import find_metrics_file

    monkeypatch.setattr(external_control, "POLL_INTERVAL_S", 0.0)
    out = tmp_path / "out"
    asking = AskToStop(out)
    trainer = _trainer(Trainer, llama, out, monkeypatch, callbacks=[asking], max_steps=6)
    trainer.train()
    assert f"pid {os.getpid()}" in asking.answer and trainer.state.global_step in (2, 3)
    assert find_metrics_file(out) == out / OWN_FILES_DIR / "metrics.jsonl"
    with pytest.raises(NoRunningJobError):  # the listener is gone with the run
        send_control(out, "save")


class Terminate(TrainerCallback):
    """Sends this process SIGTERM at the end of step ``at``, as a scheduler would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_jit_checkpoint_saves_on_sigterm_and_stops(llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer = _trainer(
            Trainer, llama, tmp_path, monkeypatch, max_steps=6, enable_jit_checkpoint=True, callbacks=[Terminate(2)]
        )
        result = trainer.train()
    finally:
        signal.signal(signal.SIGTERM, before)  # Trainer's constructor installed its own handler
    assert result.global_step == 2
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()


def test_resume_of_a_saved_from_config_model_is_warned_not_refused(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A model built from a config has ``architectures`` None until its first save sets it; the checkpoint
    recorded None. A fresh Trainer on that model object resuming (``train(resume_from_checkpoint=True)``)
    resumes, as Trainer does."""
    base, _, _ = llama
    torch.manual_seed(0)
    config = copy.deepcopy(base.config)
    config.architectures = None
    model = transformers.AutoModelForCausalLM.from_config(config)
    saving = dict(save_strategy="steps", save_steps=2)
    _trainer(Trainer, llama, tmp_path, monkeypatch, model=model, **saving).train()
    assert model.config.architectures == ["LlamaForCausalLM"]  # set by the checkpoint's save
    with caplog.at_level(logging.WARNING):
        result = _trainer(Trainer, llama, tmp_path, monkeypatch, model=model, **saving, max_steps=3).train(
            resume_from_checkpoint=True
        )
    assert result.global_step == 3
    assert "model architecture llama/None != this run's llama/['LlamaForCausalLM']" in caplog.text


class Crash(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            raise RuntimeError("crash at step 3")


def test_crash_then_rerun_of_a_from_config_model_resumes_as_trainer(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model is built with ``from_config`` (``architectures`` None until the first save sets it, after the
    checkpoint recorded None); the run saves checkpoint-2 and crashes at step 3.  Run again in the same session
    (a notebook's training cell: a fresh Trainer on the same model object) with
    ``train(resume_from_checkpoint=True)``: Trainer resumes from checkpoint-2 and finishes, and so does ours,
    with the same losses (a mismatch of the recorded architecture: the test above)."""
    config = copy.deepcopy(llama[0].config)
    config.architectures = None
    losses = []
    for cls in (transformers.Trainer, Trainer):
        out, saving = tmp_path / cls.__module__, dict(save_strategy="steps", save_steps=2, max_steps=4)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with pytest.raises(Exception, match="crash at step 3"):
            _trainer(cls, llama, out, monkeypatch, model=model, callbacks=[Crash()], **saving).train()
        assert model.config.architectures == ["LlamaForCausalLM"]  # set by checkpoint-2's save
        trainer = _trainer(cls, llama, out, monkeypatch, model=model, **saving)
        assert trainer.train(resume_from_checkpoint=True).global_step == 4
        losses.append([(e["step"], round(e["loss"], 4)) for e in trainer.state.log_history if "loss" in e])
    assert [step for step, _ in losses[0]] == [1, 2, 3, 4]  # (the checkpoint's log history, then the resumed run's)
    assert losses[1] == losses[0]


class Decoded(torch.utils.data.Dataset[dict[str, Any]]):
    """Items made on access (as images or audio are decoded), each access leaving its process's id in ``folder``."""

    def __init__(self, rows: datasets.Dataset, folder: Path) -> None:
        self.rows, self.folder = rows, folder

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        (self.folder / str(os.getpid())).touch()
        return dict(self.rows[index])


def test_dataloader_workers_read_items_in_trainers_order(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers (kept across the two epochs) read the items; the model sees Trainer's batches, in its order."""
    seen: list[list[list[list[int]]]] = []
    for cls in (transformers.Trainer, Trainer):
        readers = tmp_path / cls.__module__ / "readers"
        readers.mkdir(parents=True)
        workers = dict(
            dataloader_num_workers=2,
            dataloader_prefetch_factor=1,
            dataloader_persistent_workers=True,
            per_device_train_batch_size=4,
        )
        trainer = _trainer(cls, llama, tmp_path / cls.__module__, monkeypatch, max_steps=6, **workers)
        trainer.train_dataset = Decoded(trainer.train_dataset, readers)
        seen.append([])
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen[-1].append(kwargs["input_ids"].tolist()), with_kwargs=True
        )
        trainer.train()
        workers_pids = {int(p.name) for p in readers.iterdir()} - {os.getpid()}  # (ours probes an item first)
        assert len(workers_pids) == 2, cls
    assert len(seen[1]) == 6 and seen[1] == seen[0]


def test_dataloader_worker_settings_are_trainers(llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker DataLoader (not started here) takes Trainer's settings, ``multiprocessing_context`` included."""
    from trainbridge.data.loader_workers import LoaderWorkers, WorkerFetch
    from trainbridge.hf.porting import training_args_from_hf

    settings = dict(
        dataloader_num_workers=2,
        dataloader_prefetch_factor=3,
        dataloader_persistent_workers=True,
        dataloader_multiprocessing_context="spawn",
        dataloader_in_order=False,
    )
    trainer = _trainer(transformers.Trainer, llama, tmp_path, monkeypatch, **settings)
    theirs = trainer.get_train_dataloader()
    ported = training_args_from_hf(trainer.args, effective_batch_size=2)
    ours = WorkerFetch(trainer.train_dataset, trainer.data_collator, LoaderWorkers.of(ported)).loader
    names = ("num_workers", "prefetch_factor", "persistent_workers", "in_order")
    assert [getattr(ours, name) for name in names] == [getattr(theirs, name) for name in names]
    assert ours.multiprocessing_context.get_start_method() == theirs.multiprocessing_context.get_start_method()
    assert theirs.multiprocessing_context.get_start_method() == "spawn"


class TwoRanks:
    """Rank 0 of two for ``ModelLoss``: the other rank's step sums are ``other``."""

    world_size = 2

    def __init__(self, other: list[float]) -> None:
        self.other = other

    def sum_floats(self, values: list[float]) -> list[float]:
        return [v + o for v, o in zip(values, self.other, strict=True)]


class OneStep:
    """One step of one micro-batch on this rank."""

    accumulation, world_size, collate = 1, 2, None

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch

    def micro_batches(self, step: Any) -> list[dict[str, Any]]:
        return [dict(self.batch)]


@pytest.mark.parametrize("average", [True, False])
def test_average_tokens_across_devices_weighs_ranks_as_trainer(llama: Any, average: bool) -> None:
    """The loss rank 0 backpropagates (the loop's ``micro_sum x world / loss_units``) is Trainer's
    ``compute_loss``: the forward's loss over every rank's items x world size, or (off) over this rank's own."""
    from types import SimpleNamespace

    from trainbridge.step.model_loss import ModelLoss

    model, tokenizer, rows = llama
    batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)([rows[0], rows[1]])
    own = int(batch["labels"][..., 1:].ne(-100).sum())
    other_items = 3 * own
    step = ModelLoss(OneStep(batch), model, TwoRanks([other_items, 0.0]), average_tokens=average)  # type: ignore[arg-type]
    prepared = step.prepare(SimpleNamespace(num_samples=4))  # type: ignore[arg-type]
    with torch.no_grad():
        ours = step.micro_loss(model, prepared.micro_batches[0], prepared.micro_units[0]) * 2 / prepared.loss_units
        items = own + other_items if average else own
        trainers = model(**batch, num_items_in_batch=torch.tensor(items)).loss * (2 if average else 1)
    assert float(ours) == pytest.approx(float(trainers), rel=1e-5)


def test_underflow_overflow_debug_stops_at_the_first_inf_as_trainer(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``debug="underflow_overflow"``: transformers' ``DebugUnderflowOverflow`` watches the model, and the first
    ``inf`` in an activation stops training with its error, under Trainer and ours."""
    for cls in (transformers.Trainer, Trainer):
        model = copy.deepcopy(llama[0])
        with torch.no_grad():
            model.lm_head.weight[0, 0] = float("inf")
        trainer = _trainer(cls, llama, tmp_path / cls.__module__, monkeypatch, model=model, debug="underflow_overflow")
        with pytest.raises(Exception, match="DebugUnderflowOverflow: inf/nan detected"):
            trainer.train()


def test_full_determinism_turns_deterministic_kernels_on(args_for: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_training``'s build seeds with ``enable_full_determinism``, as Trainer's constructor (the facade's)."""
    from tests.run_inputs import as_run
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.hf.porting import training_args_from_hf
    from trainbridge.loop.build import build_run

    inputs = as_run(args_for())
    hf = TrainingArguments(output_dir=str(inputs.args.ckpt_output_dir), use_cpu=True, full_determinism=True, seed=5)
    ported = training_args_from_hf(hf, **inputs.args.model_dump(exclude_defaults=True, exclude={"ckpt_output_dir"}))
    assert ported.full_determinism and not torch.are_deterministic_algorithms_enabled()
    for name in ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards: enable_full_determinism sets them
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    try:
        build_run(ported, inputs.plan, DistributedEnv())
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class Logs(TrainerCallback):
    """Every ``on_log`` row."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.rows.append(dict(logs))


def test_ignore_data_skip_resumes_from_the_epochs_first_batch_as_trainer(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved at step 2 of 4 per epoch, resumed with ``ignore_data_skip``: Trainer restarts epoch 0's data
    (the model sees its first batches again) and logs epochs 0.25... up to step 6; so does ours."""
    seen: list[list[list[list[int]]]] = []
    rows: list[list[tuple[int | None, float | None]]] = []
    for cls in (transformers.Trainer, Trainer):
        out = tmp_path / cls.__module__
        saving = dict(save_strategy="steps", save_steps=2, per_device_train_batch_size=4, seed=5)
        _trainer(cls, llama, out, monkeypatch, **saving, max_steps=2).train()
        logs = Logs()
        trainer = _trainer(cls, llama, out, monkeypatch, **saving, max_steps=6, ignore_data_skip=True, callbacks=[logs])
        seen.append([])
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen[-1].append(kwargs["input_ids"].tolist()), with_kwargs=True
        )
        trainer.train(resume_from_checkpoint=True)
        rows.append([(row.get("step"), row.get("epoch")) for row in logs.rows if "loss" in row])
        losses = [row["loss"] for row in logs.rows if "loss" in row]
        rows[-1].append((None, losses[-1]))
    assert len(seen[1]) == 4 and seen[1] == seen[0]
    assert [epoch for _, epoch in rows[1][:-1]] == [epoch for _, epoch in rows[0][:-1]] == [0.25, 0.5, 0.75, 1.0]
    assert rows[1][-1][1] == pytest.approx(rows[0][-1][1], rel=1e-4)


@pytest.mark.parametrize("strategy", ["random", "group_by_length"])
def test_token_path_eval_loss_is_trainers_mean_of_batch_losses(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """transformers' own collator (the padding-free token path): 10 validation samples in batches of 4, 4 and 2;
    Trainer's ``eval_loss`` is the batches' token means weighted by their samples, not the set's token mean.
    Under ``group_by_length`` Trainer's evaluation sampler groups the samples by length (other batches), and
    ``compute_metrics`` gets the predictions in that order."""
    _, tokenizer, rows = llama
    evaluations: list[list[float]] = []
    handed: list[list[Any]] = []
    for cls in (transformers.Trainer, Trainer):
        logs = Logs()
        handed.append([])
        trainer = _trainer(
            cls,
            llama,
            tmp_path / cls.__module__,
            monkeypatch,
            max_steps=1,
            eval_strategy="steps",
            eval_steps=1,
            eval_on_start=True,
            per_device_eval_batch_size=4,
            train_sampling_strategy=strategy,
            callbacks=[logs],
            collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            eval_dataset=rows.select(range(10)),
        )
        trainer.compute_metrics = lambda p, into=handed[-1]: into.append((p.predictions, p.label_ids)) or {}
        trainer.train()
        evaluations.append([row["eval_loss"] for row in logs.rows if "eval_loss" in row])
    (theirs, their_labels), (ours, our_labels) = handed[0][0], handed[1][0]  # the start-up evaluation's
    assert our_labels.tolist() == their_labels.tolist()
    real = their_labels != -100  # (Trainer keeps the logits of a batch's padding; ours pads with -100)
    assert ours[real] == pytest.approx(theirs[real], abs=1e-4)
    assert len(evaluations[1]) == 2
    assert evaluations[1][0] == pytest.approx(evaluations[0][0], rel=1e-6)  # the same weights
    assert evaluations[1][1] == pytest.approx(evaluations[0][1], rel=1e-2)  # (the token path's first step differs)


def test_train_sampling_strategies_give_trainers_order(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch of Trainer's sample batches, micro-batch for micro-batch, under each ``train_sampling_strategy``:
    length-grouped mega-batches (the longest item first), transformers' cost-balanced micro-batches, in order."""
    orders: dict[str, list[list[list[list[int]]]]] = {}
    for strategy in ("group_by_length", "batch_rebalance", "sequential"):
        seen = orders.setdefault(strategy, [])
        for cls in (transformers.Trainer, Trainer):
            trainer = _trainer(
                cls,
                llama,
                tmp_path / strategy / cls.__module__,
                monkeypatch,
                max_steps=4,
                seed=7,
                gradient_accumulation_steps=2,
                train_sampling_strategy=strategy,
            )
            seen.append([])
            trainer.model.register_forward_pre_hook(
                lambda module, args, kwargs, into=seen[-1]: into.append(kwargs["input_ids"].tolist()),
                with_kwargs=True,
            )
            trainer.train()
        assert len(seen[1]) == 8 and seen[1] == seen[0], strategy


def test_group_by_length_is_dealt_to_two_ranks_as_accelerate_deals_trainers_sampler(llama: Any) -> None:
    """Trainer's ``LengthGroupedSampler`` under accelerate's ``prepare_data_loader`` for rank 0 and 1 of 2 (its
    permutation from the global generator as ``set_seed`` leaves it): each rank's micro-batches are ours."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from trainbridge.data.sample_order import SampleOrder, lengths_of

    _, _, rows = llama
    lengths = lengths_of(rows, "length", "input_ids", kept=False)
    positions = SampleOrder("group_by_length", lengths=lengths).rank_batches(0, len(rows), 3, 2, 2, False)
    transformers.set_seed(5)
    torch.empty((), dtype=torch.int64).random_()  # the DataLoader's base seed, then the sampler's draw
    order = SampleOrder("group_by_length", lengths=lengths).order(0, len(rows), 3 * 2)
    for rank in (0, 1):
        sampler = LengthGroupedSampler(3 * 2, lengths=lengths)
        loader = DataLoader(range(len(rows)), batch_size=3, sampler=sampler, collate_fn=list)
        prepared = prepare_data_loader(
            loader, num_processes=2, process_index=rank, put_on_device=False, use_seedable_sampler=True
        )  # as Trainer's accelerator prepares it
        transformers.set_seed(5)
        assert [tuple(batch) for batch in prepared] == [tuple(order[p] for p in b) for b in positions[rank]]


def _sequences(kwargs: dict[str, Any]) -> list[tuple[int, ...]]:
    """The samples of a forward's batch: rows by their attention mask, or a padding-free row cut where its
    ``position_ids`` restart."""
    ids, mask, positions = kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids")
    if mask is None and positions is not None:
        starts = [int(i) for i in (positions[0] == 0).nonzero()] + [ids.shape[1]]
        return sorted(tuple(ids[0, a:b].tolist()) for a, b in itertools.pairwise(starts))
    return sorted(tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True))


def test_token_path_sequential_steps_take_trainers_samples(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train_sampling_strategy="sequential"`` with transformers' own collator (the token path): each step
    trains on the samples Trainer's ``SequentialSampler`` gives it, in order."""
    _, tokenizer, _ = llama
    seen = _forward_inputs(
        llama,
        tmp_path,
        monkeypatch,
        read=_sequences,
        max_steps=4,
        per_device_train_batch_size=4,
        train_sampling_strategy="sequential",
        collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    assert len(seen[0]) == 4 and seen[1][-4:] == seen[0]  # (ours first probes the varlen attention: 2 forwards)
