"""What in a configuration is code: import paths (``package.module:Name``) and callbacks named by them.

``resolve_import_path`` imports a module and reads the name; ``CallbackSpec`` is a callback given as
``{"class": ..., "kwargs": ...}`` in YAML, built in each worker.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainbridge.core import config_errors
from trainbridge.core.callback import Callback


def resolve_import_path(path: str) -> Any:
    """Resolve ``pkg.mod:Name`` or ``pkg.mod.Name`` to the object; ``ValueError`` says what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import module {module_name!r}: {exc} (a module of your own must be on "
            "sys.path: `trainbridge train` finds one in the config's folder or the working directory)"
        ) from exc
    obj: Any = module
    owner = f"module {module_name!r}"
    for part in attr.split("."):
        try:
            obj, owner = getattr(obj, part), repr(part)
        except AttributeError:
            raise ValueError(config_errors.missing_attribute_message(obj, owner, part)) from None
    return obj


class CallbackSpec(BaseModel):
    """A callback named by import path, as written in a YAML config.

    ``{"class": "package.module:ClassName", "kwargs": {...}}`` builds ``ClassName(**kwargs)`` in each
    worker.  The path is imported when the config is validated (the module's code runs: a config is code),
    so a typo fails before launch; the class must be a ``Callback``/``TrainerCallback`` subclass, checked
    before it is ever called.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    class_path: str = Field(alias="class")
    """``package.module:ClassName`` (or ``package.module.ClassName``) of the callback class."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the class constructor."""

    @field_validator("class_path")
    @classmethod
    def _importable(cls, value: str) -> str:
        problem = not_a_callback(resolve_import_path(value), value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _kwargs_fit(self) -> CallbackSpec:
        try:
            config_errors.check_constructor_kwargs(resolve_import_path(self.class_path), self.kwargs)
        except ValueError as exc:
            raise ValueError(f"kwargs: {exc}") from None
        return self

    def build(self) -> Any:
        """Import the class and instantiate it with ``kwargs``, once it is known to be a callback class
        (``NotACallbackError`` otherwise: a config naming ``subprocess:Popen`` never gets it called)."""
        target = resolve_import_path(self.class_path)
        problem = not_a_callback(target, self.class_path)
        if problem:
            raise NotACallbackError(problem)
        return target(**self.kwargs)


class NotACallbackError(TypeError):
    """A ``CallbackSpec`` names something that is not a callback class; it was not called."""


def is_callback_class(cls: Any) -> bool:
    """Whether ``cls`` is a ``trainbridge.Callback`` or ``transformers.TrainerCallback`` subclass (the latter
    recognised by its bases' names, without importing transformers)."""
    if not isinstance(cls, type):
        return False
    return issubclass(cls, Callback) or any(
        base.__name__ == "TrainerCallback" and base.__module__ == "transformers.trainer_callback"
        for base in cls.__mro__
    )


def not_a_callback(target: Any, path: str) -> str | None:
    """Why ``target`` (imported from ``path``) may not be instantiated as a callback, or None."""
    if is_callback_class(target):
        return None
    what = f"the class {target.__module__}.{target.__qualname__}" if isinstance(target, type) else repr(target)
    return (
        f"{path!r} is {what}, not a subclass of trainbridge.Callback or transformers.TrainerCallback; it was not called"
    )
