"""The typed configuration: ``TrainingArgs`` and ``TorchrunArgs``.

Validated once, in the parent process, and passed as objects everywhere else.  Every field has a
docstring (``use_attribute_docstrings``), so ``TrainingArgs.model_fields[name].description`` documents
it, and an invalid value raises a ``pydantic.ValidationError`` naming the field.

- ``training``: ``TrainingArgs`` (cross-field checks in ``checks``, derived values, YAML);
- ``fields``: its fields, in groups of related settings, each with the validators that read it alone;
- ``model``: ``from_pretrained`` keywords and PEFT adapters; ``imports``: import paths and ``CallbackSpec``
  (what in a config is code);
- ``plan``: ``RunPlan``, the run's code as typed seams, given beside ``TrainingArgs`` (which holds data only;
  ``checks.check_consistent(args, plan)`` checks them together at the run boundary);
- ``torchrun``: ``TorchrunArgs`` (its default process count: ``core.nproc``).
"""

from trainbridge.core.config.checks import check_consistent
from trainbridge.core.config.imports import CallbackSpec, NotACallbackError, resolve_import_path
from trainbridge.core.config.model import ADAPTER_CONFIG_FILE, ModelKwargs, build_peft_config, peft_adapter_base
from trainbridge.core.config.names import DataColumn
from trainbridge.core.config.plan import RunPlan, eval_set_names
from trainbridge.core.config.torchrun import TorchrunArgs
from trainbridge.core.config.training import TrainingArgs

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "CallbackSpec",
    "DataColumn",
    "ModelKwargs",
    "NotACallbackError",
    "RunPlan",
    "TorchrunArgs",
    "TrainingArgs",
    "build_peft_config",
    "check_consistent",
    "eval_set_names",
    "peft_adapter_base",
    "resolve_import_path",
]
