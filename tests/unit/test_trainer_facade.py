"""The Trainer facade without launching: construction checks, inputs, argument mapping, predictions."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
import transformers
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from tests.run_inputs import RunInputs, split_run
from trainbridge import TorchrunArgs, Trainer, TrainingArgs
from trainbridge.core.config import RunPlan, eval_set_names
from trainbridge.core.distributed import DistributedEnv
from trainbridge.data import script_data
from trainbridge.demos.tiny_model import build_tiny_llama
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.launch import launcher
from trainbridge.loop.predictions import PredictionCollector
from trainbridge.trainer import job_args
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return (transformers.AutoModelForCausalLM.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path))


def _hf_args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, **kw)


# ---------------------------------------------------------------------------- unsupported
def test_live_optimizers_reach_the_jobs_as_the_scripts_own_objects(tiny: Any, tmp_path: Path) -> None:
    """A plain single process trains in place (no launch): the job steps the script's own optimizer and model."""
    from trainbridge.parallel.script_optimizer import InPlace

    model, _ = tiny
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model=model, args=_hf_args(tmp_path), optimizers=(optimizer, None), train_dataset=[{"input_ids": [1, 2, 3]}]
    )
    factory = RunInputs(*job_args.training_job(trainer, world_size=1, resume=None)).plan.optimizer_factory
    assert isinstance(factory, InPlace) and factory.script_optimizer is optimizer and factory.model_init() is model
    with pytest.raises(RuntimeError, match=r"both `optimizers` and `optimizer_cls_and_kwargs`"):  # Trainer's own
        Trainer(model=model, args=_hf_args(tmp_path), optimizers=(optimizer, None), optimizer_cls_and_kwargs=(1, {}))


def test_unhonoured_overrides_fail_at_construction_naming_them(tiny: Any, tmp_path: Path) -> None:
    class MyTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
            return 0  # honoured: runs in the workers

        def _inner_training_loop(self, *args: Any, **kw: Any) -> Any:
            return 0

        def create_optimizer(self) -> Any:
            return None

    with pytest.raises(UnsupportedTrainerFeatureError, match=r"overrides _inner_training_loop\(\):"):
        MyTrainer(model=tiny[0], args=_hf_args(tmp_path))


def test_push_to_hub_fails_clearly(tiny: Any, tmp_path: Path) -> None:
    trainer = Trainer(model=tiny[0], args=_hf_args(tmp_path))
    with pytest.raises(UnsupportedTrainerFeatureError, match="save_model"):
        trainer.push_to_hub()
    trainer.create_model_card(model_name="tiny", finetuned_from="local")
    assert "tiny" in (tmp_path / "out" / "README.md").read_text()


# ---------------------------------------------------------------------------- inputs
def test_collators_our_batching_reproduces(tiny: Any) -> None:
    _, tok = tiny
    assert script_data.classify_collator(None).reproduced
    assert script_data.classify_collator(transformers.default_data_collator).reproduced
    lm = script_data.classify_collator(DataCollatorForLanguageModeling(tok, mlm=False))
    assert lm.reproduced and lm.labels_from_input_ids
    assert script_data.classify_collator(transformers.DataCollatorForSeq2Seq(tok)).reproduced
    assert script_data.classify_collator(transformers.DataCollatorWithFlattening()).reproduced
    assert not script_data.classify_collator(lambda rows: rows).reproduced

    class Custom(DataCollatorForLanguageModeling):
        pass

    assert not script_data.classify_collator(Custom(tok, mlm=False)).reproduced  # a subclass may change the result


def test_the_run_uses_the_collator_the_instance_holds_at_train(tiny: Any, tmp_path: Path) -> None:
    """As Trainer's ``get_train_dataloader`` reads ``self.data_collator`` at ``train()``: Trainer's default (none
    given) is reproduced by the token batches; one set after construction is the run's, called on its batches."""
    model, tok = tiny
    rows = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 4)
    trainer = Trainer(model=model, args=_hf_args(tmp_path), train_dataset=rows, processing_class=tok)
    plan = trainer.run_plan()
    assert plan.rows.collator.reproduced and plan.data_collator is None
    trainer.data_collator = collator = lambda items: transformers.default_data_collator(items)
    plan = trainer.run_plan()
    assert not plan.rows.collator.reproduced and plan.rows.items and plan.data_collator is collator


