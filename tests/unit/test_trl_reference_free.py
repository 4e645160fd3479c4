"""``trainbridge.ORPOTrainer`` and ``trainbridge.CPOTrainer`` (SimPO, AlphaPO): trl's losses and metrics on
the same tensors, one packed micro-batch against trl's padded ``get_batch_loss_metrics``, and in-place runs
with trl's config as it is (metric keys at trl's log steps, first-step loss equal to trl's)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.cpo import CPOConfig
from trl.experimental.cpo import CPOTrainer as TrlCPOTrainer
from trl.experimental.orpo import ORPOConfig
from trl.experimental.orpo import ORPOTrainer as TrlORPOTrainer

from trainbridge import CPOTrainer, ORPOTrainer
from trainbridge.core.config.loss import OwnStep
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.trl.pair_scores import PairScores, score_pairs
from trainbridge.trl.reference_free_loss import PAIR_KEYS, CPOLoss, ORPOLoss
from trainbridge.trl.reference_free_step import LabelledPairBatches

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a * b + 3)}
    for a, b in [(1, 2), (13, 25), (7, 70), (9, 1), (4, 44), (30, 3), (5, 6), (8, 12)]
]
SAME_LENGTH_ROWS = [
    {"prompt": "12+3=", "chosen": "15", "rejected": "39"},
    {"prompt": "4+52=", "chosen": "56", "rejected": "11"},
]
"""With the character tokenizer every sequence has the same length: trl's padded batch has no padding."""

CPO_CASES = [
    dict(loss_type="sigmoid"),
    dict(loss_type="sigmoid", label_smoothing=0.2, cpo_alpha=0.5),
    dict(loss_type="hinge"),
    dict(loss_type="ipo"),
    dict(loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.0),
    dict(loss_type="sigmoid", alpha=0.3),  # AlphaPO
]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def _config(config_cls: type, out: Path, **overrides: object) -> Any:
    values: dict[str, object] = dict(
        output_dir=str(out),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=12,
        beta=0.2,
        learning_rate=1e-3,
    )
    values.update(overrides)
    return config_cls(**values)


def _scores(pairs: int, seed: int) -> PairScores:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 6, (2 * pairs,), generator=generator)
    logps = -torch.rand(2 * pairs, generator=generator, dtype=torch.float64) * tokens * 2
    nll_tokens = tokens + torch.randint(0, 4, (2 * pairs,), generator=generator)
    return PairScores(
        completion_logps=logps,
        scored_logps=logps - torch.rand(2 * pairs, generator=generator, dtype=torch.float64),
        completion_tokens=tokens,
        scored_tokens=nll_tokens,
        logit_sums=torch.zeros(2 * pairs, dtype=torch.float64),
        logit_positions=tokens,
        pairs=pairs,
    )


def test_orpo_loss_equals_trls_odds_ratio_loss() -> None:
    scores = _scores(5, seed=1)
    beta = 0.3
    result = ORPOLoss(beta).micro(scores)
    stand_in = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    mean = scores.completion_logps / scores.completion_tokens
    losses, chosen, rejected, ratio, log_odds = TrlORPOTrainer.odds_ratio_loss(stand_in, mean[:5], mean[5:])  # type: ignore[arg-type]
    nll = -scores.scored_logps[:5].sum() / scores.scored_tokens[:5].sum()
    assert float(result.loss) == pytest.approx(float(nll - losses.mean()), rel=1e-6)
    assert float(result.pair_sums["rewards/chosen"]) / 5 == pytest.approx(float(chosen.mean()), rel=1e-6)
    assert float(result.pair_sums["rewards/margins"]) / 5 == pytest.approx(float((chosen - rejected).mean()), rel=1e-6)
    assert float(result.rank_means["log_odds_ratio"]) == pytest.approx(float(ratio), rel=1e-6)
    assert float(result.rank_means["log_odds_chosen"]) == pytest.approx(float(log_odds), rel=1e-6)
    assert float(result.rank_means["nll_loss"]) == pytest.approx(float(nll), rel=1e-6)


