"""Admission: what the tokenizer manager checks before a request is sent.

``Admission`` validates one request against the server's limits (400 naming the field
and the limit), resolves its cache namespace and its prefill/decode rooms, and refuses
new work (503) while the server drains or its queue is full. Nothing here sends anything:
``TokenizerManager.submit`` does, once every check has passed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radixlm.runtime.disaggregation.rooms import Bootstrap, assign_rooms
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.messages import GenerateReqInput
from radixlm.runtime.managers.request_log import RequestOrigin
from radixlm.runtime.managers.validation import (
    PriorityRefused,
    cache_namespace,
    request_priority,
    validate_request,
)


@dataclass
class Prepared:
    """A validated request, before it is split into its ``n`` samples."""

    msg: GenerateReqInput
    params: SamplingParams
    labels: tuple[str, ...] | None = ()  # see ReqState.labels
    origin: RequestOrigin | None = None  # see ReqState.origin (TokenizerManager.log_origin)
    bootstrap: list[Bootstrap] | None = None  # --disaggregation-mode: each sample's room


class Admission:
    """The checks of ``TokenizerManager`` (a mixin: it reads the manager's ``args``,
    ``limits``, ``metrics``, ``states``, ``server_info`` and ``draining``)."""

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
    ) -> Prepared:
        """Validate one request whose types were checked at the edge (400 on bad input:
        ranges, vocabulary, context, the server's caps); nothing is sent yet."""
        assert self.limits is not None, "prepare() before the scheduler was ready"
        try:
            params = SamplingParams.from_dict(sampling_params)
            validate_request(input_ids, params, self.limits, top_logprobs_num,
                             token_ids_logprob)
            self.metrics.check_labels(custom_labels)
            resolved_priority = request_priority(priority, self.args)
        except PriorityRefused as e:
            raise ApiError(503, str(e), "service_unavailable", param="priority") from None
        except ValueError as e:
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise ApiError(400, str(e), code=code) from None
        msg = GenerateReqInput(
            rid or uuid.uuid4().hex,
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
    def namespace(extra_key: str | None, cache_salt: str | None,
                  tenant: str | None = None) -> str | None:
        """The cache namespace of a request (400 on a bad key); ``tenant`` comes from the
        request's API key (``http_utils.request_tenant``), never from its body."""
        try:
            return cache_namespace(extra_key, cache_salt, tenant)
        except ValueError as e:
            raise ApiError(400, str(e), param="cache_salt") from None

    def attach_bootstrap(self, items: list[Prepared], host: Any, port: Any, room: Any) -> None:
        """The rooms of sglang-router's PD mode (``rooms.assign_rooms``); a 400 naming the
        field on a server in ``--disaggregation-mode null`` or for a bad value."""
        if host is None and port is None and room is None:
            return
        field_ = "bootstrap_room" if room is not None else "bootstrap_host"
        if self.args.disaggregation_mode == "null":
            raise ApiError(400, f"{field_}: this server runs without prefill/decode "
                           "disaggregation (--disaggregation-mode null); start it with "
                           "--disaggregation-mode prefill or decode", param=field_)
        if host is None or room is None:
            raise ApiError(400, "bootstrap_host and bootstrap_room go together", param=field_)
        if self.args.disaggregation_mode == "prefill" and self.args.dp_size > 1 and any(
                p.msg.routed_dp_rank is not None for p in items):
            raise ApiError(400, "routed_dp_rank: a prefill server with --dp-size > 1 places "
                           "each bootstrap_room on replica room mod dp_size, where the decode "
                           "server looks for it", param="routed_dp_rank")
        try:
            rooms = assign_rooms(host, port, room, [p.params.n for p in items],
                                 self.args.disaggregation_bootstrap_port)
        except ValueError as e:
            raise ApiError(400, str(e), param=str(e).split(" ")[0]) from None
        for p, samples in zip(items, rooms):
            p.bootstrap = samples

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
                                    bootstrap_room=b.room) for m, b in zip(samples, rooms)]
