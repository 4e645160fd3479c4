"""``python -m compat``: run the conformance suite and write ``compat/REPORT.md``.

    python -m compat                       # every scenario x {Trainer, trainbridge} x {1, 2 ranks}
    python -m compat --fast                # the CI selection only
    python -m compat --scenario save_best --world-size 2 --work /tmp/compat --report /tmp/REPORT.md

Exits 1 when a comparison has an unexplained difference.  Run from the repository root (the workers
import ``compat`` from there).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from compat.report import write_report
from compat.scenarios import scenario
from compat.suite import all_pairs, fast_pairs, run_suite

DEFAULT_REPORT = Path(__file__).resolve().parent / "REPORT.md"


def main(argv: list[str] | None = None) -> int:
    """Run the selected scenarios, print a summary, write the report."""
    parser = argparse.ArgumentParser(prog="python -m compat", description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", help="only this scenario (repeatable)")
    parser.add_argument("--world-size", action="append", type=int, help="only this world size (repeatable)")
    parser.add_argument("--fast", action="store_true", help="the CI selection (compat/test_compat.py)")
    parser.add_argument("--work", type=Path, help="keep the runs in this directory (default: a temporary one)")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT, help=f"default: {DEFAULT_REPORT}")
    options = parser.parse_args(argv)
    pairs = fast_pairs() if options.fast else all_pairs()
    if options.scenario:
        wanted = {scenario(name).name for name in options.scenario}
        pairs = [(spec, ws) for spec, ws in pairs if spec.name in wanted]
    if options.world_size:
        pairs = [(spec, ws) for spec, ws in pairs if ws in options.world_size]
    if not pairs:
        parser.error("the selection is empty")
    with tempfile.TemporaryDirectory(prefix="compat-") as scratch:
        work = options.work or Path(scratch)
        result = run_suite(pairs, work)
        write_report(result, options.report)
    for comparison in result.comparisons:
        verdict = "pass" if comparison.passed else f"DIFFERENCE ({len(comparison.unexplained)} unexplained)"
        known = ", ".join(comparison.known())
        print(
            f"{comparison.scenario.name:>18} x{comparison.world_size}: {verdict}"
            + (f" [explained: {known}]" if known else "")
        )
    print(f"report: {options.report} ({result.seconds:.0f} s)")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
