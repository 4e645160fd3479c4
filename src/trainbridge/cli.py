"""The ``trainbridge`` command: ``trainbridge train CONFIG.yaml``, ``trainbridge demo`` and
``trainbridge control RUN_DIR save|stop|evaluate|log``.

argparse lives only here; its result is turned into ``TrainingArgs``/``TorchrunArgs`` at once.
Exit codes: 0 success, 1 a worker failed (or the run timed out), 2 invalid configuration or a failed
preflight check (nothing was launched), 128+N interrupted by signal N.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.loop.result import RunResult

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as a YAML scalar (``lr=1e-4`` -> float, ``x=null`` -> None)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value) if value else ""
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"--set {text!r}: value is not valid YAML: {exc}") from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainbridge", description="Distributed LLM fine-tuning with torchrun workers and agreed callbacks."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train from a YAML config of TrainingArgs fields")
    train.add_argument("config", type=Path, help="YAML file of TrainingArgs fields")
    train.add_argument("--nproc-per-node", type=int, help="worker processes on this node")
    train.add_argument("--nnodes", help="number of nodes, or MIN:MAX")
    train.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous)")
    train.add_argument("--master-addr", help="address of rank 0's node")
    train.add_argument("--master-port", type=int, help="port on the master node (default: a free port)")
    train.add_argument("--rdzv-endpoint", help="host:port of a c10d rendezvous")
    train.add_argument("--rdzv-id", help="rendezvous job id")
    train.add_argument("--max-restarts", type=int, help="torchrun worker-group restarts")
    train.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    train.add_argument(
        "--set", dest="overrides", type=parse_override, action="append", default=[], metavar="KEY=VALUE",
        help="override a config field (value parsed as YAML); repeatable",
    )

    control = commands.add_parser("control", help="ask a running job to save, stop, evaluate or log")
    control.add_argument("run_dir", type=Path, help="the running job's ckpt_output_dir")
    control.add_argument("action", choices=["save", "stop", "evaluate", "log"], help="what to ask for")

    demo = commands.add_parser("demo", help="two-rank CPU fine-tune of a tiny local model (about a minute)")
    demo.add_argument("--output-dir", type=Path, default=Path("demo_output"), help="where model, data and run go")
    demo.add_argument("--nproc-per-node", type=int, default=2, help="CPU worker processes")
    demo.add_argument("--max-steps", type=int, help="optimizer steps (default 200)")
    return parser


def format_summary(result: RunResult) -> str:
    """A few lines describing a finished run."""
    def number(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    stop = f"stopped early: {result.stop_reason}" if result.stopped_early else "completed"
    lines = [
        f"steps:           {result.global_step}/{result.max_steps} ({stop})",
        f"final loss:      {number(result.final_loss)}",
        f"final eval loss: {number(result.final_eval_loss)}",
        f"checkpoints:     {', '.join(result.checkpoints) or 'none'}",
    ]
    if result.best_checkpoint:
        lines.append(f"best checkpoint: {result.best_checkpoint} ({number(result.best_metric)})")
    if result.callback_errors:
        lines.append(f"callback errors: {len(result.callback_errors)} (see result.json)")
    lines.append(f"metrics file:    {result.metrics_file}")
    return "\n".join(lines)


def _torchrun_args(options: argparse.Namespace) -> TorchrunArgs:
    fields = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint",
              "rdzv_id", "max_restarts")
    return TorchrunArgs.model_validate(
        {name: getattr(options, name) for name in fields if getattr(options, name) is not None}
    )


def _train(options: argparse.Namespace) -> int:
    from trainbridge.launch.launcher import run_training

    try:
        args = TrainingArgs.from_yaml(options.config, **dict(options.overrides))
        launch = _torchrun_args(options)
    except pydantic.ValidationError as exc:
        print(f"trainbridge: invalid configuration in {options.config}:\n{exc}", file=sys.stderr)
        return EXIT_INVALID
    except (OSError, ValueError) as exc:
        print(f"trainbridge: cannot load {options.config}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    result = run_training(args, launch, timeout_s=options.timeout)
    if result is None:
        print("trainbridge: training finished; rank 0 runs on another node and holds the result")
    else:
        print(f"trainbridge: training finished\n{format_summary(result)}")
    return EXIT_OK


def _control(options: argparse.Namespace) -> int:
    from trainbridge.launch.control import NoRunningJobError, send_control

    try:
        print(f"trainbridge: {send_control(options.run_dir, options.action)}")
    except NoRunningJobError as exc:
        print(f"trainbridge: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainbridge`` command; returns the exit code."""
    from trainbridge.launch.launcher import LaunchError, PreflightError, TrainingInterruptedError
    from trainbridge.launch.transport import CallbackTransportError

    options = _parser().parse_args(argv)
    if options.command == "control":
        return _control(options)
    try:
        if options.command == "demo":
            from trainbridge.demos.demo import run_demo

            run_demo(options.output_dir, options.nproc_per_node, options.max_steps)
            return EXIT_OK
        return _train(options)
    except (PreflightError, CallbackTransportError) as exc:
        print(f"trainbridge: not launched: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except TrainingInterruptedError as exc:
        print(f"trainbridge: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except LaunchError as exc:
        print(f"trainbridge: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
