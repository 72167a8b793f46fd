"""Control calls: one message to every live data-parallel replica, their replies gathered.

``get_info``, ``flush_cache`` and ``update_weights_from_disk`` go to each scheduler; the
receive loop hands each reply to the oldest waiter of its type and rank, and a replica that
dies meanwhile is left out (``TokenizerManager.retire_replica``).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.data_parallel.data_parallel_controller import (
    DataParallelController,
    aggregate_infos,
)
from radixlm.runtime.managers.messages import (
    FlushCacheOutput,
    FlushCacheReq,
    GetInfoReq,
    InfoOutput,
    UpdateWeightFromDiskOutput,
    UpdateWeightFromDiskReq,
    encode,
)

CONTROL_TIMEOUT_S = 60.0
# the replies a control call waits for (one deque of waiters per type and rank)
CONTROL_REPLIES = (InfoOutput, FlushCacheOutput, UpdateWeightFromDiskOutput)


class ControlCalls:
    """The control calls of ``TokenizerManager``, which sets the state below in its
    ``__init__``; ``update_weights_from_disk`` writes ``model_path``."""

    dp: DataParallelController
    _waiters: dict[tuple[type, int], collections.deque]  # (reply type, rank) -> futures
    _update_lock: asyncio.Lock  # one weight update at a time
    model_path: str

    async def _call(self, msg: Any, reply_type: type,
                    timeout: float | None = CONTROL_TIMEOUT_S) -> list[Any]:
        """``msg`` to every live replica; their replies in rank order (a replica that dies
        meanwhile is left out; 503 when none is left)."""
        loop = asyncio.get_running_loop()
        futs = []
        data = encode(msg)
        for rank in self.dp.live():
            futs.append(loop.create_future())
            self._waiters[(reply_type, rank)].append(futs[-1])
            self.dp.send_to(rank, data)
        replies = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout)
        ok = [r for r in replies if not isinstance(r, BaseException)]
        if not ok:
            raise ApiError(503, f"every data-parallel replica is dead: {self.dp.dead}",
                           "service_unavailable")
        return ok

    async def get_info(self) -> dict[str, Any]:
        """The server's info; with several replicas, summed over them (``replica_infos``)."""
        return aggregate_infos([o.info for o in await self._call(GetInfoReq(), InfoOutput)])

    async def replica_infos(self) -> list[dict[str, Any]]:
        """Each live replica's info, with its ``dp_rank``."""
        return [{"dp_rank": o.dp_rank, **o.info}
                for o in await self._call(GetInfoReq(), InfoOutput)]

    async def flush_cache(self) -> FlushCacheOutput:
        outs = await self._call(FlushCacheReq(), FlushCacheOutput)
        return FlushCacheOutput(all(o.success for o in outs),
                                "; ".join(o.message for o in outs if o.message))

    async def update_weights_from_disk(self, msg: UpdateWeightFromDiskReq
                                       ) -> UpdateWeightFromDiskOutput:
        """One update at a time. No timeout: without ``abort_all_requests`` the scheduler
        answers once the requests ahead of the update are done (the watchdog covers a
        stuck scheduler)."""
        async with self._update_lock:
            outs = await self._call(msg, UpdateWeightFromDiskOutput, timeout=None)
        out = next((o for o in outs if not o.success), outs[0])
        if out.success:
            self.model_path = msg.model_path
        return out
