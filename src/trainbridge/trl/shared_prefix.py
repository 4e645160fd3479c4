"""GRPO/RLOO completion log-probs with each prompt run once for all of its completions.

trl scores a batch of ``prompt + completion`` rows (``_get_per_token_logps_and_entropies``) as one padded
``[B, P + C]`` forward: each prompt runs ``num_generations`` times, left pads and right pads included.
``pack_groups`` lays the batch out by prompt instead: one row per distinct prompt, holding the prompt's
first ``P - 1`` tokens once, then for each completion of that prompt a segment ``[last prompt token,
completion tokens]`` (its real tokens only), with ``position_ids`` continuing the prompt's in every segment.
A boolean ``[G, 1, T, T]`` attention mask lets each segment see the shared prompt and itself, causally, and
nothing else, so every completion token sees exactly what it sees in trl's row.  Under causal attention the
prompt's hidden states do not depend on what follows, so the values equal trl's up to float summation
order, and the gradient reaching the shared prompt is the sum of what each copy received.  Rows shorter than
the longest are right-padded; a pad attends only to pads (never NaN) and is never attended to.

``shared_prefix_logps`` runs the model once on that layout through trl's fused LM head (the model's
``fused_lm_head=True`` forward, with the same ``temperature``) and scatters the per-token log-probs and
entropies back into trl's ``[B, C]`` layout, zero where ``completion_mask`` is 0 (trl's values there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from trainbridge.data.types import IGNORE_INDEX
from trainbridge.modeling.load import unwrap_peft
from trainbridge.modeling.padding_free import model_supports_padding_free
from trainbridge.modeling.prefix_attention import PREFIX_SDPA, PrefixRow, prefix_layout
from trainbridge.modeling.varlen_attention import has_local_attention

CUSTOM_MASK_ATTENTION = frozenset({"sdpa", "eager", PREFIX_SDPA})
"""Attention implementations that apply a custom boolean ``[G, 1, T, T]`` mask as given."""


@dataclass(frozen=True)
class PromptGroups:
    """A batch of ``prompt + completion`` rows laid out one row per distinct prompt (module doc)."""

    input_ids: torch.Tensor
    """``[G, T]``, right-padded with the pad token 0."""
    labels: torch.Tensor
    """``[G, T]``: completion tokens, ``-100`` elsewhere (prompt, segment heads, pads)."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    """``[G, 1, T, T]`` boolean, True where a query may attend a key."""
    rows: torch.Tensor
    """For each scored token, its row in trl's batch ..."""
    columns: torch.Tensor
    """... its column in trl's completion ``[B, C]`` ..."""
    groups: torch.Tensor
    """... its group row here ..."""
    shifted: torch.Tensor
    """... and its column in the fused head's output (``labels[:, 1:]``'s layout)."""
    shape: tuple[int, int]
    """trl's completion shape ``(B, C)``."""
    layout: tuple[PrefixRow, ...]
    """Each row's shared prompt and segments (``modeling.prefix_attention``: the attention over the seen scores
    only)."""


def applies(model: torch.nn.Module, length: int) -> bool:
    """Whether ``model`` (unwrapped from DDP; PEFT is looked through) scores the layout exactly: a decoder-only
    transformers model that takes ``position_ids`` and builds its causal masks with transformers' mask
    builders (which take a 4D mask as given), under sdpa or eager attention, with no sliding-window or chunked
    attention shorter than ``length`` (the mask would drop the window)."""
    model = unwrap_peft(model)
    if not isinstance(model, PreTrainedModel) or model.config._attn_implementation not in CUSTOM_MASK_ATTENTION:
        return False
    return model_supports_padding_free(model) and not has_local_attention(model.config.get_text_config(), length)


def _real_length(mask: list[int], left_padded: bool) -> int | None:
    """The number of ones in a 0/1 ``mask`` that is one run of ones at the end (``left_padded``) or at the
    start; None when the ones are not in one such run."""
    length = sum(mask)
    expected = [0] * (len(mask) - length) + [1] * length if left_padded else [1] * length + [0] * (len(mask) - length)
    return length if mask == expected else None


