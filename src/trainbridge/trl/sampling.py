"""GRPO/RLOO's sampling with each distinct prompt prefilled once and a lean decode loop.

trl generates with ``model.generate`` on ``[B, P]`` prompts in which each prompt is repeated
``num_generations`` times, so each is prefilled that many times, and every decode step pays ``generate``'s
per-step bookkeeping (input preparation, mask building, stopping criteria objects).  ``sample_completions``
prefills the distinct prompts once (left-padded as trl pads them), copies each prompt's KV cache to its rows
(``Cache.batch_select_indices``) and decodes with the model's own forward (``decode_step``: replayed from its
submodules without the forward's per-call wrappers where that gives its logits bit for bit): per step the
float32 logits of the last position, the sampling processors ``generate`` builds for trl's settings
(temperature, top-k, top-p, min-p, in ``generate``'s order), ``softmax`` and one ``torch.multinomial`` over all
``B`` rows, finished rows continued with the pad token, stopping when every row has an end-of-sequence token or
``max_new_tokens`` are drawn. That is ``generate``'s sampling step for step, the same draws from the same random
stream, so the completions are ``generate``'s (bitwise wherever the prefill's logits are: a batch-1 prefill may
round differently from trl's batch-``B`` one).

``supported`` says when that holds: sampling without beams or a repetition penalty, and no other setting of
trl's generation config or of the model's own that would add a processor or a stopping rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trainbridge.trl import decode_step

SUPPORTED_FIELDS = frozenset(
    {
        "max_new_tokens",
        "do_sample",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "cache_implementation",
        "disable_compile",
        "use_cache",
        "transformers_version",
        "_from_model_config",
    }
)
"""Generation settings ``sample_completions`` follows; any other setting leaves it to ``generate`` unless it is off
(``None``, ``False``, ``0``) or one of ``NEUTRAL``."""

NEUTRAL = {"num_beams": 1, "num_return_sequences": 1}
"""Settings whose value here does what leaving them unset does."""


def supported(config: GenerationConfig, model_config: GenerationConfig | None) -> bool:
    """Whether ``sample_completions`` samples as ``generate`` does with trl's ``config`` on a model whose own
    generation config is ``model_config``: sampling, one beam, no repetition penalty, ``max_new_tokens``, top-k,
    top-p and temperature set, nothing outside ``SUPPORTED_FIELDS`` set in either."""
    for settings in (config, model_config):
        for key, value in (settings.to_diff_dict() if settings is not None else {}).items():
            if key not in SUPPORTED_FIELDS and value not in (None, False, 0) and NEUTRAL.get(key) != value:
                return False
    return (
        bool(config.do_sample)
        and config.max_new_tokens is not None
        and config.repetition_penalty in (None, 1.0)
        and None not in (config.temperature, config.top_k, config.top_p)
    )


def processors(config: GenerationConfig) -> LogitsProcessorList:
    """The sampling processors ``generate`` builds for ``config`` (``supported``), in its order."""
    out = LogitsProcessorList()
    if config.temperature != 1.0:
        out.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k != 0:
        out.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        out.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return out


def sample_completions(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
) -> list[list[int]]:
    """Sample one completion per prompt row (rows may repeat a prompt); each up to and including its first
    end-of-sequence token, as trl keeps them (module doc)."""
    device = next(model.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    row_prompt = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    width = max(len(p) for p in distinct)
    lengths = torch.tensor([len(p) for p in distinct], device=device)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in distinct], device=device)
    padded = bool((lengths < width).any())
    mask = (torch.arange(width, device=device) >= (width - lengths).unsqueeze(1)).long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask if padded else None,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    rows = torch.tensor(row_prompt, device=device)
    cache.batch_select_indices(rows)
    logits = out.logits[rows, -1]
    input_ids, mask, next_position = ids[rows], mask[rows], lengths[rows].unsqueeze(1)
    warpers = processors(config)
    decode = decode_step.Decoder(model)
    eos = torch.tensor(list(eos_token_ids), device=device)
    unfinished = torch.ones(len(prompts), dtype=torch.long, device=device)
    generated: list[torch.Tensor] = []
    while True:
        scores = warpers(cast(torch.LongTensor, input_ids), logits.to(copy=True, dtype=torch.float32))
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        tokens = tokens * unfinished + pad_token_id * (1 - unfinished)
        generated.append(tokens)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        unfinished = unfinished & ~torch.isin(tokens, eos)
        if len(generated) == config.max_new_tokens or unfinished.max() == 0:
            break
        if padded:
            mask = torch.cat([mask, mask.new_ones(mask.size(0), 1)], dim=-1)
        logits = decode(tokens, next_position, mask if padded else None, cache)
        next_position = next_position + 1
    completions = torch.stack(generated, dim=1).tolist()
    eos_set = set(eos_token_ids)
    return [_through_first(row, eos_set) for row in completions]


def _through_first(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first of ``eos`` (all of them when there is none)."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens
