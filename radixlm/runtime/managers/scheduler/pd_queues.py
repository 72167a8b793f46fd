"""The scheduler's queues for prefill/decode disaggregation (``--disaggregation-mode``).

Prefill server (``PrefillQueues``)::

    add -> bootstrapping --claimed--> scheduler.waiting -> prefill forward (first token
           (no KV held)                sampled; no finish check: the decode server does it)
        -> inflight: KV pages + first token sent, pages still locked
        -> ack: finish {"type": "length", "length": 0} (SGLang's), KV into the tree

Decode server (``DecodeQueues``)::

    add -> prealloc: route resolved? pages free? -> admit (match this server's own radix
           cache) + reserve the rest of the prompt's pages -> claim (prefix_len, slots)
        -> transferring -> KV written: kv_len = prompt_len, first token appended, prompt
           into the tree, finish checks, grammar advanced over the first token (and
           any text it forces), then scheduler.running (decode as usual)

A hybrid model's request also moves its recurrent state (its state slot, whole: the state
at the prompt's end) with its KV; the decode side writes it into the slot it took at
admission, instead of starting from a matched snapshot.

A request with a grammar compiles it on both servers: the prefill masks the first token
with it (a claimed room waits in bootstrapping until it compiles), the decode claims its
room only once it compiled. A grammar that fails is a 400 where it fails, and its room
ends (the other server sees the abort).

A transfer that fails (timeout, abort on the other side, a peer that died) finishes its
request with a 503 naming the cause; every page the request reserved goes back (KV that
was never written goes to the allocator, never into the tree). A request aborted by its
client here aborts the transfer, so the other side learns of it at once.
"""

from __future__ import annotations

import logging
from typing import Any

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.disaggregation.auth import SECRET_FLAG, PeerKeys, load_secret
from radixlm.runtime.disaggregation.base import KVPoll
from radixlm.runtime.disaggregation.kv_buffers import KVBuffers
from radixlm.runtime.disaggregation.manager import KVManager
from radixlm.runtime.disaggregation.zmq_backend import ZmqTransport
from radixlm.runtime.managers.scheduler.schedule_batch import Req
from radixlm.runtime.managers.scheduler.schedule_policy import decode_reserve

logger = logging.getLogger(__name__)

PREFILL_DONE = {"type": "length", "length": 0}  # SGLang's prefill server's finish reason


def transfer_failed(why: str) -> dict[str, Any]:
    return {"type": "abort", "message": f"KV transfer failed: {why}", "status_code": 503}


def create_kv_manager(args: ServerArgs, k: list[Any], v: list[Any], dp_rank: int = 0,
                      runner: Any = None) -> KVManager:
    """The transfer manager of replica ``dp_rank`` of a server in
    ``args.disaggregation_mode`` (not "null"); ``runner`` (rank 0's ModelRunner) names
    the model in the layout and, with --tp-size > 1, reads and writes every rank's heads.
    ValueError naming the flag without a usable ``--disaggregation-secret-file``: no PD
    socket is opened without it."""
    if args.disaggregation_secret_file is None:
        raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} needs "
                         f"{SECRET_FLAG}: a key file both PD servers share (e.g. "
                         "`openssl rand -hex 32 > key; chmod 600 key`), so that KV pages "
                         "come only from a prefill server holding it")
    keys = PeerKeys.from_secret(load_secret(args.disaggregation_secret_file))
    shards = None
    if runner is not None and runner.tp.size > 1:
        shards = (runner.model_config.num_key_value_heads, runner.read_kv, runner.write_kv)
    model = runner.model_config.kv_identity() if runner is not None else ""
    states = runner.state_pool if runner is not None else None  # a hybrid's: travels too
    buffers = KVBuffers(k, v, args.page_size, shards, model, states)
    assert args.disaggregation_transfer_backend == "zmq", args.disaggregation_transfer_backend
    prefill = args.disaggregation_mode == "prefill"
    transport = ZmqTransport(buffers.layout, keys, buffers.max_frame(),
                             (args.host, args.disaggregation_bootstrap_port)
                             if prefill else None, dp_rank, args.dp_size)
    return KVManager(args.disaggregation_mode, buffers, transport,
                     args.disaggregation_bootstrap_timeout,
                     args.disaggregation_waiting_timeout)


class _Queues:
    def __init__(self, scheduler: Any, manager: KVManager) -> None:
        self.s = scheduler  # the Scheduler: its cache, queues, outputs
        self.manager = manager
        self.mode = manager.mode

    def _finish(self, req: Req, reason: dict[str, Any], release: bool) -> None:
        self.s.outputs.emit_later(self.s.outputs.finish(req, reason, release=release))
        req.kv_transfer.clear()

    def wait(self, timeout: float) -> None:
        self.manager.wait(timeout)

    def close(self) -> None:
        self.manager.close()


