"""``Runtime``: ``radixlm serve`` in a subprocess, shaped as SGLang's ``sgl.Runtime``.

Programs run on its ``endpoint`` (a ``RuntimeEndpoint``); wherever a backend is taken
(``set_default_backend``, ``run(backend=...)``), the Runtime itself may be passed, as in
SGLang. Its own methods are SGLang's direct calls to the server: ``generate`` (the
``/generate`` response as a JSON string), ``async_generate`` / ``add_request`` (streamed
text pieces), ``get_tokenizer``, ``get_server_info``, ``cache_prefix``, ``shutdown``.
Keyword arguments are server flags: ``Runtime(page_size=4, max_total_tokens=8192)``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from radixlm.frontend_dsl.backends.base import BackendError
from radixlm.frontend_dsl.backends.http import RuntimeEndpoint


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runtime:
    """Starts ``radixlm serve`` and waits for ``/health``; ``shutdown()`` stops it."""

    def __init__(
        self,
        model_path: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        launch_timeout: float = 300.0,
        log_level: str = "error",
        **server_args: Any,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.generate_url = self.url + "/generate"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "radixlm.launch_server", "--host", host,
               "--port", str(self.port)]
        if model_path:
            cmd += ["--model-path", model_path]
        if api_key:
            cmd += ["--api-key", api_key]
        cmd += ["--log-level", log_level, *_flags(server_args)]
        # a file, not a pipe: a chatty server must never block on a full pipe buffer
        self._log = tempfile.TemporaryFile()
        self.process: subprocess.Popen | None = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.process.pid
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
        try:
            self._wait_healthy(launch_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise BackendError(
                    f"radixlm serve exited with code {self.process.returncode}:\n{err[-2000:]}")
            try:
                if self.endpoint.client.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"radixlm serve did not become healthy within {timeout} s")

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # --- SGLang's direct calls ----------------------------------------------------------------
    def generate(self, prompt: str | list[str], sampling_params: dict | None = None,
                 return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None,
                 lora_path: list[str | None] | None = None,
                 session_id: str | None = None) -> str:
        """``/generate``'s JSON response, as a string (SGLang returns ``json.dumps``)."""
        body = {"text": prompt, "sampling_params": sampling_params,
                "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num, "lora_path": lora_path,
                "session_id": session_id}
        body = {k: v for k, v in body.items() if v is not None}
        resp = httpx.post(self.generate_url, json=body, headers=self._headers,
                          timeout=self.endpoint.timeout)
        return json.dumps(resp.json())

    async def async_generate(self, prompt: str, sampling_params: dict | None = None,
                             session_id: str | None = None) -> AsyncIterator[str]:
        """The generated text in pieces as the server streams them."""
        body = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        if session_id is not None:
            body["session_id"] = session_id
        pos = 0
        async with httpx.AsyncClient(timeout=self.endpoint.timeout,
                                     headers=self._headers) as client:
            async with client.stream("POST", self.generate_url, json=body) as resp:
                if resp.status_code != 200:
                    raise BackendError(f"/generate: {resp.status_code} "
                                       f"{(await resp.aread()).decode(errors='replace')}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    piece = data.get("text", "")[pos:]
                    pos += len(piece)
                    if piece:
                        yield piece

    add_request = async_generate

    def encode(self, prompt: Any) -> str:
        raise NotImplementedError("Runtime.encode: radixlm serves generative models; the "
                                  "embedding route /encode is not supported")

    async def get_server_info(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30, headers=self._headers) as client:
            resp = await client.get(self.url + "/server_info")
        if resp.status_code != 200:
            raise RuntimeError(f"Failed to get server info. {resp.text}")
        return resp.json()

    def get_tokenizer(self):
        """The served model's tokenizer (transformers), from the path the server reports."""
        from transformers import AutoTokenizer

        info = self.endpoint._call("GET", "/get_model_info")
        return AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def start_profile(self) -> None:
        raise NotImplementedError("start_profile: radixlm serve has no profiling route")

    stop_profile = start_profile

    def shutdown(self) -> None:
        self.endpoint.shutdown()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        self._log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _flags(server_args: dict[str, Any]) -> list[str]:
    out = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value not in (False, None):
            out += [flag, str(value)]
    return out
