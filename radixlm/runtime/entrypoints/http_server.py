"""``radixlm serve``: the HTTP server (FastAPI on uvicorn), in the main process with the
TokenizerManager; ``launch.py`` starts it and its children. SGLang's native routes live
in ``native_api.py``, OpenAI's in ``openai_api.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.auth import ApiKeys, with_api_keys
from radixlm.runtime.entrypoints.child_processes import ChildProcesses
from radixlm.runtime.entrypoints.connections import bounded_protocol, default_max_connections
from radixlm.runtime.entrypoints.http_utils import (
    BodyLimitMiddleware,
    install_error_handlers,
)
from radixlm.runtime.entrypoints.lifecycle import (
    DrainingServer,
    LoopWatchdog,
    scheduler_watchdog,
)
from radixlm.runtime.entrypoints.native_api import NativeRoutes, radixlm_version
from radixlm.runtime.entrypoints.openai.embeddings_api import EmbeddingRoutes
from radixlm.runtime.entrypoints.openai.openai_api import OpenAIRoutes
from radixlm.runtime.entrypoints.openai.responses_api import ResponsesRoutes
from radixlm.runtime.entrypoints.openai.responses_store import ResponseStore
from radixlm.runtime.entrypoints.openapi import openapi_schema
from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import TokenizerManager
from radixlm.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


def create_app(tm: TokenizerManager, args: ServerArgs, pids: dict[str, int | None],
               heartbeat_age: Callable[[], float]) -> Any:
    app = FastAPI(title="radixlm", version=radixlm_version(), docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    install_error_handlers(app)
    NativeRoutes(app, tm, args, pids, heartbeat_age)
    served = args.served_model_name or tm.model_path
    openai_routes = OpenAIRoutes(tm, served)
    app.include_router(openai_routes.router)
    store = ResponseStore(args.max_stored_responses, args.max_stored_response_bytes)
    app.include_router(ResponsesRoutes(openai_routes, store).router)
    EmbeddingRoutes(app, tm, args, openai_routes)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(
                get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    bounded = BodyLimitMiddleware(app, args.max_request_bytes, args.request_read_timeout)
    return with_api_keys(bounded, args)


def serve_http(args: ServerArgs, model_path: str, addr: dict[str, str],
               children: ChildProcesses, sock: socket.socket) -> int:
    """Serve HTTP on ``sock`` once the children (started already) are ready, until
    SIGTERM/SIGINT: 0 after a clean shutdown, 1 when the watchdog found the scheduler
    stuck."""
    ApiKeys.from_args(args)  # a bad key file stops the server (and the children) at once
    tokenizer = load_tokenizer(args.tokenizer_path or model_path)
    return asyncio.run(_serve(args, model_path, tokenizer, addr, children, sock))


async def _serve(
    args: ServerArgs,
    model_path: str,
    tokenizer: Any,
    addr: dict[str, str],
    children: ChildProcesses,
    sock: socket.socket,
) -> int:
    sched_addrs = [addr[children.scheduler_name(r)] for r in range(args.dp_size)]
    tm = TokenizerManager(args, model_path, tokenizer, sched_addrs, addr["tm"])
    await tm.wait_ready(STARTUP_TIMEOUT_S, children.alive)
    loop = asyncio.get_running_loop()
    children.watch(lambda rank, why: loop.call_soon_threadsafe(tm.retire_replica, rank, why))
    info, minfo = tm.server_info, tm.model_info
    logger.info(
        "model %s: dtype %s on %s, context length %d",
        tm.model_path,
        minfo["dtype"],
        minfo["device"],
        info["context_length"],
    )
    logger.info(
        "KV pool: %d tokens (page size %d); up to %d running requests",
        info["max_total_num_tokens"],
        info["page_size"],
        info["max_running_requests"],
    )
    tm.start()
    app = create_app(tm, args, children.pids(), children.heartbeat_age)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        http=bounded_protocol(args.timeout_header_read,
                              args.max_connections or default_max_connections()),
    )
    server = DrainingServer(config, tm, args.shutdown_timeout)

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        logger.info(
            "ready: http://%s:%d (pids %s)",
            args.host,
            args.port,
            json.dumps({"main": os.getpid(), **children.pids()}),
        )

    tasks = [loop.create_task(announce()),
             loop.create_task(scheduler_watchdog(tm, server, children, args.watchdog_timeout)),
             loop.create_task(LoopWatchdog(args.watchdog_timeout).beat())]
    await server.serve(sockets=[sock])
    for task in tasks:
        task.cancel()
    tm.close()
    return 1 if children.stalled else 0
