"""Configuration errors as a person reads them: one short paragraph per mistake.

A ``pydantic.ValidationError`` names fields in its own vocabulary (URLs, the whole input, nested models).
``describe_validation_error`` turns each of its errors into one line: the field, the value given (and
where: the YAML file or a ``--set``), why it is wrong, and the fix -- the nearest valid name
("did you mean") for a misspelled field, choice, event, callback class or keyword, and, for a name
that belongs to another library (``transformers.TrainingArguments``' ``num_train_epochs``...), which
field of ours it is (the caller passes that knowledge in as ``foreign_hint``; it lives with the
porting code).

The helpers ``did_you_mean``, ``missing_attribute_message`` and ``check_constructor_kwargs`` are also
used while validating (``core.config``), so a misspelled callback is reported with its nearest name
wherever it is validated.
"""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from trainbridge.core.events import Event

ForeignHint = Callable[[str], "str | None"]
"""``name -> sentence`` saying which field of ours a foreign name (e.g. a Trainer argument) is, or None."""

_VALUE_WIDTH = 60


def closest(name: str, options: Iterable[str], n: int = 1) -> list[str]:
    """The ``n`` options nearest to ``name`` (difflib ratio >= 0.6), nearest first."""
    options = [str(o) for o in options]
    found = difflib.get_close_matches(name, options, n=n, cutoff=0.6)
    if not found:  # case slips and underscores vs dashes
        folded = {o.lower().replace("-", "_"): o for o in options}
        key = name.lower().replace("-", "_")
        found = [folded[m] for m in difflib.get_close_matches(key, list(folded), n=n, cutoff=0.6)]
    return found


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """``" Did you mean 'x'?"`` for the nearest option, or ``""`` when nothing is near."""
    found = closest(name, options)
    return f" Did you mean {found[0]!r}?" if found else ""


def missing_attribute_message(owner: Any, owner_name: str, attr: str) -> str:
    """Why ``attr`` is not in ``owner`` (a module or class), with the nearest public name."""
    public = [name for name in dir(owner) if not name.startswith("_")]
    return f"{owner_name} has no attribute {attr!r}.{did_you_mean(attr, public)}"


