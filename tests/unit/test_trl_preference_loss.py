"""DPO's losses and metrics against trl's own ``DPOTrainer._compute_loss`` on the same model and pairs.

trl's method runs unchanged on a stand-in ``self`` (the attributes its ``__init__`` would set) with a
tiny Llama carrying trl's fused LM head and a padded batch from trl's ``DataCollatorForPreference``;
ours packs the same pairs into one padding-free row (``sequence_stats``) and combines the terms.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from trainbridge.trl.preference_loss import (  # noqa: E402
    LOSS_TYPES,
    DPOLossSettings,
    combine_terms,
    dpo_loss_terms,
    dpo_metric_sums,
    pair_weights,
)
from trainbridge.trl.sequence_logps import pack_pairs, sequence_stats  # noqa: E402

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12], [1, 13, 14]]
CHOSEN = [[20, 21, 2], [22, 23, 24, 25, 2], [26, 2], [27, 28, 29, 2]]
REJECTED = [[30, 2], [31, 32, 2], [33, 34, 35, 36, 37, 2], [38, 39, 2]]


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _trl_loss(
    policy: Any, reference: Any, settings: DPOLossSettings, max_length: int | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """trl's own ``_compute_loss`` on copies of the models carrying trl's fused LM head."""
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    add_fused_lm_head(policy, outputs=outputs)
    add_fused_lm_head(reference)
    stand_in = SimpleNamespace(
        model=policy,
        ref_model=reference,
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=settings.ld_alpha,
        precompute_ref_logps=False,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=settings.discopop_tau),
        f_divergence_type=settings.f_divergence_type,
        f_alpha_divergence_coef=settings.f_alpha_divergence_coef,
        loss_types=list(settings.loss_type),
        loss_weights=list(settings.weights),
        beta=settings.beta,
        label_smoothing=settings.label_smoothing,
        use_weighting=settings.use_weighting,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    policy.train()  # trl reads the mode from model.training; dropout is zero in this config
    examples = [
        {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
    ]
    batch = DataCollatorForPreference(pad_token_id=0, max_length=max_length)(examples)
    loss = DPOTrainer._compute_loss(stand_in, policy, batch, return_outputs=False)
    return loss, {key: values[-1] for key, values in stand_in._metrics["train"].items()}


def _our_loss(
    policy: Any, reference: Any, settings: DPOLossSettings, max_length: int | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    packed = pack_pairs(PROMPTS, CHOSEN, REJECTED, max_length=max_length)
    stats = sequence_stats(policy, packed, settings.ld_alpha)
    with torch.no_grad():
        ref = sequence_stats(reference, packed, settings.ld_alpha)
    chosen_tokens, rejected_tokens = stats.tokens.chunk(2)
    weights = None
    if settings.use_weighting:
        chosen_aligned, rejected_aligned = (stats.aligned_logps / stats.tokens.clamp(min=1)).chunk(2)
        weights = pair_weights(chosen_aligned, rejected_aligned)
    terms = dpo_loss_terms(stats.pair_logps(), ref.pair_logps(), settings, chosen_tokens, rejected_tokens, weights)
    loss = combine_terms(terms, {"pairs": packed.pairs, "chosen_tokens": float(chosen_tokens.sum())})
    sums = dpo_metric_sums(stats.pair_logps(), ref.pair_logps(), settings.beta)
    metrics = {key: float(value) / packed.pairs for key, value in sums.items()}
    tokens = stats.tokens.sum()
    metrics["entropy"] = float(stats.entropy.sum() / tokens)
    chosen_mean_logits, rejected_mean_logits = stats.mean_logits.chunk(2)
    metrics["logits/chosen"] = float(chosen_mean_logits.sum() / chosen_tokens.sum())
    metrics["logits/rejected"] = float(rejected_mean_logits.sum() / rejected_tokens.sum())
    metrics["mean_token_accuracy"] = float(stats.top1.chunk(2)[0].sum() / chosen_tokens.sum())
    return loss, metrics


SETTINGS = [
    *(DPOLossSettings(loss_type=(t,), beta=0.3) for t in LOSS_TYPES if t not in {"exo_pair", "robust"}),
    DPOLossSettings(loss_type=("robust",), beta=0.2, label_smoothing=0.1),
    DPOLossSettings(loss_type=("exo_pair",), beta=0.2, label_smoothing=1e-3),
    DPOLossSettings(loss_type=("aot",), beta=0.2, label_smoothing=0.1),
    DPOLossSettings(loss_type=("sigmoid", "sft", "bco_pair"), loss_weights=(0.8, 0.2, 1.0)),  # MPO
    DPOLossSettings(loss_type=("sigmoid",), f_divergence_type="js_divergence"),
    DPOLossSettings(loss_type=("hinge",), f_divergence_type="forward_kl"),
    DPOLossSettings(loss_type=("ipo",), f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    DPOLossSettings(loss_type=("sigmoid", "ipo"), use_weighting=True),  # trl fails on sft + use_weighting
    DPOLossSettings(loss_type=("sigmoid",), ld_alpha=0.4),
]


@pytest.mark.parametrize(
    "settings",
    SETTINGS,
    ids=lambda s: (
        "+".join(s.loss_type)
        + f"-{s.f_divergence_type}"
        + ("-wpo" if s.use_weighting else "")
        + ("-ld" if s.ld_alpha is not None else "")
    ),
)
def test_loss_and_metrics_match_trl(settings: DPOLossSettings) -> None:
    policy, reference = _model(0), _model(1)
    trl_loss, trl_metrics = _trl_loss(policy, reference, settings)
    our_loss, our_metrics = _our_loss(policy, reference, settings)
    torch.testing.assert_close(our_loss, trl_loss.float(), rtol=1e-5, atol=1e-6)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "entropy",
        "mean_token_accuracy",
    ):
        assert our_metrics[key] == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-6), key


def test_gradients_match_trl() -> None:
    settings = DPOLossSettings(loss_type=("sigmoid",), beta=0.5)
    policy, reference = _model(0), _model(1)
    theirs = copy.deepcopy(policy)
    _our_loss(policy, reference, settings)[0].backward()
    trl_policy_loss, _ = _trl_loss_with_policy(theirs, reference, settings)
    trl_policy_loss.backward()
    for (name, ours), (_, trls) in zip(policy.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(ours.grad, trls.grad, rtol=1e-4, atol=1e-6, msg=name)


def _trl_loss_with_policy(policy: Any, reference: Any, settings: DPOLossSettings) -> tuple[torch.Tensor, Any]:
    """``_trl_loss`` on ``policy`` itself (not a copy), so its gradients can be read."""
    original = copy.deepcopy
    try:
        copy.deepcopy = lambda model, *a: model if model is policy else original(model, *a)  # type: ignore[assignment]
        return _trl_loss(policy, reference, settings)
    finally:
        copy.deepcopy = original


def test_packed_row_equals_one_forward_per_sequence() -> None:
    """Each sequence's log-prob from the packed row equals a forward of that sequence alone."""
    model = _model(0)
    packed = pack_pairs(PROMPTS, CHOSEN, REJECTED)
    with torch.no_grad():
        stats = sequence_stats(model, packed)
        for index, (prompt, completion) in enumerate(zip(PROMPTS * 2, CHOSEN + REJECTED, strict=True)):
            ids = torch.tensor([[*prompt, *completion]])
            logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            alone = logps.gather(1, ids[0, 1:, None]).squeeze(1)[len(prompt) - 1 :].sum()
            torch.testing.assert_close(stats.logps[index], alone, rtol=1e-5, atol=1e-5)
            assert int(stats.tokens[index]) == len(completion)