@pytest.mark.parametrize("case", CPO_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_cpo_loss_equals_trls_cpo_loss(case: dict[str, Any]) -> None:
    scores = _scores(6, seed=2)
    config = SimpleNamespace(
        **{**dict(beta=0.2, label_smoothing=0.0, cpo_alpha=1.0, simpo_gamma=0.5, alpha=0.0), **case}
    )
    loss = CPOLoss.from_config(config)
    result = loss.micro(scores)
    stand_in = SimpleNamespace(**vars(config), accelerator=SimpleNamespace(device=torch.device("cpu")))
    averaged = config.loss_type in ("ipo", "simpo")
    logps = scores.completion_logps / scores.completion_tokens if averaged else scores.completion_logps
    losses, chosen, rejected = TrlCPOTrainer.cpo_loss(stand_in, logps[:6], logps[6:])  # type: ignore[arg-type]
    nll = -scores.scored_logps[:6].sum() / scores.scored_tokens[:6].sum()
    expected = losses.mean() + config.cpo_alpha * (nll if config.cpo_alpha else 0.0)
    assert float(result.loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(result.pair_sums["rewards/chosen"]) / 6 == pytest.approx(float(chosen.mean()), rel=1e-6)
    assert float(result.pair_sums["rewards/rejected"]) / 6 == pytest.approx(float(rejected.mean()), rel=1e-6)
    accuracies = (chosen > rejected).float().mean()
    assert float(result.pair_sums["rewards/accuracies"]) / 6 == pytest.approx(float(accuracies))
    assert float(result.pair_sums["logps/chosen"]) / 6 == pytest.approx(float(logps[:6].mean()), rel=1e-6)


def test_cpo_refuses_what_trl_refuses() -> None:
    with pytest.raises(ValueError, match=r"loss_type: 'kto_pair'.*KTOTrainer"):
        CPOLoss(loss_type="kto_pair")


def _trl_trainer(trl_cls: type, config: Any, model_dir: Path, rows: list[dict[str, str]]) -> Any:
    return trl_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


@pytest.mark.parametrize(
    "trl_cls,config_cls,loss_of",
    [
        (TrlORPOTrainer, ORPOConfig, ORPOLoss.from_config),
        (TrlCPOTrainer, CPOConfig, CPOLoss.from_config),
        (TrlCPOTrainer, lambda **kw: CPOConfig(loss_type="simpo", **kw), CPOLoss.from_config),
    ],
    ids=["orpo", "cpo", "simpo"],
)
@pytest.mark.parametrize("rows", [ROWS[:3], SAME_LENGTH_ROWS], ids=["padded", "no-padding"])
def test_a_packed_micro_batch_equals_trls_padded_batch(
    tiny_llama: Path, tmp_path: Path, trl_cls: type, config_cls: Any, loss_of: Any, rows: list[dict[str, str]]
) -> None:
    """Loss and every metric of trl's ``get_batch_loss_metrics``; ``logits/*`` only without padding (trl
    averages over pad positions)."""
    config = _config(config_cls, tmp_path)
    trl = _trl_trainer(trl_cls, config, tiny_llama, rows)
    batch = trl.data_collator([trl.train_dataset[i] for i in range(len(rows))])
    trl_loss, trl_metrics = trl.get_batch_loss_metrics(trl.model, batch)

    loss = loss_of(config)
    pairs = trl.train_dataset  # trl's own preparation, as the drop-in's constructor (trl's) leaves it
    batches = LabelledPairBatches(pairs, len(rows), 1, 1, 0, 0, None, whole_sequence=loss.whole_sequence)
    result = loss.micro(score_pairs(trl.model, batches.micro_batch(range(len(rows)))["packed"]))
    assert float(result.loss) == pytest.approx(float(trl_loss), rel=1e-5)
    for key in PAIR_KEYS:
        assert float(result.pair_sums[key]) / len(rows) == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-6), key
    for key in loss.rank_keys:
        if key.startswith("logits/") and rows is not SAME_LENGTH_ROWS:
            assert float(result.rank_means[key]) != pytest.approx(trl_metrics[key], rel=1e-6)  # trl's pad positions
            continue
        assert float(result.rank_means[key]) == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(
    "ours,trl_cls,config_cls",
    [(ORPOTrainer, TrlORPOTrainer, ORPOConfig), (CPOTrainer, TrlCPOTrainer, CPOConfig)],
    ids=["orpo", "cpo"],
)
def test_in_place_run_logs_trls_keys_and_first_step_loss(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ours: type, trl_cls: type, config_cls: type
) -> None:
    trl = _trl_trainer(trl_cls, _config(config_cls, tmp_path / "trl"), tiny_llama, ROWS)
    trl.train()
    trl_logged = [row for row in trl.state.log_history if "loss" in row]
    config = _config(config_cls, tmp_path / "out", model_init_kwargs={"dtype": "float32"})
    fresh = _trl_trainer(trl_cls, _config(config_cls, tmp_path / "trl2"), tiny_llama, ROWS)
    _in_place(monkeypatch)  # trl's configs first: they set up accelerate before the in-place environment
    trainer = ours(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.train()
    assert out.global_step == trl.state.global_step == 3
    ignored = [str(w.message) for w in caught if issubclass(w.category, HFPortingWarning)]
    assert not [m for m in ignored if ".beta=" in m or ".max_length=" in m]  # the step reads them
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in logged] == [row["step"] for row in trl_logged] == [1, 2, 3]
    for row, trl_row in zip(logged, trl_logged, strict=True):
        assert set(row) == set(trl_row)
    assert logged[-1]["loss"] < logged[0]["loss"]

    # step 1 of our run against trl's loss and metrics on the same pairs (the untrained model)
    first = logged[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    plan = trainer.run_plan().loss.factory  # the ORPO/CPO step of the run
    indices = LabelledPairBatches(trainer.train_dataset, 2, 1, 1, 0, plan.seed, None).set_epoch(0).steps[0]
    loss, metrics = fresh.get_batch_loss_metrics(model, fresh.data_collator([fresh.train_dataset[i] for i in indices]))
    assert first["loss"] == pytest.approx(float(loss), rel=1e-4)
    logits_differ = {"logits/chosen", "logits/rejected"}  # trl's include pad positions
    for key in [*PAIR_KEYS, *(k for k in plan.loss.rank_keys if k not in logits_differ)]:
        assert first[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("ours,trl_cls", [(ORPOTrainer, TrlORPOTrainer), (CPOTrainer, TrlCPOTrainer)])
def test_the_drop_ins_are_trls_classes(ours: type, trl_cls: type) -> None:
    import transformers

    assert issubclass(ours, trl_cls) and issubclass(ours, transformers.Trainer)


EQUAL_LENGTH_ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a * b + 3)}
    for a, b in [(12, 3), (45, 2), (21, 4), (33, 2), (17, 5), (52, 1), (28, 3), (40, 2)]
]
"""Every prompt 5 characters, every answer 2: trl's padded batches have no padding, so its ``logits/*`` (which
average over its pad positions) are comparable too."""

TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}
NOT_COMPARED = {*TIMING, "total_flos"}
"""Wall-clock values, and the FLOPs estimate (trl's counts its padded batches' positions, the loop has none)."""


@pytest.mark.parametrize(
    "ours,trl_cls,config_cls,extra",
    [
        (ORPOTrainer, TrlORPOTrainer, ORPOConfig, {}),
        (CPOTrainer, TrlCPOTrainer, CPOConfig, {}),
        (CPOTrainer, TrlCPOTrainer, CPOConfig, {"loss_type": "simpo", "cpo_alpha": 0.5}),
    ],
    ids=["orpo", "cpo", "simpo"],
)
def test_the_packed_step_logs_trls_values(
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ours: type,
    trl_cls: type,
    config_cls: type,
    extra: dict[str, Any],
) -> None:
    """The loop's packed step on trl's prepared pairs gives every value trl logs, step by step: 3 steps of all 8
    pairs (one micro-batch: the pairs' order changes no value), the weights moving."""
    logs = []
    for cls in (trl_cls, ours):
        config = _config(
            config_cls, tmp_path / cls.__module__, per_device_train_batch_size=8, learning_rate=1e-2, **extra
        )
        if cls is ours:
            _in_place(monkeypatch)  # after the config: accelerate's state is trl's
        trainer = _trl_trainer(cls, config, tiny_llama, EQUAL_LENGTH_ROWS)
        if cls is ours:
            assert isinstance(trainer.run_plan().loss, OwnStep)  # the packed step, not trl's compute_loss
        trainer.train()
        logs.append([{k: v for k, v in row.items() if k not in NOT_COMPARED} for row in trainer.state.log_history])
    trl_log, log = logs
    assert [row["step"] for row in log] == [row["step"] for row in trl_log] == [1, 2, 3, 3]
    assert log[2]["loss"] < log[0]["loss"]
    for row, trl_row in zip(log, trl_log, strict=True):
        assert row.keys() == trl_row.keys()
        for key, value in trl_row.items():
            # float32 rounding of the packed and the padded forwards, amplified by Adam over the steps
            assert row[key] == pytest.approx(value, rel=2e-3, abs=1e-5), (key, row["step"], row[key], value)


