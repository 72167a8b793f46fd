"""LoopWatchdog: a server process whose event loop stops turning ends itself (a blocked
loop runs no signal handler, answers no /health), and a turning one is left alone."""

from __future__ import annotations

import asyncio
import threading

from radixlm.runtime.entrypoints.lifecycle import LoopWatchdog


def test_a_blocked_loop_is_ended():
    stuck = threading.Event()
    watchdog = LoopWatchdog(0.4, on_stuck=stuck.set)

    async def main() -> None:
        beat = asyncio.ensure_future(watchdog.beat())
        await asyncio.sleep(0.1)
        stuck.wait(60)  # the injected hang: the loop's thread blocks until the watchdog fires
        beat.cancel()

    asyncio.run(main())
    assert stuck.is_set()


def test_a_turning_loop_is_left_alone():
    stuck = threading.Event()
    watchdog = LoopWatchdog(10.0, on_stuck=stuck.set)

    async def main() -> None:
        beat = asyncio.ensure_future(watchdog.beat())
        for _ in range(30):  # 1.5 s of short steps: the heartbeat keeps up
            await asyncio.sleep(0.05)
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)

    asyncio.run(main())
    assert not stuck.is_set() and watchdog._stop.is_set()
