"""Launch counts of the plugin's finish and decode resolve, on sglang 0.5.23's real
classes (CPU; ECHO's Triton kernels under TRITON_INTERPRET=1, natively on a GPU).

Finish: the requests sglang finishes while it processes one step's results release
their host ids from ECHO's cache in ONE EchoManager.release (one release-kernel launch
for every layer and every request), when sglang's result processing returns, and only
then go back to sglang's host pool. The finish is driven through sglang's own
``SchedulerBatchResultProcessor.process_batch_result_prebuilt`` (the class attribute the
scheduler calls, wrapped by the coordinator) with a stand-in for the scheduler's other
parts; ``release_kv_cache`` is the test's (it frees the logical ids and request slot).

Resolve: one decode layer-step issues a fixed number of kernel launches (allocation and
recall) whatever the batch, and a fixed number of torch ops around them."""

from __future__ import annotations

import random
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
from torch.utils._python_dispatch import TorchDispatchMode

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)
from test_coordinator import assert_back_to_start, check_tables, selections  # noqa: E402

import sglang_echo.offload.manager as manager_module  # noqa: E402
from sglang_echo.kernels import alloc as alloc_kernels  # noqa: E402
from sglang_echo.kernels import alloc_common  # noqa: E402
from sglang_echo.kernels import release as release_kernels  # noqa: E402

# One decode layer-step of the resolve with the kernels, then the recall kernel:
# kernels/alloc.py's one program (at most ONE_PROGRAM_LANES lanes: these small batches) or
# the look-back resolve's four launches (past it, kernels/alloc_lookback.py); independent of
# the layer and of hits or misses.
ALLOC_KERNELS = ("_lookup_rank_kernel", "_evict_hist_kernel", "_evict_victims_kernel",
                 "_map_misses_kernel")  # fmt: skip
# Around it, the top-k -> host ids and slots -> rows kernels (kernels/topk_rows.py).
GLUE = {"_host_ids_kernel": 1, "_rows_kernel": 1}
RESOLVE_LAUNCHES = {
    "one-program": {**GLUE, "_one_program_kernel": 1, "_recall_flat_kernel": 1},
    "lookback": {**GLUE, **{name: 1 for name in ALLOC_KERNELS}, "_recall_flat_kernel": 1},
}


# ------------------------------------------------------------------ counters
_inside_kernel = [0]  # > 0 while a counted launch runs (the interpreter's own torch ops)


