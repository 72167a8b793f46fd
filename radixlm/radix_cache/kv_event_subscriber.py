"""KVEventSubscriber: replicas' zmq KV event streams into a PrefixIndex, gaps filled by replay.

One SUB socket (and, when given, one DEALER to the replay ROUTER) per replica. Each
message is ``[topic, seq, payload]``; per replica the subscriber expects ``seq`` to be one
more than the last it applied:

- ``seq`` as expected: apply it.
- ``seq`` ahead (a batch was lost, or the subscriber joined late: the first expected
  ``seq`` is 0): ask the replay endpoint for everything from the missing one, apply what
  comes back in order, then this one. If replay is not configured, does not answer, or no
  longer holds the missing batch, the replica's view cannot be trusted: it is dropped from
  the index (it matches nothing until its next batches refill it) and ``lost`` counts it.
- ``seq`` behind: a duplicate (replayed and also delivered) is ignored, except ``seq == 0``
  after others, which means the publisher restarted: the replica starts over.

Use ``poll`` (and ``catch_up``) from your own loop, or ``start`` for a background thread
(then not ``catch_up``: the sockets are the thread's); ``lock`` guards the index while the
thread applies batches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from radixlm.radix_cache.kv_events import KVEventBatch, decode_batch
from radixlm.radix_cache.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_MS = 2000  # how long one replay answer may take before the gap counts as lost
# the largest frame a stream may send (one step's event batch: a few bytes per token of the
# step, so far below this); a bigger frame drops its connection (zmq.MAXMSGSIZE)
MAX_FRAME_BYTES = 64 << 20


@dataclass
class ReplicaStream:
    """Where one replica publishes: its PUB ``endpoint`` and optional ROUTER ``replay``."""

    endpoint: str
    replay: str | None = None


class KVEventSubscriber:
    """Feeds ``index`` from ``streams[r]`` for replica ``r`` (see the module docstring)."""

    def __init__(self, streams: list[ReplicaStream], index: PrefixIndex, topic: str = "",
                 on_batch: Callable[[int, int, KVEventBatch], None] | None = None,
                 ctx: zmq.Context | None = None) -> None:
        assert len(streams) == index.num_replicas, (len(streams), index.num_replicas)
        self.index = index
        self.on_batch = on_batch  # (replica, seq, batch) after each applied batch
        self.lock = threading.Lock()
        self.next_seq = [0] * len(streams)
        self.replayed = [0] * len(streams)  # batches filled from replay
        self.lost = [0] * len(streams)  # gaps replay could not fill
        self._ctx = ctx or zmq.Context.instance()
        self._streams = streams
        self._subs: list[zmq.Socket] = []
        self._replays: list[zmq.Socket | None] = []
        self._poller = zmq.Poller()
        for stream in streams:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(stream.endpoint)
            self._poller.register(sub, zmq.POLLIN)
            self._subs.append(sub)
            self._replays.append(self._replay_socket(stream))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _replay_socket(self, stream: ReplicaStream) -> zmq.Socket | None:
        if stream.replay is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(stream.replay)
        return sock

    # ---- receiving ------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> int:
        """Receive and apply what arrived within ``timeout_ms``; returns messages handled."""
        handled = 0
        for sock, _ in self._poller.poll(timeout_ms):
            replica = self._subs.index(sock)
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle(replica, frames)
                handled += 1
        return handled

    def handle(self, replica: int, frames: list[bytes]) -> None:
        """Apply one received ``[topic, seq, payload]`` message of ``replica``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            logger.warning("replica %d: malformed KV event message (%d frames)", replica,
                           len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        expected = self.next_seq[replica]
        if seq < expected:
            if seq != 0:
                return  # already applied (delivered by replay first)
            logger.warning("replica %d: KV events restarted at 0; starting over", replica)
            self._resync(replica, 0)
        elif seq > expected:
            self._fill_gap(replica, expected, seq)
        self._apply(replica, seq, frames[2])

    def _fill_gap(self, replica: int, start: int, upto: int) -> None:
        """Apply batches ``start .. upto - 1`` from replay, or give up on the replica."""
        got = self._request_replay(replica, start)
        for seq, payload in got:
            if self.next_seq[replica] <= seq < upto:
                if seq != self.next_seq[replica]:
                    break  # replay no longer holds the batches between
                self._apply(replica, seq, payload)
                self.replayed[replica] += 1
        if self.next_seq[replica] != upto:
            self.lost[replica] += 1
            logger.warning("replica %d: KV event batches %d..%d lost; its cache view is "
                           "reset", replica, self.next_seq[replica], upto - 1)
            self._resync(replica, upto)

    def _request_replay(self, replica: int, start: int) -> list[tuple[int, bytes]]:
        sock = self._replays[replica]
        if sock is None:
            return []
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while sock.poll(REPLAY_TIMEOUT_MS):
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[2] == b"":
                return out  # the end marker (seq -1, empty payload)
            out.append((int.from_bytes(frames[1], "big"), frames[2]))
        logger.warning("replica %d: KV event replay did not finish", replica)
        sock.close(linger=0)  # a late rest of this answer must not pass for the next one
        self._replays[replica] = self._replay_socket(self._streams[replica])
        return out

    def catch_up(self) -> int:
        """Apply, from replay, every batch published since the last one applied (for a
        stream that went quiet right after a lost batch, or a subscriber that joined late,
        before any newer batch shows the gap). Returns the batches applied."""
        applied = 0
        for replica in range(len(self._subs)):
            for seq, payload in self._request_replay(replica, self.next_seq[replica]):
                if seq < self.next_seq[replica]:
                    continue
                if seq > self.next_seq[replica]:  # replay no longer holds the ones between
                    self.lost[replica] += 1
                    self._resync(replica, seq)
                self._apply(replica, seq, payload)
                self.replayed[replica] += 1
                applied += 1
        return applied

    def _apply(self, replica: int, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as e:
            logger.warning("replica %d: undecodable KV event batch %d: %s", replica, seq, e)
            self.lost[replica] += 1
            self._resync(replica, seq + 1)
            return
        with self.lock:
            self.index.apply(replica, batch)
        self.next_seq[replica] = seq + 1
        if self.on_batch is not None:
            self.on_batch(replica, seq, batch)

    def _resync(self, replica: int, next_seq: int) -> None:
        with self.lock:
            self.index.drop_replica(replica)
        self.next_seq[replica] = next_seq

    # ---- thread and shutdown ----------------------------------------------------------------

    def start(self) -> None:
        """Poll in a daemon thread until ``close``."""
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll(50)

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        for sock in [*self._subs, *self._replays]:
            if sock is not None:
                sock.close(linger=0)
