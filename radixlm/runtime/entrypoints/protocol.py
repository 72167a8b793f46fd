"""The typed request models of every route: what a client may send, checked at the edge.

Bodies are parsed with ``Model.model_validate_json`` in strict mode, so JSON's types are
taken at their word: booleans are not integers, strings are not numbers, floats are
finite (no NaN or Infinity), strings are valid UTF-8 without lone surrogates, nesting is
bounded by the parser, and every integer fits the 64-bit field it is sent in. Ranges
that depend on the model or the server's flags (vocabulary, context length, caps on
``n``, ``stop`` and ``logit_bias``) are checked after parsing, in
``managers/validation.py``, so the Engine checks them too. ``/openapi.json`` is built from
these models (``openapi_schema``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from radixlm.runtime.entrypoints.refused_fields import (
    REFUSED_REQUEST_FIELDS,
    REFUSED_SAMPLING_FIELDS,
    drop_neutral,
)
from radixlm.runtime.entrypoints.validation_errors import describe

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]  # lengths, numbers of things
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the vocabulary bound comes later
Finite = Annotated[float, Field(allow_inf_nan=False)]
StrOrList = str | list[str]


class _Strict(BaseModel):
    """Unknown fields are an error; types are JSON's, without coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    """OpenAI's routes: fields radixlm does not use (``user``, ``store``, ``metadata``, ...)
    are ignored, as OpenAI-compatible servers do; the ones it uses are typed."""

    model_config = ConfigDict(extra="ignore", strict=True)


# --- native (SGLang) ---------------------------------------------------------------------------
class SamplingParamsIn(_Strict):
    """SGLang's ``sampling_params``; ranges are checked by ``SamplingParams.verify``."""

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        return drop_neutral(data, REFUSED_SAMPLING_FIELDS)

    max_new_tokens: Count | None = None
    min_new_tokens: Count | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Int64 | None = None
    min_p: Finite | None = None
    frequency_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    stop: StrOrList | None = None
    stop_regex: StrOrList | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Count | None = None
    seed: Int64 | None = None
    sampling_seed: Int64 | None = None  # SGLang's name for seed
    regex: str | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None  # constrained/structural_tag.py
    logit_bias: dict[str, Finite] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields the client set (explicit nulls included: they mean the default)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None}


def typed_sampling_params(sp: Any) -> dict[str, Any]:
    """An Engine caller's ``sampling_params``, checked as an HTTP body's are (ValueError);
    ``logit_bias`` may have int keys there."""
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise ValueError(f"sampling_params must be a dict, got {type(sp).__name__}")
    if isinstance(sp.get("logit_bias"), dict):
        sp = {**sp, "logit_bias": {str(k): v for k, v in sp["logit_bias"].items()}}
    try:
        return SamplingParamsIn.model_validate(sp, strict=True).to_dict()
    except ValidationError as e:
        raise ValueError(f"sampling_params.{describe(e)[0]}") from None


def _per_item(kind: Any) -> Any:
    """A field of /generate given once for the batch or once per item."""
    return kind | list[kind] | None


class GenerateRequest(_Strict):
    """SGLang's ``/generate`` body: one prompt or a batch (lists of text or of id lists).
    SGLang's other fields are in ``REFUSED_REQUEST_FIELDS``."""

    text: StrOrList | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: _per_item(SamplingParamsIn) = None
    rid: _per_item(str) = None
    return_logprob: _per_item(bool) = None
    logprob_start_len: _per_item(Int64) = None
    top_logprobs_num: _per_item(Count) = None
    # logprobs of these ids at every position (with return_logprob): a list for one
    # prompt, a list of lists (one per item) for a batch
    token_ids_logprob: list[TokenId] | list[list[TokenId] | None] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    # cache namespaces: requests share cached KV only with the same ones (SGLang / vLLM)
    extra_key: _per_item(str) = None
    cache_salt: _per_item(str) = None
    priority: int | None = None  # scheduling priority (--enable-priority-scheduling)
    # --dp-size > 1: requests with the same key are served by the same replica (SGLang's)
    routing_key: str | None = None
    # --dp-size > 1: serve on this replica (SGLang's; data_parallel_rank is its old name)
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    # Prometheus labels of this request's metrics (--tokenizer-metrics-allowed-custom-labels)
    custom_labels: dict[str, str] | None = None
    log_metrics: bool = True  # false: left out of the request metrics (health checks)
    model: str | None = None  # sglang-router sends it (null); SGLang's /generate ignores it
    # accepted as is: radixlm logs no prompt or output, only rids and why a request was
    # refused (which may quote the bad parameter, e.g. a grammar that did not compile)
    no_logs: bool = False
    # --disaggregation-mode prefill|decode: where the KV goes / comes from (SGLang's; a
    # list gives one per item, or per sample of one item); a 400 in null mode
    bootstrap_host: _per_item(str) = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: _per_item(Int64) = None
    # the prefill server's replica that holds the rooms' KV (SGLang's hint to the decode
    # server; the prefill places them there); null: bootstrap_room mod its --dp-size
    disagg_prefill_dp_rank: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        return drop_neutral(data, REFUSED_REQUEST_FIELDS)

    def token_ids_for(self, i: int, batch: bool) -> list[int] | None:
        return token_ids_for_item(self.token_ids_logprob, i, batch)


