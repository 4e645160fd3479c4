"""What in a configuration is code: import paths (``package.module:Name``) and callbacks named by them.

``resolve_import_path`` imports a module and reads the name; ``CallbackSpec`` is a callback given as
``{"class": ..., "kwargs": ...}`` in YAML, built in each worker.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainbridge.core import config_errors


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
        raise ValueError(f"cannot import module {module_name!r}: {exc} (a module of your own must be on "
                         "sys.path: `trainbridge train` adds the config's folder and the working directory)"
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
    worker.  The path is imported when the config is validated, so a typo fails before launch.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    class_path: str = Field(alias="class")
    """``package.module:ClassName`` (or ``package.module.ClassName``) of the callback class."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the class constructor."""

    @field_validator("class_path")
    @classmethod
    def _importable(cls, value: str) -> str:
        resolve_import_path(value)
        return value

    @model_validator(mode="after")
    def _kwargs_fit(self) -> CallbackSpec:
        try:
            config_errors.check_constructor_kwargs(resolve_import_path(self.class_path), self.kwargs)
        except ValueError as exc:
            raise ValueError(f"kwargs: {exc}") from None
        return self

    def build(self) -> Any:
        """Import the class and instantiate it with ``kwargs``."""
        return resolve_import_path(self.class_path)(**self.kwargs)
