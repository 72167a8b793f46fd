"""Typed messages between the front end (Engine / tokenizer manager) and the scheduler.

msgspec Structs: passed as objects inside one process, msgpack-encoded between processes
(``encode`` / ``decode``). Never pickle.
"""

from __future__ import annotations

from typing import Any

import msgspec


class GenerateReqInput(msgspec.Struct, tag=True):
    """One tokenized, validated request for the scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    namespace: str | None = None
    return_text_in_logprobs: bool = False  # read by the detokenizer, not the scheduler
    priority: int = 0  # resolved by validation.request_priority; ordered by the policy
    token_ids_logprob: list[int] | None = None  # logprobs of these ids at each position
    routing_key: str | None = None  # --dp-size > 1: requests with the same key share a replica
    routed_dp_rank: int | None = None  # --dp-size > 1: the replica the client asked for
    # --disaggregation-mode prefill|decode: this sample's room (rooms.assign_rooms)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # the prefill replica holding the room's KV (SGLang's disagg_prefill_dp_rank); None:
    # bootstrap_room mod the prefill server's --dp-size
    prefill_dp_rank: int | None = None


class AbortReq(msgspec.Struct, tag=True):
    rid: str
    message: str | None = None  # None: SGLang's reasons ("Aborted", "Abort in waiting queue")
    abort_all: bool = False  # every queued and running request (``rid`` is ignored)


class FlushCacheReq(msgspec.Struct, tag=True):
    pass


class GetInfoReq(msgspec.Struct, tag=True):
    check_invariants: bool = False  # also assert the KV accounting (idle scheduler only)


class UpdateWeightFromDiskReq(msgspec.Struct, tag=True):
    """SGLang's ``UpdateWeightFromDiskReqInput``, the fields radixlm acts on; the scheduler
    applies it between steps once the requests ahead of it are done (or aborted)."""

    model_path: str
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False  # return the allocator's cached blocks after loading


class UpdateWeightFromDiskOutput(msgspec.Struct, tag=True):
    success: bool
    message: str
    num_paused_requests: int = 0
    weight_version: str = ""  # the version served after this reply
    dp_rank: int = 0  # the replica that answered (set by SchedulerIO)


class InfoOutput(msgspec.Struct, tag=True):
    info: dict[str, Any]
    dp_rank: int = 0


class FlushCacheOutput(msgspec.Struct, tag=True):
    success: bool
    message: str = ""
    dp_rank: int = 0


class SpecCounts(msgspec.Struct):
    """One request's speculative decoding so far (--speculative-algorithm): its decode
    forwards, the draft tokens they verified and how many were accepted."""

    verify_ct: int
    draft_tokens: int
    accepted_tokens: int


class ReqOutput(msgspec.Struct, tag=True):
    """What one scheduler step produced for one request (new tokens since the last one)."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None
    # [logprob, token_id] pairs for new_token_ids; top lists per new token
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # sent once, with the first output of a request that asked for prompt logprobs
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # token_ids_logprob: (logprob, id) of each asked id, per position, shaped as the tops
    output_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    # --is-embedding: the pooled embedding, little-endian float32 (on the last output)
    embedding: bytes | None = None
    # of cached_tokens, those loaded from the storage tier (None: no hierarchical cache)
    storage_cached_tokens: int | None = None
    spec: SpecCounts | None = None  # with --speculative-algorithm only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class BatchOutput(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]
    # seconds each request admitted in this step waited in the queue (server metrics)
    queue_times: list[float] = msgspec.field(default_factory=list)


# --- the server's processes (scheduler -> detokenizer -> tokenizer manager) ---------------


class DetokRegister(msgspec.Struct, tag=True):
    """How to turn one request's token ids into text; sent ahead of its first output."""

    rid: str
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] | None = None
    no_stop_trim: bool = False
    text_in_logprobs: bool = False


class RegisterReqs(msgspec.Struct, tag=True):
    reqs: list[DetokRegister]


# [logprob, token_id, text or None], SGLang's logprob entry
LogprobEntry = tuple[float | None, int, str | None]


class TextOutput(msgspec.Struct, tag=True):
    """A ReqOutput after detokenisation: ``text`` is the new piece that is safe to show;
    ``final_text`` (on the last output only) is the whole stop-trimmed text."""

    rid: str
    text: str
    new_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None
    final_text: str | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    output_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None
    embedding: bytes | None = None  # ReqOutput.embedding, passed on
    storage_cached_tokens: int | None = None  # see ReqOutput
    spec: SpecCounts | None = None  # see ReqOutput

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TextBatch(msgspec.Struct, tag=True):
    outputs: list[TextOutput]
    queue_times: list[float] = msgspec.field(default_factory=list)


class SchedulerReady(msgspec.Struct, tag=True):
    """The scheduler process loaded the model; ``info`` is its ``get_info()``."""

    info: dict[str, Any]
    model_info: dict[str, Any]
    dp_rank: int = 0


class ReplicaLoad(msgspec.Struct, tag=True):
    """A replica's load, sent by its scheduler process whenever it changed (at most once a
    loop turn): ``received`` counts the requests it has read so far, so the dispatcher
    knows which of the ones it sent are already in ``num_reqs`` / ``num_tokens``."""

    dp_rank: int
    received: int
    num_reqs: int  # running + waiting
    num_tokens: int  # KV tokens in use + tokens of waiting requests (SGLang's /get_load)


class ReplicaKVEvents(msgspec.Struct, tag=True):
    """One step's radix-tree events of a replica, for the front end's cache-aware
    dispatcher: ``batch`` is a ``kv_events.KVEventBatch`` in vLLM's wire format."""

    dp_rank: int
    batch: bytes


Message = (
    GenerateReqInput | AbortReq | FlushCacheReq | GetInfoReq | InfoOutput | FlushCacheOutput
    | UpdateWeightFromDiskReq | UpdateWeightFromDiskOutput | BatchOutput | RegisterReqs
    | TextBatch | SchedulerReady | ReplicaLoad | ReplicaKVEvents
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