def token_ids_for_item(ids: Any, i: int, batch: bool) -> list[int] | None:
    """Item ``i``'s ``token_ids_logprob`` (SGLang: one flat list is shared by a batch's
    items, a list of lists gives one per item); ValueError for a bad shape."""
    if ids is None or not isinstance(ids, list) or not ids or not isinstance(ids[0], list):
        return ids
    if not batch:
        raise ValueError("token_ids_logprob is a list of lists but the request is not a "
                         "batch; give one list of token ids")
    if i >= len(ids):
        raise ValueError(f"token_ids_logprob has {len(ids)} lists, fewer than the batch")
    return ids[i]


def custom_labels_from_header(value: str | None, allowed: tuple[str, ...]
                              ) -> dict[str, Any] | None:
    """SGLang's OpenAI routes take custom labels from a header holding a JSON object
    (``--tokenizer-metrics-custom-labels-header``); names the server does not allow, and a
    header that is not a JSON object, are ignored as SGLang ignores them."""
    if not value or not allowed:
        return None
    try:
        labels = json.loads(value)
    except ValueError:
        return None
    if not isinstance(labels, dict):
        return None
    return {k: v for k, v in labels.items() if k in allowed} or None


class AbortRequest(_Strict):
    rid: str | None = None
    abort_all: bool = False


class UpdateWeightFromDiskRequest(_Strict):
    """SGLang's ``UpdateWeightFromDiskReqInput`` (``/update_weights_from_disk``, and the
    Engine's method). Options radixlm cannot honour are refused by ``refused``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    # weights are copied into the captured parameters in place: the graphs stay valid
    recapture_cuda_graph: bool = False
    token_step: Int64 = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None

    def refused(self) -> tuple[str, str] | None:
        """``(field, why)`` for the first option radixlm does not support, else None."""
        for name, ok, why in (
            ("load_format", self.load_format in (None, "auto", "safetensors"),
             "radixlm loads safetensors checkpoints only ('auto' or 'safetensors')"),
            ("is_async", not self.is_async, "radixlm applies an update between two steps"),
            ("keep_pause", not self.keep_pause, "radixlm has no paused state to keep"),
            ("token_step", self.token_step == 0,
             "radixlm does not track trainer steps; use weight_version"),
            ("flush_cache", self.flush_cache,
             "KV computed by other weights is never reused, so the cache is always flushed"),
            ("manifest", self.manifest is None, "radixlm reads tensor metadata from the "
                                                "safetensors headers"),
        ):
            if not ok:
                return name, f"{name}: {why}"
        return None


class TokenizeRequest(_Strict):
    text: StrOrList | None = None
    prompt: StrOrList | None = None  # OpenAI-style alias of text
    add_special_tokens: bool = False
    model: str | None = None


class DetokenizeRequest(_Strict):
    tokens: list[TokenId]
    model: str | None = None


# --- OpenAI ------------------------------------------------------------------------------------
class StreamOptions(_Lenient):
    include_usage: bool = False


class OpenAISampling(_Lenient):
    """Sampling fields shared by both OpenAI routes, with the extras SGLang and vLLM accept."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    n: Count | None = None
    stop: StrOrList | None = None
    seed: Int64 | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    logit_bias: dict[str, Finite] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras (SGLang / vLLM)
    cache_salt: str | None = None
    extra_key: str | None = None
    priority: int | None = None  # scheduling priority (--enable-priority-scheduling)
    repetition_penalty: Finite | None = None
    top_k: Int64 | None = None
    min_p: Finite | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    min_tokens: Count | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    ebnf: str | None = None
    stop_regex: StrOrList | None = None
    # SGLang's PD and DP routing fields (see GenerateRequest)
    bootstrap_host: _per_item(str) = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: _per_item(Int64) = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Count | None = None
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: refused unless empty

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of an OpenAI feature this server lacks, set to a non-neutral value."""
        if self.suffix:
            return "suffix", ("suffix (fill-in-the-middle) is not supported: the served "
                              "models have no insertion template")
        return None


class ContentPart(_Lenient):
    type: Literal["text"]  # images and audio are not supported: a 400 names the type
    text: str


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any]  # JSON text, as OpenAI gives it back (an object too)


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    function_call: FunctionCallIn | None = None  # legacy functions
    reasoning_content: str | None = None  # an assistant's earlier thinking (SGLang, vLLM)


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionName(_Lenient):
    """A function named by ``tool_choice`` or the legacy ``function_call``."""

    name: str


class NamedToolChoice(_Lenient):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    # tool calling (entrypoints/function_call/): checked by plan_tools
    # a choice's shape is typed here (a name that is not a string is a 400 naming it);
    # whether the string or the name is one the request may use, plan_tools checks
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | FunctionName | None = None
    # SGLang / vLLM: keyword arguments of the chat template (e.g. enable_thinking), and
    # whether --reasoning-parser splits the thinking into reasoning_content
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True  # false: the reasoning comes in one delta when it ends
    # OpenAI features radixlm does not implement: a 400 naming them unless neutral
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first OpenAI feature this server lacks that the request
        asks for."""
        refused = {"prediction": self.prediction, "audio": self.audio,
                   "reasoning_effort": self.reasoning_effort,
                   "web_search_options": self.web_search_options,
                   "modalities": None if self.modalities in (None, ["text"]) else 1}
        for field, value in refused.items():
            if value is not None:
                return field, f"{field} is not supported: radixlm serves text generation only"
        return None
