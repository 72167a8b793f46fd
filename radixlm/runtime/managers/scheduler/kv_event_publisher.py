"""KVEventPublisher: a scheduler's KV events on a zmq PUB socket, as vLLM publishes them.

The scheduler hands over one ``KVEventBatch`` per step (``publish`` never blocks: it
numbers the batch and queues it); a background thread encodes and sends it::

    PUB    [topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]   seq = 0, 1, 2, ...
    ROUTER request  [identity, b"", start_seq (8 bytes)]             (a REQ or DEALER peer)
           replies  [identity, b"", seq, payload] for each kept batch with seq >= start_seq,
                    then [identity, b"", -1 (8 bytes, signed), b""]

That is vLLM's ``ZmqEventPublisher`` protocol. The last ``buffer_steps`` batches are kept
for replay. A batch that finds the queue full (``max_queue_size``; the sender thread is
that far behind) is dropped with a warning, after it got its number: subscribers see the
gap, and replay cannot fill it, so they know their view of this replica is stale.

Endpoints: a tcp address on a wildcard (``*``, ``0.0.0.0``, ``::``) or loopback host,
``ipc://`` and ``inproc://`` are bound, any other host is connected to (vLLM's rule);
``bind`` in the config overrides it. Replica ``dp_rank`` adds its rank to the port.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from radixlm.radix_cache.kv_events import KVEventBatch
from radixlm.runtime.kv_events_config import KVEventsConfig
from radixlm.runtime.managers.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_BIND_HOSTS = ("*", "0.0.0.0", "::", "[::]", "localhost", "[::1]", "::1")
# the largest frame a peer may send: a replay request's frames are an empty delimiter and an
# 8-byte seq; a subscriber's, a subscription (its topic); bigger drops the connection
REPLAY_REQUEST_MAX_BYTES = 64
SUBSCRIPTION_MAX_BYTES = 64 << 10
_IDLE_WAIT_S = 0.01  # how long the sender waits for a batch before it looks at replay


def endpoint_for_rank(endpoint: str, dp_rank: int) -> str:
    """vLLM's offset: ``tcp://host:port`` -> port + rank; other schemes get ``_dp{rank}``."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def should_bind(endpoint: str, bind: bool | None) -> bool:
    if bind is not None:
        return bind
    if not endpoint.startswith("tcp://"):
        return True  # ipc://, inproc://
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host in _BIND_HOSTS or host.startswith("127.")


class KVEventPublisher:
    """PUB + ROUTER sockets and the thread that serves them (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0,
                 ctx: zmq.Context | None = None) -> None:
        self.dp_rank = dp_rank
        self.endpoint = endpoint_for_rank(config.endpoint, dp_rank)
        self.replay_endpoint = (None if config.replay_endpoint is None
                                else endpoint_for_rank(config.replay_endpoint, dp_rank))
        self.topic = config.topic.encode()
        self.dropped = 0  # batches lost to a full queue
        self.next_seq = 0  # the number the next batch gets
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._ctx = ctx or zmq.Context.instance()
        # sockets are made (and bound: an address in use fails the start) here, then used
        # only by the sender thread
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if should_bind(self.endpoint, config.bind):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_MAX_BYTES)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"kv_events_config: cannot open {self.endpoint} / "
                               f"{self.replay_endpoint}: {e}") from e
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}",
                                        daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay: %s)", self.endpoint,
                    self.replay_endpoint)

    def publish(self, batch: KVEventBatch) -> int:
        """Number ``batch`` and queue it for sending; returns its sequence number."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.dp_rank
        seq = next(self._seq)
        self.next_seq = seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            logger.warning("KV event queue full: batch %d dropped (%d so far)", seq,
                           self.dropped)
        return seq

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread, close sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV event sender did not stop within %.1fs", timeout)
            return  # closing its sockets under it would crash it; it is a daemon
        self._close_sockets()

    # ---- the sender thread ----------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_WAIT_S if self._replay else 0.1)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                seq, batch = item
                payload = encoder.encode(batch)
                try:
                    self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                except zmq.ZMQError:
                    logger.exception("KV event batch %d not sent", seq)
                self._buffer.append((seq, payload))
            while self._replay is not None and self._replay.poll(0):
                self._serve_replay()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)


def attach_publisher(scheduler: Scheduler, dp_rank: int = 0) -> KVEventPublisher | None:
    """Publish ``scheduler``'s KV events when its ``--kv-events-config`` says so."""
    config = scheduler.args.kv_events()
    if config is None:
        return None
    publisher = KVEventPublisher(config, dp_rank)
    scheduler.kv_event_sinks.append(publisher.publish)
    return publisher
