"""The typed body of OpenAI's ``POST /v1/responses`` and what radixlm refuses in it.

Shapes are the ``openai`` package's (``openai.types.responses``). The request is parsed in
strict mode like the other OpenAI routes; input items and tools are checked one by one in
``responses_items.py`` so an error names ``input[3].content[0].type`` rather than a union.
A field whose feature radixlm lacks (hosted tools, background responses, reasoning effort,
conversations, stored prompts, ...) is a 400 naming it (``ResponsesRequest.unsupported``);
a field radixlm does not know at all is logged once and ignored, as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixlm.runtime.entrypoints.protocol import Count, Finite, Int64, StrOrList, TokenId

logger = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
_logged_unknown: set[str] = set()


class _Typed(BaseModel):
    """Strict JSON types; fields the shapes have and radixlm does not read are ignored
    (``id``, ``status``, ``annotations`` of replayed output items)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextFormat(_Typed):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat, unlike chat's
    ``response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Typed):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Typed):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(_Typed):
    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    """``ResponseCreateParams``, with the sampling extras vLLM's ``ResponsesRequest``
    accepts (seed, top_k, min_p, repetition_penalty, stop, ...)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    # required: radixlm has no stored prompts or conversations to stand in for it
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=(1 << 31) - 1)] | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    # identifiers and hints: echoed, nothing to do (the radix cache reuses every shared
    # prefix without a key)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # features radixlm lacks: a 400 unless absent or neutral (``unsupported``)
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: Count | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # extras (vLLM / SGLang)
    seed: Int64 | None = None
    top_k: Int64 | None = None
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    stop: StrOrList | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Count | None = None
    priority: int | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    # the template's switches, as on /v1/chat/completions (enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None

    def log_unknown_fields(self) -> None:
        """Log, once per name, the fields this server does not know (then ignored)."""
        for name in sorted(set(self.model_extra or ()) - _logged_unknown):
            _logged_unknown.add(name)
            logger.warning("/v1/responses: ignoring unknown field %r (logged once)", name)

    @property
    def want_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, why)`` of the first feature this request asks for and radixlm lacks."""
        for check in (self._refused_features, self._refused_options, self._bad_metadata):
            refused = check()
            if refused is not None:
                return refused
        return None

    def _refused_features(self) -> tuple[str, str] | None:
        absent = {
            "background": (self.background or None,
                           "background responses are not supported: radixlm answers while "
                           "the request is open (use stream=true for long outputs)"),
            "conversation": (self.conversation, "conversations (the Conversations API) are "
                             "not supported; chain responses with previous_response_id"),
            "prompt": (self.prompt, "stored prompt templates are not supported; send "
                       "instructions and input"),
            "context_management": (self.context_management or None,
                                   "context compaction is not supported"),
            "moderation": (self.moderation, "radixlm has no moderation model"),
            "image": (self.image, "radixlm serves text-only models"),
            "access_programs": (self.access_programs, "radixlm has no access programs"),
            "background_options": (self.background_options, "background responses are "
                                   "not supported"),
            "prompt_cache_options": (self.prompt_cache_options, "radixlm's prefix cache is "
                                     "implicit: it has no explicit cache breakpoints or TTLs"),
            "max_tool_calls": (self.max_tool_calls, "radixlm does not cap the tool calls "
                               "of a response; use parallel_tool_calls=false for one"),
        }
        for field, (value, why) in absent.items():
            if value is not None:
                return field, f"{field} is not supported: {why}"
        r = self.reasoning
        if r is not None and (r.effort, r.summary, r.generate_summary) != (None, None, None):
            return "reasoning", ("reasoning is not supported: radixlm has no reasoning-effort "
                                 "or summary control for the served model")
        return None

    def _refused_options(self) -> tuple[str, str] | None:
        if self.text is not None and self.text.verbosity is not None:
            return "text.verbosity", "text.verbosity is not supported: radixlm has no " \
                                     "verbosity control; use max_output_tokens"
        if self.truncation not in (None, "disabled"):
            return "truncation", (f"truncation {self.truncation!r} is not supported: radixlm "
                                  "does not drop input items to fit the context (an input "
                                  "too long is a 400); use 'disabled'")
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", (f"service_tier {self.service_tier!r} is not supported: "
                                    "radixlm has one tier ('auto' or 'default'); use "
                                    "priority with --enable-priority-scheduling")
        if self.prompt_cache_retention not in (None, "in_memory"):
            return "prompt_cache_retention", (
                f"prompt_cache_retention {self.prompt_cache_retention!r} is not supported: "
                "radixlm's prefix cache lives in memory ('in_memory')")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            return "stream_options.include_obfuscation", (
                "stream_options.include_obfuscation is not supported: radixlm does not pad "
                "stream events; send false")
        for i, name in enumerate(self.include or ()):
            if name != LOGPROBS_INCLUDE:
                return f"include[{i}]", (f"include {name!r} is not supported: radixlm can "
                                         f"include only {LOGPROBS_INCLUDE!r}")
        return None

    def _bad_metadata(self) -> tuple[str, str] | None:
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS:
            return "metadata", (f"metadata has {len(meta)} keys, over the limit of "
                                f"{MAX_METADATA_KEYS}")
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                return "metadata", (f"metadata keys have at most {MAX_METADATA_KEY_CHARS} "
                                    f"characters and values {MAX_METADATA_VALUE_CHARS}; "
                                    f"{key[:40]!r} is over")
        return None


# --- input items ---------------------------------------------------------------------------
class MessageItem(_Typed):
    """An input message (``EasyInputMessage`` or a replayed ``ResponseOutputMessage``)."""

    id: str | None = None
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Typed):
    """A ``function_call`` the model made earlier (``ResponseFunctionToolCall``)."""

    id: str | None = None
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Typed):
    """The client's result of a call (``FunctionCallOutput``)."""

    id: str | None = None
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningText(_Typed):
    """A ``reasoning_text`` or ``summary_text`` part of a reasoning item."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Typed):
    """The model's earlier thinking (``ResponseReasoningItem``), replayed by a client that
    manages its own context: its ``content`` (else its ``summary``) becomes the assistant
    turn's ``reasoning_content``. ``encrypted_content`` is OpenAI's, which radixlm cannot
    read (it returns none)."""

    id: str | None = None
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class FunctionToolIn(_Typed):
    """A ``FunctionTool``: the only kind of tool radixlm serves."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
