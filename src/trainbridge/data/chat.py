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
from collections.abc import Callable, Mapping, Sequence
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
                raise ChatTemplateError(
                    f"roles out of order: {where} is {role!r}; the conversation must open "
                    "with 'user' (after an optional 'system')"
                )
        elif role == "user" and previous == "user":
            raise ChatTemplateError(f"roles out of order: {where} is a second 'user' message in a row")
        elif role == "assistant" and previous == "assistant":
            raise ChatTemplateError(f"roles out of order: {where} is a second 'assistant' message in a row")
        elif role == "tool" and previous not in ("assistant", "tool"):
            raise ChatTemplateError(
                f"roles out of order: {where} is 'tool' after {previous!r}; tool results "
                "follow the assistant message that called the tool"
            )
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


ChatItem = tuple[list[dict[str, Any]], Any, int]
"""One conversation to encode: ``(messages, tools, assistant_from)`` (see ``ChatEncoder.spans``)."""

Render = Callable[[int, bool], str]
"""``render(count, add_generation_prompt)``: the text of the conversation's first ``count`` messages."""


class ChatEncoder:
    """Renders conversations with one template and computes assistant spans (see the module docstring).

    ``encode`` handles one conversation; ``encode_batch`` a ``datasets.map`` batch of them, with the
    same result per conversation (``tests/unit/test_chat_masking.py`` compares the two): the template
    renders of the batch go through one ``apply_chat_template`` call per kind (prompt / turn) and the
    texts through one tokenizer call, and a conversation that fails gets its ``ChatTemplateError``
    instead of a result, so one bad row does not fail its batch.
    """

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
                messages,
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # the template's own raise_exception, or a Jinja error
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        return str(text)

    def _render_many(
        self, conversations: list[list[dict[str, Any]]], tools: list[Any], add_generation_prompt: bool
    ) -> list[str | ChatTemplateError]:
        """``_render`` of each conversation; those without tools in one template call (each alone if it fails)."""
        out: list[str | ChatTemplateError] = [ChatTemplateError("not rendered")] * len(conversations)
        plain = [k for k, t in enumerate(tools) if t is None and conversations[k]]
        if plain:
            try:
                texts = self.tokenizer.apply_chat_template(
                    [conversations[k] for k in plain],
                    chat_template=self.template,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                )
                for k, text in zip(plain, texts):
                    out[k] = str(text)
            except Exception:  # some conversation of the batch fails: render each alone to say which
                plain = []
        done = set(plain)
        for k, conversation in enumerate(conversations):
            if k not in done:
                try:
                    out[k] = self._render(conversation, tools[k], add_generation_prompt)
                except ChatTemplateError as exc:
                    out[k] = exc
        return out

    def _targets(self, messages: list[dict[str, Any]], assistant_from: int) -> list[int]:
        targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= assistant_from]
        if not targets:
            raise ChatTemplateError("the conversation has no assistant message to train on")
        return targets

    def spans(
        self, messages: list[dict[str, Any]], tools: Any = None, assistant_from: int = 0
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans to train on, in order.

        Only assistant messages at index ``>= assistant_from`` are trained on (prompt/completion pairs
        train on the completion's); ``train_on="last"`` keeps the last of them.
        """
        targets = self._targets(messages, assistant_from)
        if self.markers:
            rendered = self._render_marked([messages], [tools])[0]
            if isinstance(rendered, ChatTemplateError):
                raise rendered
            return rendered[0], self._spans_from_markers(messages, rendered[1], targets)

        def render(count: int, add_generation_prompt: bool) -> str:
            return self._render(messages[:count], tools, add_generation_prompt)

        return self._spans_from_prefixes(messages, render, targets)

    def spans_batch(self, items: list[ChatItem]) -> list[tuple[str, list[tuple[int, int]]] | ChatTemplateError]:
        """``spans`` of each conversation, rendered in batches; a failing one gets its error instead."""
        out: list[tuple[str, list[tuple[int, int]]] | ChatTemplateError] = []
        targets: list[list[int]] = []
        for messages, _, assistant_from in items:
            try:
                targets.append(self._targets(messages, assistant_from))
            except ChatTemplateError as exc:
                targets.append([])
                out.append(exc)
            else:
                out.append(ChatTemplateError("not rendered"))
        live = [k for k, t in enumerate(targets) if t]
        if self.markers:
            marked = self._render_marked([items[k][0] for k in live], [items[k][1] for k in live])
            for k, rendered in zip(live, marked):
                try:
                    if isinstance(rendered, ChatTemplateError):
                        raise rendered
                    out[k] = (rendered[0], self._spans_from_markers(items[k][0], rendered[1], targets[k]))
                except ChatTemplateError as exc:
                    out[k] = exc
            return out
        # every render the prefix check needs, two template calls for the whole batch
        needed = {(k, count, prompt) for k in live for count, prompt in self._prefix_renders(items[k][0], targets[k])}
        texts: dict[tuple[int, int, bool], str | ChatTemplateError] = {}
        for prompt in (True, False):
            keys = sorted(key for key in needed if key[2] == prompt)
            texts.update(
                zip(
                    keys,
                    self._render_many(
                        [items[k][0][:count] for k, count, _ in keys], [items[k][1] for k, _, _ in keys], prompt
                    ),
                )
            )
        for k in live:

            def render(count: int, add_generation_prompt: bool, k: int = k) -> str:
                text = texts.get((k, count, add_generation_prompt))
                if text is None:  # not foreseen by _prefix_renders: render it now
                    return self._render(items[k][0][:count], items[k][1], add_generation_prompt)
                if isinstance(text, ChatTemplateError):
                    raise text
                return text

            try:
                out[k] = self._spans_from_prefixes(items[k][0], render, targets[k])
            except ChatTemplateError as exc:
                out[k] = exc
        return out

    def _render_marked(
        self, conversations: list[list[dict[str, Any]]], tools: list[Any]
    ) -> list[tuple[str, list[tuple[int, int]]] | ChatTemplateError]:
        """Text and ``{% generation %}`` spans of each conversation (``tools[k]`` its tools); those without
        tools in one template call (each alone if it fails)."""
        from transformers.utils import chat_template_utils

        render: Any = chat_template_utils.render_jinja_template  # returns (texts, generation spans)

        def call(group: list[list[dict[str, Any]]], group_tools: Any) -> list[tuple[str, list[tuple[int, int]]]]:
            try:
                rendered, indices = render(
                    conversations=group,
                    tools=group_tools,
                    chat_template=self.template,
                    return_assistant_tokens_mask=True,
                    **self.tokenizer.special_tokens_map,
                )
            except Exception as exc:
                raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
            return [(str(text), [(int(a), int(b)) for a, b in spans]) for text, spans in zip(rendered, indices)]

        plain = [k for k, t in enumerate(tools) if t is None]
        batched: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        if len(plain) > 1:
            try:
                batched = dict(zip(plain, call([conversations[k] for k in plain], None)))
            except ChatTemplateError:  # some conversation of the batch fails: render each alone to say which
                batched = {}
        out: list[tuple[str, list[tuple[int, int]]] | ChatTemplateError] = []
        for k, conversation in enumerate(conversations):
            if k in batched:
                out.append(batched[k])
                continue
            try:
                out.append(call([conversation], tools[k])[0])
            except ChatTemplateError as exc:
                out.append(exc)
        return out

    def _spans_from_markers(
        self, messages: list[dict[str, Any]], generation: list[tuple[int, int]], targets: list[int]
    ) -> list[tuple[int, int]]:
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(generation) != len(assistants):
            raise ChatTemplateError(
                f"the chat template's {{% generation %}} blocks mark {len(generation)} spans for {len(assistants)} "
                "assistant messages; the markers must wrap each assistant message once"
            )
        chosen = [span for i, span in zip(assistants, generation) if i in targets]
        if self.train_on == "last":
            chosen = chosen[-1:]
        return chosen

    def _prefix_renders(self, messages: list[dict[str, Any]], targets: list[int]) -> list[tuple[int, bool]]:
        """The ``(count, add_generation_prompt)`` renders ``_spans_from_prefixes`` asks for."""
        if self.train_on == "last":
            targets = targets[-1:]
        needed = [(len(messages), False)]
        for index in targets:
            needed.append((index, True))
            if index != len(messages) - 1:
                needed.append((index + 1, False))
        return needed

    def _spans_from_prefixes(
        self, messages: list[dict[str, Any]], render: Render, targets: list[int]
    ) -> tuple[str, list[tuple[int, int]]]:
        if self.train_on == "last":
            targets = targets[-1:]
        full = render(len(messages), False)
        spans = []
        for index in targets:
            prompt = render(index, True)
            turn = full if index == len(messages) - 1 else render(index + 1, False)
            for name, prefix in (("the prompt before", prompt), ("the conversation up to", turn)):
                if not full.startswith(prefix):
                    at = next((k for k, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
                    raise ChatTemplateError(
                        f"the chat template renders {name} assistant message {index} differently once later "
                        f"messages follow (they differ at character {at}: {prefix[at : at + 30]!r} vs "
                        f"{full[at : at + 30]!r}), so its assistant span cannot be found by rendering prefixes; "
                        "train on the last assistant turn only (chat_train_on='last') or use a template with "
                        "{% generation %} markers"
                    )
            if len(turn) < len(prompt):
                raise ChatTemplateError(f"assistant message {index} renders shorter than its prompt")
            spans.append((len(prompt), len(turn)))
        return full, spans

    # ------------------------------------------------------------------ tokens
    def encode(
        self, messages: list[dict[str, Any]], tools: Any = None, assistant_from: int = 0
    ) -> tuple[list[int], list[int]]:
        """``input_ids`` and ``labels`` (``-100`` outside the assistant spans) of one conversation."""
        text, spans = self.spans(messages, tools, assistant_from)
        encoded = self._tokenize(text)
        return _labelled(list(encoded["input_ids"]), encoded["offset_mapping"], spans)

    def _tokenize(self, text: str | list[str]) -> Any:
        """``input_ids`` and character ``offset_mapping`` of ``text`` (a list: of each), no special tokens added
        (the template renders them)."""
        return self.tokenizer(
            text,
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )

    def encode_batch(self, items: list[ChatItem]) -> list[tuple[list[int], list[int]] | ChatTemplateError]:
        """``encode`` of each conversation (renders batched, one tokenizer call); a failing one gets its error."""
        spans = self.spans_batch(items)
        good = [k for k, s in enumerate(spans) if not isinstance(s, ChatTemplateError)]
        out: list[tuple[list[int], list[int]] | ChatTemplateError] = []
        texts: list[str] = []
        for result in spans:
            if isinstance(result, ChatTemplateError):
                out.append(result)
            else:
                out.append(([], []))
                texts.append(result[0])
        if texts:
            encoded = self._tokenize(texts)
            for k, ids, offsets in zip(good, encoded["input_ids"], encoded["offset_mapping"]):
                result = spans[k]
                assert not isinstance(result, ChatTemplateError)
                out[k] = _labelled(list(ids), offsets, result[1])
        return out


def _labelled(
    input_ids: list[int], offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """``input_ids`` and their labels: a token is trained on when its first character lies in a span."""
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(input_ids))
    trained = np.zeros(len(input_ids), dtype=bool)
    for begin, end in spans:
        trained |= (starts >= begin) & (starts < end)
    labels = np.where(trained, np.asarray(input_ids, dtype=np.int64), -100).tolist()
    return input_ids, labels
