"""One server's KV transfers: each side of one (``KVSender`` on the prefill server,
``KVReceiver`` on the decode server) and the ``KVManager`` that drives them over one
transport from the scheduler's thread (the states and their deadlines: ``base.py``)."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import torch

from radixlm.runtime.disaggregation.base import KVPoll
from radixlm.runtime.disaggregation.kv_buffers import KVBuffers
from radixlm.runtime.disaggregation.transport import Event, Peer, Transport
from radixlm.runtime.disaggregation.wire import (
    Abort,
    Ack,
    Claim,
    KVChunk,
    RouteInfo,
    StateChunk,
)

logger = logging.getLogger(__name__)

# prefill: claims waiting for their request (each held until --disaggregation-bootstrap-
# timeout); beyond this many a new one is refused (an Abort to its sender)
EARLY_CLAIMS_LIMIT = 16384

# the first token's (logprob, top logprobs, logprobs of the asked ids), prefill -> decode
FirstLogprobs = tuple[float | None, list[tuple[float, int]] | None,
                      list[tuple[float, int]] | None]


# --- one transfer, each side -------------------------------------------------------------------
class _Transfer:
    def __init__(self, manager: KVManager, room: int, deadline: float) -> None:
        self.manager = manager
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.reason = ""
        self.deadline: float | None = deadline

    def poll(self) -> KVPoll:
        return self.state

    def failure_reason(self) -> str:
        return self.reason

    def _fail(self, reason: str) -> None:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.reason, self.deadline = KVPoll.Failed, reason, None
            logger.warning("KV transfer of room %d failed: %s", self.room, reason)

    def _to(self, state: KVPoll, timeout: float | None) -> None:
        self.state = state
        self.deadline = None if timeout is None else self.manager.clock() + timeout


class KVSender(_Transfer):
    """Prefill side of one room: waits for the decode's claim, sends the pages and the
    first token, then waits for the ack."""

    def __init__(self, manager: KVManager, room: int, deadline: float) -> None:
        super().__init__(manager, room, deadline)
        self.peer: Peer | None = None
        self.claim: Claim | None = None
        self.sent_at = 0.0  # when send() handed the pages over (transfer time: to the ack)

    @property
    def decode_prefix_len(self) -> int:
        assert self.claim is not None, f"room {self.room} not claimed"
        return self.claim.prefix_len

    def send(self, slots: torch.Tensor, first_token: int, prompt_len: int,
             first_logprobs: FirstLogprobs | None = None,
             state_slot: int | None = None) -> None:
        """Ship the pool's ``slots`` (prompt positions ``decode_prefix_len ..``, whole pages)
        and the first token (with its logprobs, when the request asked for them); for a
        hybrid model first its recurrent state, state slot ``state_slot`` (the state at
        the prompt's end, however it was computed). The transfer fails (never raises) if
        they do not fit the claim."""
        claim = self.claim
        assert self.state == KVPoll.WaitingForInput and claim is not None, (
            f"send on room {self.room} in state {self.state.name}")
        if claim.prompt_len != prompt_len or claim.num_tokens != len(slots):
            self.abort(f"the decode server expects {claim.num_tokens} tokens of a "
                       f"{claim.prompt_len}-token prompt; the prefill server has "
                       f"{len(slots)} of {prompt_len} (tokenized differently?)")
            return
        buffers = self.manager.buffers
        if buffers.states is not None:
            assert state_slot is not None, f"room {self.room}: a hybrid's request without state"
            self.manager.transport.send(self.peer, StateChunk(self.room),
                                        buffers.gather_state(state_slot))
        step = buffers.chunk_tokens()
        starts = range(0, max(len(slots), 1), step)
        for start in starts:
            part = slots[start: start + step]
            last = start + step >= len(slots)
            head = KVChunk(self.room, start, len(part), last, first_token if last else None)
            if last and first_logprobs is not None:
                head.first_logprob, head.first_top_logprobs, head.first_ids_logprobs = (
                    first_logprobs)
            self.manager.transport.send(self.peer, head, buffers.gather(part))
        self.manager.sent_tokens += len(slots)
        self.sent_at = self.manager.clock()
        self._to(KVPoll.Transferring, self.manager.waiting_timeout)

    def abort(self, reason: str = "aborted by the prefill server") -> None:
        if self.state in (KVPoll.Success, KVPoll.Failed):
            return
        if self.peer is not None:
            self.manager.transport.send(self.peer, Abort(self.room, reason))
        self._fail(reason)

    def clear(self) -> None:
        self.manager.senders.pop(self.room, None)


class KVReceiver(_Transfer):
    """Decode side of one room: resolves the prefill's endpoint, claims the room with the
    reserved slots, writes the chunks into them, and keeps the first token."""

    def __init__(self, manager: KVManager, room: int, addr: tuple[str, int],
                 deadline: float, prefill_rank: int | None = None) -> None:
        super().__init__(manager, room, deadline)
        self.addr = addr
        self.prefill_rank = prefill_rank  # the prefill replica asked for (None: room mod N)
        self.replica = 0  # the prefill replica holding the room, once the route is known
        self.slots: torch.Tensor | None = None
        self.state_slot: int | None = None  # a hybrid's: where the prefill's state goes
        self.state_written = False
        self.first_token: int | None = None
        self.first_logprobs: FirstLogprobs = (None, None, None)
        self.received = 0  # tokens written so far

    @property
    def metadata_sent(self) -> bool:
        return self.slots is not None

    def _routed(self, info: RouteInfo) -> None:
        """The prefill server's route is known: which of its replicas holds the room."""
        n = len(info.transfer_ports)
        rank = self.room % n if self.prefill_rank is None else self.prefill_rank
        if rank >= n:
            self._fail(f"disagg_prefill_dp_rank {rank}: the prefill server at "
                       f"{self.addr[0]}:{self.addr[1]} runs {n} replica(s)")
            return
        self.replica = rank
        self._to(KVPoll.WaitingForInput, None)

    def send_metadata(self, slots: torch.Tensor, prefix_len: int, prompt_len: int,
                      state_slot: int | None = None) -> None:
        """Claim the room: ``slots`` (this pool's, prompt positions ``prefix_len ..``, whole
        pages) receive the prefill's pages, and for a hybrid model state slot
        ``state_slot`` its recurrent state (the whole of it, whatever ``prefix_len``)."""
        assert self.state == KVPoll.WaitingForInput and self.slots is None, (
            f"send_metadata on room {self.room} in state {self.state.name}")
        assert (state_slot is None) == (self.manager.buffers.states is None), (
            f"room {self.room}: state slot {state_slot} for a model "
            f"{'with' if self.manager.buffers.states is not None else 'without'} state")
        self.slots, self.state_slot = slots, state_slot
        self.manager.transport.send(self.addr, Claim(self.room, prompt_len, prefix_len,
                                                     len(slots)), replica=self.replica)
        self._to(KVPoll.WaitingForInput, self.manager.waiting_timeout)

    def abort(self, reason: str = "aborted by the decode server") -> None:
        if self.state in (KVPoll.Success, KVPoll.Failed):
            return
        if self.slots is not None:  # the prefill knows the room only once claimed
            self.manager.transport.send(self.addr, Abort(self.room, reason),
                                        replica=self.replica)
        self._fail(reason)

    def clear(self) -> None:
        self.manager.receivers.pop(self.room, None)

    def _chunk_problem(self, chunk: KVChunk, frames: list[Any]) -> str | None:
        """Why this chunk cannot be written into the reserved slots (None: it can)."""
        if chunk.offset != self.received or chunk.num_tokens <= 0:
            return f"chunk at {chunk.offset} (+{chunk.num_tokens}) after {self.received} tokens"
        if chunk.offset + chunk.num_tokens > len(self.slots):
            return f"chunk ends at {chunk.offset + chunk.num_tokens}, {len(self.slots)} reserved"
        return self.manager.buffers.frames_problem(frames, chunk.num_tokens)

    def _on_state(self, frames: list[Any]) -> None:
        """A hybrid's recurrent state, before any chunk: into the reserved state slot."""
        if self.slots is None or self.state not in (KVPoll.WaitingForInput,
                                                    KVPoll.Transferring):
            return
        problem = self.manager.buffers.state_frames_problem(frames)
        if problem is None and (self.state_written or self.received):
            problem = "state after KV chunks, or twice"
        if problem is not None:
            self.abort(f"bad recurrent state from the prefill server: {problem}")
            return
        self.manager.buffers.scatter_state(self.state_slot, frames)
        self.state_written = True
        self._to(KVPoll.Transferring, self.manager.waiting_timeout)

    def _on_chunk(self, chunk: KVChunk, frames: list[Any]) -> None:
        if self.slots is None or self.state not in (KVPoll.WaitingForInput,
                                                    KVPoll.Transferring):
            return
        problem = self._chunk_problem(chunk, frames)
        if problem is not None:
            self.abort(f"bad KV chunk from the prefill server: {problem}")
            return
        part = self.slots[chunk.offset: chunk.offset + chunk.num_tokens]
        self.manager.buffers.scatter(part, self.manager.buffers.as_tensors(frames, len(part)))
        self.received += chunk.num_tokens
        self.manager.received_tokens += chunk.num_tokens
        if not chunk.last:
            self._to(KVPoll.Transferring, self.manager.waiting_timeout)
            return
        if self.received != len(self.slots) or chunk.first_token is None:
            self.abort(f"the prefill server sent {self.received} of {len(self.slots)} "
                       "tokens, or no first token")
            return
        if self.state_slot is not None and not self.state_written:
            self.abort("the prefill server sent no recurrent state (a hybrid model's)")
            return
        self.first_token = chunk.first_token
        self.first_logprobs = (chunk.first_logprob, chunk.first_top_logprobs,
                               chunk.first_ids_logprobs)
        self.manager.transport.send(self.addr, Ack(self.room), replica=self.replica)
        self._to(KVPoll.Success, None)


# --- the manager --------------------------------------------------------------------------------
class KVManager:
    """One server's transfers (``mode`` "prefill": senders; "decode": receivers) over one
    transport. ``poll`` (scheduler thread, once a loop turn) applies what arrived and ends
    transfers past their deadline."""

    def __init__(self, mode: str, buffers: KVBuffers, transport: Transport,
                 bootstrap_timeout: float, waiting_timeout: float,
                 clock: Callable[[], float] = time.monotonic,
                 early_claims_limit: int = EARLY_CLAIMS_LIMIT) -> None:
        assert mode in ("prefill", "decode"), f"mode {mode!r}"
        self.mode, self.buffers, self.transport = mode, buffers, transport
        self.bootstrap_timeout, self.waiting_timeout = bootstrap_timeout, waiting_timeout
        self.clock = clock
        self.senders: dict[int, KVSender] = {}
        self.receivers: dict[int, KVReceiver] = {}
        # prefill: claims that came before their request, with their arrival time (the
        # first claim of a room wins; at most early_claims_limit of them)
        self.early_claims: dict[int, tuple[Peer, Claim, float]] = {}
        self.early_claims_limit = early_claims_limit
        # decode: (host, port) -> RouteInfo, or the time it was asked for
        self.routes: dict[tuple[str, int], RouteInfo | float] = {}
        self.sent_tokens = self.received_tokens = 0
        self.transfer_seconds = 0.0  # prefill: send() to ack, summed over acked rooms
        self.transfers = 0  # prefill: acked rooms

    # --- creation ---------------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        assert self.mode == "prefill", "senders live on the prefill server"
        sender = KVSender(self, room, self.clock() + self.bootstrap_timeout)
        if room in self.senders:
            sender._fail(f"bootstrap_room {room} is already in use on this prefill server")
            return sender
        self.senders[room] = sender
        early = self.early_claims.pop(room, None)
        if early is not None:
            self._claimed(sender, early[0], early[1])
        return sender

    def create_receiver(self, host: str, port: int, room: int,
                        prefill_rank: int | None = None) -> KVReceiver:
        """``prefill_rank``: the prefill replica that holds the room (None: room mod the
        prefill server's replicas, as it places them)."""
        assert self.mode == "decode", "receivers live on the decode server"
        addr = (host, port)
        receiver = KVReceiver(self, room, addr, self.clock() + self.bootstrap_timeout,
                              prefill_rank)
        if room in self.receivers:
            receiver._fail(f"bootstrap_room {room} is already in use on this decode server")
            return receiver
        self.receivers[room] = receiver
        route = self.routes.get(addr)
        if isinstance(route, RouteInfo):
            receiver._routed(route)
        elif route is None:
            self.routes[addr] = self.clock()
            self.transport.resolve(host, port)
        return receiver

    # --- the scheduler's turn -----------------------------------------------------------
    def poll(self) -> None:
        while True:
            try:
                event = self.transport.inbox.get_nowait()
            except queue.Empty:
                break
            self._apply(event)
        self._expire(self.clock())

    def wait(self, timeout: float) -> None:
        """Nap until something arrives (or ``timeout``): the scheduler has nothing to run."""
        if self.transport.inbox.empty():
            self.transport.wakeup.wait(timeout)
        self.transport.wakeup.clear()

    def busy(self) -> bool:
        return bool(self.senders or self.receivers)

    def close(self) -> None:
        self.transport.close()

    def _apply(self, ev: Event) -> None:
        msg = ev.msg
        if msg is None:
            self._peer_gone(ev.peer, ev.error or "unreachable")
        elif isinstance(msg, RouteInfo):
            self._route(ev.peer, msg)
        elif isinstance(msg, Claim):
            self._claim(ev.peer, msg)
        elif isinstance(msg, KVChunk | StateChunk):
            receiver = self.receivers.get(msg.room)
            if receiver is not None and receiver.addr == ev.peer:
                if isinstance(msg, KVChunk):
                    receiver._on_chunk(msg, ev.frames)
                else:
                    receiver._on_state(ev.frames)
        elif isinstance(msg, Ack):
            sender = self.senders.get(msg.room)
            if sender is not None and sender.peer == ev.peer and \
                    sender.state == KVPoll.Transferring:
                sender._to(KVPoll.Success, None)
                self.transfer_seconds += self.clock() - sender.sent_at
                self.transfers += 1
        elif isinstance(msg, Abort):
            self._peer_abort(ev.peer, msg)

    def _claim(self, peer: Peer, claim: Claim) -> None:
        """The first claim of a room wins: a later one (while the first waits for its
        request, or once it was taken) is refused with an Abort to its sender."""
        sender = self.senders.get(claim.room)
        if sender is None and claim.room in self.early_claims:
            self._refuse(peer, claim.room, "was already claimed")
        elif sender is None and len(self.early_claims) >= self.early_claims_limit:
            self._refuse(peer, claim.room, f"cannot wait: {self.early_claims_limit} claims "
                                           "already wait for their request")
        elif sender is None:
            self.early_claims[claim.room] = (peer, claim, self.clock())
        elif sender.claim is not None or sender.state != KVPoll.Bootstrapping:
            self._refuse(peer, claim.room, "was already claimed or is closed")
        else:
            self._claimed(sender, peer, claim)

    def _refuse(self, peer: Peer, room: int, why: str) -> None:
        logger.warning("refused a claim of room %d: it %s", room, why)
        self.transport.send(peer, Abort(room, f"room {room} {why}"))

    def _claimed(self, sender: KVSender, peer: Peer, claim: Claim) -> None:
        sender.peer, sender.claim = peer, claim
        page = self.buffers.page_size
        if claim.prefix_len % page or claim.num_tokens % page or claim.prefix_len < 0:
            sender.abort(f"claim of room {claim.room} is not page-aligned (page size {page})")
            return
        sender._to(KVPoll.WaitingForInput, None)

    def _route(self, addr: Any, info: RouteInfo) -> None:
        if info.layout != self.buffers.layout:
            mine = self.buffers.layout
            hint = ("; both servers must use the same --kv-cache-dtype (and --dtype)"
                    if info.layout.dtype != mine.dtype else "; the servers serve different "
                    "models" if info.layout.model != mine.model else "; the servers' "
                    "recurrent state layouts differ" if info.layout.state != mine.state
                    else "")
            self._peer_gone(addr, f"the prefill server's KV layout {info.layout} differs "
                                  f"from this decode server's {mine}{hint}")
            return
        self.routes[addr] = info
        for r in self.receivers.values():
            if r.addr == addr and r.state == KVPoll.Bootstrapping:
                r._routed(info)

    def _peer_abort(self, peer: Peer, msg: Abort) -> None:
        if self.mode == "prefill":
            early = self.early_claims.get(msg.room)
            if early is not None and early[0] == peer:  # only its claimer withdraws it
                del self.early_claims[msg.room]
            sender = self.senders.get(msg.room)
            if sender is not None and sender.peer == peer:
                sender._fail(f"the decode server aborted the transfer: {msg.reason}")
        else:
            receiver = self.receivers.get(msg.room)
            if receiver is not None and receiver.addr == peer:
                receiver._fail(f"the prefill server aborted the transfer: {msg.reason}")

    def _peer_gone(self, peer: Peer, why: str) -> None:
        if self.mode == "prefill":
            for s in self.senders.values():
                if s.peer == peer:
                    s._fail(f"the decode server is gone: {why}")
            return
        self.routes.pop(peer, None)
        self.transport.forget(peer)
        for r in self.receivers.values():
            if r.addr == peer:
                r._fail(f"prefill server {peer[0]}:{peer[1]}: {why}")

    def _expire(self, now: float) -> None:
        for room, (peer, _, t) in list(self.early_claims.items()):
            if now - t > self.bootstrap_timeout:
                del self.early_claims[room]
                self.transport.send(peer, Abort(room, "no request with this bootstrap_room "
                                                      "reached the prefill server within "
                                                      f"{self.bootstrap_timeout:g} s"))
        for t in (*self.senders.values(), *self.receivers.values()):
            if t.deadline is not None and now > t.deadline:
                t.abort(self._timeout_reason(t))
                if isinstance(t, KVReceiver):
                    self._maybe_forget(t.addr)
        if self.mode == "decode":
            for addr, route in list(self.routes.items()):
                if not isinstance(route, RouteInfo) and now - route > self.bootstrap_timeout:
                    self._peer_gone(addr, "its bootstrap service did not answer within "
                                          f"{self.bootstrap_timeout:g} s")

    def _maybe_forget(self, addr: tuple[str, int]) -> None:
        """A prefill server that let a claim time out may have restarted (on a new transfer
        port): once none of its rooms is live here, the next request asks its bootstrap
        service again."""
        live = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)
        if isinstance(self.routes.get(addr), RouteInfo) and not any(
                r.addr == addr and r.state in live for r in self.receivers.values()):
            del self.routes[addr]
            self.transport.forget(addr)

    def _timeout_reason(self, t: _Transfer) -> str:
        if t.state == KVPoll.Bootstrapping:
            what = ("no decode server claimed the room" if self.mode == "prefill"
                    else "the prefill server's bootstrap service did not answer")
            return f"{what} within {self.bootstrap_timeout:g} s (bootstrap timeout)"
        what = ("the decode server did not acknowledge the KV" if self.mode == "prefill"
                else "the prefill server sent no KV")
        return f"{what} within {self.waiting_timeout:g} s (waiting timeout)"
