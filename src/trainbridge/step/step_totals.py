"""``StepTotals``: how a sample-batch step (``model_loss.ModelLoss.prepare``) learns its loss items and
non-padding input tokens over every rank, chosen once when the step is built.

- ``across_ranks``: one ``all_reduce`` of both counts per optimizer step (the items go to the forward as
  ``num_items_in_batch``, as Trainer gathers them; the tokens feed ``num_input_tokens_seen``).
- ``uncounted``: no collective, for a step whose loss reads no item count and whose batches carry no input
  tokens: trl's GRPO/RLOO, whose loader gives raw prompt rows (tokenised, generated and counted inside trl's
  ``_prepare_inputs``) and whose ``compute_loss`` normalises by trl's own counts.  Such batches counted
  nothing before either (0 items, 0 tokens, summed over the ranks every step).
"""

from __future__ import annotations

from typing import Protocol

from trainbridge.core.distributed import DistributedEnv


class StepTotals(Protocol):
    """``totals(env, items, tokens) -> (items, tokens)``: this rank's step counts -> every rank's; called on every
    rank at every optimizer step."""

    def __call__(self, env: DistributedEnv, items: float, tokens: float) -> tuple[float, float]: ...


def across_ranks(env: DistributedEnv, items: float, tokens: float) -> tuple[float, float]:
    """Both counts summed over the ranks in one collective (Trainer gathers the items too)."""
    total_items, total_tokens = env.sum_floats([items, tokens])  # collective: every rank, every step
    return total_items, total_tokens


def uncounted(env: DistributedEnv, items: float, tokens: float) -> tuple[float, float]:
    """No collective: the step's batches carry nothing to count (see the module doc)."""
    if items or tokens:
        raise ValueError(
            f"a step built without counts (trl's online RL: raw prompt rows) got a batch with {items:g} loss items "
            f"and {tokens:g} input tokens on rank {env.rank}: its loader must give trl's rows (lists of dicts), "
            "not tokenised batches; override get_train_dataloader to return trl's own loader"
        )
    return 0.0, 0.0
