"""Admission: what the tokenizer manager checks before a request is sent.

``Admission`` validates one request against the server's limits (400 naming the field
and the limit), resolves its cache namespace and its prefill/decode rooms, and refuses
new work (503) while the server drains or its queue is full. Nothing here sends anything:
``TokenizerManager.submit`` does, once every check has passed.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.disaggregation.rooms import Bootstrap, assign_rooms
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.messages import GenerateReqInput
from radixlm.runtime.managers.tokenizer_manager.request_log import RequestOrigin
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import check_client_rid, scoped_rid
from radixlm.runtime.managers.validation import (
    PriorityRefused,
    RequestLimits,
    cache_namespace,
    request_priority,
    validate_request,
)
from radixlm.runtime.metrics import ServerMetrics

GENERATION_REFUSED = ("The model does not support text generation: this server serves "
                      "an embedding model (--is-embedding); use /v1/embeddings or /encode")


@dataclass
class Prepared:
    """A validated request, before it is split into its ``n`` samples."""

    msg: GenerateReqInput
    params: SamplingParams
    labels: tuple[str, ...] | None = ()  # see ReqState.labels
    origin: RequestOrigin | None = None  # see ReqState.origin (TokenizerManager.log_origin)
    bootstrap: list[Bootstrap] | None = None  # --disaggregation-mode: each sample's room
    # n > 1: the prompt's cached tokens before its samples (the warm-up's), which the
    # samples, run after it, would each overstate; None: no warm-up ran
    prompt_cached_tokens: int | None = None


class Admission:
    """The checks of ``TokenizerManager``, which sets the state below in its ``__init__``
    (and ``limits`` / ``server_info`` once the scheduler is ready); these methods only
    read it."""

    args: ServerArgs
    limits: RequestLimits | None
    metrics: ServerMetrics
    states: dict[str, Any]  # rid -> the manager's ReqState
    server_info: dict[str, Any]
    sampling_defaults: dict[str, Any]
    draining: bool

    def prepare(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        text_in_logprobs: bool = False,
        namespace: str | None = None,
        token_ids_logprob: list[int] | None = None,
        custom_labels: dict[str, str] | None = None,
        log_metrics: bool = True,
        priority: int | None = None,
        tenant: str | None = None,
        embedding: bool = False,
    ) -> Prepared:
        """Validate one request whose types were checked at the edge (400 on bad input:
        ranges, vocabulary, context, the server's caps); nothing is sent yet. ``tenant``
        (from the API key) scopes the rid (``tenant_rids``). ``embedding``: a request of
        the embedding routes; any other is refused by an ``--is-embedding`` server."""
        assert self.limits is not None, "prepare() before the scheduler was ready"
        if self.args.is_embedding and not embedding:
            raise ApiError(400, GENERATION_REFUSED)
        scoped = self.scoped_rid(rid, tenant)
        try:
            params = SamplingParams.with_defaults(sampling_params, self.sampling_defaults)
            validate_request(input_ids, params, self.limits, top_logprobs_num,
                             token_ids_logprob, build_stop_automata=False)  # in submit
            self.metrics.check_labels(custom_labels)
            resolved_priority = request_priority(priority, self.args)
        except PriorityRefused as e:
            raise ApiError(503, str(e), "service_unavailable", param="priority") from None
        except ValueError as e:
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise ApiError(400, str(e), code=code, param=_param_of(str(e))) from None
        msg = GenerateReqInput(
            scoped,
            input_ids,
            params.to_dict(),
            bool(return_logprob),
            logprob_start_len,
            top_logprobs_num,
            namespace=namespace,
            return_text_in_logprobs=bool(text_in_logprobs),
            token_ids_logprob=token_ids_logprob,
            priority=resolved_priority,
        )
        labels = self.metrics.label_values(custom_labels) if log_metrics else None
        return Prepared(msg, params, labels)

    @staticmethod
    def scoped_rid(rid: str | None, tenant: str | None) -> str:
        """The rid the scheduler sees (``tenant_rids``; a fresh one if the client gave
        none); 400 for a rid that holds the scoped form's separator."""
        try:
            check_client_rid(rid or "")
        except ValueError as e:
            raise ApiError(400, str(e), param="rid") from None
        return scoped_rid(tenant, rid or uuid.uuid4().hex)

    @staticmethod
    def namespace(extra_key: str | None, cache_salt: str | None,
                  tenant: str | None = None) -> str | None:
        """The cache namespace of a request (400 on a bad key); ``tenant`` comes from the
        request's API key (``auth.request_tenant``), never from its body."""
        try:
            return cache_namespace(extra_key, cache_salt, tenant)
        except ValueError as e:
            raise ApiError(400, str(e), param="cache_salt") from None

    def attach_routing(self, items: list[Prepared], body: Any) -> None:
        """SGLang's routing fields of a request body (native or OpenAI): ``routed_dp_rank``
        (``data_parallel_rank``, its old name), then the PD fields (``attach_bootstrap``)."""
        rank = self.routed_rank(body)
        for p in items:
            p.msg.routed_dp_rank = rank
        self.attach_bootstrap(items, body.bootstrap_host, body.bootstrap_port,
                              body.bootstrap_room, body.disagg_prefill_dp_rank)

    def routed_rank(self, body: Any) -> int | None:
        """``routed_dp_rank`` or ``data_parallel_rank``: 400 unless a replica of --dp-size."""
        for name in ("routed_dp_rank", "data_parallel_rank"):
            rank = getattr(body, name)
            if rank is not None:
                if not 0 <= rank < self.args.dp_size:
                    raise ApiError(400, f"{name} must be in [0, {self.args.dp_size}) "
                                        f"(--dp-size), got {rank}", param=name)
                return rank
        return None

    def attach_bootstrap(self, items: list[Prepared], host: Any, port: Any, room: Any,
                         prefill_dp_rank: int | None = None) -> None:
        """The rooms of sglang-router's PD mode (``rooms.assign_rooms``), and the prefill
        replica that holds them (``prefill_dp_rank``, SGLang's ``disagg_prefill_dp_rank``);
        a 400 naming the field on a server in ``--disaggregation-mode null`` or for a bad
        value."""
        if host is None and port is None and room is None and prefill_dp_rank is None:
            return
        field_ = ("bootstrap_room" if room is not None else "bootstrap_host"
                  if host is not None or port is not None else "disagg_prefill_dp_rank")
        if self.args.disaggregation_mode == "null":
            raise ApiError(400, f"{field_}: this server runs without prefill/decode "
                           "disaggregation (--disaggregation-mode null); start it with "
                           "--disaggregation-mode prefill or decode", param=field_)
        if host is None or room is None:
            raise ApiError(400, "bootstrap_host and bootstrap_room go together"
                           + (", and disagg_prefill_dp_rank needs them" if prefill_dp_rank
                              is not None else ""), param=field_)
        try:
            rooms = assign_rooms(host, port, room, [p.params.n for p in items],
                                 self.args.disaggregation_bootstrap_port)
        except ValueError as e:
            raise ApiError(400, str(e), param=str(e).split(" ")[0]) from None
        self._check_trusted(rooms)
        self._check_prefill_replica(items, rooms, prefill_dp_rank)
        for p, samples in zip(items, rooms):
            p.bootstrap = [dataclasses.replace(b, prefill_dp_rank=prefill_dp_rank)
                           for b in samples]

    def _check_trusted(self, rooms: list[list[Bootstrap]]) -> None:
        """A decode server connects only to the bootstrap hosts of
        ``--disaggregation-trusted-hosts`` (when given): 403 before anything connects."""
        trusted = self.args.disaggregation_trusted_hosts
        if not trusted or self.args.disaggregation_mode != "decode":
            return
        allowed = {h.lower() for h in trusted}
        for b in (b for samples in rooms for b in samples):
            if b.host.lower() not in allowed:
                raise ApiError(403, f"bootstrap_host {b.host!r} is not one of this decode "
                               f"server's --disaggregation-trusted-hosts {list(trusted)}",
                               "permission_denied", param="bootstrap_host")

    def _check_prefill_replica(self, items: list[Prepared], rooms: list[list[Bootstrap]],
                               hint: int | None) -> None:
        """The prefill replica of each room must be where the decode server will claim it:
        ``disagg_prefill_dp_rank`` if given, else bootstrap_room mod the prefill's
        --dp-size (a decode server cannot check this: it does not know that size)."""
        if hint is not None and hint < 0:
            raise ApiError(400, f"disagg_prefill_dp_rank must be >= 0, got {hint}",
                           param="disagg_prefill_dp_rank")
        if self.args.disaggregation_mode != "prefill":
            return
        dp = self.args.dp_size
        if hint is not None and hint >= dp:
            raise ApiError(400, f"disagg_prefill_dp_rank must be in [0, {dp}) (this prefill "
                           f"server's --dp-size), got {hint}", param="disagg_prefill_dp_rank")
        for p, samples in zip(items, rooms):
            routed = p.msg.routed_dp_rank
            for b in samples:
                where = hint if hint is not None else b.room % dp
                if routed is not None and routed != where:
                    raise ApiError(400, f"routed_dp_rank {routed} would prefill "
                                   f"bootstrap_room {b.room} on replica {routed}, but the "
                                   f"decode server claims it from replica {where} "
                                   "(disagg_prefill_dp_rank, else bootstrap_room mod "
                                   "--dp-size): send disagg_prefill_dp_rank with it",
                                   param="routed_dp_rank")

    def check_capacity(self, n_new: int) -> None:
        """503 while shutting down or when ``--max-queued-requests`` are already queued
        (with priority scheduling the scheduler enforces the limit: it may drop a less
        urgent queued request instead)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable")
        limit = self.args.max_queued_requests
        if limit is not None and not self.args.enable_priority_scheduling:
            running = self.server_info["max_running_requests"]
            queued = len(self.states) + n_new - running
            if queued > limit:
                raise ApiError(
                    503,
                    f"too many queued requests: the limit is {limit} "
                    "(--max-queued-requests); retry later",
                    "service_unavailable",
                )


def with_rooms(samples: list[GenerateReqInput], rooms: list[Bootstrap] | None
                ) -> list[GenerateReqInput]:
    """Each sample with its room (``attach_bootstrap``), or as it is."""
    if rooms is None:
        return samples
    return [msgspec.structs.replace(m, bootstrap_host=b.host, bootstrap_port=b.port,
                                    bootstrap_room=b.room, prefill_dp_rank=b.prefill_dp_rank)
            for m, b in zip(samples, rooms)]


# the request fields a validation message may start with (``param`` of its 400)
_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {
    "input_ids", "top_logprobs_num", "logprob_start_len", "token_ids_logprob",
    "stop_strings", "custom_labels"}


def _param_of(message: str) -> str | None:
    """The field a validation message names first ("temperature must be ...", "n is
    ..."), so OpenAI clients get ``param``; None when it starts with no field."""
    first = message.split(" ", 1)[0].rstrip(":,")
    return first if first in _PARAMS else None
