"""Tensor-parallel process groups: which rank this process is, how many there are, and the
collectives the parallel layers and the step broadcast use.

``init_tp`` joins a group (once per process: torch.distributed has one default group).
The parallel layers read the group they belong to when they are constructed, from
``get_tp_group()``: the group ``building_with(tp)`` names while a model is built
(``models.load_model``), else rank 0 of 1, whose collectives are the identity. So a
single-rank model built in a process that also leads a tensor-parallel group stays
single-rank.

Two groups over the same ranks:

- ``device_group``: the model's tensors (NCCL on CUDA, gloo on a CPU). Its timeout bounds
  every collective of a forward: a rank that died or hangs makes the others raise.
- ``cpu_group``: gloo, for what rank 0 tells the others each step (msgspec bytes). A
  follower waits there while rank 0 is idle, so its timeout is long; a dead rank 0 shows
  as a closed connection (or, on one machine, the parent-death signal).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# how long a follower may wait for rank 0's next step (rank 0 may idle for days)
IDLE_WAIT = timedelta(days=30)
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TpGroup:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    timeout_s: float = 0.0  # how long rank 0 waits for the others to take a step

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (sizes every rank must agree on)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' ``x`` concatenated along the last dimension; other ranks
        get an empty ``[..., 0]`` tensor (only rank 0 samples)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.device_group)
            return x.new_empty(*x.shape[:-1], 0)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's ``x`` (the same shape on all), in rank order; the others
        get None. Over the CPU group (``x`` on the CPU)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.cpu_group)
        return parts

    def scatter_from_first(self, parts: list[torch.Tensor] | None,
                           like: torch.Tensor) -> torch.Tensor:
        """Rank r gets rank 0's ``parts[r]`` (each shaped as ``like``), over the CPU group."""
        out = torch.empty_like(like)
        dist.scatter(out, parts if self.rank == 0 else None, src=0, group=self.cpu_group)
        return out

    def broadcast_bytes(self, data: bytes | None = None) -> bytes:
        """Rank 0 sends ``data`` (non-empty), the others receive it: the length first,
        then the bytes as a uint8 tensor, over the CPU group."""
        assert self.size > 1, "broadcast_bytes needs more than one rank"
        length = torch.tensor([len(data) if self.rank == 0 and data else 0], dtype=torch.int64)
        self._broadcast(length)
        if self.rank == 0:
            assert data, "rank 0 broadcasts a non-empty message"
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(buf)
        return data if self.rank == 0 else buf.numpy().tobytes()

    def _broadcast(self, t: torch.Tensor) -> None:
        """Followers wait as long as rank 0 idles; rank 0 waits at most ``timeout_s`` for
        them to take the message (a hung rank raises here)."""
        work = dist.broadcast(t, src=0, group=self.cpu_group, async_op=True)
        if self.rank == 0:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        else:
            work.wait()


_TP = TpGroup()  # the group of the model being built (building_with)


def get_tp_group() -> TpGroup:
    """The group of the model being built; rank 0 of 1 outside ``building_with``."""
    return _TP


@contextlib.contextmanager
def building_with(tp: TpGroup) -> Iterator[None]:
    """Layers constructed inside belong to ``tp``."""
    global _TP
    old, _TP = _TP, tp
    try:
        yield
    finally:
        _TP = old


def init_tp(rank: int, size: int, init_addr: str, device: torch.device,
            timeout_s: float) -> TpGroup:
    """Join the ``size`` ranks that meet at ``init_addr`` (``host:port``; rank 0 listens
    there). Blocks until every rank has joined (at most ``STARTUP_TIMEOUT_S``, or
    ``timeout_s`` if longer); ``timeout_s`` then bounds every collective of a forward."""
    assert not dist.is_initialized(), "one tensor-parallel group per process at a time"
    backend = "nccl" if device.type == "cuda" else "gloo"
    ranks = list(range(size))
    # joining waits for the slowest rank to import torch and build its model slice
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank,
                            world_size=size,
                            timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))
    device_group = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s))
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=IDLE_WAIT)
    return TpGroup(rank, size, device_group, cpu_group, timeout_s)


def destroy_tp() -> None:
    """Leave the group (shutdown); ``init_tp`` may be called again."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1 for rank 0 to listen on (single-machine groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