def test_dataset_kinds_become_one_hf_dataset() -> None:
    rows = [{"input_ids": torch.tensor([1, 2, 3])}, {"input_ids": np.array([4, 5])}]

    class MapStyle(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> dict[str, Any]:
            return rows[i]

    for data in (rows, MapStyle(), datasets.Dataset.from_list([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])):
        ds = script_data.as_hf_dataset(data, "train_dataset")
        assert ds["input_ids"] == [[1, 2, 3], [4, 5]]
    with pytest.raises(TypeError, match=r"train_dataset\[0\]"):
        script_data.as_hf_dataset([[1, 2]], "train_dataset")


def test_lm_collator_labels_mask_the_pad_token_like_the_collator(tiny: Any) -> None:
    _, tok = tiny
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    ds = datasets.Dataset.from_list([{"input_ids": [1, 5, tok.pad_token_id, 6], "labels": [-100] * 4}])
    rows, longest = script_data.prepare_rows(ds, script_data.classify_collator(collator), tok.pad_token_id)
    expected = collator([{"input_ids": [1, 5, tok.pad_token_id, 6]}])["labels"][0].tolist()
    assert rows.rows()[0]["labels"] == expected and longest == 4


# ---------------------------------------------------------------------------- arguments
def test_batch_size_maps_to_effective_batch_without_warning(tiny: Any, tmp_path: Path) -> None:
    trainer = Trainer(
        model=tiny[0],
        args=_hf_args(
            tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2, per_device_eval_batch_size=5
        ),
        train_dataset=[{"input_ids": [1, 2, 3]}],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)
        args = RunInputs(*job_args.training_job(trainer, world_size=2, resume=None))
    assert args.effective_batch_size == 3 * 2 * 2
    assert args.max_seq_len == 3 and args.max_batch_len == 9


# ---------------------------------------------------------------------------- run_training
@pytest.fixture
def stopped_at_preflight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TrainingArgs, list[Any]]:
    """Run arguments, and the list of arguments ``run_training`` reached preflight with (where it stops)
    outside a launched worker."""
    seen: list[Any] = []

    def stop(args: TrainingArgs, plan: RunPlan) -> None:
        seen.append(args)
        raise launcher.PreflightError("stop here")

    monkeypatch.setattr(launcher, "preflight", stop)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    args = split_run(model_path=build_tiny_llama(tmp_path / "m"), data_path=data, ckpt_output_dir=tmp_path / "o")
    return args, seen


def test_run_training_accepts_instructlab_argument_order(stopped_at_preflight: tuple[TrainingArgs, list[Any]]) -> None:
    args, seen = stopped_at_preflight
    with pytest.raises(launcher.PreflightError):
        launcher.run_training(TorchrunArgs(nproc_per_node=2), args)
    assert seen == [args]


