"""Optimizers that update during backward (``parallel.backward_updates``): LOMO / AdaLomo in their fused backward,
layer-wise GaLore / APOLLO in each parameter's gradient hook.  With one process they train as Trainer trains them
(on several they are refused before launch: tests/unit/test_optimizers.py)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

from trainbridge import Trainer

CUDA = torch.cuda.is_available()


def _case(name: str, package: str, cuda: bool = False) -> Any:
    missing = importlib.util.find_spec(package) is None
    reason = f"{package} is not installed" if missing else "it allocates its state on CUDA"
    return pytest.param(name, marks=pytest.mark.skipif(missing or (cuda and not CUDA), reason=reason))


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.rows.append(dict(logs))


def _collate(tokenizer: Any) -> Any:
    """A function of the script's: Trainer's sample batches, in its order (not our token batches)."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def collate(items: list[Any]) -> Any:
        return collator(items)

    return collate


@pytest.mark.parametrize(
    "name",
    [
        _case("lomo", "lomo_optim"),
        _case("adalomo", "lomo_optim", cuda=True),
        _case("galore_adamw_layerwise", "galore_torch"),
        _case("apollo_adamw_layerwise", "apollo_torch"),
    ],
)
def test_updates_in_backward_are_trainers(
    name: str, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps of a decaying schedule: the weights, losses, logged learning rates and (zero: no gradient is left
    to clip) gradient norms of Trainer's run.  There accelerate calls LOMO's ``fused_backward(loss, lr)`` with the
    schedule's rate, and the layers' optimizers of a layer-wise one keep ``learning_rate``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    rng = random.Random(0)
    texts = ["".join(rng.choice("12+ab") for _ in range(rng.randint(4, 9))) for _ in range(12)]
    rows = datasets.Dataset.from_list([dict(tokenizer(t)) for t in texts])
    initial = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    runs = []
    for cls in (transformers.Trainer, Trainer):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__module__), per_device_train_batch_size=4, max_steps=3, optim=name,
            optim_target_modules=["q_proj", "v_proj"], optim_args="rank=4",
            learning_rate=5e-2, lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=name != "adalomo", disable_tqdm=True,
        )  # fmt: skip
        if cls is Trainer:  # in place, as under a launcher (after the arguments)
            for variable, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(variable, value)
        logs = Logs()
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
        cls(model=model, args=args, train_dataset=rows, data_collator=_collate(tokenizer), callbacks=[logs]).train()
        steps = [(row["loss"], row["grad_norm"], row["learning_rate"]) for row in logs.rows if "loss" in row]
        runs.append((model.state_dict(), steps))
    (want, want_steps), (got, got_steps) = runs
    assert len(got_steps) == len(want_steps) == 3
    for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(got_steps, want_steps, strict=True):
        assert (loss, norm, lr) == pytest.approx((want_loss, want_norm, want_lr), rel=1e-4)
    assert [norm for _, norm, _ in got_steps] == [0.0, 0.0, 0.0]
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert any(not torch.equal(got[k], initial[k]) for k in initial)
