"""Noticing that an HTTP client went away while its request is being served.

Once a request's body has been read, the ASGI ``receive`` channel yields nothing but ``http.disconnect``, which
arrives when the client closes the connection (or once the response is complete). uvicorn reads the socket again
only while someone waits on ``receive``: without a waiter, a client that hung up goes unnoticed until a write fails,
and a plain (non-streamed) answer is never written to a dead socket at all. :class:`ClientWatch` is that waiter, in
a task of its own, so that work for a client that left can be stopped and recorded as cut short.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("reef.serve")

#: Why a record is incomplete when its client left before receiving all of it (``payload.error``).
CLIENT_DISCONNECTED = "client_disconnected"


class ClientGone(Exception):
    """The client closed the connection before its answer was delivered."""


async def _until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    try:
        while (await receive()).get("type") != "http.disconnect":
            pass  # a server may repeat an empty final body message; only a disconnect ends the wait
    except Exception:  # noqa: BLE001 - a receive channel that fails is a connection that is gone
        log.debug("receive failed while watching for a disconnect", exc_info=True)


class ClientWatch:
    """Watches one request's connection from the moment its body has been read until :meth:`close`."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self._watcher = asyncio.ensure_future(_until_disconnect(receive))

    @property
    def gone(self) -> bool:
        """Whether the client has left."""
        return self._watcher.done() and not self._watcher.cancelled()

    async def run(self, work: Awaitable[Any]) -> Any:
        """The result of ``work``, run as a task of its own. When the client leaves first the task is cancelled
        and :class:`ClientGone` raised; when the caller is cancelled, so is the task. Either way the task has ended
        when this returns, so nothing of it outlives the call."""
        task = asyncio.ensure_future(work)
        abandoned = False
        try:
            await asyncio.wait((task, self._watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                abandoned = True
                task.cancel()
                await asyncio.wait((task,))
        if abandoned and (task.cancelled() or task.exception() is not None):
            raise ClientGone()  # the work's own end (cancelled, or failing on it) is not worth reporting
        return task.result()

    def close(self) -> None:
        """Stop watching (the response is being or has been delivered)."""
        self._watcher.cancel()
