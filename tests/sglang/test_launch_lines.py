"""The launch-line generator (``sglang_echo.sglang.launch_lines``): every sglang line it
emits resolves under sglang 0.5.23's real argument resolution with the plugin installed,
and the lines of one deployment agree with each other.

The lines are taken from the generated script itself: bash runs ``SCRIPT NAME`` for every
node with a ``python`` on PATH that records its argv and ECHO environment, so what is
resolved is what an operator's shell would pass. Each recorded sglang line is resolved as
``python -m sglang.launch_server`` does (dry_parse.py) against a DeepSeek-V3.2-shaped
config, adding only what a CPU machine cannot provide: ``--device cpu`` and
``--skip-tokenizer-init`` (as test_e2e_launch_lines.py does), and an InfiniBand sysfs
listing (sglang checks ``--disaggregation-ib-device`` against /sys/class/infiniband; the
stub lists two devices and leaves sglang's check itself in place). The default sizes are
resolved again as test_sizing.py resolves README's lines, with the GPU's memory of the
checkpoint they are meant for.

Run as a script (``test_launch_lines.py parse|sizing CASES.json``) this file is that
launcher: the IB stub, then dry_parse's or test_sizing's driver.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from test_plugin_args import MODEL_CONFIG, collect, field  # noqa: E402

from sglang_echo.sglang import launch_lines as ll  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
LAUNCH_DOC = ROOT / "docs" / "LAUNCH.md"
CPU_ONLY = ["--device", "cpu", "--skip-tokenizer-init"]
IB_SYSFS = "/sys/class/infiniband"
IB_DEVICES = ["mlx5_0", "mlx5_1"]  # what the stubbed sysfs lists
TOP_K, PAGE = MODEL_CONFIG["index_topk"], 64

# The descriptions resolved: 1+1 and 2+2, fp8 and W4, bf16 rows, one server per node and
# servers over two nodes (ranks, dist-init), custom hosts and ports.
DESCRIPTIONS = {
    "1p1d_fp8": ll.Deployment(ib_device="mlx5_0"),
    "1p1d_w4": ll.Deployment(quantization="w4", ib_device="mlx5_1"),
    "2p2d_fp8_bf16": ll.Deployment(
        prefill_nodes=2,
        decode_nodes=2,
        kv_cache_dtype="bf16",
        ib_device="mlx5_0,mlx5_1",
        prefill_hosts=("10.1.0.1", "10.1.0.2"),
        decode_hosts=("10.2.0.1", "10.2.0.2"),
        prefill_port=31000,
        decode_port=32000,
        bootstrap_port=9100,
        router_port=8100,
    ),
    "2p2d_two_node_servers_w4": ll.Deployment(
        quantization="w4",
        prefill_nodes=2,
        decode_nodes=2,
        prefill_nodes_per_server=2,
        decode_nodes_per_server=2,
        ib_device="mlx5_0",
        dist_init_port=6000,
    ),
    "4p4d_two_node_servers_fp8": ll.Deployment(
        prefill_nodes=4,
        decode_nodes=4,
        prefill_nodes_per_server=2,
        decode_nodes_per_server=2,
        ib_device="mlx5_0",
    ),
}


# -------------------------------------------------------------------------- launcher
def _stub_ib_sysfs() -> None:
    """sglang's validate_ib_devices lists /sys/class/infiniband: list IB_DEVICES there."""
    import types

    import sglang.srt.arg_groups.validation_hook as validation

    real = validation.os
    path = types.SimpleNamespace(**vars(real.path))
    path.isdir = lambda p: p == IB_SYSFS or real.path.isdir(p)
    fake = types.SimpleNamespace(**vars(real))
    fake.path = path
    fake.listdir = lambda p: list(IB_DEVICES) if p == IB_SYSFS else real.listdir(p)
    validation.os = fake


def _launcher(mode: str, cases_path: str) -> None:
    _stub_ib_sysfs()
    if mode == "parse":
        import dry_parse

        sys.argv = [sys.argv[0], cases_path]
        dry_parse.main()
    else:
        import test_sizing

        test_sizing._driver(cases_path)


