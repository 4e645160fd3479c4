"""Tests' shorthand for a run's two inputs: ``split_run(**keywords)`` -> ``RunInputs(args, plan)``.

A test gives settings and code in one call; the settings validate as ``TrainingArgs``, the code (callback
objects and classes, ``on_<event>=fn``, ``model_init``...) becomes the ``RunPlan`` (``RunPlan.from_keywords``, as
``run_training``'s keywords), and the two are checked together.  ``RunInputs`` unpacks as ``(args, plan)``
(``build_run(*inputs, env)``) and reads the arguments' fields (``inputs.ckpt_output_dir``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from trainbridge.core.config import CallbackSpec, RunPlan, TrainingArgs, check_consistent
from trainbridge.core.config.plan import CODE_KEYWORDS


class RunInputs(NamedTuple):
    """A run's settings and code."""

    args: TrainingArgs
    plan: RunPlan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.args, name)

    def model_copy(self, update: dict[str, Any] | None = None) -> RunInputs:
        """A copy whose arguments have ``update``."""
        return RunInputs(self.args.model_copy(update=update), self.plan)


def as_run(inputs: TrainingArgs | RunInputs) -> RunInputs:
    """``inputs`` as ``RunInputs`` (arguments alone run the default plan)."""
    return inputs if isinstance(inputs, RunInputs) else RunInputs(inputs, RunPlan())


def split_keywords(keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(settings, code)`` of ``keywords``: callback specs stay settings, callback objects/classes are code."""
    settings = dict(keywords)
    code = {k: settings.pop(k) for k in list(settings) if k in CODE_KEYWORDS or k.startswith("on_")}
    given = settings.pop("callbacks", None)
    items = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
    specs = [c for c in items if isinstance(c, dict | str | CallbackSpec)]
    objects = [c for c in items if not isinstance(c, dict | str | CallbackSpec)]
    if specs:
        settings["callbacks"] = specs
    if objects:
        code["callbacks"] = objects
    return settings, code


def split_run(**keywords: Any) -> Any:
    """The ``TrainingArgs`` of ``keywords``' settings and the ``RunPlan`` of their code, checked together
    (``RunInputs``); keywords without code: the ``TrainingArgs`` alone."""
    settings, code = split_keywords(keywords)
    args = TrainingArgs(**settings)
    plan = RunPlan.from_keywords(**code)
    check_consistent(args, plan)
    return RunInputs(args, plan) if code else args


def run_training(inputs: TrainingArgs | RunInputs, *launch: Any, **options: Any) -> Any:
    """``trainbridge.run_training`` of ``inputs``: its arguments, with its plan's code as keywords."""
    from trainbridge import run_training as launch_run

    args, plan = as_run(inputs)
    code = {k: v for k, v in plan.keywords().items() if v}
    return launch_run(args, *launch, **code, **options)
