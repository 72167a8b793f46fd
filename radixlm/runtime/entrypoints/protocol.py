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


# --- what SGLang 0.5 accepts and radixlm refuses ---------------------------------------------
# Field -> (values that mean "not used", why radixlm lacks it). A field holding one of its
# neutral values (SGLang's default, or null) is dropped before parsing, so clients that
# send defaults explicitly (SGLang's own frontend does) work; any other value is a 400
# that names the field and gives the reason. ``tests/.../test_sglang_parity.py`` reads
# SGLang's source and fails when one of its fields is in neither this table nor a model.
_MEDIA = "radixlm serves text-only models: no image, video or audio input"
_EMBEDS = "radixlm takes text or token ids, not embeddings"
_DISAGG = ("radixlm pairs one prefill scheduler with one decode scheduler (--dp-size 1, "
           "--tp-size 1 on both): there is no rank or pair to choose")
_SESSION = ("radixlm has no sessions; a repeated prefix is reused through the radix cache "
            "without one")
_REASONING = "radixlm has no reasoning-model controls"
_SGLANG_INTERNAL = "internal to SGLang's server, not a request field"
_OFF: tuple[Any, ...] = (None, False)

REFUSED_REQUEST_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "session_id": ((None,), _SESSION),
    "session_params": ((None,), _SESSION),
    "input_embeds": ((None,), _EMBEDS),
    "positional_embed_overrides": ((None,), _EMBEDS),
    **{name: ((None,), _MEDIA) for name in (
        "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
        "video_config", "modalities", "max_dynamic_patch", "min_dynamic_patch",
        "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
        "mm_processor_kwargs", "need_wait_for_mm_inputs", "num_items_assigned",
        "encoder_urls")},
    "use_audio_in_video": (_OFF, _MEDIA),
    "return_bytes": (_OFF, "radixlm does not generate images"),
    "watermark": ((None,), "radixlm does not watermark its output"),
    "return_sampling_mask": (_OFF, "radixlm returns logprobs of the model's distribution, "
                                   "not of the sampling support"),
    "sampling_logprobs_mode": ((None,), "radixlm returns logprobs of the model's "
                                        "distribution, not of the sampling support"),
    **{name: (_OFF, "radixlm returns top logprobs nested, [logprob, token_id, text] "
                    "per entry, not as flat arrays") for name in (
        "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64")},
    "return_hidden_states": (_OFF, "radixlm does not return hidden states"),
    "return_routed_experts": (_OFF, "radixlm's models are dense: there are no experts"),
    "routed_experts_start_len": ((None, 0), "radixlm's models are dense: there are no "
                                           "experts"),
    "return_indexer_topk": (_OFF, "radixlm has no sparse-attention indexer"),
    "return_entropy": (_OFF, "radixlm does not compute output entropies; use "
                             "top_logprobs_num"),
    "lora_path": ((None,), "radixlm does not serve LoRA adapters"),
    "lora_id": ((None,), "radixlm does not serve LoRA adapters"),
    "custom_logit_processor": ((None,), "radixlm does not run custom logit processors "
                                        "(serialized code from the client)"),
    **{name: ((None,), _DISAGG) for name in (
        "bootstrap_pair_key", "decode_tp_size", "disagg_prefill_dp_rank")},
    "conversation_id": ((None,), "radixlm has no request tracing"),
    "external_trace_header": ((None,), "radixlm has no request tracing"),
    "background": (_OFF, "radixlm has no background responses (OpenAI Responses API)"),
    "require_reasoning": (_OFF, _REASONING),
    "max_thinking_tokens": ((None,), _REASONING),
    "multi_item_delimiter_indices": ((None,), "radixlm has no multi-item scoring"),
    "token_indices_to_pool": ((None,), "radixlm has no multi-item scoring"),
    "kv_hints": ((None,), "radixlm has no hierarchical KV cache (HiCache)"),
    "http_worker_ipc": ((None,), _SGLANG_INTERNAL),
    "received_time": ((None,), _SGLANG_INTERNAL),
}

_SAMPLING_INTERNAL = "internal to SGLang's SamplingParams, not a request field"
REFUSED_SAMPLING_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "beam_width": ((None, 1), "radixlm has no beam search; n gives independent samples"),
    "structural_tag": ((None, ""), "radixlm's grammars are regex, json_schema and ebnf; "
                                   "it has no structural tags"),
    "stream_interval": ((None, 1), "radixlm streams every scheduler step"),
    "custom_params": ((None,), "custom_params feed custom logit processors, which radixlm "
                               "does not run"),
    "watermark": ((None,), "radixlm does not watermark its output"),
    "stop_strs": ((None,), _SAMPLING_INTERNAL),
    "stop_regex_strs": ((None,), _SAMPLING_INTERNAL),
    "stop_str_max_len": ((None, 0), _SAMPLING_INTERNAL),
    "stop_regex_max_len": ((None, 0), _SAMPLING_INTERNAL),
    "is_normalized": (_OFF, _SAMPLING_INTERNAL),
    "ebnf_full_assistant": (_OFF, _SAMPLING_INTERNAL),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """``value`` is one of ``neutral`` with the same JSON type (``0`` is not ``false``)."""
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


