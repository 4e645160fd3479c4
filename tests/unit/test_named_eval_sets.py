"""Named validation sets (``TrainingArgs.eval_data_paths``; the facade's dict ``eval_dataset``), as
``transformers.Trainer`` evaluates a dict of eval datasets: each set in turn at every evaluation, metrics
``eval_<name>_...``, each with its own ``on_log``/``on_evaluate``; ``metric_for_best_model`` naming one set's
metric drives best-model tracking and early stopping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from transformers import EarlyStoppingCallback, TrainerCallback

from tests.run_inputs import as_run, split_run
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.demos.tiny_model import write_arithmetic_dataset
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop


def test_config_names_sets_and_checks_the_best_metric(run_files: dict[str, Path]) -> None:
    base = dict(model_path=run_files["model"], data_path=run_files["train"], ckpt_output_dir=run_files["out"])
    sets = {"a": run_files["val"], "a_b": run_files["train"]}
    args = split_run(
        **base, eval_data_paths=sets, eval_strategy="steps", eval_steps=1, metric_for_best_model="a_b_loss"
    )
    assert args.best_metric_name == "eval_a_b_loss" and args.best_metric_eval_set(sets) == "a_b"
    assert (
        split_run(**base, eval_data_paths=sets, metric_for_best_model="eval_a_loss").best_metric_eval_set(sets) == "a"
    )
    with pytest.raises(ValueError, match=r"metric_for_best_model.*'eval_a_loss'"):
        split_run(
            **base, eval_data_paths=sets, load_best_model_at_end=True, eval_strategy="steps", eval_steps=1, save_steps=1
        )  # Trainer's default eval_loss: no set reports it
    with pytest.raises(pydantic.ValidationError, match="eval_data_paths: give named validation sets or"):
        split_run(**base, eval_data_paths=sets, val_data_path=run_files["val"])
    with pytest.raises(pydantic.ValidationError, match="validation set 'c': data file"):
        split_run(**base, eval_data_paths={"c": run_files["out"] / "missing.jsonl"})


class Recorder(TrainerCallback):
    """What a TrainerCallback sees at on_log/on_evaluate."""

    def __init__(self) -> None:
        self.evaluations: list[tuple[int, list[str]]] = []
        self.logs: list[dict[str, Any]] = []

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self.evaluations.append((state.global_step, sorted(metrics)))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs))


class ScriptedSetLoss(TrainerCallback):
    """Overwrites ``eval_<name>_loss`` with the next scripted value at that set's on_evaluate (before the
    best tracker and early stopping read it)."""

    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values = name, list(values)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        key = f"eval_{self.name}_loss"
        if key in metrics:
            metrics[key] = self.values.pop(0)


def test_each_set_is_evaluated_logged_and_tracked_in_turn(tmp_path: Path, tiny_llama: Path) -> None:
    train = write_arithmetic_dataset(tmp_path / "train.jsonl", 48, seed=1)
    first = write_arithmetic_dataset(tmp_path / "first.jsonl", 6, seed=2)
    second = write_arithmetic_dataset(tmp_path / "second.jsonl", 5, seed=3)
    recorder = Recorder()
    # set "b" gets worse after its first evaluation: best stays at step 1, early stopping (patience 2) at step 3
    args = split_run(
        model_path=tiny_llama,
        data_path=train,
        eval_data_paths={"a": first, "b": second},
        ckpt_output_dir=tmp_path / "out",
        max_seq_len=32,
        max_batch_len=64,
        effective_batch_size=8,
        max_steps=6,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="b_loss",
        load_best_model_at_end=True,
        disable_tqdm=True,
        callbacks=[
            recorder,
            ScriptedSetLoss("a", [0.1, 0.05, 0.01]),
            ScriptedSetLoss("b", [1.0, 2.0, 3.0]),
            EarlyStoppingCallback(early_stopping_patience=2),
        ],
    )
    env = DistributedEnv()
    loop = TrainingLoop(as_run(args).args, env, assemble_callbacks(*as_run(args)), build_run(*as_run(args), env))
    result = loop.run()

    assert result.global_step == 3 and result.stopped_early  # early stopping on eval_b_loss, not on a's
    assert result.callback_errors == []  # the tracker skips set a's on_evaluate rather than failing on it
    a_keys = ["epoch", "eval_a_loss", "eval_a_runtime", "eval_a_samples_per_second", "eval_a_steps_per_second"]
    b_keys = [k.replace("eval_a_", "eval_b_") for k in a_keys]
    assert recorder.evaluations == [(step, keys) for step in (1, 2, 3) for keys in (a_keys, b_keys)]
    assert loop.context.best_metric == 1.0 and result.best_checkpoint == str(tmp_path / "out" / "checkpoint-1")
    # every set's log reaches metrics.jsonl and trainer_state.json's log_history, one entry each
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if "eval_a_loss" in e] == [1, 2, 3]
    assert [e["step"] for e in lines if "eval_b_loss" in e] == [1, 2, 3]
    assert not any("eval_a_loss" in e and "eval_b_loss" in e for e in lines)
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    evals = [e for e in state["log_history"] if any(k.startswith("eval_") for k in e)]
    assert [(e["step"], "eval_a_loss" in e) for e in evals] == [(s, a) for s in (1, 2, 3) for a in (True, False)]
    assert state["best_metric"] == 1.0 and state["best_global_step"] == 1


def test_yaml_resolves_named_set_paths_against_its_folder(run_files: dict[str, Path]) -> None:
    folder = run_files["train"].parent
    config = folder / "run.yaml"
    config.write_text(
        f"model_path: model\ndata_path: train.jsonl\nckpt_output_dir: out\n"
        f"eval_data_paths:\n  a: val.jsonl\n  b: {run_files['train']}\n"
    )
    args = TrainingArgs.from_yaml(config)
    assert args.eval_data_paths == {"a": folder / "val.jsonl", "b": run_files["train"]}
    again = TrainingArgs.from_yaml(_written(args, folder / "again.yaml"))
    assert again.eval_data_paths == {"a": (folder / "val.jsonl").resolve(), "b": run_files["train"].resolve()}


def _written(args: TrainingArgs, path: Path) -> Path:
    args.to_yaml(path)
    return path