def check_constructor_kwargs(cls: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when ``cls(**kwargs)`` cannot bind: an unknown keyword (with the nearest
    parameter name) or a missing required one.  Classes whose signature cannot be read pass."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    name = getattr(cls, "__name__", repr(cls))
    if not takes_any:
        for key in kwargs:
            if key not in named:
                listed = ", ".join(named) or "none"
                raise ValueError(f"{name} has no argument {key!r}.{did_you_mean(key, named)} (its arguments: {listed})")
    missing = [n for n in named if params[n].default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ValueError(f"{name} needs {', '.join(repr(m) for m in missing)} in its kwargs")


# ----------------------------------------------------------------------------- validation errors
def describe_validation_error(
    exc: ValidationError,
    model: type[BaseModel],
    *,
    source: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    foreign_hint: ForeignHint | None = None,
) -> list[str]:
    """One short paragraph (a line) per mistake in ``exc``, raised while validating ``model``.

    ``source`` names where the values came from (a YAML file); values of ``overrides`` came from
    ``--set`` and are reported as such.  ``foreign_hint(name)`` explains an unknown name that is
    another library's name for one of our fields.
    """
    overrides = overrides or {}
    merged: dict[str, list[str]] = {}  # a union field fails once per branch: its reasons are joined
    for error in exc.errors(include_url=False):
        for field, value, reason in _problems(error, model, foreign_hint):
            top = re.split(r"[\[.]", field, maxsplit=1)[0]
            if top in overrides:
                where = f" (from --set {top}={_show(overrides[top], quote=False)})"
            elif source is not None and value is not _NO_VALUE:
                where = f" (in {source})"
            else:
                where = ""
            shown = "" if value is _NO_VALUE else f" = {_show(value)}"
            reasons = merged.setdefault(f"{field}{shown}{where}", [])
            if reason not in reasons:
                reasons.append(reason)
    return [f"{head}: {_either(reasons)}" for head, reasons in merged.items()]


def _either(reasons: list[str]) -> str:
    """One reason, or several joined: ``must be 'auto' or a path.``"""
    if len(reasons) == 1:
        return reasons[0]
    parts = [r.rstrip(".") for r in reasons]
    if all(p.startswith("must be ") for p in parts):
        parts = [parts[0]] + [p.removeprefix("must be ") for p in parts[1:]]
    return " or ".join(parts) + "."


def format_validation_error(
    exc: ValidationError,
    model: type[BaseModel],
    *,
    source: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    foreign_hint: ForeignHint | None = None,
) -> str:
    """The whole report: a heading and one ``- `` line per mistake."""
    lines = describe_validation_error(exc, model, source=source, overrides=overrides, foreign_hint=foreign_hint)
    origin = f" in {source}" if source else ""
    count = "1 problem" if len(lines) == 1 else f"{len(lines)} problems"
    return "\n".join(
        [f"invalid configuration{origin} ({count}); nothing was launched:"] + [f"- {line}" for line in lines]
    )


_NO_VALUE: Any = object()


def _problems(
    error: Mapping[str, Any], model: type[BaseModel], foreign_hint: ForeignHint | None
) -> list[tuple[str, Any, str]]:
    """``[(field, value, reason)]`` for one pydantic error (a message may hold several, one a line)."""
    loc: Sequence[Any] = error.get("loc", ())
    kind: str = error.get("type", "")
    value = error.get("input", _NO_VALUE)
    message = str(error.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    fields = model.model_fields
    if not loc:  # a model-level check: its message starts with the field it is about
        out = []
        for line in message.splitlines():
            name, sep, rest = line.partition(": ")
            field = name if sep and (name in fields or name.startswith("on_")) else ""
            given = value.get(field, _NO_VALUE) if isinstance(value, Mapping) and field else _NO_VALUE
            if field.startswith("on_") and field not in fields:
                out.append((field, _NO_VALUE, _event_reason(field)))
            else:
                out.append((field or model.__name__, given, _sentence(rest if field else line)))
        return out
    field = _field_path(loc)
    top = str(loc[0])
    if kind == "extra_forbidden":
        if top.startswith("on_"):
            return [(top, _NO_VALUE, _event_reason(top))]
        names = [info.alias or name for name, info in fields.items()]
        hint = foreign_hint(top) if foreign_hint else None
        listing = f" Its fields: {', '.join(names)}." if len(names) <= 6 else f" See `{_HELP % model.__name__}`."
        reason = f"not a {model.__name__} field." + (f" {hint}" if hint else did_you_mean(top, names) or listing)
        return [(field, value, reason)]
    if kind == "missing":
        info = fields.get(top)
        described = re.sub(r"``?", "", (info.description or "").strip().split("\n\n")[0]) if info else ""
        return [
            (field, _NO_VALUE, "required" + (f" -- {_sentence(' '.join(described.split()))}" if described else "."))
        ]
    if kind == "literal_error":
        choices = _choices(model, top) or []
        if len(choices) > 1:
            reason = f"must be one of {', '.join(repr(c) for c in choices)}."
        else:
            reason = f"must be {choices[0]!r}." if choices else _sentence(_must(message))
        return [(field, value, reason + did_you_mean(str(value), [str(c) for c in choices]))]
    out = []
    for line in message.splitlines():
        line = line.removeprefix(f"{top}: ")  # our validators name the field themselves
        item = re.match(rf"({re.escape(top)}\[\d+\](?:\.\w+)?(?: = .*?)?): (.*)", line)
        if item:  # "callbacks[1].kwargs: ..." names the item (and its value) itself
            out.append((item.group(1), _NO_VALUE, _sentence(item.group(2))))
        else:
            out.append((field, value, _sentence(_must(line))))
    return out


_HELP = "python -c 'import trainbridge; help(trainbridge.%s)'"


def _event_reason(name: str) -> str:
    events = [e.value for e in Event]
    return f"not an event.{did_you_mean(name, events) or ' Events: ' + ', '.join(events) + '.'}"


def _field_path(loc: Sequence[Any]) -> str:
    """``('callbacks', 0, 'class')`` -> ``callbacks[0].class``; validator-internal parts are dropped."""
    out = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part)):
            out += f".{part}"
    return out


def _choices(model: type[BaseModel], name: str) -> list[Any] | None:
    """The ``Literal`` values a field accepts (through ``Optional``/unions), or None."""
    info = model.model_fields.get(name)
    if info is None:
        return None
    found: list[Any] = []

    def walk(tp: Any) -> None:
        if typing.get_origin(tp) is typing.Literal:
            found.extend(typing.get_args(tp))
        else:
            for arg in typing.get_args(tp):
                walk(arg)

    walk(info.annotation)
    return found or None


_PYDANTIC_WORDING = [
    (r"^Input should be\b", "must be"),
    (r"^Input is not a valid path.*", "must be a path"),
    (r"^Input is not a valid (\w+).*", r"must be a valid \1"),
]


def _must(message: str) -> str:
    """pydantic's "Input should be ..." in the words of a config error: "must be ..."."""
    for pattern, replacement in _PYDANTIC_WORDING:
        message = re.sub(pattern, replacement, message)
    return message


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!", ")")) else text + "."


def _show(value: Any, quote: bool = True) -> str:
    text = repr(value) if quote or not isinstance(value, str) else value
    text = text.replace("\n", " ")
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 3] + "..."