class PrefillQueues(_Queues):
    def __init__(self, scheduler: Any, manager: KVManager) -> None:
        super().__init__(scheduler, manager)
        self.bootstrapping: list[Req] = []  # waiting for the decode server's claim
        self.inflight: list[Req] = []  # KV sent, waiting for the ack; pages locked
        self.tracked: dict[str, Req] = {}  # every request with a room, until it ends here

    def add(self, req: Req) -> None:
        self.manager.poll()  # an idle loop polls lazily: take a withdrawn claim into account
        req.kv_transfer = self.manager.create_sender(req.bootstrap.room)
        self.bootstrapping.append(req)
        self.tracked[req.rid] = req

    def busy(self) -> bool:
        return bool(self.bootstrapping or self.inflight)

    def poll(self) -> None:
        self.manager.poll()
        still = []
        for req in self.bootstrapping:
            state = req.kv_transfer.poll()
            if state == KVPoll.WaitingForInput:
                ready = self.s.grammar_ready(req)  # None: a bad grammar; _reap ends the room
                if ready:
                    self.s.waiting.append(req)
                elif ready is not None:
                    still.append(req)  # claimed, its grammar still compiling
            elif state == KVPoll.Failed:
                self._finish(req, transfer_failed(req.kv_transfer.failure_reason()), False)
            else:
                still.append(req)
        self.bootstrapping = still
        self._poll_inflight()
        self._reap()

    def _poll_inflight(self) -> None:
        still = []
        for req in self.inflight:
            state = req.kv_transfer.poll()
            if state == KVPoll.Success:
                self._finish(req, dict(PREFILL_DONE), True)
            elif state == KVPoll.Failed:  # the KV is sound: it stays in this server's tree
                self._finish(req, transfer_failed(req.kv_transfer.failure_reason()), True)
            else:
                still.append(req)
        self.inflight = still

    def _reap(self) -> None:
        """Requests that ended elsewhere (aborted in a queue, refused): end their room."""
        for rid, req in list(self.tracked.items()):
            if req.finished and req not in self.inflight:
                req.kv_transfer.abort(f"the request ended on the prefill server: "
                                      f"{req.finish_reason.get('message', req.finish_reason)}")
                req.kv_transfer.clear()
                del self.tracked[rid]

    def after_forward(self) -> None:
        """Requests that just sampled their first token leave ``running``: send their KV."""
        done = [r for r in self.s.running if r.bootstrap is not None]
        if not done:
            return
        self.s.running = [r for r in self.s.running if r.bootstrap is None]
        page = self.s.cache.page_size
        for req in done:
            sender = req.kv_transfer
            end = -(-req.prompt_len // page) * page
            row = self.s.cache.req_to_token_pool.req_to_token[req.req_pool_idx]
            if sender.poll() == KVPoll.WaitingForInput:
                sender.send(row[sender.decode_prefix_len: end].clone(), req.output_ids[0],
                            req.prompt_len, req.first_token_logprobs, req.state_slot)
            self.inflight.append(req)

    def abort(self, rid: str, message: str | None) -> bool:
        for queue in (self.bootstrapping, self.inflight):
            req = next((r for r in queue if r.rid == rid), None)
            if req is not None:
                queue.remove(req)
                reason = {"type": "abort", "message": message or "Aborted"}
                req.kv_transfer.abort(reason["message"])
                self._finish(req, reason, release=req.req_pool_idx is not None)
                return True
        return False

    def abort_all(self) -> None:
        for req in [*self.bootstrapping, *self.inflight]:
            self.abort(req.rid, None)

    def info(self) -> dict[str, int]:
        return {"num_prefill_prealloc_queue_reqs": len(self.bootstrapping),
                "num_prefill_bootstrap_tokens": sum(r.seq_len for r in self.bootstrapping),
                "num_prefill_inflight_queue_reqs": len(self.inflight),
                "kv_transfer_sent_tokens": self.manager.sent_tokens,
                "kv_transfer_seconds": self.manager.transfer_seconds,
                "kv_transfers": self.manager.transfers,
                "kv_transfer_bytes_per_token": 2 * self.manager.buffers.layout.num_layers
                * self.manager.buffers.token_bytes}


class DecodeQueues(_Queues):
    def __init__(self, scheduler: Any, manager: KVManager) -> None:
        super().__init__(scheduler, manager)
        self.prealloc: list[Req] = []  # resolving the route, or waiting for free pages
        self.transferring: list[Req] = []  # pages reserved, claim sent

    def add(self, req: Req) -> None:
        b = req.bootstrap
        req.kv_transfer = self.manager.create_receiver(b.host, b.port, b.room,
                                                       b.prefill_dp_rank)
        self.prealloc.append(req)

    def busy(self) -> bool:
        return bool(self.prealloc or self.transferring)

    def poll(self) -> None:
        self.manager.poll()
        still = []
        for req in self.transferring:
            state = req.kv_transfer.poll()
            if state == KVPoll.Success:
                self._install(req)
            elif state == KVPoll.Failed:  # unwritten pages: to the allocator, not the tree
                self.s.cache.release(req, cache=False)
                self._finish(req, transfer_failed(req.kv_transfer.failure_reason()), False)
            else:
                still.append(req)
        self.transferring = still
        self._reserve()

    def _reserve(self) -> None:
        """FIFO: claim rooms while rows and pages (beyond the running requests' decode
        reserve) are free; a request with a grammar once it compiled (it goes on from the
        first token as soon as its KV is in)."""
        still = []
        blocked = False
        for req in self.prealloc:
            state = req.kv_transfer.poll()
            ready = state == KVPoll.Failed or self.s.grammar_ready(req)
            if state == KVPoll.Failed:
                self._finish(req, transfer_failed(req.kv_transfer.failure_reason()), False)
            elif ready is None:  # a bad grammar: finished as a 400; end the room too
                req.kv_transfer.abort("the request's grammar failed on the decode server")
                req.kv_transfer.clear()
            elif not ready or state != KVPoll.WaitingForInput or blocked or not self._claim(req):
                blocked = blocked or (ready and state == KVPoll.WaitingForInput)
                still.append(req)
        self.prealloc = still

    def _claim(self, req: Req) -> bool:
        s, cache = self.s, self.s.cache
        active = [*s.running, *self.transferring]
        if len(active) + (s.chunked_req is not None) >= s.max_running_requests:
            return False
        reserve = sum(decode_reserve(r, s.new_token_ratio) for r in active)
        if cache.available_size() - reserve < req.prompt_len + decode_reserve(
                req, s.new_token_ratio) or not cache.admit(req):
            return False
        if not cache.alloc(req, req.prompt_len - req.prefix_len):
            cache.release(req, cache=False)
            return False
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        req.kv_transfer.send_metadata(row[req.prefix_len: req.alloc_len].clone(),
                                      req.prefix_len, req.prompt_len, req.state_slot)
        req.state_restore = None  # a hybrid's: the prefill's whole state replaces a snapshot
        s.stats["prompt_tokens"] += req.prompt_len
        s.stats["cached_tokens"] += req.prefix_len
        self.transferring.append(req)
        return True

    def _install(self, req: Req) -> None:
        """The prompt's KV is in place: the request continues as if it had prefilled here."""
        s = self.s
        token = req.kv_transfer.first_token
        lp, top, asked = req.kv_transfer.first_logprobs
        req.kv_transfer.clear()
        req.kv_len = req.prompt_len
        start = len(req.output_ids)
        req.output_ids.append(token)
        s.stats["generation_tokens"] += 1
        s.cache.cache_unfinished(req)
        req.finish_reason = s.outputs._check_finish(req, token)
        s.outputs._advance_grammars([req], [token])  # the prefill's mask chose it; go on
        s.outputs.emit_later(s.outputs._output(  # the prompt's logprobs stay on the prefill
            req, req.output_ids[start:], [(lp, token)], [top], [asked]))
        if req.finished:
            s.cache.release(req, cache=True)
        else:
            s.running.append(req)

    def abort(self, rid: str, message: str | None) -> bool:
        for queue in (self.prealloc, self.transferring):
            req = next((r for r in queue if r.rid == rid), None)
            if req is not None:
                queue.remove(req)
                req.kv_transfer.abort(message or "Aborted")
                if req.req_pool_idx is not None:
                    s = self.s
                    s.cache.release(req, cache=False)
                reason = {"type": "abort", "message": message or "Abort in waiting queue"}
                self._finish(req, reason, release=False)
                return True
        return False

    def abort_all(self) -> None:
        for req in [*self.prealloc, *self.transferring]:
            self.abort(req.rid, None)

    def after_forward(self) -> None:
        return None

    def info(self) -> dict[str, int]:
        return {"num_decode_prealloc_queue_reqs": len(self.prealloc),
                "num_decode_transfer_queue_reqs": len(self.transferring),
                # tokens whose KV has not arrived (the transferring ones hold their pages)
                "num_decode_awaiting_tokens": sum(r.seq_len for r in self.prealloc),
                "num_decode_transfer_tokens": sum(r.seq_len for r in self.transferring),
                "kv_transfer_received_tokens": self.manager.received_tokens}


def create_queues(scheduler: Any, args: ServerArgs,
                  dp_rank: int = 0) -> PrefillQueues | DecodeQueues | None:
    if args.disaggregation_mode == "null":
        return None
    pool = scheduler.model_runner.kv_pool
    manager = create_kv_manager(args, pool.k_buffers, pool.v_buffers, dp_rank,
                                scheduler.model_runner)
    cls = PrefillQueues if args.disaggregation_mode == "prefill" else DecodeQueues
    return cls(scheduler, manager)