def pack_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PromptGroups | None:
    """Lay trl's ``[B, P + C]`` batch (``C = logits_to_keep``, prompts left-padded, completions right-padded)
    out by prompt (module doc); None when a row's masks are not in that form or a prompt is empty."""
    batch, width = input_ids.shape
    prompt_width = width - logits_to_keep
    ids = input_ids.tolist()
    masks = attention_mask.tolist()
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for row, (row_ids, row_mask) in enumerate(zip(ids, masks, strict=True)):
        prompt_length = _real_length(row_mask[:prompt_width], left_padded=True)
        completion_length = _real_length(row_mask[prompt_width:], left_padded=False)
        if not prompt_length or completion_length is None:
            return None
        prompt = tuple(row_ids[prompt_width - prompt_length : prompt_width])
        groups.setdefault(prompt, []).append((row, row_ids[prompt_width : prompt_width + completion_length]))
    layouts = []
    prefix_rows: list[PrefixRow] = []
    rows: list[int] = []
    columns: list[int] = []
    group_of: list[int] = []
    shifted: list[int] = []
    for group, (prompt, members) in enumerate(groups.items()):
        tokens = list(prompt[:-1])
        labels = [IGNORE_INDEX] * len(tokens)
        positions = list(range(len(tokens)))
        segments = [0] * len(tokens)
        spans: list[tuple[int, int]] = []
        for segment, (row, completion) in enumerate(members, start=1):
            start = len(tokens)
            spans.append((start, len(completion) + 1))
            tokens.extend([prompt[-1], *completion])
            labels.extend([IGNORE_INDEX, *completion])
            positions.extend(range(len(prompt) - 1, len(prompt) + len(completion)))
            segments.extend([segment] * (len(completion) + 1))
            for column in range(len(completion)):
                rows.append(row)
                columns.append(column)
                group_of.append(group)
                shifted.append(start + column)
        layouts.append((tokens, labels, positions, segments))
        prefix_rows.append(PrefixRow(len(prompt) - 1, tuple(spans)))
    length = max(len(tokens) for tokens, _, _, _ in layouts)

    def padded(index: int, value: int) -> torch.Tensor:
        return torch.tensor([layout[index] + [value] * (length - len(layout[0])) for layout in layouts])

    segment_ids = padded(3, -1)
    query, key = segment_ids.unsqueeze(2), segment_ids.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    visible = causal & ((query == key) | ((key == 0) & (query >= 0)))
    device = input_ids.device
    return PromptGroups(
        input_ids=padded(0, 0).to(device),
        labels=padded(1, IGNORE_INDEX).to(device),
        position_ids=padded(2, 0).to(device),
        attention_mask=visible.unsqueeze(1).to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        columns=torch.tensor(columns, dtype=torch.long, device=device),
        groups=torch.tensor(group_of, dtype=torch.long, device=device),
        shifted=torch.tensor(shifted, dtype=torch.long, device=device),
        shape=(batch, logits_to_keep),
        layout=tuple(prefix_rows),
    )


def unpack(values: torch.Tensor, packed: PromptGroups) -> torch.Tensor:
    """The fused head's per-token ``values`` (``[G, T - 1]``) in trl's ``[B, C]`` layout, zero elsewhere."""
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.columns), values[packed.groups, packed.shifted])


def shared_prefix_logps(
    model: torch.nn.Module, packed: PromptGroups, compute_entropy: bool, unwrapped: torch.nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One fused-head forward of ``packed``: per-token log-probs and (``compute_entropy``) entropies in trl's
    ``[B, C]`` layout, attended per segment (``prefix_attention.prefix_layout``, on ``unwrapped``: ``model``
    without its DDP wrapper, ``model`` itself when None)."""
    prefix_layout(unwrapped if unwrapped is not None else model, packed.attention_mask, packed.layout)
    outputs = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        labels=packed.labels,
        fused_lm_head=True,
    )
    entropy = unpack(outputs.entropy, packed) if compute_entropy else None
    return unpack(outputs.log_probs, packed), entropy
