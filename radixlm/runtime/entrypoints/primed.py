"""Streams whose status is known before it is sent: every request of a streamed response
has produced its first output (or failed) before the response starts.

A request can fail in the scheduler before it produces anything (a grammar that does not
compile, a schema keyword no backend supports): ``prime`` turns that into the response's
status (400, ...) instead of an error event after a 200. Errors after the first output stay
error events (``http_utils.sse_response``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from radixlm.runtime.entrypoints.http_utils import await_or_disconnect
from radixlm.runtime.managers.messages import TextOutput

logger = logging.getLogger(__name__)


class PrimedOutputs:
    """``(index, output)`` pairs of a response's requests: each one's first output,
    already received, then the rest as they arrive. An error of any request ends the
    iteration with its ``ApiError``; leaving early aborts the requests still running."""

    def __init__(self, states: list[Any], gens: list[AsyncIterator[TextOutput]],
                 firsts: list[TextOutput]) -> None:
        self.states, self.gens, self.firsts = states, gens, firsts

    async def __aiter__(self) -> AsyncIterator[tuple[int, TextOutput]]:
        live = {i: self.gens[i] for i, out in enumerate(self.firsts) if not out.finished}
        merged = _merge(live)
        try:
            for i, out in enumerate(self.firsts):
                yield i, out
            async for pair in merged:
                yield pair
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
            await self.aclose()

    async def aclose(self) -> None:
        """Close every request's output iterator (a request not finished is aborted)."""
        for gen in self.gens:
            await gen.aclose()  # type: ignore[attr-defined]


async def prime(request: Request, tm: Any, states: list[Any]) -> PrimedOutputs:
    """Wait for the first output of every request in ``states``. A request that fails
    first raises its ``ApiError`` (the others are aborted); a client that goes away
    meanwhile gets 499 (``await_or_disconnect``)."""
    gens = [tm.outputs(s) for s in states]
    firsts = await await_or_disconnect(request, _firsts(gens))
    return PrimedOutputs(states, gens, firsts)


async def _firsts(gens: list[AsyncIterator[TextOutput]]) -> list[TextOutput]:
    tasks = [asyncio.ensure_future(_first(g)) for g in gens]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t in done and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()  # type: ignore[attr-defined]
        raise


async def _first(gen: AsyncIterator[TextOutput]) -> TextOutput:
    async for out in gen:
        return out
    raise RuntimeError("a request ended without an output")


async def _merge(gens: dict[int, AsyncIterator[TextOutput]]
                 ) -> AsyncIterator[tuple[int, TextOutput]]:
    """The outputs of several iterators as they arrive; the first error is raised."""
    if len(gens) == 1:
        (i, gen), = gens.items()
        async for out in gen:
            yield i, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[TextOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in gens.items()]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
