"""The KV transfer between a prefill server and a decode server: its states, and each
side of one transfer (``KVSender``, ``KVReceiver``). The messages are in ``wire.py``, the
pluggable transport in ``transport.py``, the manager that drives a server's transfers in
``manager.py``.

One transfer is one *room* (SGLang's ``bootstrap_room``: a random 63-bit id the router
puts in both copies of a request). Its life, on each side (SGLang's ``KVPoll``)::

    prefill (KVSender)                          decode (KVReceiver)
    Bootstrapping   no claim for the room yet   Bootstrapping   asking the prefill's
                                                                bootstrap service for its
                                                                transfer endpoint
    WaitingForInput decode claimed it (prefix,  WaitingForInput route known; then the
                    token count): compute       metadata (claim) sent, pages reserved
    Transferring    pages + first token sent,   Transferring    chunks arriving
                    waiting for the ack
    Success         decode acknowledged         Success         last chunk written, ack sent
    Failed          timeout, abort, bad peer    Failed          timeout, abort, bad data

Every state but Success and Failed has a deadline (``--disaggregation-bootstrap-timeout``
while bootstrapping, ``--disaggregation-waiting-timeout`` once the claim is out), so a
room that is never claimed, a peer that dies mid-transfer or a prefill that never answers
ends in Failed and its owner frees its pages. All state changes happen in the scheduler's
thread (``KVManager.poll``); a transport only moves bytes and queues what it received.

Data: each ``KVChunk`` message is followed by ``2 * num_layers`` frames, K then V of each
layer, each ``[num_tokens, num_kv_heads, head_dim]`` in the pool's dtype; chunks start on
page boundaries and hold whole pages (the last page may be partly filled: its tail is
whatever the prefill's pool held there, never read by attention).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

import torch

from radixlm.runtime.disaggregation.transport import Peer
from radixlm.runtime.disaggregation.wire import Abort, Ack, Claim, KVChunk

if TYPE_CHECKING:
    from radixlm.runtime.disaggregation.manager import KVManager

logger = logging.getLogger(__name__)

ROOM_LIMIT = 2**63  # rooms are in [0, 2**63), as sglang-router draws them


class KVPoll(enum.IntEnum):
    """SGLang's transfer states, same numbers."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4



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

    def send(self, slots: torch.Tensor, first_token: int, prompt_len: int) -> None:
        """Ship the pool's ``slots`` (prompt positions ``decode_prefix_len ..``, whole pages)
        and the first token; the transfer fails (never raises) if they do not fit the claim."""
        claim = self.claim
        assert self.state == KVPoll.WaitingForInput and claim is not None, (
            f"send on room {self.room} in state {self.state.name}")
        if claim.prompt_len != prompt_len or claim.num_tokens != len(slots):
            self.abort(f"the decode server expects {claim.num_tokens} tokens of a "
                       f"{claim.prompt_len}-token prompt; the prefill server has "
                       f"{len(slots)} of {prompt_len} (tokenized differently?)")
            return
        step = self.manager.buffers.chunk_tokens()
        starts = range(0, max(len(slots), 1), step)
        for start in starts:
            part = slots[start: start + step]
            last = start + step >= len(slots)
            head = KVChunk(self.room, start, len(part), last, first_token if last else None)
            self.manager.transport.send(self.peer, head, self.manager.buffers.gather(part))
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
                 deadline: float) -> None:
        super().__init__(manager, room, deadline)
        self.addr = addr
        self.slots: torch.Tensor | None = None
        self.first_token: int | None = None
        self.received = 0  # tokens written so far

    @property
    def metadata_sent(self) -> bool:
        return self.slots is not None

    def send_metadata(self, slots: torch.Tensor, prefix_len: int, prompt_len: int) -> None:
        """Claim the room: ``slots`` (this pool's, prompt positions ``prefix_len ..``, whole
        pages) receive the prefill's pages."""
        assert self.state == KVPoll.WaitingForInput and self.slots is None, (
            f"send_metadata on room {self.room} in state {self.state.name}")
        self.slots = slots
        self.manager.transport.send(self.addr, Claim(self.room, prompt_len, prefix_len,
                                                     len(slots)))
        self._to(KVPoll.WaitingForInput, self.manager.waiting_timeout)

    def abort(self, reason: str = "aborted by the decode server") -> None:
        if self.state in (KVPoll.Success, KVPoll.Failed):
            return
        if self.slots is not None:  # the prefill knows the room only once claimed
            self.manager.transport.send(self.addr, Abort(self.room, reason))
        self._fail(reason)

    def clear(self) -> None:
        self.manager.receivers.pop(self.room, None)

    def _on_chunk(self, chunk: KVChunk, frames: list[Any]) -> None:
        if self.slots is None or self.state not in (KVPoll.WaitingForInput,
                                                    KVPoll.Transferring):
            return
        problem = self.manager.check_chunk(chunk, frames, len(self.slots), self.received)
        if problem is not None:
            self.abort(f"bad KV chunk from the prefill server: {problem}")
            return
        part = self.slots[chunk.offset: chunk.offset + chunk.num_tokens]
        self.manager.buffers.scatter(part, self.manager.frames_to_tensors(frames, len(part)))
        self.received += chunk.num_tokens
        self.manager.received_tokens += chunk.num_tokens
        if not chunk.last:
            self._to(KVPoll.Transferring, self.manager.waiting_timeout)
            return
        if self.received != len(self.slots) or chunk.first_token is None:
            self.abort(f"the prefill server sent {self.received} of {len(self.slots)} "
                       "tokens, or no first token")
            return
        self.first_token = chunk.first_token
        self.manager.transport.send(self.addr, Ack(self.room))
        self._to(KVPoll.Success, None)
