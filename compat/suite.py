"""Run a selection of (scenario, world size) pairs both ways and compare them.

The runs of one side and world size share a launch where they can (``runners.run_scenarios``); where Trainer
is expected to fail at a size, trainbridge's ranks are compared with the one-rank Trainer run, which is
run too when it is not part of the selection.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from compat.assets import build_assets
from compat.diff import Comparison, compare
from compat.runners import RunOutcome, run_scenarios
from compat.scenarios import SCENARIOS, Scenario

Pair = tuple[Scenario, int]


def all_pairs() -> list[Pair]:
    """Every scenario at every world size it declares."""
    return [(spec, ws) for spec in SCENARIOS for ws in spec.world_sizes]


def fast_pairs() -> list[Pair]:
    """The CI part: each scenario at the world sizes in its ``fast``."""
    return [(spec, ws) for spec in SCENARIOS for ws in spec.world_sizes if ws in spec.fast]


@dataclass
class SuiteResult:
    """Every comparison of a suite run, with its outcomes and timing."""

    comparisons: list[Comparison]
    outcomes: dict[tuple[str, str, int], RunOutcome]
    seconds: float
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No comparison has an unexplained difference."""
        return all(c.passed for c in self.comparisons)


def run_suite(pairs: Iterable[Pair], work: Path, *, skip_expected_trainer_failures: bool = False) -> SuiteResult:
    """Run ``pairs`` with both runners under ``work`` and compare each.

    ``skip_expected_trainer_failures``: do not launch Trainer where it is expected to crash or hang (the
    CI part: that launch only documents Trainer's behaviour and can take up to its timeout)."""
    start = time.monotonic()
    pairs = list(pairs)
    assets = build_assets(work / "assets")
    needed: dict[tuple[str, int], set[str]] = {}
    for spec, ws in pairs:
        runners = needed.setdefault((spec.name, ws), set())
        runners.add("trainbridge")
        if not (skip_expected_trainer_failures and ws in spec.trainer_fails):
            runners.add("trainer")
        if ws in spec.trainer_fails:
            needed.setdefault((spec.name, 1), set()).add("trainer")
    by_name = {spec.name: spec for spec in SCENARIOS}
    outcomes: dict[tuple[str, str, int], RunOutcome] = {}
    for ws in sorted({ws for _, ws in needed}):
        for runner in ("trainer", "trainbridge"):
            specs = [by_name[name] for (name, size), runners in needed.items() if size == ws and runner in runners]
            if specs:
                for outcome in run_scenarios(specs, runner, ws, assets, work):
                    outcomes[(outcome.scenario, runner, ws)] = outcome
    comparisons = []
    for spec, ws in pairs:
        trainer = outcomes.get((spec.name, "trainer", ws))
        if trainer is None:  # skipped expected failure
            trainer = RunOutcome(
                spec.name,
                "trainer",
                ws,
                work / spec.name / f"trainer-ws{ws}",
                status="failed",
                error="not launched (expected to crash or hang; run python -m compat for it)",
            )
        comparisons.append(
            compare(
                spec, ws, trainer, outcomes[(spec.name, "trainbridge", ws)], outcomes.get((spec.name, "trainer", 1))
            )
        )
    return SuiteResult(comparisons, outcomes, time.monotonic() - start, _environment())


def _environment() -> dict[str, str]:
    import torch
    import transformers

    import trainbridge

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trainbridge": trainbridge.__version__,
        "platform": platform.platform(),
    }
