"""A model's chat template: a list of messages -> the prompt text the model was trained on.

Templates are Jinja2, as Hugging Face defines them (``tokenizer_config.json``'s ``chat_template``, a
``chat_template.jinja`` file, or a GGUF file's ``tokenizer.chat_template``).  They come with the model,
so they are rendered in Jinja's immutable sandbox (no attribute access to Python internals, no mutation
of the arguments) with the globals transformers provides: ``raise_exception``, ``strftime_now`` and a
``tojson`` filter; ``trim_blocks`` and ``lstrip_blocks`` as transformers sets them.

Rendering always passes ``add_generation_prompt`` (default True: the text ends where the assistant's turn
begins).  The rendered text is tokenized *without* adding special tokens (the template writes BOS itself
where the model wants it).  ``end_of_turn_token_ids`` are the special tokens that close a turn in this
template (``<|im_end|>``, ``<|eot_id|>``, ...): a chat completion stops at them as it stops at EOS.

The engine applies nothing implicitly: a raw text prompt stays raw; callers choose to render.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")
# Special tokens named like these close a turn when the template writes them.
_END_OF_TURN = re.compile(r"^<\|?(im_end|eot_id|eom_id|end|end_of_turn)\|?>$")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: a bad message, or the template itself raised.  A bad message's
    error keeps where it is (``index``, ``key``) apart from what is wrong (``problem``), for a front end
    that names the field in its own spelling."""

    def __init__(self, problem: str, *, index: int | None = None, key: str | None = None) -> None:
        super().__init__(problem if index is None else f"messages[{index}].{key} {problem}")
        self.problem, self.index, self.key = problem, index, key


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token strings it may refer to (``bos_token``, ...)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    end_of_turn_token_ids: tuple[int, ...] = ()
    origin: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _environment().from_string(self.source))

    @classmethod
    def build(
        cls, source: str, *, special_tokens: Mapping[str, str], vocab: Mapping[str, int], origin: str
    ) -> ChatTemplate:
        """``vocab``: the special tokens' ids (to find the template's end-of-turn tokens)."""
        import jinja2

        try:
            _environment().parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin}: the chat template does not parse: {exc}") from exc
        eot = tuple(sorted({i for t, i in vocab.items() if _END_OF_TURN.match(t) and t in source}))
        return cls(source, dict(special_tokens), eot, origin)

    def render(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """``tools``: the functions the model may call, in OpenAI's shape (``{"type": "function",
        "function": {...}}``), as Hugging Face hands them to a template; None (no tools) otherwise.
        A message's ``name`` the template does not show the model is refused (ChatTemplateError on its
        ``name``): the template is rendered once more with a marker for each name to find out (a second
        render only for conversations with names)."""
        checked = [_check_message(i, m) for i, m in enumerate(messages)]
        roles = [m["role"] for m in checked]  # as the client sent them (for an error)
        if "developer" not in self.source:  # OpenAI's newer name for the system role, where the template
            for m in checked:  # knows no such role (it rendered a default system prompt, then the turn)
                if m["role"] == "developer":
                    m["role"] = "system"
        if not checked:
            raise ChatTemplateError("messages: at least one message is needed")
        named = [i for i, m in enumerate(checked) if "name" in m]
        if named:  # a name the template never shows the model is refused, not dropped
            nonce = secrets.token_hex(8)  # no text of the request can hold it
            marked = [
                {**m, "name": _name_marker(i, nonce)} if i in named else m for i, m in enumerate(checked)
            ]
            shown = self._render(marked, add_generation_prompt, tools).lower()
            for i in named:
                if _name_marker(i, nonce).lower() not in shown:
                    raise ChatTemplateError(
                        f"this model's chat template does not show a {roles[i]} message's name to the model: "
                        "leave it out, or put it in the content",
                        index=i,
                        key="name",
                    )
        return self._render(checked, add_generation_prompt, tools)

    def _render(
        self,
        checked: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str:
        import jinja2

        try:
            return str(
                self._compiled.render(  # type: ignore[attr-defined]
                    messages=checked,
                    add_generation_prompt=add_generation_prompt,
                    tools=list(tools) if tools else None,
                    documents=None,
                    **self.special_tokens,
                )
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
        except Exception as exc:  # a template's own runtime error (a type error in its expressions, ...)
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


def _name_marker(i: int, nonce: str) -> str:
    """Message ``i``'s name while the template is asked whether it shows names: letters and digits only
    (a template may check a name's characters), found again whatever case the template writes it in;
    ``nonce`` is the call's own, so no content can hold a marker and pass for a shown name."""
    return f"PdkvName{i}x{nonce}"


def _check_message(i: int, m: ChatMessage | Mapping[str, Any]) -> dict[str, Any]:
    """The message as the template sees it: role and content, and -- only when set, since templates test
    for the key (``'tool_calls' in message``) -- the participant's ``name``, an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id``."""
    d = m.as_dict() if isinstance(m, ChatMessage) else dict(m)
    role, content = d.get("role"), d.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise ChatTemplateError(f"must be one of {', '.join(ROLES)}, got {role!r}", index=i, key="role")
    if not isinstance(content, str):
        raise ChatTemplateError(f"must be a string, got {type(content).__name__}", index=i, key="content")
    out: dict[str, Any] = {"role": role, "content": content}
    for key, kind in _OPTIONAL_KEYS.items():
        value = d.get(key)
        if value is None or (key == "tool_calls" and not value):
            continue
        if not isinstance(value, kind):
            raise ChatTemplateError(
                f"must be a {kind.__name__}, got {type(value).__name__}", index=i, key=key
            )
        out[key] = value
    return out


# What a message may carry besides its role and content (Hugging Face's names), and each one's type.
_OPTIONAL_KEYS: dict[str, type] = {"name": str, "tool_calls": list, "tool_call_id": str}


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV: Any = None


def _environment() -> Any:
    global _ENV
    if _ENV is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV
