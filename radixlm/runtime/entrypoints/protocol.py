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

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    """SGLang's ``/generate`` body: one prompt or a batch (lists of text or of id lists)."""

    text: StrOrList | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: _per_item(SamplingParamsIn) = None
    rid: _per_item(str) = None
    return_logprob: _per_item(bool) = None
    logprob_start_len: _per_item(Int64) = None
    top_logprobs_num: _per_item(Count) = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    # cache namespaces: requests share cached KV only with the same ones (SGLang / vLLM)
    extra_key: _per_item(str) = None
    cache_salt: _per_item(str) = None


class AbortRequest(_Strict):
    rid: str | None = None
    abort_all: bool = False


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