def start_launcher(mode: str, cases: list[dict], env: dict, tmp: Path, name: str):
    """This file as the launcher, in its own process (plugins load once per process);
    NSA_* and SGLANG_PLUGINS only as ``env`` gives them (as test_plugin_args.run_driver)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cases))
    full = {k: v for k, v in os.environ.items() if not k.startswith("NSA_")}
    full.pop("SGLANG_PLUGINS", None)
    full.update(env, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, __file__, mode, str(path)],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---------------------------------------------------------------------- the scripts
def record_script(dep: ll.Deployment, tmp: Path) -> dict[str, dict]:
    """Run the generated script once per node name with a recording ``python``: per name,
    the module, argv and NSA_* environment the shell passed."""
    script = tmp / "launch.sh"
    script.write_text(ll.render_script(dep))
    stub = tmp / "bin"
    stub.mkdir(exist_ok=True)
    recorder = (
        "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': "
        "{k: v for k, v in os.environ.items() if k.startswith('NSA_')}}))"
    )
    (stub / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{recorder}" "$@"\n')
    (stub / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NSA_")}
    env["PATH"] = f"{stub}:{env['PATH']}"
    env["NSA_KV_OFFLOAD"] = "1"  # exported by the operator: a prefill line must override it
    recorded = {}
    for line in ll.launch_lines(dep):
        done = subprocess.run(
            ["bash", str(script), line.name], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        call = json.loads(done.stdout)
        assert call["argv"][0] == "-m", call
        recorded[line.name] = {
            "module": call["argv"][1],
            "argv": call["argv"][2:],
            "env": call["env"],
            "line": line,
        }
    return recorded


def sglang_case(call: dict, model: Path) -> dict:
    argv = list(call["argv"])
    argv[argv.index("--model-path") + 1] = str(model)
    return {"argv": [*argv, *CPU_ONLY], "env": call["env"]}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """Every description's script recorded, then its sglang lines resolved: ECHO lines
    in a process with NSA_KV_OFFLOAD=1, prefill lines in one with their own value (0);
    plus one prefill line with NSA_KV_OFFLOAD=1 and one naming an IB device the machine
    lacks, to show what the generated values protect against."""
    tmp = tmp_path_factory.mktemp("launch_lines")
    model = tmp / "dsv32"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    calls = {}
    for name, dep in DESCRIPTIONS.items():
        (tmp / name).mkdir()
        calls[name] = record_script(dep, tmp / name)
    groups: dict[str, list[tuple[str, str]]] = {"1": [], "0": []}
    for desc, by_name in calls.items():
        for node, call in by_name.items():
            if call["module"] == "sglang.launch_server":
                groups[call["env"]["NSA_KV_OFFLOAD"]].append((desc, node))
    on = [sglang_case(calls[d][n], model) for d, n in groups["1"]]
    off = [sglang_case(calls[d][n], model) for d, n in groups["0"]]
    prefill = calls["1p1d_fp8"]["prefill-0"]
    extra = [sglang_case({**prefill, "env": {"NSA_KV_OFFLOAD": "1"}}, model)]
    missing_ib = dict(prefill, argv=[*prefill["argv"], "--disaggregation-ib-device", "mlx5_9"])
    off.append(sglang_case(missing_ib, model))
    procs = {
        "1": start_launcher("parse", on + extra, {"NSA_KV_OFFLOAD": "1"}, tmp, "on"),
        "0": start_launcher("parse", off, {"NSA_KV_OFFLOAD": "0"}, tmp, "off"),
    }
    out = {"calls": calls, "results": {}}
    for value, proc in procs.items():
        state, results = collect(proc)
        out[f"state_{value}"] = state
        keys = groups[value]
        for key, result in zip(keys, results[: len(keys)], strict=True):
            out["results"][key] = result
        out[f"extra_{value}"] = results[len(keys) :]
    return out


def results_of(resolved: dict, desc: str, role: str) -> list[tuple[dict, dict]]:
    """(recorded call, resolution) of each ``role`` line of ``desc``, in node order."""
    calls = resolved["calls"][desc]
    return [
        (call, resolved["results"][(desc, name)])
        for name, call in calls.items()
        if call["line"].role == role
    ]


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_the_script_passes_the_lines(resolved, desc):
    """What bash passes is the generator's lines, and the markdown shows the same ones."""
    dep = DESCRIPTIONS[desc]
    calls = resolved["calls"][desc]
    nodes = dep.prefill_nodes + dep.decode_nodes
    assert list(calls) == [*(f"prefill-{i}" for i in range(dep.prefill_nodes)),
                           *(f"decode-{i}" for i in range(dep.decode_nodes)),
                           "router", "server"]  # fmt: skip
    assert len(calls) == nodes + 2
    for call in calls.values():
        line = call["line"]
        assert call["module"] == line.module and call["argv"] == list(line.argv)
        # the exported NSA_KV_OFFLOAD=1 is overridden by each line's own setting
        assert call["env"] == {"NSA_KV_OFFLOAD": "1", **line.env}
    blocks = re.findall(r"```bash\n(.*?)```", ll.render_markdown(dep), re.S)
    shown = [shlex.split(block.replace("\\\n", " ")) for block in blocks]
    want = [
        [*(f"{k}={v}" for k, v in c["line"].env.items()), "python", "-m", c["module"], *c["argv"]]
        for c in calls.values()
    ]
    assert shown == want


