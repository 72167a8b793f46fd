"""What a PD router does, by hand: the same body to a prefill and a decode server."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from radixlm.runtime.disaggregation.auth import SECRET_FLAG, write_secret


def secret_flags(d: Path) -> list[str]:
    """A fresh key in ``d`` and the flag that gives it to a PD server."""
    path = d / "pd-secret"
    if not path.exists():
        write_secret(str(path))
    return [SECRET_FLAG, str(path)]


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


def both(prefill: str, dec: str, body: dict) -> httpx.Response:
    """``body`` to both servers at once (the prefill's answer must be a 200); the decode's
    answer."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(p=post(prefill, body)))
    t.start()
    answer = post(dec, body)
    t.join(timeout=120)
    assert out["p"].status_code == 200, out["p"].text
    return answer
