"""Chat conversations -> token ids and labels, with the loss on assistant tokens only.

A conversation (``messages``: a list of ``{"role", "content", ...}`` dicts, tool calls and tool
messages included) is rendered with the model's own chat template (``tokenizer.apply_chat_template``)
and tokenized once; a token is trained on when its first character lies in an assistant span of the
rendered text.  The spans come from one of two places:

* **generation markers**: a template with ``{% generation %}`` blocks marks the assistant text itself
  (``apply_chat_template(..., return_assistant_tokens_mask=True)``, the spans transformers computes);
* **growing prefixes** otherwise (the approach of trl and instructlab-training): assistant turn ``a``
  spans from the end of ``render(messages[:a], add_generation_prompt=True)`` to the end of
  ``render(messages[:a + 1])``.  This is right only if every prefix renders as the beginning of the
  whole conversation, so each one is checked on every sample: a template that re-renders earlier turns
  once later ones follow (Qwen3 drops the reasoning of earlier turns) fails with a ``ChatTemplateError``
  naming the turn, never a silently wrong mask.

``train_on="last"`` keeps only the last assistant turn's span (the only choice for a template that
re-renders earlier turns and has no generation markers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ChatTrainOn = Literal["all", "last"]
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered or masked; the message says why (the caller adds file and row)."""


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` marks assistant text with ``{% generation %}`` blocks."""
    return bool(_GENERATION_MARKER.search(template))


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase | None, override: str | None) -> str:
    """The Jinja template to render conversations with: ``override`` if given, else the tokenizer's.

    Raises ``ChatTemplateError`` when there is none (a base model's tokenizer usually has no template).
    """
    if override:
        return override
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise ChatTemplateError(
            "the tokenizer has no chat template (tokenizer.chat_template is empty); set chat_template to a "
            "Jinja template string or a .jinja file, or use a model whose tokenizer has one"
        )
    return str(template)


def normalize_messages(messages: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Check a conversation and return it as plain dicts (``None`` values dropped, as Arrow rows fill them in).

    Roles must be ``system`` (first message only), ``user``, ``assistant`` or ``tool``; the first
    message after the system prompt is ``user``; ``user`` and ``assistant`` alternate, ``tool`` messages
    follow an ``assistant`` message (or another ``tool``); there is at least one ``assistant`` message.
    ``system_prompt`` is prepended when the conversation has no system message.
    Raises ``ChatTemplateError`` naming the message at fault.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatTemplateError(f"'messages' must be a non-empty list of messages, got {_short(messages)}")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {index} is not an object: {_short(message)}")
        clean = {key: _drop_none(value) for key, value in message.items() if value is not None}
        role = clean.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"message {index} has role {role!r}; expected one of {', '.join(ROLES)}")
        out.append(clean)
    if system_prompt is not None and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    offset = 1 if system_prompt is not None and messages[0].get("role") != "system" else 0
    previous = None
    for index, message in enumerate(out):
        role, where = message["role"], f"message {index - offset}"
        if role == "system":
            if index != 0:
                raise ChatTemplateError(f"roles out of order: {where} is 'system'; only the first message may be")
        elif previous in (None, "system"):
            if role != "user":
                raise ChatTemplateError(f"roles out of order: {where} is {role!r}; the conversation must open "
                                        "with 'user' (after an optional 'system')")
        elif role == "user" and previous == "user":
            raise ChatTemplateError(f"roles out of order: {where} is a second 'user' message in a row")
        elif role == "assistant" and previous == "assistant":
            raise ChatTemplateError(f"roles out of order: {where} is a second 'assistant' message in a row")
        elif role == "tool" and previous not in ("assistant", "tool"):
            raise ChatTemplateError(f"roles out of order: {where} is 'tool' after {previous!r}; tool results "
                                    "follow the assistant message that called the tool")
        previous = role
    if not any(message["role"] == "assistant" for message in out):
        raise ChatTemplateError("the conversation has no assistant message: nothing to train on")
    return out


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ChatEncoder:
    """Renders conversations with one template and computes assistant spans (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, train_on: ChatTrainOn = "all"):
        if train_on not in ("all", "last"):
            raise ValueError(f"train_on must be 'all' or 'last', got {train_on!r}")
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = train_on
        self.markers = has_generation_markers(template)

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # the template's own raise_exception, or a Jinja error
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        return str(text)

    def spans(self, messages: list[dict[str, Any]], tools: Any = None,
              assistant_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans to train on, in order.

        Only assistant messages at index ``>= assistant_from`` are trained on (prompt/completion pairs
        train on the completion's); ``train_on="last"`` keeps the last of them.
        """
        targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= assistant_from]
        if not targets:
            raise ChatTemplateError("the conversation has no assistant message to train on")
        if self.markers:
            return self._spans_from_markers(messages, tools, targets)
        return self._spans_from_prefixes(messages, tools, targets)

    def _spans_from_markers(self, messages: list[dict[str, Any]], tools: Any,
                            targets: list[int]) -> tuple[str, list[tuple[int, int]]]:
        from transformers.utils import chat_template_utils

        render: Any = chat_template_utils.render_jinja_template  # returns (texts, generation spans)
        try:
            rendered, indices = render(
                conversations=[messages], tools=tools, chat_template=self.template,
                return_assistant_tokens_mask=True, **self.tokenizer.special_tokens_map,
            )
        except Exception as exc:
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        text, spans = rendered[0], [tuple(span) for span in indices[0]]
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(spans) != len(assistants):
            raise ChatTemplateError(
                f"the chat template's {{% generation %}} blocks mark {len(spans)} spans for {len(assistants)} "
                "assistant messages; the markers must wrap each assistant message once"
            )
        chosen = [span for i, span in zip(assistants, spans) if i in targets]
        if self.train_on == "last":
            chosen = chosen[-1:]
        return text, [(int(a), int(b)) for a, b in chosen]

    def _spans_from_prefixes(self, messages: list[dict[str, Any]], tools: Any,
                             targets: list[int]) -> tuple[str, list[tuple[int, int]]]:
        if self.train_on == "last":
            targets = targets[-1:]
        full = self._render(messages, tools, add_generation_prompt=False)
        spans = []
        for index in targets:
            prompt = self._render(messages[:index], tools, add_generation_prompt=True)
            turn = full if index == len(messages) - 1 else self._render(messages[: index + 1], tools, False)
            for name, prefix in (("the prompt before", prompt), ("the conversation up to", turn)):
                if not full.startswith(prefix):
                    at = next((k for k, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
                    raise ChatTemplateError(
                        f"the chat template renders {name} assistant message {index} differently once later "
                        f"messages follow (they differ at character {at}: {prefix[at:at + 30]!r} vs "
                        f"{full[at:at + 30]!r}), so its assistant span cannot be found by rendering prefixes; "
                        "train on the last assistant turn only (chat_train_on='last') or use a template with "
                        "{% generation %} markers"
                    )
            if len(turn) < len(prompt):
                raise ChatTemplateError(f"assistant message {index} renders shorter than its prompt")
            spans.append((len(prompt), len(turn)))
        return full, spans

    # ------------------------------------------------------------------ tokens
    def encode(self, messages: list[dict[str, Any]], tools: Any = None,
               assistant_from: int = 0) -> tuple[list[int], list[int]]:
        """``input_ids`` and ``labels`` (``-100`` outside the assistant spans) of one conversation."""
        text, spans = self.spans(messages, tools, assistant_from)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoded["input_ids"])
        starts = np.fromiter((start for start, _ in encoded["offset_mapping"]), dtype=np.int64,
                             count=len(input_ids))
        trained = np.zeros(len(input_ids), dtype=bool)
        for begin, end in spans:
            trained |= (starts >= begin) & (starts < end)
        labels = np.where(trained, np.asarray(input_ids, dtype=np.int64), -100).tolist()
        return input_ids, labels