def test_truncation_matches_trl() -> None:
    settings = DPOLossSettings(loss_type=("sigmoid",), beta=0.3)
    policy, reference = _model(0), _model(1)
    trl_loss, trl_metrics = _trl_loss(policy, reference, settings, max_length=6)
    our_loss, our_metrics = _our_loss(policy, reference, settings, max_length=6)
    torch.testing.assert_close(our_loss, trl_loss.float(), rtol=1e-5, atol=1e-6)
    assert our_metrics["logps/chosen"] == pytest.approx(trl_metrics["logps/chosen"], rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": ("dpo",)}, "loss_type"),
        ({"loss_type": ("sigmoid", "ipo"), "loss_weights": (1.0,)}, "loss_weights"),
        ({"loss_type": ("robust",), "label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": ("exo_pair",)}, "label_smoothing"),
        ({"loss_type": ("aot",), "f_divergence_type": "forward_kl"}, "f_divergence_type"),
        ({"loss_type": ("aot",), "use_weighting": True}, "use_weighting"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPOLossSettings(**kwargs)


def test_settings_from_trl_config(tmp_path: Any) -> None:
    from trl import DPOConfig

    config = DPOConfig(
        output_dir=str(tmp_path),
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.5],
        beta=0.2,
        label_smoothing=0.05,
        report_to="none",
        bf16=False,
    )
    settings = DPOLossSettings.from_config(config)
    assert settings.loss_type == ("sigmoid", "sft")
    assert settings.loss_weights == (1.0, 0.5)
    assert (settings.beta, settings.label_smoothing) == (0.2, 0.05)


def test_terms_of_micro_batches_sum_to_the_steps_loss() -> None:
    """Split over micro-batches (or ranks), each term's sums add up; divided once by the step's counts they
    give the loss of all pairs at once (what a step with several micro-batches optimises)."""
    from trainbridge.trl.preference_loss import SequenceLogps

    torch.manual_seed(0)
    policy = SequenceLogps(-torch.rand(6) * 20, -torch.rand(6) * 20)
    reference = SequenceLogps(-torch.rand(6) * 20, -torch.rand(6) * 20)
    chosen_tokens, rejected_tokens = torch.randint(1, 9, (6,)), torch.randint(1, 9, (6,))
    settings = DPOLossSettings(loss_type=("sigmoid", "ipo", "sft"), loss_weights=(1.0, 0.5, 0.2))
    counts = {"pairs": 6.0, "chosen_tokens": float(chosen_tokens.sum())}
    whole = combine_terms(dpo_loss_terms(policy, reference, settings, chosen_tokens, rejected_tokens), counts)
    parts = [
        dpo_loss_terms(
            SequenceLogps(policy.chosen[s], policy.rejected[s]),
            SequenceLogps(reference.chosen[s], reference.rejected[s]),
            settings,
            chosen_tokens[s],
            rejected_tokens[s],
        )
        for s in (slice(0, 2), slice(2, 6))
    ]
    split = sum(combine_terms(terms, counts) for terms in parts)
    torch.testing.assert_close(split, whole)
