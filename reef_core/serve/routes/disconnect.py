"""Noticing that an HTTP client went away while its request is being served.

Once a request's body has been read, the ASGI ``receive`` channel yields nothing but ``http.disconnect``, which
arrives when the client closes the connection (or once the response is complete). uvicorn reads the socket only
while someone waits on ``receive``, and silently drops what is written to a closed connection: without a waiter, a
client that hung up goes unnoticed. :class:`ClientWatch` is that waiter, in a task of its own, so that work for a
client that left can be stopped (its task cancelled) and recorded as cut short.
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


async def _until_disconnect(receive: Callable[[], Awaitable[dict]]) -> bool:
    """True once the client disconnected; False when the channel failed instead (nothing is known then, and a
    request must not be abandoned on a guess)."""
    try:
        while (await receive()).get("type") != "http.disconnect":
            pass  # a server may repeat an empty final body message; only a disconnect ends the wait
    except Exception:  # noqa: BLE001
        log.warning("receive failed while watching for a disconnect; not watching this request", exc_info=True)
        return False
    return True


def _disconnected(watcher: asyncio.Future) -> bool:
    return watcher.done() and not watcher.cancelled() and watcher.result()


class ClientWatch:
    """Watches one request's connection from the moment its body has been read until :meth:`close`."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self._watcher = asyncio.ensure_future(_until_disconnect(receive))

    @property
    def gone(self) -> bool:
        """Whether the client has left."""
        return _disconnected(self._watcher)

    async def run(self, work: Awaitable[Any]) -> Any:
        """Await ``work`` in the calling task (no task hop: a stream keeps its pace). When the client leaves first,
        the task is cancelled out of ``work`` and :class:`ClientGone` is raised instead; a cancellation from
        elsewhere propagates as usual."""
        task = asyncio.current_task()
        armed, fired = True, False

        def client_left(watcher: asyncio.Future) -> None:
            nonlocal fired
            if armed and _disconnected(watcher):
                fired = True
                task.cancel()

        if self.gone:
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientGone()
        self._watcher.add_done_callback(client_left)
        try:
            result = await work
        except asyncio.CancelledError:
            if fired and task.uncancel() == 0:  # cancelled by us alone
                raise ClientGone() from None
            raise
        finally:
            armed = False
            self._watcher.remove_done_callback(client_left)
        if fired:  # the work ignored the cancellation and finished: forget the request
            task.uncancel()
        return result

    def close(self) -> None:
        """Stop watching (the response is being or has been delivered)."""
        self._watcher.cancel()
