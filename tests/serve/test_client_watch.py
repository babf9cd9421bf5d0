"""ClientWatch (reef_core.serve.routes.disconnect): work is stopped when, and only when, the client leaves."""

from __future__ import annotations

import asyncio

import pytest

from reef_core.serve.routes.disconnect import ClientGone, ClientWatch


class Channel:
    """An ASGI receive channel whose disconnect the test triggers."""

    def __init__(self):
        self.left = asyncio.Event()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}


def test_work_that_finishes_first_returns_its_result():
    async def main():
        channel = Channel()
        watch = ClientWatch(channel.receive)
        assert await watch.run(asyncio.sleep(0, result="answer")) == "answer"
        assert not watch.gone
        watch.close()

    asyncio.run(main())


def test_a_client_leaving_stops_the_work_and_raises_client_gone():
    async def main():
        channel = Channel()
        watch = ClientWatch(channel.receive)
        stopped = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(30)
            finally:
                stopped.set()

        asyncio.get_running_loop().call_later(0.01, channel.left.set)
        with pytest.raises(ClientGone):
            await watch.run(work())
        assert stopped.is_set() and watch.gone
        # The task is not left cancelled: it can await again (to store the record).
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0)
        with pytest.raises(ClientGone):  # once gone, further work is refused at once
            await watch.run(asyncio.sleep(30))

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_is_not_taken_for_a_disconnect():
    async def main():
        channel = Channel()
        watch = ClientWatch(channel.receive)
        task = asyncio.ensure_future(watch.run(asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not watch.gone
        watch.close()

    asyncio.run(main())


def test_a_failing_receive_channel_is_not_taken_for_a_disconnect():
    async def broken() -> dict:
        raise RuntimeError("receive timed out")

    async def main():
        watch = ClientWatch(broken)
        assert await watch.run(asyncio.sleep(0.05, result="answer")) == "answer"
        assert not watch.gone
        watch.close()

    asyncio.run(main())
