"""--max-queued-requests with --enable-priority-scheduling over HTTP: the front end lets
requests through to the scheduler, which drops the least urgent queued one for a more
urgent arrival (a 503 naming the flag, for the dropped request) or refuses the arrival."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess

FLAGS = ["--max-total-tokens", "8192", "--log-level", "warning", "--max-running-requests",
         "1", "--max-queued-requests", "1", "--enable-priority-scheduling"]


@pytest.fixture(scope="module")
def server(module_server) -> ServerProcess:
    return module_server(FLAGS, "queue_priority")


def _wait_load(srv: ServerProcess, running: int, waiting: int) -> None:
    deadline, load = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        load = httpx.get(srv.url + "/v1/loads").json()["loads"][0]
        if (load["num_running_reqs"], load["num_waiting_reqs"]) == (running, waiting):
            return
        time.sleep(0.02)
    raise AssertionError(f"never {running} running and {waiting} waiting: {load}")


def test_more_urgent_request_takes_the_queued_place(server):
    def gen(rid: str, priority: int, max_new_tokens: int) -> httpx.Response:
        return httpx.post(server.url + "/generate", timeout=120, json={
            "rid": rid, "text": f"request {rid}", "priority": priority,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}})

    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(gen, "long", 0, 400)
        _wait_load(server, 1, 0)
        low = pool.submit(gen, "low", 1, 4)
        _wait_load(server, 1, 1)
        high = pool.submit(gen, "high", 9, 4)
        resp = low.result(60)
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert "more urgent" in message and "--max-queued-requests" in message
        _wait_load(server, 1, 1)  # the urgent one holds the queue's place
        tie = gen("tie", 9, 4)  # only as urgent as the queued one: refused
        assert tie.status_code == 503, tie.text
        assert "queue is full" in tie.json()["error"]["message"]
        httpx.post(server.url + "/abort_request", json={"rid": "long"})
        assert high.result(60).status_code == 200
        assert running.result(60).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert gen("after", 0, 2).status_code == 200
