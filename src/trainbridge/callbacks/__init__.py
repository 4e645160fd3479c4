"""The native callback layer: the ``Callback`` API and its manager."""

from trainbridge.callbacks.base import Callback, FunctionCallback, rank_zero_only
from trainbridge.callbacks.manager import CallbackFatalError, CallbackManager, CallbackSetupError

__all__ = [
    "Callback",
    "CallbackFatalError",
    "CallbackManager",
    "CallbackSetupError",
    "FunctionCallback",
    "rank_zero_only",
]
