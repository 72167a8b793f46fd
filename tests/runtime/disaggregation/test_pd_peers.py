"""Trusted PD peers, end to end: a process posing as a prefill server (plain zmq, the wire
format, no secret) cannot put KV into a decode server's cache, and a request naming a
bootstrap_host off ``--disaggregation-trusted-hosts`` is a 403 before anything connects."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import zmq

from radixlm.runtime.disaggregation.wire import (
    Claim,
    KVChunk,
    KVLayout,
    RouteInfo,
    RouteQuery,
    decode,
    encode,
)

FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--page-size", "4",
         "--chunked-prefill-size", "64", "--cpu-threads", "1", "--random-seed", "0"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
SYSTEM = " ".join(f"You are the assistant of bank {i % 11}, rule {i}." for i in range(20))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pd_cluster):
    pd = ["--disaggregation-bootstrap-timeout", "4", "--disaggregation-waiting-timeout", "8"]
    with pd_cluster(tmp_path_factory.mktemp("pd-peers"), FLAGS, pd,
                    ["--disaggregation-trusted-hosts", "127.0.0.1"]) as servers:
        yield servers


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


class ForeignPrefill:
    """A "prefill server" without the secret: plain zmq ROUTERs answering the wire format
    and pushing KV of its choosing (all 0x3c bytes) for every claim. ``heard`` lists the
    messages it received. Its layout: whatever the genuine prefill's bootstrap service
    answers a plain RouteQuery (nothing, once PD sockets need the secret)."""

    def __init__(self, ctx: zmq.Context, genuine_bport: int) -> None:
        self.ctx, self.heard = ctx, []
        self.layout = self._ask_layout(genuine_bport) or KVLayout(1, 1, 1, "float32", 4)
        self.boot, self.xfer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        self.port = self.boot.bind_to_random_port("tcp://127.0.0.1")
        self.xport = self.xfer.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _ask_layout(self, port: int) -> KVLayout | None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(encode(RouteQuery()))
        info = decode(sock.recv()) if sock.poll(3000) else None
        sock.close()
        return info.layout if isinstance(info, RouteInfo) else None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.boot, zmq.POLLIN)
        poller.register(self.xfer, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                ident, meta, *_ = sock.recv_multipart()
                msg = decode(meta)
                self.heard.append(msg)
                if isinstance(msg, RouteQuery):
                    sock.send_multipart([ident, encode(RouteInfo([self.xport], self.layout))])
                elif isinstance(msg, Claim):
                    self._push(ident, msg)

    def _push(self, ident: bytes, claim: Claim) -> None:
        lay = self.layout
        size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(lay.dtype, 1)
        frame = b"\x3c" * (claim.num_tokens * lay.num_kv_heads * lay.head_dim * size)
        head = KVChunk(claim.room, 0, claim.num_tokens, True, first_token=7)
        self.xfer.send_multipart([ident, encode(head), *[frame] * (2 * lay.num_layers)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.boot.close(linger=0)
        self.xfer.close(linger=0)


def test_foreign_prefill_cannot_poison_the_decode_cache(cluster):
    """The foreign "prefill" is named by a request: the decode server's handshake fails,
    the foreign process hears nothing, the request fails (bootstrap timeout); the next
    genuine request with that prompt reuses nothing and its greedy output equals a single
    server's."""
    mono, _, dec, router, bport = cluster
    ctx = zmq.Context()
    fake = ForeignPrefill(ctx, bport)
    try:
        r = generate(dec.url, text=SYSTEM, sampling_params=GREEDY, bootstrap_host="127.0.0.1",
                     bootstrap_port=fake.port, bootstrap_room=31)
        assert r.status_code == 503, r.text
        assert fake.heard == []
    finally:
        fake.close()
        ctx.destroy(linger=0)
    want = generate(mono.url, text=SYSTEM, sampling_params=GREEDY).json()
    got = generate(router, text=SYSTEM, sampling_params=GREEDY).json()
    assert got["meta_info"]["cached_tokens"] == 0, got["meta_info"]
    assert got["output_ids"] == want["output_ids"]


def test_untrusted_bootstrap_host_is_403_before_connecting(cluster):
    """The decode server trusts 127.0.0.1 only: "localhost" (same machine, another name)
    is refused with OpenAI's error shape naming the flag, and the listening socket it
    names never sees a connection."""
    _, _, dec, _, _ = cluster
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(2.0)
        r = generate(dec.url, text="hi", sampling_params=GREEDY, bootstrap_host="localhost",
                     bootstrap_port=listener.getsockname()[1], bootstrap_room=41)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["param"] == "bootstrap_host"
        assert "--disaggregation-trusted-hosts" in err["message"]
        with pytest.raises(TimeoutError):
            listener.accept()


def test_trusted_host_goes_through(cluster):
    mono, prefill, dec, _, bport = cluster
    body = {"text": "The capital of France is", "sampling_params": GREEDY,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": 51}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(p=generate(prefill.url, **body)))
    t.start()
    got = generate(dec.url, **body)
    t.join(timeout=120)
    want = generate(mono.url, text=body["text"], sampling_params=GREEDY).json()
    assert got.status_code == 200 and out["p"].status_code == 200, (got.text, out["p"].text)
    assert got.json()["output_ids"] == want["output_ids"]
