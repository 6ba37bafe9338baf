"""runtime/jit_watch.py: Triton's compiles counted through its own hook calls, earlier hooks
kept, and the count at /metrics and in bench_serving's record."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from sglang_echo.bench.server_counters import parse_counters  # noqa: E402
from sglang_echo.runtime import metrics  # noqa: E402
from sglang_echo.runtime.jit_watch import JitWatch  # noqa: E402


def _kernel(x_ptr, n, BLOCK):  # a JIT function's source; never launched
    pass


OPTIONS = SimpleNamespace(
    num_warps=4,
    num_ctas=1,
    num_stages=3,
    enable_fp_fusion=True,
    launch_cooperative_grid=False,
    extern_libs=None,
)


def _compile_through_triton(fn: JITFunction, key: tuple) -> None:
    """What ``JITFunction._do_compile`` does around a compile: its two hook calls, made by
    Triton's own ``_call_hook`` with the arguments Triton passes."""
    signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    runtime = knobs.runtime
    skip = fn._call_hook(
        runtime.jit_cache_hook, key, signature, 0, {(2,): 16}, OPTIONS, [{}], False
    )
    assert not skip, "the watch must never make Triton skip a compile"
    fn._call_hook(
        runtime.jit_post_compile_hook, key, signature, 0, {(2,): 16}, OPTIONS, [{}], False
    )


@pytest.fixture
def watch():
    """A watch over Triton's hooks as this test finds them cleared: a server built earlier
    in the process installed the process's own watch, which would see these compiles too."""
    runtime = knobs.runtime
    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
    w = JitWatch()
    yield w
    w.uninstall()
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_each_compile_is_counted_with_its_kernel(watch):
    assert watch.install()
    fn = JITFunction(_kernel)
    _compile_through_triton(fn, (("*fp32", "i32"), ("D", "")))
    _compile_through_triton(fn, (("*fp32", "i32"), ("D", "D")))  # another specialization
    assert watch.compiles == 2
    assert watch.by_kernel == {f"{__name__}._kernel": 2}
    assert watch.counters()["seconds"] >= 0.0
    assert not watch._started, "every start was matched by its end"


def test_hooks_found_at_install_still_run_and_come_back(watch):
    runtime = knobs.runtime
    seen: list[str] = []

    def earlier_cache_hook(**kw):
        seen.append("cache")
        return None

    def earlier_post_hook(**kw):
        seen.append("post")

    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = earlier_cache_hook, earlier_post_hook
    try:
        watch.install()
        assert runtime.jit_cache_hook == watch.before_compile
        _compile_through_triton(JITFunction(_kernel), (("*fp32", "i32"), ("D", "")))
        assert seen == ["cache", "post"] and watch.compiles == 1
        watch.uninstall()
        assert runtime.jit_cache_hook is earlier_cache_hook
        assert runtime.jit_post_compile_hook is earlier_post_hook
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_an_earlier_hook_that_skips_the_compile_is_obeyed(watch):
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook
    runtime.jit_cache_hook = lambda **kw: True  # e.g. a tool that only inspects kernels
    try:
        watch.install()
        assert watch.before_compile(key=("k",), fn=None) is True
    finally:
        watch.uninstall()
        runtime.jit_cache_hook = saved


def test_install_is_idempotent(watch):
    assert watch.install() and watch.install()
    watch.uninstall()
    watch.uninstall()
    assert not watch.installed


def test_compiles_reach_bench_serving_as_engine_counters(watch):
    """The /metrics lines of the counts parse as bench_serving's engine counters, so a
    run's record holds its own compiles as a delta (``server_engine``)."""
    watch.install()
    _compile_through_triton(JITFunction(_kernel), (("*fp32", "i32"), ("D", "")))
    counts = watch.counters()
    text = "\n".join(
        [
            metrics._line("triton_compiles_total", counts["compiles"], {"model_name": "m"}),
            metrics._line("triton_compile_seconds_total", counts["seconds"], {"model_name": "m"}),
        ]
    )
    engine = parse_counters(text)["engine"]
    assert engine["triton_compiles"] == 1.0
    assert engine["triton_compile_seconds"] == pytest.approx(counts["seconds"])


def test_a_compile_while_serving_is_a_warning(watch, caplog):
    """Start-up compiles are expected (debug); one while serving stalls every request
    behind it, so it is a warning naming the kernel."""
    watch.install()
    fn = JITFunction(_kernel)
    with caplog.at_level("DEBUG", logger="sglang_echo.jit"):
        _compile_through_triton(fn, (("*fp32", "i32"), ("D", "")))
        watch.serving = True
        _compile_through_triton(fn, (("*fp32", "i32"), ("D", "D")))
    levels = [(r.levelname, "while serving" in r.getMessage()) for r in caplog.records]
    assert levels == [("DEBUG", False), ("WARNING", True)]
    assert "_kernel" in caplog.records[-1].getMessage()


def test_the_warning_says_which_arguments_made_the_variant(watch, caplog):
    """Triton's cache key is the specialization's text followed by the options' text; the
    warning keeps the first (what changed: types, values, alignments), not the options."""
    watch.install()
    watch.serving = True
    fn = JITFunction(_kernel)
    key = "[('*fp32', 'D'), ('i32', '')]" + "CUDAOptions(num_warps=4, num_stages=3)"
    with caplog.at_level("WARNING", logger="sglang_echo.jit"):
        _compile_through_triton(fn, key)
    message = caplog.records[-1].getMessage()
    assert message.endswith("specialization [('*fp32', 'D'), ('i32', '')]")
    assert "num_warps" not in message
