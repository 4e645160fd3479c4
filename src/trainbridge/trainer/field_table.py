"""Every ``transformers.TrainingArguments`` field of the installed version, as ``trainbridge.Trainer`` treats it.

Read from the dataclass and the data the port itself uses: ``hf.fields.FIELD_LINKS`` (carried over),
``hf.porting`` (``NOT_WARNED``, ``REPLACED_BY``, ``EXPLANATIONS``: the warnings' words) and the facade's
callbacks' ``honours_hf_fields``.  ``python -m trainbridge.trainer.field_table > docs/trainer_fields.md``
writes the table; tests/unit/test_field_table.py checks the committed one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import transformers
from transformers import TrainingArguments

from trainbridge.callbacks.neftune import NEFTune
from trainbridge.hf.fields import CARRIED_OVER, FIELD_LINKS
from trainbridge.hf.porting import EXPLANATIONS, NOT_WARNED, REPLACED_BY, ignored_reason
from trainbridge.trainer.subclass import INSTANCE_STEP_HONOURS

Status = Literal["same", "differs", "ignored"]
"""``same``: as under Trainer; ``differs``: applied another way, or not at all without a warning (``why``
says how); ``ignored``: a non-default value is ignored with an ``HFPortingWarning`` saying ``why``.  No field
is refused as a whole (some values are, before launch: see ``why`` and the config's errors)."""

HONOURING: tuple[type[NEFTune], ...] = (NEFTune,)
"""The facade's callbacks that apply ``TrainingArguments`` fields themselves (``honours_hf_fields``)."""

REGENERATE = "python -m trainbridge.trainer.field_table > docs/trainer_fields.md"


@dataclass(frozen=True)
class FieldRow:
    """One field: how the run treats it, where it goes (a ``TrainingArgs`` field or a callback), and why."""

    name: str
    status: Status
    here: str
    why: str


def field_names(cls: type[TrainingArguments] = TrainingArguments) -> list[str]:
    """``cls``'s constructor fields, in declaration order (those the port reads)."""
    return [field.name for field in dataclasses.fields(cls) if field.init]


def field_row(name: str) -> FieldRow:
    """How ``name`` (a ``TrainingArguments`` field) is treated, in the port's own order of checks."""
    links = {link.hf: link for link in FIELD_LINKS}
    if name in CARRIED_OVER:
        link = links[name]
        here = link.reads or link.ours or ""
        return FieldRow(name, "differs" if link.differs else "same", here, link.differs or "")
    for callback in HONOURING:
        if name in callback.honours_hf_fields:
            return FieldRow(name, "same", f"{callback.__name__} (callback)", "applied as Trainer.train applies it")
    if name in INSTANCE_STEP_HONOURS:
        why = "applied by Trainer's own compute_loss, which the loop steps through; ignored with a warning where "
        return FieldRow(name, "differs", "Trainer.compute_loss", why + "a Seq2SeqTrainer generates its predictions")
    if name in NOT_WARNED:
        unwarned = NOT_WARNED[name]
        return FieldRow(name, "same" if unwarned.same else "differs", "", unwarned.why)
    if name in REPLACED_BY:
        here = ", ".join(REPLACED_BY[name])
        otherwise = f"; without it, ignored with a warning: {EXPLANATIONS[name]}" if name in EXPLANATIONS else ""
        return FieldRow(name, "differs", here, f"applied through {here} when the caller passes it{otherwise}")
    return FieldRow(name, "ignored", "", ignored_reason(name))


def field_rows(cls: type[TrainingArguments] = TrainingArguments) -> list[FieldRow]:
    """One row per field of ``cls``."""
    return [field_row(name) for name in field_names(cls)]


def counts(rows: list[FieldRow]) -> dict[str, int]:
    """How many rows of each status."""
    found = Counter(row.status for row in rows)
    return {status: found[status] for status in ("same", "differs", "ignored")}


def markdown(rows: list[FieldRow]) -> str:
    """docs/trainer_fields.md."""
    total = ", ".join(f"{n} {status}" for status, n in counts(rows).items())
    lines = [
        "# TrainingArguments fields under trainbridge.Trainer",
        "",
        f"Generated for transformers {transformers.__version__} by `{REGENERATE}` (do not edit by hand):",
        f"{len(rows)} fields, {total}. `same`: as under Trainer; `differs`: applied another way, or not at all",
        "without a warning; `ignored`: a non-default value is ignored with an `HFPortingWarning` saying why.",
        "See [porting.md](porting.md#trainingarguments).",
        "",
        "| field | status | trainbridge | why |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        here = f"`{row.here}`" if row.here else ""
        lines.append(f"| `{row.name}` | {row.status} | {here} | {row.why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(field_rows()), end="")
