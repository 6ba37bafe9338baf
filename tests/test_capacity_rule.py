"""The capacity rule and the eviction reserve's default, each written once (issue 51).

The rule: one decode step selects up to top-k tokens per running request in each layer,
and all of them must be resident in the N_G device slots at once, so at most N_G // top-k
requests decode together; under speculative decoding a verify step has Q = S + 1 query
tokens per request, so N_G // (Q x top-k) (``queries_per_request``, the same function).
``sglang_echo.config.max_running(dev_cache_size, top_k)`` is its one home (``EchoConfig.max_running(top_k)`` delegates; ``dev_cache_for`` reads it the other
way). Here, for a grid of (N_G, top-k):

- every site that bounds running requests agrees with it: the runtime's admission bound
  (``runtime.serving.running_requests`` and ``EchoConfig.validate``), its resolve bound
  (``EchoKVCache.max_resolve_queries``), the plugin's plan (``sglang.args.plan_echo``),
  its sizing (``sglang.sizing.EchoSizes``) and its decode resolve (``TopkToRows``);
- a scanner (``capacity_arithmetic``) finds no module of the package but the rule's home
  computing the rule by hand. What it flags, by the AST: a division of anything by a name
  or attribute called ``top_k``/``topk``/``index_topk`` (``//``, ``/``, ``//=``,
  ``divmod``; the rule with Q query tokens per request, ``n_g // q // top_k``, too), and a comparison with a ``x * top_k`` side (``running * top_k <= n_g``).
  Not flagged: a product outside a comparison (bytes of a top-k table, messages' "x
  tokens per layer"); a top-k under another name. ``test_the_scanner_finds_hand_written_rules``
  shows each flagged form is caught.

The reserve: ``config.eviction_reserve_in_force(dev_cache_size, asked)`` turns an unset
``SGLANG_ECHO_EVICTION_RESERVE`` into ``default_eviction_reserve(N_G)``; the runtime's
``EchoConfig``, the settings' summary, the plugin's cache (``sglang.storage``) and its
sizing (``sglang.sizing``) must agree with it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_echo.config import (
    ENV_EVICTION_RESERVE,
    ConfigError,
    EchoConfig,
    EchoSettings,
    default_eviction_reserve,
    dev_cache_for,
    eviction_reserve_in_force,
    max_eviction_reserve,
    max_running,
)
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime import serving
from sglang_echo.sglang import sizing
from sglang_echo.sglang.args import plan_echo
from sglang_echo.sglang.storage import eviction_reserve_for
from sglang_echo.sglang.topk_resolve import TopkToRows

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python" / "sglang_echo"
RULE_HOME = PACKAGE_ROOT / "config.py"

# Around the edges: below one top-k, at it, one past, and the default N_G.
DEV_CACHE_SIZES = (1, 7, 8, 9, 63, 64, 65, 2047, 2048, 2049, 4096, 10_000, 260_000)
TOP_KS = (1, 8, 64, 2048)


def plugin_view(**fields) -> SimpleNamespace:
    """A launch's resolved arguments as ``plan_echo`` reads them: a PD decode node (no
    prompt rows, so no context length needed), nothing incompatible."""
    base = dict(
        max_total_tokens=1_000_000,
        max_running_requests=None,
        disaggregation_mode="decode",
        kv_cache_dtype="auto",
        dsa_decode_backend=None,
        page_size=None,
        hisparse_config=None,
        speculative_algorithm=None,
        pp_size=1,
        dp_size=1,
    )
    base.update(fields)
    return SimpleNamespace(**base)


def resolve_for(n_g: int, top_k: int) -> TopkToRows:
    """The plugin's decode resolve over an N_G-slot cache; its bound reads only
    ``manager.cache.num_slots`` (the tensors are not touched until a step runs)."""
    manager = SimpleNamespace(cache=SimpleNamespace(num_slots=n_g))
    return TopkToRows(manager, 0, None, None, None, top_k, None)


def test_the_rule_and_its_inverse() -> None:
    for top_k in TOP_KS:
        for running in (1, 2, 3, 126, 4096):
            n_g = dev_cache_for(running, top_k)
            assert max_running(n_g, top_k) == running
            assert max_running(n_g - 1, top_k) == running - 1
            assert EchoConfig(dev_cache_size=n_g).max_running(top_k) == running
            # The runtime's smallest N_G for these requests (a one-token chunk).
            assert EchoConfig().min_dev_cache_size(running, top_k, 1) == n_g
    with pytest.raises(ValueError, match="top-k"):
        max_running(2048, 0)


@pytest.mark.parametrize("q", (1, 2, 3, 4))
def test_the_rule_with_q_query_tokens_per_request(q: int) -> None:
    """A verify step of Q tokens per request: N_G >= running x Q x top-k, one function."""
    for top_k in TOP_KS:
        for running in (1, 2, 3, 126):
            n_g = dev_cache_for(running, top_k, queries_per_request=q)
            assert n_g == running * q * top_k
            assert max_running(n_g, top_k, queries_per_request=q) == running
            assert max_running(n_g - 1, top_k, queries_per_request=q) == running - 1
            echo = EchoConfig(offload=True, dev_cache_size=n_g)
            assert echo.max_running(top_k, queries_per_request=q) == running
            assert echo.min_dev_cache_size(running, top_k, 1, queries_per_request=q) == n_g
            echo.check_verify_batch(running, top_k, q)  # fits exactly
            with pytest.raises(ConfigError) as refused:
                echo.check_verify_batch(running + 1, top_k, q)
            message = str(refused.value)
            for needle in (
                f"NSA_DEV_CACHE_SIZE={n_g} (N_G)",
                f"Q {q} query tokens",
                f"top-k {top_k}",
                f"largest batch that fits is {running}",
                f">= {dev_cache_for(running + 1, top_k, queries_per_request=q)} for a batch",
            ):
                assert needle in message, (needle, message)
        # Q = 1 is the plain decode rule; without offload nothing is checked.
        assert max_running(5000, top_k, queries_per_request=1) == max_running(5000, top_k)
        EchoConfig(offload=False, dev_cache_size=1).check_verify_batch(10**6, top_k, q)
    with pytest.raises(ValueError, match="queries per request"):
        max_running(2048, 8, queries_per_request=0)


def test_a_verify_that_fits_no_batch_says_so() -> None:
    with pytest.raises(ConfigError, match=r"largest batch that fits is 0 \(no batch fits\)"):
        EchoConfig(offload=True, dev_cache_size=10).check_verify_batch(1, 4, 3)


@pytest.mark.parametrize("n_g", DEV_CACHE_SIZES)
def test_every_site_agrees_with_the_rule(n_g: int, monkeypatch) -> None:
    # The runtime's default only caps the rule from above: lift it to see the rule.
    monkeypatch.setattr(serving, "DEFAULT_MAX_RUNNING", 1 << 30)
    echo = EchoConfig(offload=True, dev_cache_size=n_g)
    kv = EchoKVCache(echo, 1, 16, 4, 4, torch.float32, "cpu")
    for top_k in TOP_KS:
        rule = max_running(n_g, top_k)
        assert rule == n_g // top_k  # the rule itself, restated once here
        assert echo.max_running(top_k) == rule
        # The runtime: the running requests it admits by default, the largest asked value
        # start-up accepts, and how many queries one resolve may carry.
        assert serving.running_requests(None, echo, top_k) == max(1, rule)
        assert kv.max_resolve_queries(top_k) == max(1, rule)
        asked = dict(host_tokens=1, topk=top_k, chunk_size=1)
        if rule >= 1:
            echo.validate(max_running_requests=rule, **asked)
        with pytest.raises(ConfigError, match="is too small"):
            echo.validate(max_running_requests=rule + 1, **asked)
        # The plugin's sizing: its default running count, and which counts are valid.
        sizes = sizing.EchoSizes(
            dev_cache_size=n_g, host_tokens=10_000, top_k=top_k, prefill_rows=0
        )
        assert sizes.per_rank_running == rule
        assert sizes.valid() == (rule >= 1)
        assert replace(sizes, running=rule).valid() == (rule >= 1)
        assert not replace(sizes, running=rule + 1).valid()
        # The plugin's plan (per rank; under attention DP the global cap is the share x
        # ranks) and its decode resolve.
        if rule < 1:
            with pytest.raises(ConfigError, match="cannot hold one request's"):
                plan_echo(plugin_view(), echo, top_k=top_k, context_len=None)
            with pytest.raises(ValueError, match="cannot hold one request's"):
                resolve_for(n_g, top_k)
            continue
        plan = plan_echo(plugin_view(), echo, top_k=top_k, context_len=None)
        assert plan.per_rank_running == plan.max_running_requests == rule
        assert plan.sizes().per_rank_running == rule
        dp = plan_echo(plugin_view(attn_dp_size=4), echo, top_k=top_k, context_len=None)
        assert dp.per_rank_running == rule and dp.max_running_requests == 4 * rule
        fit = plan_echo(plugin_view(max_running_requests=rule), echo, top_k=top_k, context_len=None)
        assert fit.per_rank_running == rule
        with pytest.raises(ConfigError, match="--max-running-requests"):
            plan_echo(
                plugin_view(max_running_requests=rule + 1), echo, top_k=top_k, context_len=None
            )
        resolve = resolve_for(n_g, top_k)
        assert resolve.max_rows == rule
        resolve.check_batch(rule)
        with pytest.raises(ConfigError, match="--max-running-requests"):
            resolve.check_batch(rule + 1)


@pytest.mark.parametrize("n_g", (1, 2, 3, 63, 64, 65, 4096, 10_000, 260_000, 1 << 20))
def test_every_site_agrees_on_the_eviction_reserve(n_g: int) -> None:
    default = default_eviction_reserve(n_g)
    assert 0 <= default <= max_eviction_reserve(n_g)
    assert eviction_reserve_in_force(n_g, None) == default
    # Unset: the runtime's cache, the settings' summary, the plugin's cache and sizing.
    assert EchoConfig(dev_cache_size=n_g).eviction_reserve == default
    assert EchoSettings(dev_cache_size=n_g).shown(ENV_EVICTION_RESERVE) == f"{default:_}"
    assert eviction_reserve_for(n_g, {}) == default
    metadata = sizing.echo_metadata_bytes(n_g, 1000, 2)
    assert metadata == sizing.echo_metadata_bytes(n_g, 1000, 2, default)
    # Set: every site takes the value asked.
    asked = max_eviction_reserve(n_g)
    assert eviction_reserve_in_force(n_g, asked) == asked
    assert EchoConfig(dev_cache_size=n_g, eviction_reserve=asked).eviction_reserve == asked
    assert eviction_reserve_for(n_g, {ENV_EVICTION_RESERVE: str(asked)}) == asked
    with pytest.raises(ConfigError, match=f"at most {asked}"):
        eviction_reserve_for(n_g, {ENV_EVICTION_RESERVE: str(asked + 1)})


# ----------------------------------------------------------------------------- scanner
TOP_K_NAME = re.compile(r"^(index_)?top_?k$", re.IGNORECASE)


def _is_top_k(node: ast.AST) -> bool:
    name = getattr(node, "id", None) or getattr(node, "attr", None)
    return isinstance(name, str) and TOP_K_NAME.match(name) is not None


def _is_times_top_k(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and (_is_top_k(node.left) or _is_top_k(node.right))
    )


def capacity_arithmetic(source: str) -> list[str]:
    """``line: expression`` for each place ``source`` computes the capacity rule by hand
    (module docstring: what counts)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        divisor = None
        if isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(
            node.op, ast.FloorDiv | ast.Div
        ):
            divisor = node.right if isinstance(node, ast.BinOp) else node.value
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "divmod"
            and len(node.args) == 2
        ):
            divisor = node.args[1]
        hit = divisor is not None and _is_top_k(divisor)
        if isinstance(node, ast.Compare):
            hit = any(_is_times_top_k(side) for side in (node.left, *node.comparators))
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_the_rules_home_computes_it() -> None:
    stray = {
        str(path.relative_to(PACKAGE_ROOT)): hits
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if path != RULE_HOME and (hits := capacity_arithmetic(path.read_text()))
    }
    assert not stray, (
        "the capacity rule (N_G // top-k running requests) is computed by hand; call "
        f"sglang_echo.config.max_running / EchoConfig.max_running / dev_cache_for: {stray}"
    )
    # The home holds it once: max_running's division.
    assert [hit.split(": ", 1)[1] for hit in capacity_arithmetic(RULE_HOME.read_text())] == [
        "dev_cache_size // queries_per_request // top_k"
    ]


@pytest.mark.parametrize(
    "line",
    [
        "cap = config.dev_cache_size // top_k",
        "max_rows = manager.cache.num_slots // top_k",
        "running = self.dev_cache_size // self.top_k",
        "running = n_g //cfg.index_topk",
        "share = n_g / topk",
        "running = n_g // q // top_k",
        "n //= top_k",
        "rows, rest = divmod(n_g, self.top_k)",
        "ok = running * self.top_k <= self.dev_cache_size",
        "ok = n_g >= top_k * running",
    ],
)
def test_the_scanner_finds_hand_written_rules(line: str) -> None:
    hits = capacity_arithmetic(f"def f():\n    {line}\n")
    assert len(hits) == 1 and hits[0].startswith("2: "), hits


def test_the_scanner_leaves_other_arithmetic() -> None:
    source = (
        "table = slots * 4 * top_k\n"
        "pages = n_g // 64\n"
        "share = n_g // slots\n"
        "text = f'{per_rank * top_k} tokens per layer'\n"
        "rows = max_running(n_g, top_k)\n"
    )
    assert capacity_arithmetic(source) == []