@contextmanager
def kernel_launches():
    """Counts ECHO's Triton launches by kernel name (the interpreter's or the GPU's
    launcher: ``kernel[grid](...)`` calls ``run``)."""
    launches: Counter[str] = Counter()
    kinds = {type(k) for k in (release_kernels._release_kernel, alloc_kernels._lookup_kernel)}
    saved = {kind: kind.run for kind in kinds}

    def counting(original):
        def run(self, *args, **kwargs):
            launches[self.fn.__name__] += 1
            _inside_kernel[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _inside_kernel[0] -= 1

        return run

    for kind, original in saved.items():
        kind.run = counting(original)
    try:
        yield launches
    finally:
        for kind, original in saved.items():
            kind.run = original


class OpCounter(TorchDispatchMode):
    """Torch ops dispatched (views apart: they launch nothing; inside a counted kernel
    launch apart: the interpreter's, which a GPU does not run)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not _inside_kernel[0]:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.fixture
def release_calls(monkeypatch):
    """Every call of the release (the Triton launcher or its torch reference, whichever
    EchoManager.release runs) with the ids it released, and the torch ops inside it."""
    calls: list[dict] = []

    def counted(original):
        def release(cache, ids, errors):
            with OpCounter() as ops:
                original(cache, ids, errors)
            calls.append({"ids": ids.clone(), "ops": ops.total})

        return release

    monkeypatch.setattr(manager_module, "release_kernel", counted(release_kernels.release_kernel))
    monkeypatch.setattr(
        manager_module, "release_reference", counted(release_kernels.release_reference)
    )
    return calls


# ----------------------------------------------------- sglang's result processing
@pytest.fixture
def result_processing(monkeypatch):
    """sglang's process_batch_result_prebuilt on a stand-in processor: the scheduler's
    other parts are stubs; the hisparse coordinator, the requests and the loop are real."""
    import sglang.srt.managers.scheduler_components.batch_result_processor as brp
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    monkeypatch.setattr(brp, "get_memory", lambda: SimpleNamespace(enable_hisparse=True))
    monkeypatch.setattr(
        brp, "get_disagg", lambda: SimpleNamespace(disaggregation_decode_enable_radix_cache=False)
    )

    def finish_step(node: DecodeNode, rids: list[str]) -> None:
        reqs = []
        for rid in rids:
            req = node.running.pop(rid).req
            req.to_finish = FINISH_ABORT()
            reqs.append(req)
        monkeypatch.setattr(
            brp, "release_kv_cache", lambda req, tree_cache, checkpoint: node._release_kv(req)
        )
        processor = SimpleNamespace(
            disaggregation_mode=DisaggregationMode.DECODE,
            hisparse_coordinator=node.coord,
            tree_cache=None,
            token_to_kv_pool_allocator=node.allocator,
            output_streamer=SimpleNamespace(stream_output=lambda reqs, return_logprob: None),
        )
        batch = SimpleNamespace(reqs=reqs, return_logprob=False)
        brp.SchedulerBatchResultProcessor.process_batch_result_prebuilt(processor, batch)
        assert all(req.finished() for req in reqs)

    return finish_step


def live_node(layers: int, kernels: bool, seed: int = 0) -> tuple[DecodeNode, list[str], object]:
    """Four running requests after three decode steps (ECHO's cache holds rows of all
    of them in every layer)."""
    node = DecodeNode(layers=layers, top_k=16, dev_cache=64, max_running=4, host_tokens=2048,
                      max_context=256)  # fmt: skip
    node.coord.manager.use_kernels = kernels
    topk_for = selections(node, random.Random(seed))
    rids = [node.arrive(n) for n in (70, 100, 130, 65)]
    for _ in range(3):
        check_tables(node, rids, node.step(rids, padded_bs=4, topk_for=topk_for))
    return node, rids, topk_for


def host_ids_of(node: DecodeNode, rid: str) -> set[int]:
    coord = node.coord
    idx = node.running[rid].req.kv.req_pool_idx
    row = coord.req_to_host_pool[idx]
    return set(row[row >= 0].tolist())


# -------------------------------------------------------------------- finish
def test_a_steps_finished_requests_release_in_one_call(release_calls, result_processing):
    """Per step: one release call whatever the layers and finished requests, over exactly
    the finished requests' host ids, which go back to the host pool only after it; the
    running requests' rows stay exact, and the end state is the start state."""
    report = {}
    for layers, finishing in ((2, 1), (2, 3), (4, 3)):
        node, rids, topk_for = live_node(layers, kernels=False)
        host = node.coord.mem_pool_host
        done, survivors = rids[:finishing], rids[finishing:]
        want = set().union(*(host_ids_of(node, rid) for rid in done))
        free_before = host.available_size()
        releases_before_free: list[int] = []  # release calls made when the pool frees
        free = host.free

        def logged_free(ids, free=free, log=releases_before_free):
            log.append(len(release_calls))
            return free(ids)

        host.free = logged_free
        release_calls.clear()
        with OpCounter() as finish_ops:
            result_processing(node, done)
        assert len(release_calls) == 1, (
            f"{layers} layers, {finishing} finished: {len(release_calls)} release calls"
        )
        assert set(release_calls[0]["ids"].tolist()) == want
        assert release_calls[0]["ids"].numel() == len(want)
        assert releases_before_free == [1]  # one free, after the release
        assert host.available_size() == free_before + len(want)
        host.free = free
        report[(layers, finishing)] = (release_calls[0]["ops"], finish_ops.total)
        if survivors:
            check_tables(node, survivors, node.step(survivors, padded_bs=4, topk_for=topk_for))
        for rid in survivors:
            node.finish(rid)  # outside a step's result processing: released at once
        assert_back_to_start(node)
    # The release's own torch ops (the reference's fixed sequence) do not grow with the
    # layers or the finished requests.
    assert len({ops for ops, _ in report.values()}) == 1, report
    print("\nrelease torch ops / whole finish torch ops, per step:", report)


def test_finish_outside_a_step_releases_at_once(release_calls):
    """An abort or retraction outside sglang's result processing releases then and
    there: nothing is left waiting for a step that may never come."""
    node, rids, _ = live_node(2, kernels=False)
    for n, rid in enumerate(rids, start=1):
        ids = host_ids_of(node, rid)
        node.finish(rid)
        assert len(release_calls) == n
        assert set(release_calls[-1]["ids"].tolist()) == ids
    assert not node.coord.releases.finished_rows
    assert_back_to_start(node)


def test_the_step_scope_wraps_sglangs_result_processing():
    """The decode, prefill and PD-prebuilt result paths all run inside the scope."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    from sglang_echo.sglang.step_release import release_finished_together

    live_node(1, kernels=False)  # a coordinator exists in this process
    for name in ("decode", "prefill", "prebuilt"):
        method = getattr(SchedulerBatchResultProcessor, f"process_batch_result_{name}")
        hooks = []
        while method is not None:
            hooks.append(method)
            method = getattr(method, "__wrapped__", None)
        closure = [c.cell_contents for f in hooks for c in (f.__closure__ or ())]
        assert release_finished_together in closure, name


@pytest.mark.parametrize("path", sorted(RESOLVE_LAUNCHES))
def test_kernel_launches_per_finish_and_per_resolve_layer_step(
    result_processing, path, monkeypatch
):
    """With ECHO's kernels (the path a GPU runs): a step's finish is ONE release launch
    for every layer and request; each decode layer-step of the resolve is one allocation
    launch (small batches) or four, and one recall launch."""
    if path == "lookback":  # every batch past the one-program bound
        monkeypatch.setattr(alloc_common, "ONE_PROGRAM_LANES", 0)
    report = {}
    for layers, finishing in ((2, 1), (4, 3)):
        node, rids, topk_for = live_node(layers, kernels=True, seed=layers)
        coord = node.coord
        with kernel_launches() as launches:
            result_processing(node, rids[:finishing])
        assert dict(launches) == {"_release_kernel": 1}, (
            f"{layers} layers, {finishing} finished: {dict(launches)}"
        )
        report[("finish", layers, finishing)] = "1 launch"
        survivors = rids[finishing:]
        per_layer = []
        resolve = coord.swap_in_selected_pages

        def counted(*args, per_layer=per_layer, resolve=resolve):
            with kernel_launches() as launches, OpCounter() as ops:
                out = resolve(*args)
            per_layer.append((dict(launches), ops.total))
            # Besides the launches only the outputs' allocations: the glue is in kernels.
            assert set(ops.ops) <= {"aten.empty"}, ops.ops
            return out

        coord.swap_in_selected_pages = counted
        check_tables(node, survivors, node.step(survivors, padded_bs=4, topk_for=topk_for))
        del coord.swap_in_selected_pages
        assert len(per_layer) == layers
        for launches_, _ in per_layer:
            assert launches_ == RESOLVE_LAUNCHES[path], launches_
        ops = {n for _, n in per_layer}
        assert len(ops) == 1, per_layer  # the same torch ops in every layer
        report[("resolve layer-step", layers, len(survivors))] = (
            f"{sum(RESOLVE_LAUNCHES[path].values())} launches + {ops.pop()} torch ops"
        )
        for rid in survivors:
            node.finish(rid)
        assert_back_to_start(node)
    print("\nwith the kernels:", report)
