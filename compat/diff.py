"""Compare a trainbridge run with the ``transformers.Trainer`` run of the same scenario, and explain
every difference.

Traces are aligned hook by hook on ``(event, global_step)`` (``difflib``), so a missing or extra hook
shows as one difference instead of shifting everything after it; aligned hooks are compared field by
field.  Artifacts (``compat.artifacts``) are compared by name.  Each difference is matched against
``KNOWN_DIFFERENCES``: a *deliberate* difference is a documented design choice of trainbridge; a
*divergence* is a trainbridge bug with its root cause and proposed fix, marked here until it is fixed.
Anything else is *unexplained* and fails the comparison.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from compat.artifacts import collect_artifacts
from compat.recorder import CONTROL_FLAGS, read_trace
from compat.runners import RunOutcome
from compat.scenarios import Scenario

TRACE_FIELDS = (
    "epoch",
    "max_steps",
    "num_train_epochs",
    "logs",
    "metrics",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "kwargs",
    "none_kwargs",
    "num_input_tokens_seen",
)
"""Snapshot fields compared on aligned hooks (``control`` is compared flag by flag)."""


@dataclass(frozen=True)
class Difference:
    """One thing that is not the same.  ``where``: ``rank 0 trace``, ``artifact <name>``...;
    ``event``/``step``: the hook (traces); ``field``: what differs."""

    scenario: str
    world_size: int
    where: str
    field: str
    trainer: Any
    trainbridge: Any
    event: str | None = None
    step: int | None = None
    rank: int | None = None

    def describe(self) -> str:
        """One line: where, what, and both values."""
        at = f"{self.event} @ step {self.step}, " if self.event else ""
        return (
            f"{self.where}: {at}{self.field}: Trainer {_short(self.trainer)} / trainbridge {_short(self.trainbridge)}"
        )


@dataclass(frozen=True)
class KnownDifference:
    """An explained difference: ``deliberate`` (trainbridge design) or ``divergence`` (a trainbridge bug,
    with ``cause`` and ``fix``)."""

    key: str
    kind: Literal["deliberate", "divergence"]
    summary: str
    cause: str
    applies: Callable[[Difference], bool]
    fix: str | None = None


@dataclass
class Comparison:
    """The comparison of one scenario at one world size."""

    scenario: Scenario
    world_size: int
    trainer: RunOutcome
    trainbridge: RunOutcome
    reference: str = ""
    explained: list[tuple[Difference, KnownDifference]] = field(default_factory=list)
    unexplained: list[Difference] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No unexplained difference and both runs behaved as expected."""
        return not self.unexplained

    def known(self) -> dict[str, tuple[KnownDifference, list[Difference]]]:
        """The explained differences grouped by ``KnownDifference.key``."""
        groups: dict[str, tuple[KnownDifference, list[Difference]]] = {}
        for difference, known in self.explained:
            groups.setdefault(known.key, (known, []))[1].append(difference)
        return groups


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ============================================================================ known differences
def _is(
    scenario: str | None = None,
    *,
    event: str | None = None,
    fields: Sequence[str] = (),
    where_prefix: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    step: int | None = None,
) -> Callable[[Difference], bool]:
    """A predicate over a difference; every given criterion must hold."""

    def applies(d: Difference) -> bool:
        return (
            (scenario is None or d.scenario == scenario)
            and (event is None or d.event == event)
            and (not fields or d.field in fields)
            and (where_prefix is None or d.where.startswith(where_prefix))
            and (rank is None or d.rank == rank)
            and (world_size is None or d.world_size == world_size)
            and (step is None or d.step == step)
        )

    return applies


