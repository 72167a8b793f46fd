"""The HTTP backend: a radixlm (or SGLang) server through its native API.

``RuntimeEndpoint(base_url, api_key=None)`` talks to a running server (``Runtime``, in
``runtime.py``, starts one). The chat template comes from ``GET /get_model_info`` (field
``chat_template``, the Jinja source); without it a named template is used.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.frontend_dsl.backends.base import BackendError, NativeBackend
from radixlm.frontend_dsl.chat_template import ChatTemplate, resolve_chat_template
from radixlm.frontend_dsl.tools import check_parser_name, template_messages

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class RuntimeEndpoint(NativeBackend):
    """A radixlm / SGLang server at ``base_url`` (``http://host:port``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: str | bool | None = None,
        chat_template_name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        tool_call_parser: str | None = None,
    ) -> None:
        """SGLang's arguments: ``verify`` is TLS verification (a CA bundle path, or False);
        ``chat_template_name`` picks a named template (``chatml``, ``default``, ...)
        instead of the model's own. ``timeout`` (radixlm's) bounds each HTTP call;
        ``tool_call_parser`` (radixlm's) names the format ``gen(tool_choice="auto")``
        reads, by default the server's ``--tool-call-parser`` (``/get_server_info``)."""
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            verify=True if verify is None else verify,
            limits=httpx.Limits(max_connections=256),
        )
        self.timeout = timeout
        self._chat_template_name = chat_template_name
        self._chat_template: ChatTemplate | None = None
        self._model_info: dict[str, Any] | None = None
        self._tool_call_parser = check_parser_name(tool_call_parser)

    # --- plumbing ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        try:
            resp = self.client.request(method, path, json=body, timeout=self._timeout(timeout))
        except httpx.TimeoutException as e:
            raise TimeoutError(f"{method} {self.base_url}{path} timed out: {e}") from e
        except httpx.HTTPError as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {e!r}") from e
        if resp.status_code != 200:
            raise BackendError(
                f"{method} {self.base_url}{path} returned HTTP "
                f"{resp.status_code}: {resp.text[:500]}"
            )
        return resp.json() if resp.content else None

    def _timeout(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.timeout
        return timeout if self.timeout is None else min(timeout, self.timeout)

    def request(self, payload: dict[str, Any], timeout: float | None = None) -> Any:
        return self._call("POST", "/generate", payload, timeout)

    def request_stream(
        self, payload: dict[str, Any], timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """SSE ``data: {...}`` chunks carry the cumulative text; yield increments."""
        sent = 0
        try:
            with self.client.stream(
                "POST",
                "/generate",
                json={**payload, "stream": True},
                timeout=self._timeout(timeout),
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise BackendError(
                        f"POST {self.base_url}/generate returned HTTP "
                        f"{resp.status_code}: {resp.text[:500]}"
                    )
                for chunk in _sse_chunks(resp.iter_lines()):
                    text = chunk.get("text", "")
                    yield {**chunk, "text": text[sent:]}
                    sent = len(text)
        except httpx.TimeoutException as e:
            raise TimeoutError(f"streaming from {self.base_url}/generate timed out") from e
        except httpx.HTTPError as e:
            raise BackendError(f"streaming from {self.base_url}/generate failed: {e!r}") from e

    # --- backend API --------------------------------------------------------------------------
    def get_model_info(self) -> dict[str, Any]:
        if self._model_info is None:
            self._model_info = self._call("GET", "/get_model_info")
        return self._model_info

    def get_model_name(self) -> str:
        return self.get_model_info()["model_path"]

    def get_chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            source = None
            info: dict[str, Any] = {}
            if not self._chat_template_name:
                info = self.get_model_info()
                source = info.get("chat_template")
            self._chat_template = resolve_chat_template(
                source,
                info.get("model_path"),
                info.get("bos_token") or "",
                info.get("eos_token") or "",
                fallback=self._chat_template_name,
            )
        return self._chat_template

    def tool_call_parser(self) -> str | None:
        if self._tool_call_parser is None:
            self._tool_call_parser = check_parser_name(
                self.get_server_info().get("tool_call_parser"))
        return self._tool_call_parser

    def render_chat(self, messages, tools, add_generation_prompt):
        """The served model's Jinja template (``/get_model_info``), rendered by
        transformers' own renderer, as the server's chat route renders it."""
        info = self.get_model_info()
        source = info.get("chat_template")
        if not source:
            raise ValueError("gen(tools=...) needs the served model's own chat template; "
                             "/get_model_info reports none")
        # transformers is heavy and only this path needs it
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                [template_messages(messages)], tools=tools, chat_template=source,
                add_generation_prompt=add_generation_prompt,
                bos_token=info.get("bos_token") or "", eos_token=info.get("eos_token") or "")
        except Exception as e:  # noqa: BLE001 - a template error comes from the program
            raise ValueError(f"the model's chat template failed on this conversation: {e}"
                             ) from e
        return rendered[0]

    def abort(self, rid: str) -> None:
        try:
            self.client.post("/abort_request", json={"rid": rid}, timeout=5.0)
        except httpx.HTTPError:
            logger.debug("abort of %s failed", rid, exc_info=True)

    def flush_cache(self) -> bool:
        """True when the server flushed (SGLang answers in plain text, 200 or 400)."""
        try:
            resp = self.client.post("/flush_cache", timeout=self._timeout(None))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_server_info")

    def shutdown(self) -> None:
        self.client.close()


def _sse_chunks(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise BackendError(f"the server reported an error mid-stream: {chunk['error']}")
        yield chunk
