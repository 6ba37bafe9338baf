"""runtime.server.EventMailbox: events posted from another thread reach their streams'
queues complete and in order, with one loop wake-up per burst instead of one per event."""

import asyncio
import threading

from sglang_echo.runtime.server import EventMailbox


def test_a_burst_arrives_in_order_with_few_wakeups():
    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        plain = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return plain(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        box = EventMailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]
        burst = threading.Thread(target=lambda: [box.post(queues[i % 3], i) for i in range(300)])
        burst.start()
        await asyncio.to_thread(burst.join)
        got = [[await q.get() for _ in range(100)] for q in queues]
        return got, wakeups

    got, wakeups = asyncio.run(run())
    assert got == [list(range(k, 300, 3)) for k in range(3)]  # every event, in order
    assert 1 <= wakeups < 300  # the loop was woken per burst, not per event
