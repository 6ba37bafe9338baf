"""Localize the H200 finding of tests/test_serving_gpu.py: under the serving scheduler,
ECHO's greedy tokens differed from the plain pool's on the same arrival sequence (both
with CUDA-graph decode), while the CPU tests and the offline Engine's GPU tests agree.
Prints equal / DIFF for eager decode, eager without the Triton recall kernel, graphs for
every batch size, graphs up to 4 with eager beyond, and graphs without staggered arrivals.
Usage on the GPU machine: python3 benchmark/serving_gpu_probe.py"""

import random
import sys

import torch

sys.path.insert(0, "python")
sys.path.insert(0, ".")  # scripts/ (run from the repository root)
from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from sglang_echo.config import EchoConfig, settings
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.step_runner import StepRunner

ck = make_tiny_checkpoint("/tmp/probe_ckpt", TinySpec(seed=0))
kernels = ModelKernels.from_settings(settings())  # SGLANG_ECHO_SPARSE_MLA, _BATCH_INVARIANT
model = load_model(ck, device="cuda", dtype=torch.float32, kernels=kernels)
cfg = model.config
rng = random.Random(3)
prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(5, 80))] for _ in range(14)]
NEW, MR, CH = 12, 6, 32
cap = sum(len(p) + NEW for p in prompts)


def serve(cache, graph, gbs, stagger=True):
    steps = StepRunner(model, cache, cap, MR, 128, use_cuda_graph=graph, cuda_graph_max_bs=gbs)
    s = Scheduler(steps, MR, CH, 128, [1])
    reqs = [
        ServeRequest(
            p, rid=str(i), params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    for i, r in enumerate(reqs):
        s.add(r)
        if stagger and i % 3 == 0:
            s.step()
    while s.has_work():
        s.step()
    return [r.output for r in reqs]


n_g = EchoConfig(offload=True).min_dev_cache_size(MR, cfg.index_topk, CH)


def echo(kern=None):
    return EchoKVCache(
        EchoConfig(offload=True, dev_cache_size=n_g),
        cfg.num_hidden_layers,
        cap,
        cfg.kv_row_dim,
        cfg.index_row_dim,
        torch.float32,
        "cuda",
        use_kernels=kern,
        index_dtype=cfg.index_row_dtype(torch.float32),
    )


def plain():
    return PlainKVCache.for_model(cfg, cap, torch.float32, "cuda")


for name, graph, gbs, kern, stag in [
    ("eager", False, None, None, True),
    ("eager-nokern", False, None, False, True),
    ("graph-all", True, 6, None, True),
    ("graph-4", True, 4, None, True),
    ("graph-all-nostagger", True, 6, None, False),
]:
    model.set_graph_safe(graph)
    a = serve(plain(), graph, gbs, stag)
    b = serve(echo(kern), graph, gbs, stag)
    diff = sum(x != y for r, e in zip(a, b, strict=False) for x, y in zip(r, e, strict=False))
    print(name, "equal" if a == b else f"DIFF tokens={diff}", flush=True)
