"""The tensor-parallel ranks of one replica, other than rank 0: start, watch, stop.

Rank 0 is the scheduler (the server's scheduler process, or the Engine's caller). Before
it builds its model it calls ``start_tp_ranks``, which starts this machine's other ranks
as ``python -c "...tp_ranks import main; main()"`` processes (plain subprocesses: a
daemonic scheduler process may not have multiprocessing children). Each builds its own
slice of the model, joins the group and runs ``tp_worker.run_follower``.

Failure is bounded: a rank that exits is seen by ``TpRanks.watch`` within
``WATCH_INTERVAL_S`` (the scheduler process then exits, and the server with it; the Engine
fails its requests); a rank that hangs makes rank 0's next collective fail after
``--dist-timeout``. A rank dies with its parent (``PR_SET_PDEATHSIG``), and ``stop`` kills
whoever has not left after rank 0's shutdown step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed.layers import check_tp_split
from radixlm.runtime.distributed.parallel_state import free_loopback_port
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.tp_worker import run_follower
from radixlm.runtime.managers.child_setup import setup_child
from radixlm.runtime.managers.data_parallel.data_parallel_controller import replica_args
from radixlm.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
# a follower's command (``-c``: radixlm's package imports this module, so ``-m`` would
# import it twice)
_FOLLOWER_MAIN = "from radixlm.runtime.managers.scheduler.tp_ranks import main; main()"


def ranks_of_node(args: ServerArgs) -> list[int]:
    """The global ranks that run on this machine (``--node-rank`` of ``--nnodes``)."""
    per_node = args.tp_size // args.nnodes
    return list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))


def threads_per_rank(args: ServerArgs) -> int:
    """CPU threads each rank of this machine gets: the scheduler's share, split."""
    return max(args.resolve_cpu_threads() // len(ranks_of_node(args)), 1)


class TpRanks:
    """This machine's follower ranks (processes) of one tensor-parallel group."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs
        self.stopping = False

    def exited(self) -> str | None:
        """Why the group is broken (a rank that exited), or None."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")
        return None

    def watch(self, on_exit: Callable[[str], None] | None = None) -> None:
        """Call ``on_exit(why)`` (default: log and exit this process with code 1) from a
        thread as soon as a rank exits while not stopping."""
        threading.Thread(target=self._watch, args=(on_exit or _exit_process,),
                         name="radixlm-tp-watch", daemon=True).start()

    def _watch(self, on_exit: Callable[[str], None]) -> None:
        while not self.stopping:
            why = self.exited()
            if why is not None and not self.stopping:
                self.kill()
                on_exit(why)
                return
            time.sleep(WATCH_INTERVAL_S)

    def stop(self, runner: ModelRunner | None, timeout: float = 10.0) -> None:
        """Rank 0's shutdown step (if ``runner`` still leads a group), then wait for the
        ranks to leave; whoever is still there after ``timeout`` is killed."""
        self.stopping = True
        if runner is not None:
            broken = runner.tp_broken or self.exited() is not None
            try:
                runner.shutdown_tp(notify=not broken)
            except Exception as e:  # noqa: BLE001 - a broken group: the kill below ends it
                logger.error("tensor-parallel shutdown step failed: %s", e)
                broken = True
            if broken:  # a hung rank would never leave by itself
                self.kill()
                return
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


def _exit_process(why: str) -> None:
    logger.error("%s; shutting down", why)
    os._exit(1)


def start_tp_ranks(args: ServerArgs, model_path: str) -> tuple[ServerArgs, TpRanks | None]:
    """Start this machine's ranks other than 0 (all of them on a machine with
    ``node_rank > 0``). Returns the args every rank uses (``dist_init_addr`` filled in)
    and the ranks' handle; ``(args, None)`` at tp_size 1. Refuses a model that does not
    split before starting anything."""
    if args.tp_size == 1:
        return args, None
    check_tp_split(ModelConfig.from_hf(model_path), args.tp_size)
    if args.dist_init_addr is None:
        args = dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{free_loopback_port()}")
    if args.device in ("auto", "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(threads_per_rank(args))
    args_json = json.dumps(dataclasses.asdict(args))
    procs: dict[int, subprocess.Popen] = {}
    for rank in ranks_of_node(args):
        if rank == 0:
            continue
        cmd = [sys.executable, "-c", _FOLLOWER_MAIN, "--rank", str(rank),
               "--model-path", model_path, "--parent-pid", str(os.getpid()),
               "--args-json", args_json]
        procs[rank] = subprocess.Popen(cmd)
    logger.info("started tensor-parallel ranks %s (pids %s), meeting at %s", list(procs),
                [p.pid for p in procs.values()], args.dist_init_addr)
    return args, TpRanks(procs)


def run_tp_rank(args: ServerArgs, model_path: str, rank: int) -> None:
    """A follower rank: its slice of the model, then rank 0's steps until shutdown."""
    runner = ModelRunner(args, model_path, tp_rank=rank)
    logger.info("rank %d ready: %d parameter bytes", rank,
                sum(p.numel() * p.element_size() for p in runner.model.parameters()))
    try:
        with torch.inference_mode():
            run_follower(runner, runner.tp)
    finally:
        runner.shutdown_tp()


def serve_node(args: ServerArgs, model_path: str) -> int:
    """``radixlm serve --node-rank k`` (k > 0): run this machine's ranks of every replica
    (``--dp-size``; replica r meets at ``replica_args``'s address) until they end; the exit
    code is 1 if any failed."""
    groups: list[TpRanks] = []
    try:
        for dp_rank in range(args.dp_size):
            _, ranks = start_tp_ranks(replica_args(args, dp_rank), model_path)
            assert ranks is not None, "serve_node needs tp_size > 1"
            groups.append(ranks)
        codes = [proc.wait() for ranks in groups for proc in ranks.procs.values()]
    finally:
        for ranks in groups:
            ranks.kill()
    return 1 if any(codes) else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one tensor-parallel rank (started by rank 0)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--args-json", required=True)
    ns = ap.parse_args(argv)
    args = ServerArgs(**json.loads(ns.args_json))
    setup_child(f"tp-rank-{ns.rank}", ns.parent_pid, args.log_level)
    torch.set_num_threads(threads_per_rank(args))
    run_tp_rank(args, ns.model_path, ns.rank)
