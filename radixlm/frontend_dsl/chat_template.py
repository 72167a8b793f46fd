"""Role markers for ``system()/user()/assistant()``.

``from_jinja`` derives them from a model's own Jinja chat template (the local backend
reads the tokenizer's, the HTTP backend asks ``/get_model_info``) by rendering small
conversations with sentinel contents and cutting the text around the sentinels. When
there is no template, or it renders in a way the cuts cannot explain, a named template
from ``TEMPLATES`` is used instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

_S = ["\x00SGL0\x00", "\x00SGL1\x00", "\x00SGL2\x00"]


@dataclass(frozen=True)
class ChatTemplate:
    """``roles[role] = (prefix, suffix)`` around each message; ``preamble`` opens a
    conversation (a BOS token, say); ``stop_str`` ends an assistant turn."""

    name: str
    roles: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()
    preamble: str = ""
    default_system_prompt: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def prefix(self, role: str) -> str:
        return self._pair(role)[0]

    def suffix(self, role: str) -> str:
        return self._pair(role)[1]

    def _pair(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(
                f"chat template {self.name!r} has no role {role!r}; roles: {sorted(self.roles)}"
            )
        return self.roles[role]


def _chatml() -> ChatTemplate:
    roles = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")}
    return ChatTemplate("chatml", roles, stop_str=("<|im_end|>",))


def _llama3() -> ChatTemplate:
    roles = {
        r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
        for r in ("system", "user", "assistant")
    }
    return ChatTemplate(
        "llama-3-instruct", roles, stop_str=("<|eot_id|>",), preamble="<|begin_of_text|>"
    )


def _llama2() -> ChatTemplate:
    roles = {
        "system": ("<<SYS>>\n", "\n<</SYS>>\n\n"),
        "user": ("[INST] ", " [/INST]"),
        "assistant": (" ", "</s><s>"),
    }
    return ChatTemplate("llama-2-chat", roles, stop_str=("</s>",), preamble="<s>")


def _default() -> ChatTemplate:
    roles = {
        "system": ("SYSTEM:", "\n"),
        "user": ("USER:", "\n"),
        "assistant": ("ASSISTANT:", "\n"),
    }
    return ChatTemplate("default", roles)


TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t for t in (_chatml(), _llama3(), _llama2(), _default())
}


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}") from None


def guess_template_name(model_path: str | None) -> str:
    """A named template for a model path (used only when the model has no template)."""
    path = (model_path or "").lower()
    if "llama-3" in path or "llama3" in path:
        return "llama-3-instruct"
    if "llama-2" in path and "chat" in path:
        return "llama-2-chat"
    return "chatml"


def from_jinja(
    source: str, bos_token: str = "", eos_token: str = "", name: str = "model"
) -> ChatTemplate:
    """Derive role markers from a Jinja chat template; ValueError when it cannot."""
    render = _renderer(source, bos_token, eos_token)
    user_only = render([("user", 0)], False)
    with_gen = render([("user", 0)], True)
    pre_user, user_suffix = _split(user_only, _S[0])
    if not with_gen.startswith(user_only):
        raise ValueError("the generation prompt does not extend the conversation")
    asst_prefix = with_gen[len(user_only) :]
    ua = render([("user", 0), ("assistant", 1)], False)
    asst_suffix = _split(ua, _S[1])[1]
    uau = render([("user", 0), ("assistant", 1), ("user", 2)], False)
    between = uau[uau.index(_S[1]) + len(_S[1]) : uau.index(_S[2])]
    user_prefix = _strip_prefix(between, asst_suffix)
    preamble = _strip_suffix(pre_user, user_prefix)
    roles = {"user": (user_prefix, user_suffix), "assistant": (asst_prefix, asst_suffix)}
    try:
        roles["system"] = _system_role(render, preamble, user_prefix)
    except (ValueError, TemplateError):
        logger.info("chat template %s: no separate system role; using the user markers", name)
        roles["system"] = roles["user"]
    stop = asst_suffix.strip()
    return ChatTemplate(name, roles, stop_str=(stop,) if stop else (), preamble=preamble)


def _system_role(render, preamble: str, user_prefix: str) -> tuple[str, str]:
    su = render([("system", 0), ("user", 1)], False)
    before, rest = su.split(_S[0], 1)
    between = rest.split(_S[1], 1)[0]
    system_suffix = _strip_suffix(between, user_prefix)
    return _strip_prefix(before, preamble), system_suffix


def _renderer(source: str, bos_token: str, eos_token: str):
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)

    def render(turns: list[tuple[str, int]], add_generation_prompt: bool) -> str:
        messages = [{"role": role, "content": _S[i]} for role, i in turns]
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )

    return render


def _split(text: str, sentinel: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise ValueError("the template does not render the message content verbatim")
    before, after = text.split(sentinel)
    return before, after


def _strip_prefix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ValueError(f"expected {text!r} to start with {prefix!r}")
    return text[len(prefix) :]


def _strip_suffix(text: str, suffix: str) -> str:
    if not text.endswith(suffix):
        raise ValueError(f"expected {text!r} to end with {suffix!r}")
    return text[: len(text) - len(suffix)]


def resolve_chat_template(
    jinja_source: str | None,
    model_path: str | None = None,
    bos_token: str = "",
    eos_token: str = "",
    fallback: str | None = None,
) -> ChatTemplate:
    """The model's own template when it can be derived, else a named fallback."""
    if jinja_source:
        try:
            return from_jinja(jinja_source, bos_token, eos_token, name=model_path or "model")
        except (ValueError, TemplateError) as e:
            logger.warning(
                "cannot derive role markers from the chat template (%s); "
                "falling back to a named template",
                e,
            )
    return get_chat_template(fallback or guess_template_name(model_path))
