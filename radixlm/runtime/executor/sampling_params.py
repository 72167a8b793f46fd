"""Per-request sampling parameters, with SGLang's field names and defaults.

``from_dict`` takes the ``sampling_params`` object of a native ``/generate`` request;
``verify`` checks the numbers against the model's vocabulary and context length. Both
raise ``ValueError`` with a message that names the field and the limit, which the
server turns into an HTTP 400.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.executor.stop_regex import (
    MAX_STOP_REGEX_SIZE,
    check_stop_regex,
    stop_automaton,
)
from radixlm.runtime.model_config import model_sampling_defaults

# Temperatures below this are treated as greedy (argmax), as in SGLang.
GREEDY_TEMPERATURE_EPS = 1e-5
logger = logging.getLogger(__name__)

_ALIASES = {"sampling_seed": "seed"}
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")  # at most one per request


@dataclass
class SamplingParams:
    """How to sample one request's tokens. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None  # normalised to list[str] | None
    stop_regex: str | list[str] | None = None  # SGLang's; normalised to list[str] | None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None  # SGLang's `sampling_seed`
    regex: str | None = None
    json_schema: str | None = None  # a dict is accepted and dumped to a string
    ebnf: str | None = None  # a GBNF grammar (SGLang's ebnf)
    # SGLang's structural_tag: free text, and a JSON-schema call after each trigger (JSON
    # text {"structures": [{"begin", "schema", "end"}], "triggers": [...]}); a dict is dumped
    structural_tag: str | None = None
    # the grammar holds only the output after this text (set by the chat route when
    # --reasoning-parser says the output starts with thinking; constrained/after_text.py)
    reasoning_end: str | None = None
    logit_bias: dict[int, float] | None = None  # keys may be given as str; stored as int

    def __post_init__(self) -> None:
        for kind in GRAMMAR_FIELDS:  # SGLang: an empty grammar means none, not "nothing"
            if getattr(self, kind) == "":
                setattr(self, kind, None)
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        elif isinstance(self.stop_regex, (list, tuple)):
            self.stop_regex = list(self.stop_regex)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        elif self.stop is not None:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if isinstance(self.json_schema, (dict, bool)):
            try:
                self.json_schema = json.dumps(self.json_schema)
            except RecursionError:
                raise ValueError("json_schema is nested too deeply to encode") from None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token ids to numbers, "
                                 f"got {self.logit_bias!r}")
            self.logit_bias = {_token_id_key(k): _bias_value(v)
                               for k, v in self.logit_bias.items()}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's ``sampling_params``; unknown keys are a ValueError."""
        if d is None:
            return cls()
        valid = cls.field_names()
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _ALIASES.get(key, key)
            if name not in valid:
                names = ", ".join(valid + list(_ALIASES))
                raise ValueError(f"unknown sampling parameter {key!r}; valid fields: {names}")
            if name in kwargs and kwargs[name] != value:
                raise ValueError(f"{key!r} conflicts with {name!r}: give only one of them")
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def with_defaults(cls, d: dict[str, Any] | None, defaults: dict[str, Any]
                      ) -> SamplingParams:
        """``from_dict(d)``, the fields ``d`` leaves unset taken from ``defaults`` (the
        model's generation config, ``--sampling-defaults model``) rather than ours."""
        given = {k: v for k, v in (d or {}).items() if v is not None}
        return cls.from_dict({**{k: v for k, v in defaults.items() if k not in given}, **given})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def clone(self) -> SamplingParams:
        return self.replace()

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied; list and dict fields are copied, not shared."""
        current = {f: getattr(self, f) for f in self.field_names()}
        for name in ("stop", "stop_regex", "stop_token_ids"):
            if current[name] is not None:
                current[name] = list(current[name])
        if current["logit_bias"] is not None:
            current["logit_bias"] = dict(current["logit_bias"])
        return SamplingParams(**{**current, **changes})

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's grammar, if it has one."""
        for kind in GRAMMAR_FIELDS:
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def verify(self, vocab_size: int, context_len: int | None = None,
               build_stop_automata: bool = True) -> None:
        """Raise ValueError naming the first field of the wrong type or out of range.
        ``build_stop_automata=False`` checks the stop_regex patterns' size only (cheap);
        the caller then builds them (``build_stop_automata``) off its event loop."""
        self._verify_types()
        self._verify_distribution()
        self._verify_lengths(context_len)
        self._verify_stops(vocab_size, build_stop_automata)
        given = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of regex, json_schema and ebnf (or structural_tag) "
                             f"may be set, got {' and '.join(given)}")
        for token_id in (self.logit_bias or {}).keys():
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias keys must be in [0, {vocab_size}), got {token_id}")

    def _verify_types(self) -> None:
        """Python callers are not parsed from JSON: booleans are not numbers here either."""
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), f.default
            if value is None or default is None:
                continue
            if isinstance(default, bool):
                ok, kind = isinstance(value, bool), "a boolean"
            elif isinstance(default, int):
                ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok, kind = ok and math.isfinite(value), "a finite number"
            if not ok:
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
        checks = [("seed", self.seed is None or (isinstance(self.seed, int)
                                                 and not isinstance(self.seed, bool)),
                   "an integer"),
                  ("stop", all(isinstance(x, str) for x in self.stop or []), "a list of strings"),
                  ("stop_regex", self.stop_regex is None or (
                      isinstance(self.stop_regex, list)
                      and all(isinstance(x, str) for x in self.stop_regex)),
                   "a string or a list of strings"),
                  ("stop_token_ids", all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in self.stop_token_ids or []),
                   "a list of token ids"),
                  ("regex", self.regex is None or isinstance(self.regex, str), "a string"),
                  ("ebnf", self.ebnf is None or isinstance(self.ebnf, str), "a string"),
                  ("reasoning_end", self.reasoning_end is None
                   or isinstance(self.reasoning_end, str) and bool(self.reasoning_end),
                   "a non-empty string"),
                  ("structural_tag", self.structural_tag is None
                   or isinstance(self.structural_tag, str), "a JSON string"),
                  ("json_schema", self.json_schema is None or isinstance(self.json_schema, str),
                   "a JSON schema"),
                  ("logit_bias", all(math.isfinite(v) for v in (self.logit_bias or {}).values()),
                   "a map of token ids to finite numbers")]
        for name, ok, kind in checks:
            if not ok:
                raise ValueError(f"{name} must be {kind}, got {getattr(self, name)!r}")

    def _verify_distribution(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

    def _verify_lengths(self, context_len: int | None) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if context_len is not None and self.max_new_tokens > context_len:
            raise ValueError(
                f"max_new_tokens must be <= the context length {context_len}, "
                f"got {self.max_new_tokens}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )

    def _verify_stops(self, vocab_size: int, build: bool) -> None:
        if any(s == "" for s in self.stop or []):
            raise ValueError("stop strings must be non-empty, got ''")
        size = 0  # every pattern checked cheaply (and their total bounded) before any build
        for pattern in self.stop_regex or []:
            if not pattern:
                raise ValueError("stop_regex patterns must be non-empty, got ''")
            size += check_stop_regex(pattern)
            if size > MAX_STOP_REGEX_SIZE:
                raise ValueError(f"stop_regex patterns expand to more than {MAX_STOP_REGEX_SIZE}"
                                 " elements in all (bounded repeats such as {n,m} are unrolled;"
                                 f" limit {MAX_STOP_REGEX_SIZE})")
        if build:
            self.build_stop_automata()
        for token_id in self.stop_token_ids or []:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {token_id}")


    def build_stop_automata(self) -> None:
        """Build (and cache) each stop_regex automaton: ValueError for what an automaton
        cannot express or past its state limit. Bounded (``stop_regex``'s limits), but up
        to about 0.2 s: the server does it on a worker thread."""
        for pattern in self.stop_regex or []:
            stop_automaton(pattern)


def sample_sampling_params(sp: dict[str, Any], j: int) -> dict[str, Any]:
    """Sample ``j``'s copy of a request's sampling params (``n > 1``): a seeded request's
    samples get seeds ``seed + j`` (vLLM's rule), so they differ as OpenAI's do while
    sample 0 is what the request alone gives. The sum wraps into int64; ``row_seed``
    reads seeds modulo 2**64, so the wrap changes no token."""
    seed = sp.get("seed")
    if seed is None or j == 0:
        return sp
    return {**sp, "seed": (seed + j + _INT64_HALF) % (2 * _INT64_HALF) - _INT64_HALF}


_INT64_HALF = 1 << 63


def _token_id_key(key: object) -> int:
    if isinstance(key, (bool, float)):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    try:
        return int(key)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None


def _bias_value(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"logit_bias values must be numbers, got {value!r}")
    return float(value)


def sampling_defaults(args: Any, model_path: str) -> dict[str, Any]:
    """The request defaults ``--sampling-defaults`` picks: the checkpoint's generation
    config (``model``, checked now: a bad value fails the start, naming it) or none
    (``openai``: SamplingParams' own)."""
    if args.sampling_defaults != "model":
        return {}
    defaults = model_sampling_defaults(model_path)
    try:
        SamplingParams.from_dict(defaults).verify(vocab_size=1)
    except ValueError as e:
        raise ValueError(f"generation_config.json of {model_path}: {e}") from None
    if defaults:
        logger.info("sampling defaults from the model's generation_config.json: %s "
                    "(--sampling-defaults openai ignores them)", defaults)
    return defaults
