"""The offline workloads, as token ids: the same requests for radixlm and for vLLM.

Standard library only (this module is imported by the vLLM worker too). Every workload is
built from one seeded ``random.Random``, so both systems (and every round) get identical
prompts and output lengths.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

WORKLOADS = ("unique", "shared-prefix", "variable", "json", "long-prompt", "rag")
SMOKE = "smoke"  # 4 x 32 in, 8 out: the test that runs both systems, not a benchmark

# long fixed keys (jump-forward has something to skip), bounded values
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "string", "pattern": "^[0-9]{1,6}$"},
        "preferred_contact_method_for_support": {"enum": ["email", "phone", "post"]},
        "has_accepted_the_terms_and_conditions": {"type": "boolean"},
        "number_of_previous_support_tickets": {"type": "string", "pattern": "^[0-9]{1,3}$"},
    },
    "required": ["customer_identification_number", "preferred_contact_method_for_support",
                 "has_accepted_the_terms_and_conditions", "number_of_previous_support_tickets"],
    "additionalProperties": False,
}
JSON_MAX_TOKENS = 256  # a cap: a JSON request ends when its object is complete (EOS)
FIRST_ID = 10  # random prompt ids avoid the special tokens at the start of the vocabulary


@dataclass(frozen=True)
class Request:
    """One request: prompt token ids and output tokens (exact unless ``json_schema``,
    then a cap; greedy, EOS ignored except for JSON, whose grammar ends with EOS)."""

    prompt_ids: list[int]
    max_tokens: int
    json_schema: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Request:
        return cls(list(d["prompt_ids"]), int(d["max_tokens"]), bool(d["json_schema"]))


def make_workload(name: str, vocab: int, seed: int = 0) -> list[Request]:
    """``unique``: 32 x 256 in, 64 out; ``shared-prefix``: 4 groups x 8, a 512-token prefix
    per group + 32, 32 out; ``variable``: 48 prompts of 16-1024 tokens, 8-256 out;
    ``json``: 16 prompts of 32-96 tokens, a JSON object of ``SCHEMA`` each;
    ``long-prompt``: 4 prompts of 3,000 tokens, 16 out (a RAG-sized context: the prefill's
    attention, chunked, is most of it; fits the presets' 4,096-token context); ``rag``: 4
    groups x 8, a 512-token prefix per group + 256 tokens of each request's own, 16 out
    (a shared system prompt, then a retrieved document per request)."""
    if vocab <= FIRST_ID:
        raise ValueError(f"vocab must be above {FIRST_ID}, got {vocab}")
    rng = random.Random(f"{name}:{seed}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]

    def groups(own: int, out: int) -> list[Request]:  # 4 x 8 sharing a 512-token prefix
        reqs = []
        for _ in range(4):
            prefix = ids(512)
            reqs += [Request(prefix + ids(own), out) for _ in range(8)]
        return reqs

    if name == "unique":
        return [Request(ids(256), 64) for _ in range(32)]
    if name == "shared-prefix":
        return groups(32, 32)
    if name == "variable":
        return [Request(ids(rng.randint(16, 1024)), rng.randint(8, 256)) for _ in range(48)]
    if name == "rag":
        return groups(256, 16)
    if name == "long-prompt":
        return [Request(ids(3000), 16) for _ in range(4)]
    if name == SMOKE:
        return [Request(ids(32), 8) for _ in range(4)]
    if name == "json":
        return [Request(ids(rng.randint(32, 96)), JSON_MAX_TOKENS, json_schema=True)
                for _ in range(16)]
    raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")


def warmup_requests(vocab: int) -> list[Request]:
    """A short mixed batch run before the timed workloads (kernels, allocator, grammar
    compiler warm); its own seed, so it primes no prefix of the timed prompts."""
    rng = random.Random("warm-up")
    plain = [Request([rng.randrange(FIRST_ID, vocab) for _ in range(64)], 8) for _ in range(4)]
    return plain + [Request([rng.randrange(FIRST_ID, vocab) for _ in range(16)], 32, True)]