@pytest.mark.parametrize("ours,config_cls", [(ORPOTrainer, ORPOConfig), (CPOTrainer, CPOConfig)], ids=["orpo", "cpo"])
def test_a_subclass_compute_loss_runs_per_micro_batch(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ours: type, config_cls: type
) -> None:
    """A script's subclass overriding ``compute_loss`` gets its own code run through trl's ``training_step`` on
    trl's collated micro-batches, not the loop's packed step; trl's metrics are logged."""
    calls: list[int] = []

    class Counting(ours):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            calls.append(int(inputs["chosen_input_ids"].shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = _config(config_cls, tmp_path / "out", max_steps=2, gradient_accumulation_steps=2)
    _in_place(monkeypatch)
    trainer = Counting(model=str(tiny_llama), args=config, train_dataset=datasets.Dataset.from_list(ROWS))
    assert not isinstance(trainer.run_plan().loss, OwnStep)  # trl's own step
    trainer.train()
    assert calls == [2, 2, 2, 2]  # 2 steps of 2 micro-batches of 2 pairs: trl's batches
    assert {"rewards/margins", "logps/chosen", "nll_loss"} <= set(trainer.state.log_history[0])  # trl's metrics


EVAL_TIMING = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time"}


@pytest.mark.parametrize(
    "ours,trl_cls,config_cls",
    [(ORPOTrainer, TrlORPOTrainer, ORPOConfig), (CPOTrainer, TrlCPOTrainer, CPOConfig)],
    ids=["orpo", "cpo"],
)
def test_evaluate_is_trls(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ours: type, trl_cls: type, config_cls: type
) -> None:
    """``eval_dataset`` is taken and prepared by trl's constructor; ``evaluate()`` is trl's own
    (``evaluation_loop``, ``prediction_step``: its padded batches, loss and metrics), equal to trl's."""
    found = []
    for cls in (trl_cls, ours):
        config = _config(config_cls, tmp_path / cls.__module__, per_device_eval_batch_size=2)
        if cls is ours:
            _in_place(monkeypatch)
        trainer = cls(
            model=AutoModelForCausalLM.from_pretrained(tiny_llama),
            args=config,
            train_dataset=datasets.Dataset.from_list(ROWS),
            eval_dataset=datasets.Dataset.from_list(ROWS[:4]),
            processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        )
        found.append({k: v for k, v in trainer.evaluate().items() if k not in EVAL_TIMING})
    trl_metrics, metrics = found
    assert {"eval_loss", "eval_rewards/margins", "eval_nll_loss"} <= set(metrics)
    assert metrics == pytest.approx(trl_metrics, rel=1e-5)
