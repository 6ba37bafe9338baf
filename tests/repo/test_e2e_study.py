"""The end-to-end study's harness on the CPU (issue 14): the routed MoE equals its dense
reference, synthetic prompt KV is deterministic by seed, the fake-transfer decode node
admits, decodes and releases with nothing leaked, the locality knob moves ECHO's hit rate
the way it claims, and ``benchmark/e2e_study.py --smoke`` writes a complete record."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmark.e2e.lossless import (
    MIN_TOKENS_COMPARED,
    first_difference,
    outputs_agree,
    tokens_in_common,
)
from benchmark.e2e.measure import joint_groups
from benchmark.e2e.plan import StudyPlan, tag
from benchmark.study.decode_node import DecodeNode
from benchmark.study.locality import Locality
from benchmark.study.moe import (
    LocalRoutedMoE,
    bytes_table,
    combine_pairs,
    experts_touched,
    has_grouped_mm,
)
from benchmark.study.worker import SMOKE_DIMS, SMOKE_MOE, build_worker, study_config
from sglang_echo.config import EchoConfig
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.offload.device_cache import ABSENT, FREE
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.runtime.synthetic_kv import SyntheticKV

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def worker():
    cfg = study_config(SMOKE_DIMS, 2, 64, 2048, "fp8_hadamard")
    model, directions = build_worker(cfg, SMOKE_MOE, torch.float32, "cpu")
    return cfg, model, directions


# ------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_routed_moe_equals_dense_reference(impl: str, batch: int) -> None:
    if impl == "grouped_mm" and not has_grouped_mm():
        pytest.skip("torch has no _grouped_mm")
    moe = LocalRoutedMoE(
        64, intermediate=16, local_experts=4, global_experts=16, top_k=2, dp_ranks=4,
        impl=impl, seed=batch,
    )  # fmt: skip
    x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch))
    out, ref = moe(x).float(), moe.reference(x)
    routed = ref - moe.shared(x)
    assert routed.norm() > 0.1 * ref.norm()  # the routed part is really there
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # Only routed pairs are computed: the experts touched are those the global batch picks.
    _, experts, _ = moe.route(x)
    assert int(moe.touched) == len({e for e in experts.reshape(-1).tolist() if e < 4})


def test_moe_combine_does_not_depend_on_the_lane_order() -> None:
    """The combine's bits depend on the pairs only: the same pairs in another lane order (as
    atomics on CUDA, or another expert layout, would add them) give the same output.
    Magnitudes 1e8 and 1 make the float32 sum's order visible, so an order-dependent
    combine (``index_add_`` in lane order) fails here."""
    gen = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 5, 4, 16
    contrib = torch.randn(tokens * top_k, hidden, generator=gen)
    contrib[::3] *= 1e8
    pair_id = torch.randperm(tokens * top_k, generator=gen)
    live = torch.rand(tokens * top_k, generator=gen) > 0.2
    contrib[~live] = float("nan")  # dead lanes never leak in
    out = combine_pairs(contrib, pair_id, live, tokens, top_k)
    assert torch.isfinite(out).all()
    for seed in range(20):
        perm = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(seed))
        again = combine_pairs(contrib[perm], pair_id[perm], live[perm], tokens, top_k)
        assert torch.equal(out, again)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    ref.index_add_(0, pair_id[live] // top_k, contrib[live].double())
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-3 * ref.abs().max().item())


def test_bytes_table_follows_the_touch_formula() -> None:
    assert experts_touched(1) == pytest.approx(32 * (1 - (31 / 32) ** 8))
    rows = bytes_table([1, 3, 17, 64])
    assert [r["experts_touched"] for r in rows] == sorted(r["experts_touched"] for r in rows)
    assert rows[-1]["experts_touched"] == pytest.approx(32, abs=1e-3)
    assert rows[0]["moe_bytes"] < rows[-1]["moe_bytes"]


# ---------------------------------------------------------------- synthetic KV
def test_synthetic_kv_is_deterministic_by_seed(worker) -> None:
    cfg, _, directions = worker
    synth = SyntheticKV(cfg, directions, Locality(0.5), torch.float32, "cpu")
    kv_a, keys_a = synth.rows(1, 300, seed=7)
    kv_b, keys_b = synth.rows(1, 300, seed=7)
    kv_c, keys_c = synth.rows(1, 300, seed=8)
    assert torch.equal(kv_a, kv_b) and torch.equal(keys_a, keys_b)
    assert not torch.equal(kv_a, kv_c) and not torch.equal(keys_a, keys_c)
    assert kv_a.shape == (300, cfg.kv_row_dim) and keys_a.shape == (300, cfg.index_row_dim)
    assert keys_a.dtype == torch.uint8  # fp8 rows + scale, as the model caches them
    # the MLA rows are a window into the layer's bank: other layers get other rows
    assert torch.equal(kv_a, synth.kv_window(1, 300, seed=7).materialize())
    assert not torch.equal(kv_a, synth.rows(0, 300, seed=7)[0])
    hot = synth.hot_positions(range(0, 2), 300, seed=7)
    assert hot.shape == (2, round(0.5 * cfg.index_topk))
    assert torch.equal(hot[1], synth.hot_positions(range(1, 2), 300, seed=7)[0])
    # a transfer makes keys a group of layers at a time: each layer's from its own draw
    # (the group's batched arithmetic may round a few bytes differently from a group of one)
    group = synth.keys_of(range(0, 2), 300, seed=7)
    assert torch.equal(group, synth.keys_of(range(0, 2), 300, seed=7))
    assert (group[1] == keys_a).float().mean() > 0.95
    assert (group[0] == keys_a).float().mean() < 0.5


def _echo_node(cfg, model, directions, stable: float, n_g: int, host: int):
    kv = echo_cache_for_model(
        EchoConfig(offload=True, dev_cache_size=n_g), cfg, host, torch.float32, "cpu"
    )
    runner = StepRunner(model, kv, host, max_requests=n_g // cfg.index_topk, max_context=900)
    synth = SyntheticKV(cfg, directions, Locality(stable), torch.float32, "cpu")
    return kv, runner, DecodeNode(runner, synth, cfg.vocab_size)


def test_decode_node_admits_decodes_releases_without_leaks(worker) -> None:
    cfg, model, directions = worker
    # No-offload: prompt rows land in the device pool at the request's locations.
    plain = PlainKVCache.for_model(cfg, 1200, torch.float32, "cpu")
    runner = StepRunner(model, plain, 1200, max_requests=4, max_context=900)
    synth = SyntheticKV(cfg, directions, Locality(0.9), torch.float32, "cpu")
    node = DecodeNode(runner, synth, cfg.vocab_size)
    req = node.admit(400, seed=3, max_new_tokens=5)
    kv_rows, _ = synth.rows(0, 400, seed=3)
    assert torch.equal(plain.kv[0, torch.tensor(req.locs)], kv_rows)
    assert not node.fits(700, 100)  # 400 + 4 reserved + 800 > 1200
    for _ in range(4):
        node.step()
    assert not node.running and len(req.output) == 5  # finished and released
    assert runner.allocator.num_free == 1200 and runner.table.num_free_rows == 4

    # ECHO with evictions: host rows + device index keys at admission, and rows in free
    # slots while they last (never evicting): the first request's first 64 here.
    kv, runner, node = _echo_node(cfg, model, directions, 0.5, n_g=64, host=2000)
    reqs = [node.admit(300 + 10 * i, seed=i, max_new_tokens=20) for i in range(4)]
    assert kv.cache.free_count.tolist() == [0, 0] and sum(kv.telemetry()["evictions"]) == 0
    first = torch.tensor(reqs[0].locs)
    placed = kv.cache.host_to_device[:, first] != ABSENT
    assert placed[:, :64].all() and not placed[:, 64:].any()
    for layer in range(2):
        slots = kv.cache.host_to_device[layer, first[:64]].long()
        assert torch.equal(kv.cache.rows[layer, slots], kv.host.rows[layer, first[:64]])
    for r in reqs[1:]:
        assert (kv.cache.host_to_device[:, torch.tensor(r.locs)] == ABSENT).all()
    synth = SyntheticKV(cfg, directions, Locality(0.5), torch.float32, "cpu")
    (group,) = synth.layer_groups(320)  # both layers' keys made in one pass, as written
    host_rows, keys = synth.kv_window(1, 320, seed=2).materialize(), synth.keys_of(group, 320, 2)[1]
    locs = torch.tensor(reqs[2].locs)
    assert torch.equal(kv.host.rows[1, locs], host_rows)
    assert torch.equal(kv.index[1, locs], keys)
    for _ in range(6):
        node.step()
    assert sum(kv.telemetry()["evictions"]) > 0
    node.release(reqs[0])
    for _ in range(2):
        node.step()
    node.release_all()
    c = kv.cache
    assert runner.allocator.num_free == 2000 and runner.table.num_free_rows == 4
    assert c.free_count.tolist() == [64, 64]
    assert (c.host_to_device[:, 1:2001] == ABSENT).all()
    assert (c.device_to_host[:, 1:65] == FREE).all()


def test_locality_knob_moves_the_hit_rate(worker) -> None:
    cfg, model, directions = worker
    rates = {}
    for stable in (0.0, 0.5, 0.9):
        kv, _, node = _echo_node(cfg, model, directions, stable, n_g=64, host=3000)
        for i in range(4):
            node.admit(600 + 10 * i, seed=i, max_new_tokens=20)
        for _ in range(3):
            node.step()
        kv.cache.reset_telemetry()
        for _ in range(6):
            node.step()
        rates[stable] = sum(kv.telemetry()["hit_rate"]) / cfg.num_hidden_layers
        node.release_all()
    assert Locality(0.0).source == "random" and Locality(0.9).source == "synthetic-keys:0.9"
    assert rates[0.0] < rates[0.5] < rates[0.9]
    # The stable fraction is a floor (once warm) and the claim is "about p".
    assert rates[0.5] >= 0.45 and rates[0.9] >= 0.85
    assert rates[0.0] < 0.4


@pytest.fixture(scope="module")
def e2e_study():
    spec = importlib.util.spec_from_file_location("e2e_study", ROOT / "benchmark/e2e_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_study"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_e2e_study_schedule_interleaves_baselines(e2e_study, tmp_path: Path) -> None:
    """Each ratio's two sides alternate within one block, repeat by repeat; a baseline
    whose ECHO engine is not selected still gets its repeats."""
    args = e2e_study.parse_args(["--smoke", "--out", str(tmp_path), "--repeats", "3"])
    args.profile_steps = 3  # as on the GPU (the smoke run profiles nothing)
    blocks = StudyPlan(args).schedule()
    order = [[f"{e.label}/{tag(ph)}" for e, ph in block] for block in blocks]
    paper = order[0]
    assert paper[:6] == [
        "noff_paper/full", "echo_paper/full", "noff_paper/full#1", "echo_paper/full#1",
        "noff_paper/full#2", "echo_paper/full#2",
    ]  # fmt: skip
    assert paper.count("echo_paper/random") == 1  # unrepeated phases run once
    i = paper.index("noff_low/b1")
    assert paper[i : i + 6] == [
        "noff_low/b1", "echo_inline/b1", "echo_paper/b1",
        "noff_low/b1#1", "echo_inline/b1#1", "echo_paper/b1#1",
    ]  # fmt: skip
    # The low-load phases run alternated, a repeat's three engines together.
    low = [g for g in joint_groups(blocks[0]) if g[0][1].label == "b1"]
    assert [[e.label for e, _ in g] for g in low] == [["noff_low", "echo_inline", "echo_paper"]] * 3
    assert [g[0][0].label for g in joint_groups(blocks[0])][:2] == ["noff_paper", "echo_paper"]
    assert ["echo_pressure/b2"] in order and order[-2][:2] == ["noff_400/full", "echo_400/full"]
    profiled = {ph.repeat for block in blocks for e, ph in block if ph.profile}
    assert profiled == {0}  # the profiler only ever slows the first measurement
    args = e2e_study.parse_args(["--smoke", "--out", str(tmp_path), "--only", "noff_paper"])
    alone = StudyPlan(args).schedule()
    assert [[f"{e.label}/{tag(ph)}" for e, ph in b] for b in alone] == [
        ["noff_paper/full", "noff_paper/full#1"]
    ]


def test_e2e_study_smoke_writes_the_record(e2e_study, tmp_path: Path) -> None:
    e2e_study.main(["--smoke", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "e2e_study.json").read_text())
    assert {"name", "device", "date", "command", "metrics", "config"} <= rec.keys()
    assert rec["complete"] and not rec["errors"]
    m = rec["metrics"]
    for key in (
        "ratio_paper_all_hbm", "ratio_paper_200k", "ratio_paper_110k", "ratio_equal_hbm_380k",
        "low_load_cost", "hit_rate_per_layer", "locality_source", "breakdown",
    ):  # fmt: skip
        assert m[key] is not None, key
    assert "hisparse_ratio_equal_hbm_380k" in m and m["locality_source"] == "synthetic-keys:0.9"
    assert m["echo_decode_prefetch"]["mode"] == "auto"  # the study runs the product default
    assert len(m["hit_rate_per_layer"]) == rec["config"]["layers"]
    # from admission on: the first step's recalls counted, so below the timed steps' rate
    seen = m["hit_rate_from_admission"]
    assert len(seen["per_layer"]) == rec["config"]["layers"]
    assert seen["decode_steps"] > rec["config"]["measured_steps"]
    assert sum(seen["per_layer"]) < sum(m["hit_rate_per_layer"])
    # the same counts step by step over the warm-up and fill: cumulative, one row a step,
    # its last row the before-timed part of the from-admission figure
    curve = m["hit_curve_from_admission"]
    steps = [row[0] for row in curve["rows"]]
    assert (
        steps == list(range(1, len(steps) + 1))
        and len(steps) == seen["decode_steps"] - rec["config"]["measured_steps"]
    )
    looked = [row[1] + row[2] for row in curve["rows"]]
    assert looked[0] > 0 and all(b > a for a, b in itertools.pairwise(looked))
    assert all(b[1] >= a[1] for a, b in itertools.pairwise(curve["rows"]))
    assert all(r["leak_free"] for r in rec["runs"])
    batches = {r["engine"]: r["batch"] for r in rec["runs"] if r["phase"] == "full"}
    assert batches["noff_paper"] == 3 and batches["echo_paper"] == 10  # the capacity rules
    assert m["hisparse_ratio_equal_hbm_380k"] is not None  # the per-request-buffer baseline
    hisparse = next(r for r in rec["runs"] if r["engine"].startswith("hisparse_equal"))
    assert hisparse["evictions_per_step"] > 0 and hisparse["leak_free"]
    for key in ("lossless_under_eviction", "lossless_under_eviction_hisparse"):
        pressure = m["details"][key]  # ECHO's and the HiSparse-like backend's, evicting
        assert pressure["evictions_per_step"] > 0 and pressure["greedy_outputs_equal"], key
        # every request of the batch compared, each over all the tokens the run decoded
        assert pressure["requests_compared"] == pressure["batch"], key
        decoded = 1 + rec["config"]["warmup_steps"] + rec["config"]["measured_steps"]
        assert pressure["min_tokens_per_request"] == decoded, key
        assert pressure["tokens_compared"] >= pressure["batch"] * decoded, key

    # Repeats: every repeated phase measured --repeats times; medians inside their range.
    repeats = rec["config"]["repeats"]
    assert m["repeats"] == repeats >= 2
    series = m["details"]["repeats"]
    assert {"noff_paper", "echo_paper", "noff_low/b1", "echo_paper/b1", "noff_400"} <= series.keys()
    assert all(len(v) == repeats and min(v) > 0 for v in series.values())
    d = m["details"]
    pairs = [d["paper_all_hbm"], *d["same_pools"].values(), *d["equal_hbm_380k"].values()]
    for r in [*pairs, *d["hisparse_equal_hbm_380k"].values()]:
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["repeats"] == {"echo": repeats, "no_offload": repeats}
    for key, spread in m["spread"].items():
        assert spread["ratio_min"] <= m[key] <= spread["ratio_max"], key
    assert m["spread"].keys() >= {"ratio_paper_all_hbm", "ratio_paper_200k", "ratio_equal_hbm_380k"}
    low = m["low_load_cost"]
    assert low["per_batch"].keys() == low["per_batch_range"].keys() == {"1", "2"}
    for b, (lo, hi) in low["per_batch_range"].items():
        assert lo <= low["per_batch"][b] <= hi
    # From steps taken side by side (alternated), beside ECHO without the step's defaults.
    assert all(how.startswith("paired steps") for how in low["method"].values())
    assert all(v is not None for v in low["inline_per_batch"].values())
    assert all(v is not None for v in low["inline_over_default_per_batch"].values())
    inline = [r for r in rec["runs"] if r["engine"] == "echo_inline"]
    assert len(inline) == 2 * repeats and all(r["leak_free"] for r in inline)
    assert inline[0]["echo_options"] == {
        "decode_place": False,
        "resolve_overlap": 0,
        "fuse_decode": "auto",  # the product default: only the two options differ
    }
    assert inline[0]["alternated_with"] == ["noff_low", "echo_paper"]
    assert len(inline[0]["step_ms_device_steps"]) == rec["config"]["measured_steps"]
    assert all(d["greedy_outputs_equal_at_low_load"].values())  # every repeat, both sides

    # The 61-layer estimate: labelled, from a fixed part timed in this run, same batches.
    est = m["estimate_61_layers"]
    assert est["estimate"] is True and "ESTIMATE" in est["label"]
    assert est["fixed_part"].startswith("measured in this run")
    for key in ("ratio_paper_all_hbm", "ratio_paper_200k", "ratio_paper_110k",
                "ratio_equal_hbm_380k", "hisparse_ratio_equal_hbm_380k"):  # fmt: skip
        assert est["ratios"][key] > 0, key
    paper = est["settings"]["ratio_paper_all_hbm"]
    assert paper["offload"]["batch"] == 10 and paper["no_offload"]["batch"] == 3
    for side in (paper["offload"], paper["no_offload"]):
        assert 0 < side["fixed_ms"] < side["step_ms_measured"] < side["step_ms_61"]
        assert side["step_ms_61"] == pytest.approx(
            side["fixed_ms"] + 61 * side["layer_ms"], abs=1e-2
        )
    assert paper["capacity"]["no_offload"]["pool_tokens"] == 820
    assert any("dense" in note for note in est["notes"])


def test_e2e_study_smoke_at_fp8_kv(e2e_study, tmp_path: Path) -> None:
    """``--kv-cache-dtype fp8_e4m3``: every backend stores fp8 rows (the smoke latent
    becomes one 128-wide tile), the equal-HBM split counts their bytes, and ECHO and the
    HiSparse-like backend stay lossless under eviction at that KV dtype."""
    only = "noff_low,echo_pressure,hisparse_pressure,noff_paper,echo_equal_hbm_b6"
    e2e_study.main(["--smoke", "--out", str(tmp_path), "--kv-cache-dtype", "fp8_e4m3",
                    "--only", only, "--no-random-keys", "--locality-sweep", "", "--repeats", "1"])  # fmt: skip
    rec = json.loads((tmp_path / "e2e_study.json").read_text())
    cfg = rec["config"]
    assert rec["complete"] and not rec["errors"]
    assert cfg["kv_cache_dtype"] == "fp8_e4m3" and cfg["kv_row_bytes"] == 128 + 4 + 2 * 16
    det = rec["metrics"]["details"]
    for key in ("lossless_under_eviction", "lossless_under_eviction_hisparse"):
        assert det[key]["evictions_per_step"] > 0 and det[key]["greedy_outputs_equal"], key
    assert rec["metrics"]["ratio_equal_hbm_380k"] is not None


def test_e2e_study_smoke_decode_prefetch_ab(e2e_study, tmp_path: Path) -> None:
    """``--decode-prefetch``: echo_paper runs the product's default (auto) and the A/B's
    other side the same ECHO with the prefetch off, phase by phase, so the record's ratio
    compares the prefetch against its absence (not the default against itself)."""
    e2e_study.main(["--smoke", "--out", str(tmp_path), "--decode-prefetch", "--only",
                    "echo_paper,echo_noprefetch", "--locality-sweep", "", "--skip-components",
                    "--skip-fixed", "--repeats", "2"])  # fmt: skip
    rec = json.loads((tmp_path / "e2e_study.json").read_text())
    assert rec["complete"] and not rec["errors"]
    modes = {r["engine"]: r["echo_options"]["fuse_decode"] for r in rec["runs"]}
    assert modes == {"echo_paper": "auto", "echo_noprefetch": "0"}
    ab = rec["metrics"]["decode_prefetch_auto"]
    assert ab.keys() == {"full", "random"}
    for phase in ab.values():
        assert phase["repeats"] == 2 and phase["ratio_min"] <= phase["ratio"] <= phase["ratio_max"]
        assert phase["outputs_equal"] is True
    # The prefetching side kept its rule's counters: steps with the prefetch on, of all.
    assert all(len(phase["prefetch_steps_on_all"]) == 2 for phase in ab.values())
    mode = rec["metrics"]["echo_decode_prefetch"]
    assert mode["mode"] == "auto" and {"full", "random"} <= mode["steps_on_all"].keys()
    for on, steps in mode["steps_on_all"].values():  # each phase's own decode steps
        assert 0 <= on <= steps and steps > 0


def test_decode_node_echo_equals_no_offload_under_eviction(worker) -> None:
    """Same seeds, same batch: ECHO at its smallest legal cache (evicting every step) gives
    the no-offload node's greedy tokens."""
    cfg, model, directions = worker
    outputs = []
    for backend in ("no-offload", "echo"):
        if backend == "echo":
            kv, runner, node = _echo_node(cfg, model, directions, 0.5, n_g=48, host=2000)
        else:
            kv = PlainKVCache.for_model(cfg, 2000, torch.float32, "cpu")
            runner = StepRunner(model, kv, 2000, max_requests=3, max_context=900)
            synth = SyntheticKV(cfg, directions, Locality(0.5), torch.float32, "cpu")
            node = DecodeNode(runner, synth, cfg.vocab_size)
        reqs = [node.admit(500 + 7 * i, seed=i, max_new_tokens=12) for i in range(3)]
        while node.running:
            node.step()
        outputs.append([r.output for r in reqs])
        if backend == "echo":
            assert sum(kv.telemetry()["evictions"]) > 0
    assert outputs[0] == outputs[1]


