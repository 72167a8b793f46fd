"""``radixlm serve``'s start: the children first, then the HTTP server's own imports.

The main process runs HTTP and the TokenizerManager (``http_server.py``); the scheduler
and the detokenizer run in ``spawn``ed children, linked by zmq PUSH/PULL over ipc sockets
in a private 0700 directory. Every process imports torch (transformers' tokenizers and
xgrammar do), seconds of a core each: this module imports nothing heavy, so the children
start at once and import while this process does, the HTTP stack is imported only after
they started.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.child_processes import (
    DETOKENIZER_ENTRY,
    SCHEDULER_ENTRY,
    ChildProcesses,
)
from radixlm.runtime.entrypoints.listener import bind_listener
from radixlm.runtime.model_dir import ModelDirError, check_model_dir
from radixlm.runtime.tokenizer import gguf_served_name, resolve_model_path

logger = logging.getLogger(__name__)


def launch_server(args: ServerArgs, sock: socket.socket | None = None) -> int:
    """Start the processes and serve until SIGTERM/SIGINT: 0 after a clean shutdown, 1
    when the watchdog found the scheduler stuck. ``sock``: the port, bound already
    (``listener.bind_listener``; the command line binds it before its imports)."""
    try:
        model_path = resolve_model_path(args.model_path, args.load_format)
        check_model_dir(model_path, args.tokenizer_path)
        if args.served_model_name is None:  # a GGUF file serves under its own name
            name = gguf_served_name(args.model_path, model_path)
            args = dataclasses.replace(args, served_model_name=name) if name else args
    except ModelDirError as e:  # one line and exit 1, before any child starts (as listener.py)
        raise SystemExit(f"radixlm serve: {e}") from None
    if args.node_rank > 0:  # --nnodes: this machine runs only its tensor-parallel ranks
        from radixlm.runtime.managers.scheduler.tp_ranks import serve_node

        return serve_node(args, model_path)
    sock = sock or bind_listener(args.host, args.port)
    children = ChildProcesses(args.dp_size)
    names = [children.scheduler_name(r) for r in range(args.dp_size)]
    addr = {name: children.address(name) for name in (*names, "detokenizer", "tm")}
    try:
        children.start("detokenizer", DETOKENIZER_ENTRY, args.tokenizer_path or model_path,
                       addr["detokenizer"], addr["tm"], os.getpid(), args.log_level)
        for rank, name in enumerate(names):
            children.start(name, SCHEDULER_ENTRY, json.dumps(dataclasses.asdict(args)),
                           model_path, addr[name], addr["detokenizer"], os.getpid(),
                           children.heartbeats[rank], rank)
        # while the children import and load the model
        from radixlm.runtime.entrypoints.http_server import serve_http

        code = serve_http(args, model_path, addr, children, sock)
    finally:
        children.stop(timeout=10.0 if not children.stalled else 0.0)
        sock.close()
    logger.info("server stopped")
    return code
