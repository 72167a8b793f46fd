"""An in-memory transport for unit tests: prefill and decode managers in one process.

``FakeNetwork`` stands for the network: a prefill transport registers its bootstrap
address on it; messages are delivered to the other side's inbox at once, frames as tensor
copies (so a test can mutate the sender's pool afterwards and see the copy unchanged).
``drop`` makes every message to an address vanish (a peer that died). Not a backend users
can choose: ``--disaggregation-transfer-backend`` accepts only real ones.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from radixlm.runtime.disaggregation.transport import Event, Peer, Transport
from radixlm.runtime.disaggregation.wire import KVLayout, RouteInfo, WireMsg, decode, encode


class FakeNetwork:
    def __init__(self) -> None:
        self.prefills: dict[tuple[str, int], FakeTransport] = {}
        self.dead: set[Any] = set()  # transports (or addresses) whose messages vanish
        self._ids = itertools.count()
        self.registry: list[FakeTransport] = []
        self.log: list[WireMsg] = []  # every message sent, in order

    def drop(self, who: Any) -> None:
        self.dead.add(who)


class FakeTransport(Transport):
    """One side's transport on a FakeNetwork. Messages go through msgpack (as on a wire)."""

    def __init__(self, net: FakeNetwork, layout: KVLayout | None = None,
                 bootstrap: tuple[str, int] | None = None) -> None:
        super().__init__()
        self.net = net
        self.id = next(net._ids)
        net.registry.append(self)
        self.layout = layout
        if bootstrap is not None:  # a prefill side: reachable at its bootstrap address
            assert layout is not None, "a prefill transport advertises its layout"
            net.prefills[bootstrap] = self

    def send(self, peer: Peer, msg: WireMsg, frames: list[torch.Tensor] | None = None,
             replica: int = 0) -> None:
        self.net.log.append(msg)
        copies = [f.clone() for f in frames or []]
        if isinstance(peer, tuple):  # decode -> prefill, by bootstrap address
            target = self.net.prefills.get(peer)
            if target is None or target in self.net.dead or peer in self.net.dead:
                return
            target.deliver(Event(self.id, decode(encode(msg)), copies))
            return
        target = self._by_id(peer)  # prefill -> decode, by transport id
        if target is None:
            self.deliver(Event(peer, None, error="no such peer"))
            return
        if target in self.net.dead:
            return  # a peer that died silently: only a deadline notices
        addr = next(a for a, t in self.net.prefills.items() if t is self)
        target.deliver(Event(addr, decode(encode(msg)), copies))

    def resolve(self, host: str, port: int) -> None:
        target = self.net.prefills.get((host, port))
        if target is None or target in self.net.dead:
            return  # no answer: the bootstrap timeout ends it
        info = RouteInfo([port + 1], target.layout)
        self.deliver(Event((host, port), decode(encode(info))))

    def _by_id(self, peer: Any) -> FakeTransport | None:
        for t in self.net.registry:
            if t.id == peer:
                return t
        return None