def test_first_difference_names_request_and_token() -> None:
    same = [[1, 2, 3], [4, 5]]
    assert first_difference(same, [list(r) for r in same]) is None
    assert first_difference(same, [[1, 2, 3], [4, 9]]) == [1, 1]
    assert first_difference([[7, 2]], [[1, 2]]) == [0, 0]


def test_outputs_agree_over_the_common_length_only() -> None:
    """A profiled run's longer output that its repeat matches is agreement; a differing
    token, a missing request or an empty output is not."""
    long = [list(range(40)), list(range(100, 137))]
    short = [long[0][:33], long[1][:32]]
    assert outputs_agree(long, short) and outputs_agree(short, long)
    assert tokens_in_common(long, short) == 65
    assert not outputs_agree(long, [[*long[0][:5], 999, *long[0][6:]], long[1]])
    assert not outputs_agree(long, [long[0]])
    assert not outputs_agree(long, [[], long[1]])


def test_outputs_agree_needs_32_tokens_of_every_request() -> None:
    """The lossless check compares every request, each over at least 32 tokens: outputs of
    1 token (or of 31) that match prove nothing and are not agreement; no requests at all
    is not agreement either. A smaller bound is only for the smoke run, which decodes 6."""
    a = [list(range(50)), list(range(200, 250)), list(range(300, 350))]
    assert outputs_agree(a, [r[:32] for r in a])
    assert not outputs_agree(a, [r[:1] for r in a])  # 1-token outputs
    assert not outputs_agree(a, [a[0], a[1], a[2][:31]])  # one request short
    assert not outputs_agree([], [])
    assert MIN_TOKENS_COMPARED == 32
    assert outputs_agree([r[:6] for r in a], a, min_tokens=6)  # the smoke run's