def test_run_training_inside_a_launched_worker_runs_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(launcher, "run_in_place", lambda args, plan: calls.append("in place"))
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("launched nested torchrun"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    model_dir = build_tiny_llama(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    launcher.run_training(
        split_run(model_path=model_dir, data_path=data, ckpt_output_dir=tmp_path / "o"),
        TorchrunArgs(nproc_per_node=2),
    )
    assert calls == ["in place"]


# ---------------------------------------------------------------------------- predictions
class _TwoRanks(DistributedEnv):
    """Rank 0 of a pretend 2-rank world whose rank 1 holds ``other``."""

    def __init__(self, other: list[Any]) -> None:
        super().__init__(rank=0, world_size=2)
        self.other = other

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return [obj, self.other]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj


def test_predictions_are_gathered_in_dataset_order_without_padding(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def compute_metrics(p: Any) -> dict[str, float]:
        seen["p"] = p
        return {"n": float(len(p.label_ids))}

    model_dir = build_tiny_llama(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    args = split_run(
        model_path=model_dir,
        data_path=data,
        ckpt_output_dir=tmp_path / "o",
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    vocab = 8

    def batch(rows: list[list[int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        labels = ids.masked_fill(mask == 0, -100)
        logits = torch.nn.functional.one_hot(ids, vocab).float()  # predicts its own input
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}, logits

    # 5 samples on 2 ranks (uneven): rank 0 holds 0, 2, 4; rank 1 holds 1, 3
    rank1 = PredictionCollector(*args)
    b, lg = batch([[11 % vocab, 1], [3, 3, 3]])
    rank1.add([1, 3], b, lg, b["labels"])
    rank0 = PredictionCollector(*args)
    b, lg = batch([[0], [2, 2], [4, 4, 4, 4]])
    rank0.add([0, 2, 4], b, lg, b["labels"])
    b, lg = batch([[0]])
    rank0.add([], b, lg, b["labels"])  # a dummy micro-batch adds nothing
    metrics = rank0.compute(_TwoRanks(rank1._samples))
    assert metrics == {"eval_n": 5.0}
    p = seen["p"]
    assert p.label_ids.shape == (5, 4)
    assert p.label_ids[:, 0].tolist() == [0, 3, 2, 3, 4]
    assert p.label_ids[0].tolist() == [0, -100, -100, -100]  # padding removed, then -100 to the common length
    assert (p.predictions == p.label_ids).all()


# ---------------------------------------------------------------------------- porting mappings
def _ported(tmp_path: Path, hf: TrainingArguments, **required: Any) -> TrainingArgs:
    from trainbridge.hf.porting import training_args_from_hf

    model_dir = tmp_path / "m"
    if not model_dir.exists():
        build_tiny_llama(model_dir)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return training_args_from_hf(hf, model_path=model_dir, data_path=data, **required)


def test_porting_maps_backend_schedule_warmup_and_checkpointing(tmp_path: Path) -> None:
    hf = _hf_args(
        tmp_path,
        fsdp="full_shard",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0.25,
        gradient_checkpointing=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)
        args = _ported(tmp_path, hf)
    assert args.distributed_backend == "fsdp"
    assert args.lr_scheduler == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert args.warmup_steps == 0 and args.warmup_ratio == 0.25  # a ratio of steps not known yet
    assert args.gradient_checkpointing
    ds = _ported(tmp_path, _hf_args(tmp_path, deepspeed={"zero_optimization": {"stage": 3}}))
    assert ds.distributed_backend == "deepspeed" and ds.deepspeed_zero_stage == 3


def test_warmup_ratio_resolves_against_the_run_steps(tmp_path: Path) -> None:
    from trainbridge.parallel.optim import build_scheduler

    model_dir = build_tiny_llama(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    args = split_run(
        model_path=model_dir,
        data_path=data,
        ckpt_output_dir=tmp_path / "o",
        warmup_ratio=0.25,
        lr_scheduler="linear",
        learning_rate=1.0,
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, args, total_steps=8)
    lrs = []
    for _ in range(3):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == [0.0, 0.5, 1.0]  # 2 warm-up steps of 8


def test_trl_config_max_length_becomes_max_seq_len(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    hf = trl.SFTConfig(output_dir=str(tmp_path / "out"), max_length=64, report_to="none", use_cpu=True)
    assert _ported(tmp_path, hf, max_batch_len=128).max_seq_len == 64


def test_instructlab_field_names_translate_or_name_ours(tmp_path: Path) -> None:
    """instructlab-training's README split_run(...) validates with its names: exact equivalents are translated
    (one warning each), data_output_dir is dropped; names needing a decision fail naming ours."""
    import pydantic

    from trainbridge.core.instructlab_names import InstructlabNameWarning

    model_dir = build_tiny_llama(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    base = dict(model_path=model_dir, data_path=data, ckpt_output_dir=tmp_path / "o")
    with pytest.warns(InstructlabNameWarning, match="random_seed is instructlab-training's name: use seed="):
        args = split_run(
            **base,
            random_seed=1,
            is_padding_free=True,
            num_warmup_steps=5,
            data_output_dir=str(tmp_path / "x"),
            keep_last_checkpoint_only=True,
        )
    assert (args.seed, args.packing, args.warmup_steps, args.save_total_limit) == (1, "padding_free", 5, 1)
    with pytest.raises(pydantic.ValidationError, match=r"fsdp_options: use distributed_backend=.*mock_data: use no"):
        split_run(**base, fsdp_options={}, mock_data=True)
    # instructlab's LoraOptions -> peft_config (None target_modules: every *_proj layer); rank 0: full fine-tuning
    from trainbridge.instructlab import DeepSpeedOptions, LoraOptions

    with pytest.warns(InstructlabNameWarning, match="lora is instructlab-training's name: use peft_config="):
        lora = split_run(**base, lora=LoraOptions(rank=8, alpha=16, dropout=0.05), deepspeed_options=DeepSpeedOptions())
    assert lora.peft_config is not None
    assert tuple(lora.peft_config[k] for k in ("r", "lora_alpha", "target_modules")) == (8, 16, r".*_proj")
    assert lora.distributed_backend == "ddp"  # deepspeed_options configure DeepSpeed, they do not select it
    with pytest.warns(InstructlabNameWarning):
        assert split_run(**base, lora={"rank": 0}).peft_config is None
    with pytest.raises(pydantic.ValidationError, match="cpu_offload_optimizer=True: optimizer CPU offload"):
        split_run(**base, deepspeed_options=DeepSpeedOptions(cpu_offload_optimizer=True))
    with pytest.raises(pydantic.ValidationError, match=r"random_seed .* and seed .* are both given; keep only seed"):
        split_run(**base, random_seed=1, seed=2)


def test_run_training_takes_instructlabs_torch_args_keyword(
    stopped_at_preflight: tuple[TrainingArgs, list[Any]],
) -> None:
    args, seen = stopped_at_preflight
    with pytest.raises(launcher.PreflightError):
        launcher.run_training(torch_args=TorchrunArgs(nproc_per_node=2), train_args=args)
    assert seen == [args]
    with pytest.raises(TypeError, match="not both"):
        launcher.run_training(args, TorchrunArgs(), torch_args=TorchrunArgs())


# ---------------------------------------------------------------------------- in place, one rank
def test_train_evaluate_predict_in_place_on_one_rank(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set (a launched worker of a 1-process job): the loop runs in this
    process on the datasets written as Arrow; evaluate/predict/save_model work after training."""
    from trainbridge.demos.tiny_model import arithmetic_problems

    model, tok = tiny
    model = transformers.AutoModelForCausalLM.from_config(model.config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    texts = [p + a for p, a in arithmetic_problems(24, seed=1)]
    train = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"]), batched=True, remove_columns=["text"]
    )
    val = train.select(range(5))
    seen: list[int] = []

    def compute_metrics(p: Any) -> dict[str, float]:
        seen.append(len(p.label_ids))
        return {"rows": float(len(p.label_ids))}

    args = _hf_args(
        tmp_path,
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        save_steps=3,
        eval_strategy="steps",
        eval_steps=3,
        learning_rate=1e-2,
        disable_tqdm=True,
    )
    # set after TrainingArguments, which would otherwise start accelerate's process group for this test
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    recorder = EventRecorder()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        compute_metrics=compute_metrics,
        callbacks=[recorder],
    )
    untrained = trainer.evaluate()  # standalone, before any training
    assert untrained["eval_rows"] == 5 and "eval_loss" in untrained
    assert [name for name, *_ in recorder.events] == ["on_log", "on_evaluate"]  # as Trainer.evaluate()
    assert recorder.events[-1][1]["eval_rows"] == 5 and recorder.events[-1][2]  # rank 0's state
    out = trainer.train()
    assert out.global_step == 3 and out.training_loss > 0
    assert not (tmp_path / "out" / ".trainbridge").exists()  # nothing written: the rows trained in memory
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # the caller's model trained
    assert trainer.state.global_step == 3 and any("eval_rows" in e for e in trainer.state.log_history)
    recorder.events.clear()
    logged = len(trainer.state.log_history)
    assert trainer.evaluate()["eval_rows"] == 5  # in place on the run's own set: the loop fires the events
    assert len(trainer.state.log_history) == logged + 1  # one log entry, as Trainer.evaluate()
    assert [name for name, *_ in recorder.events] == ["on_log", "on_evaluate"]
    assert isinstance(recorder.events[-1][3], TrainingArguments) and recorder.events[-1][1]["epoch"] > 0
    prediction = trainer.predict(val)
    assert prediction.label_ids.shape[0] == 5 and "test_rows" in prediction.metrics
    assert recorder.events[-1][:2] == ("on_predict", prediction.metrics)
    recorder.events.clear()  # a dict: one evaluation job over both sets, each logged and fired in turn
    both = trainer.evaluate(eval_dataset={"x": val, "y": val.select(range(2))}, metric_key_prefix="dev")
    assert (both["dev_x_rows"], both["dev_y_rows"]) == (5, 2) and "dev_y_loss" in both
    assert [(name, "dev_x_loss" in values) for name, values, *_ in recorder.events] == [
        ("on_log", True),
        ("on_evaluate", True),
        ("on_log", False),
        ("on_evaluate", False),
    ]
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "checkpoint-3").is_dir()
    # resume_from_checkpoint=True: from the newest checkpoint, to the new max_steps
    args.max_steps = 4
    resumed = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    ).train(resume_from_checkpoint=True)
    assert resumed.global_step == 4


def test_a_peft_model_trains_in_place_adapter_only(tiny: Any, tmp_path: Path) -> None:
    """The script's PeftModel is the object trained (nothing is saved and reloaded): afterwards
    ``trainer.model`` is that object, its adapter weights changed and its base weights not."""
    peft = pytest.importorskip("peft")
    base, tok = tiny
    fresh = transformers.AutoModelForCausalLM.from_config(base.config)
    fresh.load_state_dict(base.state_dict())
    model = peft.get_peft_model(fresh, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [3, 4, 5, 6]] * 4})
    args = _hf_args(tmp_path, max_steps=2, per_device_train_batch_size=2, learning_rate=0.1, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    trainer.train()
    assert trainer.model is model
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)


def test_train_metrics_keep_total_flos_like_trainer_unless_printer_callback_pops_it() -> None:
    """run_clm.py's ``train_results.json`` holds ``total_flos`` under real Trainer (ProgressCallback, the
    default, pops from a copy); with ``disable_tqdm`` Trainer's PrinterCallback pops it from the returned dict."""
    from trainbridge.hf.trainer_state import train_metrics

    history = [
        {"loss": 1.0, "step": 2},
        {"train_runtime": 0.5, "train_loss": 1.0, "total_flos": 8.0, "epoch": 1.0, "step": 2},
    ]
    assert train_metrics(history, disable_tqdm=False) == {
        "train_runtime": 0.5,
        "train_loss": 1.0,
        "total_flos": 8.0,
        "epoch": 1.0,
    }
    assert "total_flos" not in train_metrics(history, disable_tqdm=True)


class EventRecorder(transformers.TrainerCallback):
    """The events a TrainerCallback receives, with what state and args it is handed."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], bool, Any]] = []

    def _record(self, name: str, args: Any, state: Any, values: Any) -> None:
        self.events.append((name, dict(values or {}), state.is_world_process_zero, args))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self._record("on_log", args, state, logs)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._record("on_evaluate", args, state, metrics)

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._record("on_predict", args, state, metrics)


def test_it_is_a_real_trainer_whose_evaluate_predict_and_log_are_trainers_own(tiny: Any, tmp_path: Path) -> None:
    """``trainbridge.Trainer`` is a ``transformers.Trainer``: outside training ``evaluate()``, ``predict()``,
    ``get_*_dataloader()`` and ``log()`` are Trainer's own code, so they give what real Trainer gives on the
    same model and data: the metrics, the events the script's callbacks receive (with the Trainer's own args,
    state and handler), ``log_history``."""
    model, tok = tiny
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [2, 3, 4, 5, 6], [5, 6]]})
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    outcomes = []
    for cls in (transformers.Trainer, Trainer):
        recorder = EventRecorder()
        args = _hf_args(tmp_path / cls.__module__, per_device_eval_batch_size=2)
        trainer = cls(
            model=model,
            args=args,
            processing_class=tok,
            data_collator=collator,
            callbacks=[recorder],
            eval_dataset=rows,
        )
        assert isinstance(trainer, transformers.Trainer)
        batch = next(iter(trainer.get_eval_dataloader()))  # a script printing a sample batch
        trainer.state.epoch, trainer.state.global_step = 0.5, 6
        metrics = trainer.evaluate()
        named = trainer.evaluate(eval_dataset={"a": rows, "b": rows.select([0])})
        output = trainer.predict(rows)
        trainer.log({"custom": 1.0})
        events = [(name, sorted(values), zero, hf_args is args) for name, values, zero, hf_args in recorder.events]
        outcomes.append(
            (batch["input_ids"].tolist(), metrics, sorted(named), output, events, trainer.state.log_history)
        )
    (batch_hf, metrics_hf, named_hf, out_hf, events_hf, hist_hf), (batch, metrics, named, out, events, hist) = outcomes
    assert issubclass(Trainer, transformers.Trainer)
    assert batch == batch_hf
    assert metrics.keys() == metrics_hf.keys() and metrics["eval_loss"] == pytest.approx(metrics_hf["eval_loss"])
    assert named == named_hf
    assert np.allclose(out.predictions, out_hf.predictions) and (out.label_ids == out_hf.label_ids).all()
    assert out.metrics.keys() == out_hf.metrics.keys()
    assert events == events_hf and events[-1][:2] == ("on_log", ["custom", "epoch"])
    assert [sorted(e) for e in hist] == [sorted(e) for e in hist_hf]


def test_a_dict_eval_dataset_becomes_named_validation_sets(tiny: Any, tmp_path: Path) -> None:
    """During training a dict ``eval_dataset`` is evaluated set by set (``ScriptData.named_eval``), as Trainer
    does; one dataset stays ``ScriptData.eval``.  No path: the loop reads the script's data in place."""
    model, tok = tiny
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [2, 3, 4, 5]]})
    args = _hf_args(tmp_path, eval_strategy="steps", eval_steps=1, metric_for_best_model="b_loss", max_steps=2)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        eval_dataset={"a": rows, "b": rows.select([0])},
        processing_class=tok,
    )
    ported = RunInputs(*job_args.training_job(trainer, 1, None))
    data = ported.plan.script_data
    assert data is not None and data.eval is None and list(data.named_eval) == ["a", "b"]
    assert (
        ported.best_metric_eval_set(eval_set_names(*ported)) == "b"
        and ported.max_seq_len == 4
        and ported.eval_data_paths == {}
    )
    assert ported.data_path is None and ported.val_data_path is None and ported.tokenizer_path is None
    single = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, processing_class=tok)
    data = RunInputs(*job_args.training_job(single, 1, None)).plan.script_data
    assert data is not None and data.eval is not None and data.named_eval == {} and data.processing_class is tok


def test_flops_estimate_leaves_out_the_input_embeddings_like_trainer(tiny: Any) -> None:
    """run_clm.py: Trainer's ``total_flos`` is 6 x tokens x ``num_parameters(exclude_embeddings=True)``."""
    from trainbridge.core.context import flops_parameters

    model, _ = tiny
    embeddings = model.get_input_embeddings().weight.numel()
    assert flops_parameters(model) == model.num_parameters(exclude_embeddings=True)
    assert flops_parameters(model) == sum(p.numel() for p in model.parameters()) - embeddings
    assert flops_parameters(torch.nn.Linear(2, 3)) == 9


def test_flops_estimate_counts_padded_input_positions_like_trainer() -> None:
    """run_glue.py (padded to max_seq_length): Trainer's ``floating_point_ops`` counts ``input_ids.numel()``,
    padding included, not the attended tokens."""
    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.context import TrainingContext
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.step.model_loss import ModelLoss
    from trainbridge.step.token_ce import TokenCrossEntropy

    counts: dict[str, Any] = dict(flops_parameters=3, tokens_seen=7, input_tokens_seen=10)
    on_trainers_batches = TrainingContext(
        args=TrainingArgs.model_construct(), env=DistributedEnv(), flops_input_positions=True, **counts
    )
    assert on_trainers_batches.total_flos == 6 * 3 * 10
    # token-budget batches are trainbridge's own: their real tokens stand for Trainer's (unpadded) blocks
    own_batches = TrainingContext(args=TrainingArgs.model_construct(), env=DistributedEnv(), **counts)
    assert own_batches.total_flos == 6 * 3 * 7
    assert ModelLoss.flops_input_positions and not TokenCrossEntropy.flops_input_positions