@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_decode_lines_resolve_with_echo_on(resolved, desc):
    dep = DESCRIPTIONS[desc]
    assert resolved["state_1"]["echo_installed"]
    assert resolved["state_1"]["coordinator"] == "EchoCoordinator"
    decode = results_of(resolved, desc, "decode")
    assert len(decode) == dep.decode_nodes
    for call, result in decode:
        assert result.get("pickle_stable"), result.get("error")
        ranks = dep.gpus_per_node * dep.decode_nodes_per_server
        assert field(result, "disaggregation_mode") == "decode"
        assert field(result, "enable_hisparse") is True
        assert field(result, "tp_size") == field(result, "attn_dp_size") == ranks
        assert field(result, "disaggregation_decode_retraction_backup") == "none"
        check_echo_sizes(call, result, ranks, prompt_rows=0)


def check_echo_sizes(call: dict, result: dict, ranks: int, prompt_rows: int) -> None:
    """The per-rank plan, computed here from the line: S = ceil64(N_G + 1) + 64 x running
    (+ one prompt's rows on a non-PD server), running = N_G // top-k on every rank."""
    n_g = int(call["env"]["NSA_DEV_CACHE_SIZE"].replace("_", ""))
    host = int(flag(call["argv"], "--max-total-tokens"))
    running = n_g // TOP_K
    rows = math.ceil((n_g + 1) / PAGE) * PAGE + PAGE * running + prompt_rows
    config = json.loads(field(result, "hisparse_config"))
    assert (config["echo_dev_cache"], config["echo_host_tokens"]) == (n_g, host)
    assert config["echo_device_rows"] == field(result, "max_total_tokens") == rows
    assert field(result, "max_running_requests") == running * ranks
    ratio = config["host_to_device_ratio"]
    assert rows * ratio - PAGE >= host > rows * (ratio - 1) - PAGE  # T fits the host pool


@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_prefill_lines_resolve_without_the_plugin(resolved, desc):
    dep = DESCRIPTIONS[desc]
    state = resolved["state_0"]
    assert state["echo_plugin_loaded"] and not state["echo_installed"]
    assert state["coordinator"] == "HiSparseCoordinator"
    prefill = results_of(resolved, desc, "prefill")
    assert len(prefill) == dep.prefill_nodes
    for call, result in prefill:
        assert call["env"] == {"NSA_KV_OFFLOAD": "0"}
        assert field(result, "disaggregation_mode") == "prefill"
        assert field(result, "enable_hisparse") is False
        assert field(result, "hisparse_config") is None
        assert field(result, "tp_size") == dep.gpus_per_node * dep.prefill_nodes_per_server
        assert field(result, "disaggregation_bootstrap_port") == dep.bootstrap_port


def test_the_plugin_refuses_a_prefill_line_with_echo_on(resolved):
    """Why the prefill lines say NSA_KV_OFFLOAD=0: with 1 (e.g. exported) they stop."""
    (refused,) = resolved["extra_1"]
    assert "--disaggregation-mode prefill" in refused.get("error", ""), refused


def test_sglang_checks_the_ib_device_it_is_given(resolved):
    """The stubbed sysfs keeps sglang's own check: a device the node lacks is refused,
    so the generated --disaggregation-ib-device values above were checked too."""
    (refused,) = resolved["extra_0"]
    assert "mlx5_9" in refused.get("error", "") and "Available devices" in refused["error"]


