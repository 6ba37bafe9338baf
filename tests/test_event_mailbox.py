"""runtime.server.EventMailbox: events posted from another thread reach their streams'
queues complete and in order, with one loop wake-up per burst instead of one per event."""

import asyncio
import threading

from sglang_echo.runtime.server import EventMailbox


def _counting_mailbox(loop: asyncio.AbstractEventLoop) -> tuple[EventMailbox, dict[str, int]]:
    """A mailbox on ``loop`` that counts the loop's wake-ups (``call_soon_threadsafe``) and
    the deliveries that found the mailbox empty."""
    counts = {"wakeups": 0, "empty_deliveries": 0}
    plain = loop.call_soon_threadsafe

    def counting(*args):
        counts["wakeups"] += 1
        return plain(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    box = EventMailbox(loop)
    deliver = box._deliver

    def checked_deliver() -> None:
        if not box._pending:
            counts["empty_deliveries"] += 1
        deliver()

    box._deliver = checked_deliver  # type: ignore[method-assign]
    return box, counts


def _post_all(box: EventMailbox, queues: list[asyncio.Queue], n: int) -> threading.Thread:
    thread = threading.Thread(target=lambda: [box.post(queues[i % 3], i) for i in range(n)])
    thread.start()
    return thread


def test_a_burst_arrives_in_order_with_one_wakeup():
    """While the loop is busy (here: blocked on the posting thread), a burst of 300 events
    from the engine thread costs exactly one wake-up; a second burst after the loop has
    delivered the first costs exactly one more. Waking per event would count 300 or 600."""

    async def run() -> tuple[list[list[int]], list[int]]:
        box, counts = _counting_mailbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(3)]
        wakeups = []
        for burst in range(2):
            _post_all(box, queues, 300).join()  # the loop cannot run until the burst is in
            wakeups.append(counts["wakeups"])
            got = [[await q.get() for _ in range(100)] for q in queues]
            assert got == [list(range(k, 300, 3)) for k in range(3)], burst  # all, in order
            assert all(q.empty() for q in queues)
        assert counts["empty_deliveries"] == 0
        return got, wakeups

    _, wakeups = asyncio.run(run())
    assert wakeups == [1, 2]


def test_events_racing_the_loop_arrive_in_order_and_every_wakeup_delivers():
    """With the loop free to deliver while events are still posted, the wake-up count
    depends on timing, but every wake-up must hand over at least one event (a wake-up
    per post would find the mailbox already emptied) and no event may be lost or reordered."""

    async def run() -> tuple[list[list[int]], dict[str, int]]:
        box, counts = _counting_mailbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(3)]
        burst = _post_all(box, queues, 3000)
        await asyncio.to_thread(burst.join)
        got = [[await q.get() for _ in range(1000)] for q in queues]
        return got, counts

    got, counts = asyncio.run(run())
    assert got == [list(range(k, 3000, 3)) for k in range(3)]  # every event, in order
    assert counts["empty_deliveries"] == 0
    assert 1 <= counts["wakeups"] <= 3000
