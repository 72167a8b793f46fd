"""The KV transfer between a prefill server and a decode server: its states. The messages
are in ``wire.py``, the pluggable transport in ``transport.py``, each side of a transfer
(``KVSender``, ``KVReceiver``) and the manager that drives a server's transfers in
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
whatever the prefill's pool held there, never read by attention). A hybrid model's transfer
(``KVLayout.state`` not empty) starts with one ``StateChunk``: ``2 * len(layout.state)``
frames, the conv then the SSM state of each linear-attention layer, the request's state
slot whole (its state at the prompt's end; the decode writes it into the slot it reserved,
and fails the room if the last chunk comes without it).
"""

from __future__ import annotations

import enum

ROOM_LIMIT = 2**63  # rooms are in [0, 2**63), as sglang-router draws them


class KVPoll(enum.IntEnum):
    """SGLang's transfer states, same numbers."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4