@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_both_sides_of_every_pd_pair_agree(resolved, desc):
    dep = DESCRIPTIONS[desc]
    sides = results_of(resolved, desc, "prefill") + results_of(resolved, desc, "decode")
    for call, _ in sides:  # stated explicitly on both sides, not left to defaults
        assert flag(call["argv"], "--page-size") == "64"
        assert flag(call["argv"], "--kv-cache-dtype") == dep.kv_dtype
    layout = {
        (
            field(r, "page_size"),
            field(r, "kv_cache_dtype"),
            field(r, "disaggregation_transfer_backend"),
            field(r, "disaggregation_ib_device"),
        )
        for _, r in sides
    }
    assert layout == {(64, dep.kv_dtype, "mooncake", dep.ib_device)}


@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_multi_node_ranks_are_consistent(resolved, desc):
    dep = DESCRIPTIONS[desc]
    for role in ("prefill", "decode"):
        per = dep.per_server(role)
        results = results_of(resolved, role=role, desc=desc)
        servers: dict[object, list] = {}
        for call, result in results:
            addr = field(result, "dist_init_addr")
            key = addr if per > 1 else call["line"].host  # one server per node otherwise
            servers.setdefault(key, []).append((call, result))
        assert len(servers) == len(results) // per
        for addr, members in servers.items():
            assert [field(r, "nnodes") for _, r in members] == [per] * per
            assert sorted(field(r, "node_rank") for _, r in members) == list(range(per))
            assert len({field(r, "tp_size") for _, r in members}) == 1
            if per == 1:
                assert field(members[0][1], "dist_init_addr") is None
                continue
            # the address is the rank-0 node's, at the dist-init port
            (first,) = [c for c, r in members if field(r, "node_rank") == 0]
            assert addr == f"{first['line'].host}:{dep.dist_init_port}"


