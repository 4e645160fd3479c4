"""The ``trainbridge`` command: ``train CONFIG.yaml``, ``demo``, ``plot RUN_DIR`` and
``control RUN_DIR save|stop|evaluate|log``.

argparse lives only here; its result is turned into ``TrainingArgs``/``TorchrunArgs`` at once.
Exit codes: 0 success, 1 a worker failed (or the run timed out), 2 invalid configuration or a failed
preflight check (nothing was launched), 128+N interrupted by signal N.

Everything heavier than argparse is imported inside the command that needs it, so ``--help`` and
``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.launch import console

if TYPE_CHECKING:
    from trainbridge.core.config import TorchrunArgs, TrainingArgs

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2

_NPROC_HELP = (
    "worker processes on this node (default: one per visible GPU; on a machine without GPUs, 1, with a "
    "note: give --nproc-per-node N for N CPU ranks)"
)
_NO_GPU_NOTE = "no GPU in use: 1 worker process (give --nproc-per-node N to train with N CPU ranks)"
_SET_HELP = (
    "override a config field (value parsed as YAML, e.g. max_steps=100, report_to=[tensorboard]); "
    "repeatable.  A relative path given here resolves against the working directory, like any path "
    "typed on a command line (paths inside the YAML resolve against the YAML's folder)"
)


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as a YAML scalar (``lr=1e-4`` -> float, ``x=null`` -> None)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value) if value else ""
    except yaml.YAMLError as exc:
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise argparse.ArgumentTypeError(f"--set {text!r}: the value is not valid YAML ({problem})") from None


def _version() -> str:
    from importlib import metadata

    import trainbridge

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"trainbridge {trainbridge.__version__} (torch {installed('torch')}, transformers "
        f"{installed('transformers')}, python {sys.version.split()[0]})"
    )


class _VersionAction(argparse.Action):
    """``--version``: the versions are looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(_version())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainbridge", description="Distributed LLM fine-tuning with torchrun workers and agreed callbacks."
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="show the versions of trainbridge, torch, transformers and python, and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        help="train from a YAML config of TrainingArgs fields",
        description="Train from a YAML config of TrainingArgs fields.  Before training, rank 0 prints a "
        "summary of the run (model, data, steps, batch, backend, output); --dry-run prints it "
        "with the resolved config and stops there.  A callback module or model_init next to the "
        "config or in the working directory is importable by name ('my_callbacks:MyCallback') "
        "when no installed module has that name and the folder is writable only by you.",
    )
    train.add_argument("config", type=Path, help="YAML file of TrainingArgs fields")
    # torchrun's options, in both of its spellings (--nproc-per-node and --nproc_per_node)
    train.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, help=_NPROC_HELP)
    train.add_argument("--nnodes", help="number of nodes, or MIN:MAX")
    train.add_argument(
        "--node-rank", "--node_rank", dest="node_rank", type=int, help="this node's rank (static rendezvous)"
    )
    train.add_argument("--master-addr", "--master_addr", dest="master_addr", help="address of rank 0's node")
    train.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        help="port on the master node (default: a free port)",
    )
    train.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", help="host:port of a c10d rendezvous"
    )
    train.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="rendezvous job id")
    train.add_argument(
        "--max-restarts", "--max_restarts", dest="max_restarts", type=int, help="torchrun worker-group restarts"
    )
    train.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    train.add_argument(
        "--resume",
        action="store_true",
        help="resume from the newest checkpoint in ckpt_output_dir, if there is one "
        "(resume_from_checkpoint=auto; an explicit --set resume_from_checkpoint wins)",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and the run summary (the workers load model and data "
        "and build the engine), then exit without training",
    )
    train.add_argument(
        "--set", dest="overrides", type=parse_override, action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP
    )

    control = commands.add_parser("control", help="ask a running job to save, stop, evaluate or log")
    control.add_argument("run_dir", type=Path, help="the running job's ckpt_output_dir")
    control.add_argument("action", choices=["save", "stop", "evaluate", "log"], help="what to ask for")

    demo = commands.add_parser("demo", help="two-rank CPU fine-tune of a tiny local model (about a minute)")
    demo.add_argument("--output-dir", type=Path, default=Path("demo_output"), help="where model, data and run go")
    demo.add_argument(
        "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=2, help="CPU worker processes"
    )
    demo.add_argument("--max-steps", type=int, help="optimizer steps (default 200)")
    demo.add_argument(
        "--chat",
        action="store_true",
        help="train on the shipped chat data set (messages, loss on assistant turns only)",
    )

    plot = commands.add_parser(
        "plot",
        help="plot a run's metrics.jsonl to a PNG (needs the 'plot' extra: matplotlib)",
        description="Plot loss, eval loss, learning rate, grad norm and tokens/s against step from a run's "
        "metrics.jsonl, write a PNG and print its path.",
    )
    plot.add_argument("run_dir", type=Path, help="a run's ckpt_output_dir (or its metrics .jsonl file)")
    plot.add_argument("-o", "--output", type=Path, help="PNG to write (default: metrics.png beside the metrics)")
    return parser


# ----------------------------------------------------------------------------- train
def format_summary(result: Any, wall_time_s: float | None = None) -> str:
    """What a finished run did (``trainbridge.loop.summary.format_run_result``)."""
    from trainbridge.loop.summary import format_run_result

    return format_run_result(result, wall_time_s)


class UntrustedFolderError(ValueError):
    """A module the config names would be imported from a folder that others can write to."""


def _named_modules(config: Path, overrides: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, top-level module)`` of every import path in the config: ``callbacks[i].class`` and
    ``model_init`` (the YAML as written, then the ``--set`` overrides)."""
    import yaml

    try:
        data = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []  # the config's own loading reports it
    if not isinstance(data, dict):
        return []
    data = {**data, **overrides}
    found = []
    callbacks = data.get("callbacks") or []
    for index, item in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        path = item.get("class") if isinstance(item, dict) else item
        if isinstance(path, str):
            found.append((f"callbacks[{index}].class", path))
    if isinstance(data.get("model_init"), str):
        found.append(("model_init", data["model_init"]))
    return [(field, path.partition(":")[0].split(".")[0]) for field, path in found if path.strip()]


def add_user_import_paths(config: Path, overrides: dict[str, Any] | None = None) -> list[str]:
    """Make the modules a config names by import path (``class:``, ``model_init:``) importable, and nothing else.

    A module found where Python finds it anyway (installed, ``PYTHONPATH``) is used from there.  Otherwise
    the config's folder, then the working directory, is searched; a folder holding it is appended to
    ``sys.path`` (after site-packages: it cannot shadow an installed module) and reaches the workers in the
    launcher's signed payload.  A folder that someone else could write to (``core.private_files``) is
    refused (``UntrustedFolderError``, saying how to allow it).  Returns the folders added.
    """
    import importlib.util

    from trainbridge.core.private_files import folder_problem

    added: list[str] = []
    for field, module in _named_modules(config, overrides or {}):
        try:
            if importlib.util.find_spec(module) is not None:
                continue
        except (ImportError, ValueError):
            pass
        for folder in (config.resolve().parent, Path.cwd()):
            if not ((folder / f"{module}.py").is_file() or (folder / module).is_dir()):
                continue
            problem = folder_problem(folder)
            if problem:
                raise UntrustedFolderError(
                    f"{field}: module {module!r} would be imported from {folder}, but {problem}, so others could "
                    f"put code there that runs as you; to allow it, make the folder writable only by you "
                    f"(chmod go-w), or put it on PYTHONPATH yourself"
                )
            if str(folder) not in sys.path:
                sys.path.append(str(folder))
                added.append(str(folder))
            break
    return added


def _trainer_hint(name: str) -> str | None:
    from trainbridge.hf.porting import trainer_field_hint

    return trainer_field_hint(name)


def _load_config(options: argparse.Namespace) -> tuple[TrainingArgs, TorchrunArgs, dict[str, Any]] | str:
    """Validated arguments and the config's code (``model_init:``, for ``run_training``), or the error report to
    print."""
    import pydantic

    from trainbridge.core import nproc
    from trainbridge.core.config import RunPlan, TorchrunArgs, TrainingArgs, check_consistent
    from trainbridge.core.config.training import read_yaml
    from trainbridge.core.config_errors import format_validation_error

    overrides = dict(options.overrides)
    if options.resume:
        overrides.setdefault("resume_from_checkpoint", "auto")
    try:
        data = {**read_yaml(options.config), **overrides}
        code = {"model_init": data.pop("model_init")} if data.get("model_init") is not None else {}
        args = TrainingArgs.model_validate(data)
        check_consistent(args, RunPlan.from_keywords(**code))
    except pydantic.ValidationError as exc:
        return format_validation_error(
            exc, TrainingArgs, source=str(options.config), overrides=overrides, foreign_hint=_trainer_hint
        )
    except (OSError, ValueError) as exc:
        return f"cannot load {options.config}: {exc}"
    fields = (
        "nproc_per_node",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "rdzv_endpoint",
        "rdzv_id",
        "max_restarts",
    )
    given = {name: getattr(options, name) for name in fields if getattr(options, name) is not None}
    try:
        launch = TorchrunArgs.model_validate(given).for_device(args.device)
    except pydantic.ValidationError as exc:
        text = format_validation_error(exc, TorchrunArgs)
        return text.replace("invalid configuration", "invalid command-line option", 1)
    except ValueError as exc:  # a bad TRAINBRIDGE_NPROC_PER_NODE
        return str(exc)
    counted_gpus = "nproc_per_node" not in given and nproc.NPROC_ENV not in os.environ
    if counted_gpus and (args.device == "cpu" or nproc.visible_gpu_count() == 0):
        print(f"trainbridge: note: {_NO_GPU_NOTE}", file=sys.stderr)
    return args, launch, code


def _train(options: argparse.Namespace) -> int:
    import time

    from trainbridge.launch import launcher

    start = time.monotonic()
    console.quiet_this_process("auto")  # the parent never trains: no library start-up noise
    try:
        add_user_import_paths(options.config, dict(options.overrides))
    except UntrustedFolderError as exc:
        print(f"trainbridge: not launched: {exc}", file=sys.stderr)
        return EXIT_INVALID
    loaded = _load_config(options)
    if isinstance(loaded, str):
        print(f"trainbridge: {loaded}", file=sys.stderr)
        return EXIT_INVALID
    args, launch, code = loaded
    if options.dry_run:
        print(f"trainbridge: resolved configuration ({options.config}):\n{args.to_yaml()}", flush=True)
        launcher.run_training(args, launch, timeout_s=options.timeout, dry_run=True, **code)
        print("trainbridge: dry run: nothing was trained")
        return EXIT_OK
    result = launcher.run_training(args, launch, timeout_s=options.timeout, **code)
    if result is None:
        print("trainbridge: training finished; rank 0 runs on another node and holds the result")
    else:
        print(f"trainbridge: training finished\n{format_summary(result, time.monotonic() - start)}")
    return EXIT_OK


def _plot(options: argparse.Namespace) -> int:
    from trainbridge.report.plot import PlotError, plot_metrics

    try:
        path = plot_metrics(options.run_dir, options.output)
    except PlotError as exc:
        print(f"trainbridge: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(path)
    return EXIT_OK


def _control(options: argparse.Namespace) -> int:
    from trainbridge.launch.control_command import ControlRequestError, send_control

    try:
        print(f"trainbridge: {send_control(options.run_dir, options.action)}")
    except ControlRequestError as exc:
        print(f"trainbridge: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainbridge`` command; returns the exit code.

    Without ``argv`` it is the program itself (the console script, ``python -m trainbridge``): it reads
    ``sys.argv`` and ends the process when the command is done (``launch.process_exit.exit_now``: exit
    handlers run and the streams are flushed, the interpreter's slow teardown of torch and transformers
    is skipped).  With ``argv`` (tests, embedding) it returns the exit code.
    """
    code = _run_command(argv)
    if argv is None:
        from trainbridge.launch.process_exit import exit_now

        exit_now(code)
    return code


def _run_command(argv: Sequence[str] | None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "plot":
        return _plot(options)
    if options.command == "control":
        return _control(options)

    from trainbridge.launch.launcher import LaunchError, PreflightError, TrainingInterruptedError
    from trainbridge.launch.transport import CallbackTransportError

    try:
        if options.command == "demo":
            console.quiet_this_process("cpu")  # the demo's ranks run on CPU
            from trainbridge.demos.demo import run_demo

            run_demo(options.output_dir, options.nproc_per_node, options.max_steps, chat=options.chat)
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
