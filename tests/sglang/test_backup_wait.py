"""Host ids go back to sglang's host allocator only after the host has waited for the
last decode backup (NewestRowBackup.finish_on_host): under PD a freed host id
can be handed at once to a transfer whose RDMA write follows no device stream. The
order of the calls is recorded on the real coordinator (on the CPU every copy is
synchronous, so the order is what can be checked here; the overlap needs a GPU)."""

from __future__ import annotations

import random

import plugin_testenv  # first: sets the process up before sglang loads

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)
from test_coordinator import assert_back_to_start, selections  # noqa: E402


class RecordingEvent:
    """sglang's backup-done event, with every call logged."""

    def __init__(self, event, log: list[str]) -> None:
        self.event, self.log = event, log

    def record(self, *args) -> None:
        self.log.append("backup recorded")
        self.event.record(*args)

    def wait(self, *args) -> None:
        self.log.append("stream waits")
        self.event.wait(*args)

    def synchronize(self) -> None:
        self.log.append("host waits")
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


def test_host_waits_for_the_backup_before_freeing_host_ids():
    node = DecodeNode(layers=1, top_k=16, dev_cache=64, max_running=2, host_tokens=1024,
                      max_context=256)  # fmt: skip
    coord = node.coord
    log: list[str] = []
    coord._backup_done_event = RecordingEvent(coord._backup_done_event, log)
    free = coord.mem_pool_host.free

    def logged_free(ids):
        log.append("host ids freed")
        return free(ids)

    coord.mem_pool_host.free = logged_free
    topk_for = selections(node, random.Random(2))
    rid = node.arrive(70)
    for _ in range(3):  # the first step skips the backup (PD: prompt already on host)
        node.step([rid], padded_bs=2, topk_for=topk_for)
    assert log.count("backup recorded") == 2
    log.clear()
    node.finish(rid)
    assert "host ids freed" in log
    assert log.index("host waits") < log.index("host ids freed")
    # Nothing recorded since: a second release does not wait again.
    rid = node.arrive(30)
    log.clear()
    node.finish(rid)
    assert log == ["host ids freed"]
    assert_back_to_start(node)