def drop_neutral(data: Any, table: dict[str, tuple[tuple[Any, ...], str]]) -> Any:
    """``data`` without the refused fields that hold a neutral value."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if k not in table or not _neutral(v, table[k][0])}


def refusal(name: str) -> str | None:
    """Why radixlm refuses SGLang's field ``name`` (None: not a refused field)."""
    found = REFUSED_REQUEST_FIELDS.get(name) or REFUSED_SAMPLING_FIELDS.get(name)
    return None if found is None else found[1]


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


def refuse_options(options: dict[str, Any]) -> None:
    """``Engine.generate``'s keyword arguments beyond radixlm's: SGLang's refused fields
    at a neutral value pass; other values are a ValueError saying why; unknown names are
    a TypeError, as for any Python function."""
    for name, value in options.items():
        if name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            if value is not None:  # SGLang's Engine takes them; null is its default
                raise ValueError(f"{name} is not supported: the offline Engine has no "
                                 "prefill/decode disaggregation (radixlm serve "
                                 "--disaggregation-mode prefill|decode has)")
            continue
        if name not in REFUSED_REQUEST_FIELDS:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        neutral, why = REFUSED_REQUEST_FIELDS[name]
        if not _neutral(value, neutral):
            raise ValueError(f"{name} is not supported: {why}")


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
    # sglang-router's PD mode (see GenerateRequest)
    bootstrap_host: _per_item(str) = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: _per_item(Int64) = None


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Count | None = None
    echo: bool = False


class ContentPart(_Lenient):
    type: Literal["text"]  # images and audio are not supported: a 400 names the type
    text: str


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None


_MODEL_NAMES = {"SamplingParamsIn", "StreamOptions", "ContentPart", "ChatMessage",
                "JsonSchemaFormat", "ResponseFormat"}

ROUTE_MODELS: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/abort_request": AbortRequest,
    "/update_weights_from_disk": UpdateWeightFromDiskRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


# --- errors --------------------------------------------------------------------------------------
def describe(err: ValidationError) -> tuple[str, str | None]:
    """A 400's message for a validation error: the field's path, the value's problem and
    the limit (pydantic's message carries the bound). Where a field takes one of several
    forms, the form that got furthest into the value explains it best; where none got in,
    one line lists the forms."""
    found = [(_path(e["loc"]), e) for e in err.errors(include_url=False)]
    deepest = max(len(p) for p, _ in found)
    by_path: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for path, e in found:
        if len(path) == deepest:
            by_path.setdefault(path, []).append(e)
    parts = [_problem(path, errs) for path, errs in list(by_path.items())[:3]]
    first = ".".join(str(x) for x in found[0][0]) if deepest else None
    return "; ".join(parts), first


_KINDS = {"dict_type": "an object", "model_type": "an object", "model_attributes_type":
          "an object", "list_type": "an array", "string_type": "a string", "bool_type":
          "a boolean", "int_type": "an integer", "float_type": "a number"}


def _problem(path: tuple[Any, ...], errs: list[dict[str, Any]]) -> str:
    loc = ".".join(str(x) for x in path)
    e = errs[0]
    if e["type"] == "json_invalid":
        why = e["ctx"].get("error", "")
        return (f"the request body is nested too deeply to parse ({why})"
                if "recursion limit" in why else f"the request body is not valid JSON ({why})")
    kinds = list(dict.fromkeys(_KINDS.get(x["type"], "") for x in errs))
    if len(errs) > 1 and all(kinds):
        forms = ", ".join(kinds[:-1]) + f" or {kinds[-1]}" if len(kinds) > 1 else kinds[0]
        problem = f"Input should be {forms}"
    else:
        problem = e["msg"]
    if e["type"] == "extra_forbidden" and path and refusal(str(path[-1])):
        return f"{loc} is not supported: {refusal(str(path[-1]))}"
    if "input" in e and e["type"] not in ("missing", "extra_forbidden"):
        problem += f", got {_short(e['input'])}"
    return f"{loc}: {problem}" if loc else problem


def _path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The field path without pydantic's names of union members (``str``, ``list[int]``)."""
    return tuple(p for p in loc if not (isinstance(p, str) and (
        "[" in p or p in _TYPE_TAGS or p in _MODEL_NAMES)))


_TYPE_TAGS = {"str", "int", "bool", "float", "constrained-int", "constrained-float", "dict",
              "function-after", "literal"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- OpenAPI -------------------------------------------------------------------------------------
def openapi_schema(base: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's generated document, with each route's request body taken from its model."""
    components = base.setdefault("components", {}).setdefault("schemas", {})
    for path, model in ROUTE_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        op = base.get("paths", {}).get(path, {}).get("post")
        if op is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
    return base