def parse_router(argv: list[str]) -> argparse.Namespace:
    """sglang_router.launch_router's PD flags as its CLI defines them (not installed
    here): ``--prefill URL [BOOTSTRAP_PORT]`` and ``--decode URL``, each repeatable."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--pd-disaggregation", action="store_true")
    parser.add_argument("--prefill", nargs="+", action="append", default=[])
    parser.add_argument("--decode", nargs=1, action="append", default=[])
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    return parser.parse_args(argv)


@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_the_router_names_every_server(resolved, desc):
    dep = DESCRIPTIONS[desc]
    router = resolved["calls"][desc]["router"]
    assert router["module"] == "sglang_router.launch_router" and router["env"] == {
        "NSA_KV_OFFLOAD": "1"  # the operator's export; the router does not read it
    }
    args = parse_router(router["argv"])
    assert args.pd_disaggregation and args.port == dep.router_port

    def rank0(role: str) -> list[tuple[dict, dict]]:
        return [(c, r) for c, r in results_of(resolved, desc, role) if field(r, "node_rank") == 0]

    want_prefill = [
        [
            f"http://{c['line'].host}:{field(r, 'port')}",
            str(field(r, "disaggregation_bootstrap_port")),
        ]
        for c, r in rank0("prefill")
    ]
    want_decode = [[f"http://{c['line'].host}:{field(r, 'port')}"] for c, r in rank0("decode")]
    assert args.prefill == want_prefill
    assert args.decode == want_decode
    assert len(want_prefill) == dep.prefill_nodes // dep.prefill_nodes_per_server
    assert len(want_decode) == dep.decode_nodes // dep.decode_nodes_per_server
    # the hosts are the description's, in order
    assert [c["line"].host for c, _ in results_of(resolved, desc, "prefill")] == list(
        dep.hosts("prefill")
    )
    assert [c["line"].host for c, _ in results_of(resolved, desc, "decode")] == list(
        dep.hosts("decode")
    )


@pytest.mark.parametrize("desc", list(DESCRIPTIONS))
def test_the_non_pd_line_resolves_with_dp_attention(resolved, desc):
    dep = DESCRIPTIONS[desc]
    ((call, result),) = results_of(resolved, desc, "server")
    assert "--tp" not in call["argv"]  # not plain TP: per-rank pools
    assert field(result, "disaggregation_mode") == "null"
    assert field(result, "enable_hisparse") is True
    # sglang 0.5.23 turns --dp-size N --enable-dp-attention into attn_dp_size = N
    ranks = dep.gpus_per_node
    assert field(result, "tp_size") == field(result, "attn_dp_size") == ranks
    assert field(result, "context_length") == dep.context_length
    assert (field(result, "page_size"), field(result, "kv_cache_dtype")) == (64, dep.kv_dtype)
    prompt = math.ceil(dep.context_length / PAGE) * PAGE
    check_echo_sizes(call, result, ranks, prompt_rows=prompt)


# ------------------------------------------------------------------- default sizes
@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    """The default sizes of every (checkpoint, KV dtype) resolved with the memory of the
    GPU they are meant for (test_sizing's driver and configs: DeepSeek-V3.2's config.json
    and the W4 checkpoint's), one-node servers and a two-node decode server; and the
    non-PD line at the decode sizes (why the server's are smaller)."""
    import test_sizing as ts

    tmp = tmp_path_factory.mktemp("launch_sizes")
    for name, config in ts.CONFIGS.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
    runs, wanted = [], {}

    def add(name: str, dep: ll.Deployment, node: str) -> None:
        line = next(x for x in ll.launch_lines(dep) if x.name == node)
        model = "w4" if dep.quantization == "w4" else "dsv32"
        argv = ts.with_flag(list(line.argv), "--model-path", str(tmp / model))
        env = {k: v for k, v in line.env.items() if k != "NSA_KV_OFFLOAD"}
        gpu = ll.GPU_OF[dep.quantization]
        runs.append(
            {"name": name, "argv": [*argv, "--device", "cuda", "--skip-tokenizer-init"],
             "env": env, "gpu_mib": ts.GPU_MIB[gpu], "node_memory": ts.NODE_MEMORY}
        )  # fmt: skip
        wanted[name] = (dep, line)

    for quant, kv in ll.DECODE_SIZES:
        dep = ll.Deployment(quantization=quant, kv_cache_dtype=kv, ib_device="mlx5_0")
        add(f"decode-{quant}-{kv}", dep, "decode-0")
        add(f"server-{quant}-{kv}", dep, "server")
        two = ll.Deployment(quantization=quant, kv_cache_dtype=kv, decode_nodes=2,
                            decode_nodes_per_server=2, ib_device="mlx5_0")  # fmt: skip
        add(f"decode2-{quant}-{kv}", two, "decode-1")
    n_g, t = ll.DECODE_SIZES[("none", "fp8_e4m3")]
    big = ll.Deployment(server_dev_cache_size=n_g, server_host_tokens=t)
    add("server-at-decode-sizes", big, "server")
    proc = start_launcher("sizing", runs, {"NSA_KV_OFFLOAD": "1"}, tmp, "sizes")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    results = {}
    for row in out.splitlines():
        if row.startswith("CASE "):
            result = json.loads(row[5:])
            results[result["name"]] = {**result, "dep": wanted[result["name"]][0]}
    assert set(results) == set(wanted)
    return results


def test_the_defaults_are_readmes():
    """The checkpoints, their GPUs and the decode sizes are those of README's PD lines
    (test_sizing.py checks that those fit)."""
    import test_sizing as ts

    for quant, path in ll.DEFAULT_MODEL_PATH.items():
        assert ll.GPU_OF[quant] == ts.GPU_OF[ts.MODELS[path]]
    readme = {
        flag(argv, "--quantization"): (
            env["NSA_DEV_CACHE_SIZE"],
            int(flag(argv, "--max-total-tokens")),
        )
        for env, argv in ts.readme_launch_lines()
        if flag(argv, "--disaggregation-mode") == "decode"
    }
    assert readme == {
        ll.QUANTIZATIONS[q]: ll.DECODE_SIZES[(q, "fp8_e4m3")] for q in ll.QUANTIZATIONS
    }
    assert set(ll.DECODE_SIZES) == set(ll.SERVER_SIZES)


@pytest.mark.parametrize(
    "name",
    [f"{kind}-{q}-{kv}" for q, kv in ll.DECODE_SIZES for kind in ("decode", "decode2", "server")],
)
def test_default_sizes_fit_their_gpu(sized, name):
    result = sized[name]
    assert result["error"] is None, result["error"]
    budget = re.search(r"GPU total ([\d.]+) GiB <= KV budget ([\d.]+) GiB", result["log"])
    assert budget, result["log"]
    assert float(budget[1]) <= float(budget[2])
    assert result["fields"]["kv_cache_dtype"] == result["dep"].kv_dtype


def test_the_server_needs_its_smaller_sizes(sized):
    """At a decode node's sizes the non-PD server does not fit (its prompt rows, and
    sglang's smaller fraction for a non-PD server): the plugin refuses it."""
    error = sized["server-at-decode-sizes"]["error"] or ""
    assert "do not fit the GPU" in error, error


# ------------------------------------------------------------------ bad descriptions
BAD = {
    "no_prefill": (["--prefill-nodes", "0"], "--prefill-nodes 0"),
    "no_decode": (["--decode-nodes", "0"], "--decode-nodes 0"),
    "kv_dtype": (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2"),
    "w4_bf16": (["--quantization", "w4", "--kv-cache-dtype", "bf16"], "--quantization w4 with"),
    "gpus_not_dividing": (["--gpus-per-node", "6"], "TP 6, which does not divide"),
    "no_gpus": (["--gpus-per-node", "0"], "--gpus-per-node 0"),
    "nodes_not_divisible": (
        ["--decode-nodes", "3", "--decode-nodes-per-server", "2"],
        "--decode-nodes 3 is not divisible by --decode-nodes-per-server 2",
    ),
    "hosts_count": (
        ["--prefill-nodes", "2", "--prefill-hosts", "10.0.0.1"],
        "--prefill-hosts names 1 host(s) but --prefill-nodes is 2",
    ),
    "host_twice": (["--decode-nodes", "2", "--decode-hosts", "a,a"], "names a host twice"),
    "host_url": (["--prefill-hosts", "http://10.0.0.1"], "no scheme"),
    "dev_cache_text": (["--dev-cache-size", "12k"], "NSA_DEV_CACHE_SIZE='12k'"),
    "dev_cache_small": (["--server-dev-cache-size", "1000"], "top-2048"),
    "host_pool": (["--max-total-tokens", "0"], "--max-total-tokens 0"),
    "port_clash": (["--bootstrap-port", "30000"], "they must differ"),
    "port_range": (["--router-port", "70000"], "--router-port 70000: a TCP port"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_descriptions_fail_clearly(name, capsys):
    argv, message = BAD[name]
    assert ll.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no partial script
    assert "cannot generate launch lines" in captured.err and message in captured.err


def test_every_problem_is_reported_at_once(capsys):
    argv = [arg for name in ("no_prefill", "kv_dtype", "port_range") for arg in BAD[name][0]]
    assert ll.main(argv) == 2
    err = capsys.readouterr().err
    assert all(BAD[name][1] in err for name in ("no_prefill", "kv_dtype", "port_range"))


def test_unknown_quantization_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        ll.main(["--quantization", "int8"])
    assert exc.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


def test_the_script_rejects_an_unknown_node(tmp_path):
    script = tmp_path / "launch.sh"
    assert ll.main(["--out", str(script)]) == 0
    done = subprocess.run(["bash", str(script), "decode-7"], capture_output=True, text=True)
    assert done.returncode == 2 and "prefill-0|decode-0|router|server" in done.stderr


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit):
        ll.main(["--help"])
    text = capsys.readouterr().out
    for option in ll.build_parser()._option_string_actions:
        assert option in text


def test_the_module_imports_no_torch():
    """Pure Python: the CLI runs where torch and sglang are not installed."""
    code = "import sys, sglang_echo.sglang.launch_lines; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# ------------------------------------------------------------------------ the docs
def doc_command() -> list[str]:
    """The generator's arguments that docs/LAUNCH.md says it was generated with."""
    found = re.search(r"Generated by `([^`]*)`", LAUNCH_DOC.read_text())
    assert found, "docs/LAUNCH.md does not say which command generates it"
    words = shlex.split(found[1])
    assert words[:3] == ll.COMMAND.split() and "--markdown" in words
    return words[3:]


def test_launch_doc_is_the_generators_output(capsys):
    assert ll.main(doc_command()) == 0
    assert LAUNCH_DOC.read_text() == capsys.readouterr().out, (
        f"docs/LAUNCH.md is stale: {ll.COMMAND} {shlex.join(doc_command())} > docs/LAUNCH.md"
    )


def test_launch_doc_shows_a_resolved_description():
    """The documented description is one of those resolved above."""
    ns = ll.build_parser().parse_args(doc_command())
    assert ll.deployment_from_args(ns) in DESCRIPTIONS.values()


if __name__ == "__main__":
    _launcher(sys.argv[1], sys.argv[2])