def test_gpu_study_refuses_too_few_tokens_to_compare(e2e_study, tmp_path: Path) -> None:
    """Outside --smoke, a run that would decode fewer than 32 tokens per request (1 +
    --warmup + --steps) is refused before it starts."""
    with pytest.raises(SystemExit):
        e2e_study.parse_args(["--out", str(tmp_path), "--warmup", "2", "--steps", "8"])
    args = e2e_study.parse_args(["--out", str(tmp_path), "--warmup", "0", "--steps", "31"])
    assert 1 + args.warmup + args.steps == 32


def test_an_equal_hbm_split_without_room_for_a_step_is_skipped_with_its_reason(
    e2e_study, tmp_path: Path
) -> None:
    """A pool whose bytes go entirely to the host tokens' index keys (fp8 rows at the
    paper's pool and batch 24 did this) is not built and run into a ValueError: the record
    says why it was skipped, and the errors stay empty."""
    args = e2e_study.parse_args(["--smoke", "--out", str(tmp_path)])
    study = e2e_study.Study(args, [])
    study.setup.plan.equal_hbm_batches = [10_000]  # far more host tokens than the pool's bytes
    labels = [e.label for e in study.setup.engines()]
    study.setup.engines()
    assert not any(label.startswith(("echo_equal_hbm", "hisparse_equal_hbm")) for label in labels)
    assert len(study.setup.skipped) == 1 and "batch 10000" in study.setup.skipped[0]
    assert "not run" in study.setup.skipped[0] and not study.errors


