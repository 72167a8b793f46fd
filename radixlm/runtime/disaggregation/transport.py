"""What moves wire messages between the two sides (``zmq_backend``, ``fake_backend``):
the interface a transport implements and the events it delivers."""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

import msgspec
import torch

from radixlm.runtime.disaggregation.wire import WireMsg

Peer = Hashable  # prefill side: who claimed (a transport's id); decode side: (host, port)


class Event(msgspec.Struct):
    """What a transport received: ``msg`` from ``peer`` (+ frames for a KVChunk), or, with
    ``msg`` None, that ``peer`` is unreachable (``error`` says why)."""

    peer: Any
    msg: Any = None
    frames: list[Any] = msgspec.field(default_factory=list)
    error: str | None = None


class Transport(ABC):
    """Moves wire messages between the two sides; never touches a transfer's state.

    ``send`` / ``resolve`` / ``forget`` are called from the scheduler's thread and return
    at once; whatever arrives is queued in ``inbox`` for ``KVManager.poll``."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[Event] = queue.Queue()
        self.wakeup = threading.Event()  # set with every event: the scheduler may nap on it

    def deliver(self, event: Event) -> None:
        self.inbox.put(event)
        self.wakeup.set()

    @abstractmethod
    def send(self, peer: Peer, msg: WireMsg, frames: list[torch.Tensor] | None = None,
             replica: int = 0) -> None:
        """Send ``msg`` (and its frames) to ``peer``; from a decode side, to the prefill
        server's replica ``replica`` (an index into its ``RouteInfo.transfer_ports``)."""

    @abstractmethod
    def resolve(self, host: str, port: int) -> None:
        """Decode side: ask the bootstrap service at host:port for its RouteInfo; the answer
        arrives as an Event from peer ``(host, port)`` (RouteInfo, or an error)."""

    def forget(self, peer: Peer) -> None:
        """Decode side: drop the connection to ``peer`` (it timed out); the next resolve
        starts afresh."""
        return None

    def close(self) -> None:
        """Stop I/O; nothing is delivered afterwards."""
        return None