KNOWN_DIFFERENCES: tuple[KnownDifference, ...] = (
    KnownDifference(
        "one-rank-stop-agreed",
        "deliberate",
        "a stop requested by an HF callback on the last rank only: the other ranks' HF callbacks see "
        "should_training_stop from the next hook on (on_epoch_end), not in the on_step_end where it was set",
        "control flags are per rank in Trainer; trainbridge agrees them across ranks at the decision point "
        "after on_step_end and folds the agreed decision into every rank's TrainerControl before the next "
        "hook. This is what lets every rank stop at the same step (Trainer crashes or hangs instead).",
        _is("one_rank_stop", event="on_step_end", fields=("control.should_training_stop",), world_size=2, step=3),
    ),
    KnownDifference(
        "train-batch-size",
        "deliberate",
        "TrainerState.train_batch_size (and args.per_device_train_batch_size) is the samples per rank per "
        "optimizer step (micro-batch rows x accumulation); Trainer's is the micro-batch size",
        "trainbridge batches by token budget, so rows per micro-batch vary; trainbridge.hf.arguments builds "
        "TrainingArguments with per_device_train_batch_size = effective_batch_size // world_size and "
        "gradient_accumulation_steps = 1 (documented there). Equal whenever no gradient accumulation is used.",
        _is(where_prefix="artifact checkpoint-", fields=("train_batch_size",)),
    ),
)
"""Every explained difference; ``report.py`` lists them with the scenarios where they showed."""


def explain(difference: Difference) -> KnownDifference | None:
    """The known difference that explains ``difference``, if any."""
    return next((known for known in KNOWN_DIFFERENCES if known.applies(difference)), None)


# ============================================================================ comparison
def compare(
    spec: Scenario,
    world_size: int,
    trainer: RunOutcome,
    trainbridge: RunOutcome,
    trainer_one_rank: RunOutcome | None = None,
) -> Comparison:
    """Compare the two runs of ``spec`` at ``world_size``.

    Where Trainer is expected to fail at this size (``spec.trainer_fails``), its failure is recorded as a
    finding and trainbridge's ranks are compared with the one-rank Trainer run instead."""
    comparison = Comparison(spec, world_size, trainer, trainbridge)
    differences: list[Difference] = []
    reference = trainer
    if world_size in spec.trainer_fails:
        if trainer.status == "completed":
            differences.append(
                Difference(spec.name, world_size, "Trainer run", "status", "completed", "expected a crash or a hang")
            )
        else:
            comparison.findings.append(f"Trainer {trainer.status} on {world_size} ranks (expected): {trainer.error}")
        if trainer_one_rank is None or trainer_one_rank.status != "completed":
            comparison.findings.append("no completed one-rank Trainer run to compare trainbridge's ranks with")
            reference = trainer
        else:
            reference = trainer_one_rank
            comparison.reference = "the one-rank Trainer run (each trainbridge rank against Trainer's rank 0)"
    elif trainer.status != "completed":
        differences.append(Difference(spec.name, world_size, "Trainer run", "status", trainer.status, "reference"))
        comparison.findings.append(f"Trainer {trainer.status}: {trainer.error}")
    if trainbridge.status != "completed":
        differences.append(
            Difference(
                spec.name,
                world_size,
                "trainbridge run",
                "status",
                "completed",
                f"{trainbridge.status}: {trainbridge.error}",
            )
        )
    elif trainbridge.callback_errors != sorted(set(spec.expected_callback_errors)):
        differences.append(
            Difference(
                spec.name,
                world_size,
                "trainbridge run",
                "callback_errors",
                sorted(set(spec.expected_callback_errors)),
                trainbridge.callback_errors,
            )
        )
    elif spec.expected_callback_errors:
        comparison.findings.append(
            f"trainbridge isolated and reported {', '.join(trainbridge.callback_errors)}; "
            "every other callback matched Trainer's run without it"
        )
    if reference.status == "completed" and trainbridge.status == "completed":
        reference_ranks = reference.world_size
        phases = [""] + (["resume"] if spec.resume_from is not None else [])
        for phase in phases:
            traces = [read_trace(trainbridge.trace_dir(phase), rank) for rank in range(world_size)]
            differences += _rank_agreement(spec.name, world_size, phase, traces)
            for rank, ours in enumerate(traces):
                theirs = read_trace(reference.trace_dir(phase), rank if reference_ranks == world_size else 0)
                label = f"rank {rank} trace" + (f" ({phase})" if phase else "")
                differences += compare_traces(spec.name, world_size, rank, label, theirs, ours)
        if reference is trainer:
            differences += compare_artifacts(
                spec.name, world_size, collect_artifacts(trainer.run_dir), collect_artifacts(trainbridge.run_dir)
            )
    for difference in differences:
        known = explain(difference)
        if known is None:
            comparison.unexplained.append(difference)
        else:
            comparison.explained.append((difference, known))
    return comparison