def test_prefetch_precision_is_each_phases_share_of_the_cumulative_counters() -> None:
    """The prefetching engine's counters run over its life: a phase's staged and used rows
    are the difference from its run before the phase's first (not the totals)."""
    from benchmark.e2e.metrics import prefetch_auto

    def run(engine: str, phase: str, staged: int = 0, used: int = 0) -> dict:
        r = {"engine": engine, "phase": phase, "tokens_per_s_device": 100.0}
        r |= {"hit_rate_per_layer": [0.5], "outputs": [[1]]}
        if engine == "echo_paper":
            r |= {"prefetched_rows": staged, "prefetch_hits": used, "prefetch_steps": [1, 2]}
        return r

    runs = [
        run("echo_noprefetch", "full"),
        run("echo_paper", "full", 100, 40),
        run("echo_paper", "full", 300, 90),
        run("echo_noprefetch", "random"),
        run("echo_paper", "random", 1300, 890),
        run("echo_paper", "random", 2300, 1690),
    ]
    got = prefetch_auto(runs)
    assert (got["full"]["phase_staged_rows"], got["full"]["phase_staged_used"]) == (300, 90)
    assert (got["random"]["phase_staged_rows"], got["random"]["phase_staged_used"]) == (2000, 1600)
    assert got["random"]["phase_precision"] == 0.8 and got["random"]["repeats"] == 2