def _rank_agreement(scenario: str, world_size: int, phase: str, traces: list[list[dict[str, Any]]]) -> list[Difference]:
    """trainbridge's ranks must fire the same hooks at the same steps."""
    sequences = [[(s["event"], s["global_step"]) for s in trace] for trace in traces]
    return [
        Difference(
            scenario,
            world_size,
            f"trainbridge rank {rank} vs rank 0" + (f" ({phase})" if phase else ""),
            "hook sequence",
            sequences[0],
            sequence,
            rank=rank,
        )
        for rank, sequence in enumerate(sequences[1:], start=1)
        if sequence != sequences[0]
    ]


def compare_traces(
    scenario: str,
    world_size: int,
    rank: int,
    where: str,
    trainer: list[dict[str, Any]],
    trainbridge: list[dict[str, Any]],
) -> list[Difference]:
    """Differences between two traces of one rank (aligned on ``(event, global_step)``)."""
    keys_a = [(s["event"], s["global_step"]) for s in trainer]
    keys_b = [(s["event"], s["global_step"]) for s in trainbridge]
    if not trainer:
        return [Difference(scenario, world_size, where, "trace", "empty", f"{len(trainbridge)} hooks", rank=rank)]
    differences: list[Difference] = []
    matcher = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for a, b in zip(trainer[a0:a1], trainbridge[b0:b1]):
                differences += _compare_snapshots(scenario, world_size, rank, where, a, b)
            continue
        for a in trainer[a0:a1]:
            differences.append(
                Difference(
                    scenario,
                    world_size,
                    where,
                    "hook",
                    "called",
                    "not called",
                    event=a["event"],
                    step=a["global_step"],
                    rank=rank,
                )
            )
        for b in trainbridge[b0:b1]:
            differences.append(
                Difference(
                    scenario,
                    world_size,
                    where,
                    "hook",
                    "not called",
                    "called",
                    event=b["event"],
                    step=b["global_step"],
                    rank=rank,
                )
            )
    return differences


def _compare_snapshots(
    scenario: str, world_size: int, rank: int, where: str, a: dict[str, Any], b: dict[str, Any]
) -> list[Difference]:
    found = []
    for name in TRACE_FIELDS:
        if a.get(name) != b.get(name):
            found.append(
                Difference(
                    scenario,
                    world_size,
                    where,
                    name,
                    a.get(name),
                    b.get(name),
                    event=a["event"],
                    step=a["global_step"],
                    rank=rank,
                )
            )
    for flag in CONTROL_FLAGS:
        if a["control"][flag] != b["control"][flag]:
            found.append(
                Difference(
                    scenario,
                    world_size,
                    where,
                    f"control.{flag}",
                    a["control"][flag],
                    b["control"][flag],
                    event=a["event"],
                    step=a["global_step"],
                    rank=rank,
                )
            )
    return found


def compare_artifacts(
    scenario: str, world_size: int, trainer: dict[str, Any], trainbridge: dict[str, Any]
) -> list[Difference]:
    """Differences between the artifacts of two runs (by artifact name, then by field)."""
    differences = []
    for name in sorted(set(trainer) | set(trainbridge)):
        where = f"artifact {name}"
        if name not in trainer or name not in trainbridge:
            differences.append(Difference(scenario, world_size, where, "present", name in trainer, name in trainbridge))
            continue
        a, b = trainer[name], trainbridge[name]
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    differences.append(Difference(scenario, world_size, where, key, a.get(key), b.get(key)))
        elif a != b:
            differences.append(Difference(scenario, world_size, where, "value", a, b))
    return differences
