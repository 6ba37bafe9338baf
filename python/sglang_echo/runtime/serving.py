"""Build what a server serves from its flags: model, KV backend, step runner, scheduler.

Sizes follow SGLang's rules where they apply: the token pool comes from
``--max-total-tokens`` or from the memory that ``--mem-fraction-static`` leaves after the
weights; under ECHO the device cache must hold one decode step's selections (max running
requests x top-k) and one prefill chunk, so unset defaults are capped to fit it and set
values that cannot fit fail here with the setting to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.offload import footprint
from sglang_echo.runtime import jit_watch
from sglang_echo.runtime.assemble import (
    build_kv_backend,
    check_context,
    check_kv_dtype,
    load_draft,
    resolve_start_up,
)
from sglang_echo.runtime.model_loader import load_served_model
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.server_args import (
    ServerArgError,
    ServerArgs,
    hisparse_buffer_size,
    speculative_num_steps,
)
from sglang_echo.runtime.speculative import SpecRounds
from sglang_echo.runtime.speculative_flags import check_nextn_layer
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.runtime.streams import on_engine_stream
from sglang_echo.tokenizer import load_tokenizer

DEFAULT_MAX_RUNNING = 64
DEFAULT_CHUNK = 8192


@dataclass
class Serving:
    args: ServerArgs
    model: DeepseekV32ForCausalLM
    kv_cache: KVCache
    scheduler: Scheduler
    tokenizer: object | None
    echo: EchoConfig
    info: dict = field(default_factory=dict)


def _token_bytes(
    cfg: DeepseekV32Config, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> tuple[int, int]:
    """(MLA row bytes as stored, indexer-key row bytes) of one token, summed over layers."""
    width, stored = cfg.kv_storage(dtype, kv_cache_dtype)
    kv = width * torch.empty(0, dtype=stored).element_size()
    idx = cfg.index_row_dim * torch.empty(0, dtype=cfg.index_row_dtype(dtype)).element_size()
    return kv * cfg.num_hidden_layers, idx * cfg.num_hidden_layers


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def memory_token_budget(
    cfg: DeepseekV32Config,
    dtype: torch.dtype,
    device: torch.device,
    echo: EchoConfig,
    mem_fraction: float,
    kv_cache_dtype: str = "auto",
) -> int:
    """Tokens the KV pool may hold given the memory left for it (as SGLang sizes it)."""
    kv_b, idx_b = _token_bytes(cfg, dtype, kv_cache_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - mem_fraction)
    else:
        budget = _host_available_bytes() * mem_fraction
    if budget <= 0:
        raise ServerArgError(
            f"--mem-fraction-static {mem_fraction} leaves no memory for the KV cache after "
            "the weights; raise it or give --max-total-tokens"
        )
    if not echo.offload:
        return int(budget // (kv_b + idx_b))
    # ECHO: the device keeps every token's indexer key and host-map entry, the bounded
    # cache (rows and metadata, as its owners count them: offload/footprint.py), one
    # allocation workspace and the manager's counters; the host keeps every token's rows.
    layers, n_g = cfg.num_hidden_layers, echo.dev_cache_size
    fixed = footprint.echo_device_bytes(layers, n_g, 0, kv_b // layers, echo.eviction_reserve)
    per_token = idx_b + footprint.host_map_bytes_per_token(layers)
    on_device = int((budget - fixed) // per_token)
    on_host = int(_host_available_bytes() * 0.5 // kv_b)
    return max(1, min(on_device, on_host))


def running_requests(asked: int | None, echo: EchoConfig, topk: int, q: int = 1) -> int:
    """Requests the scheduler runs at once: ``--max-running-requests`` as asked, else
    ``DEFAULT_MAX_RUNNING``, under ECHO capped by what one decode step's selections leave
    room for (``EchoConfig.max_running``, the capacity rule, with Q = ``q`` query tokens
    per request: S + 1 under speculative decoding). An asked value past the rule fails in
    ``build_kv_cache`` (``EchoConfig.validate``), or here under speculation
    (``EchoConfig.check_verify_batch``), naming the setting to change."""
    running = asked or DEFAULT_MAX_RUNNING
    if echo.offload and asked is None:
        running = max(1, min(running, echo.max_running(topk, queries_per_request=q)))
    if q > 1:
        echo.check_verify_batch(running, topk, q, batch_flag="--max-running-requests")
    return running


def check_speculative(args: ServerArgs, cfg: DeepseekV32Config) -> int:
    """Q = S + 1 under ``--speculative-algorithm`` (1 without): the flags as ``generate``
    validates them, and what this server cannot run with them, refused with the reason."""
    steps = speculative_num_steps(args)
    if steps is None:
        return 1
    check_nextn_layer(
        cfg.num_nextn_predict_layers, args.speculative_algorithm, args.model_path, ServerArgError
    )
    return steps + 1


def build_serving(args: ServerArgs, echo: EchoConfig | None = None) -> Serving:
    """``echo`` overrides the environment's ECHO settings (tests build both kinds)."""
    # Every Triton compile from here on is counted and logged (runtime/jit_watch.py): the
    # start-up's, and any a run meets that start-up did not cover.
    jit_watch.install()
    # The start-up generate shares (runtime/assemble.py): settings parsed once, handed down.
    start = resolve_start_up(args.device, args.dtype, echo, ServerArgError)
    device, dtype, dtype_name, echo = start.device, start.dtype, start.dtype_name, start.echo
    # --model-loader, or the checkpoint
    loaded = load_served_model(args, device, dtype, start.kernels)
    model = loaded.model
    cfg = model.config
    check_kv_dtype(cfg, dtype, args.kv_cache_dtype, ServerArgError)
    context = check_context(cfg, args.context_length, ServerArgError)
    topk = cfg.index_topk
    q = check_speculative(args, cfg)
    max_running = running_requests(args.max_running_requests, echo, topk, q)
    chunk = args.chunked_prefill_size or DEFAULT_CHUNK
    if chunk == -1:
        chunk = context
    if echo.offload and args.chunked_prefill_size is None:
        chunk = min(chunk, echo.dev_cache_size)
    frac = args.mem_fraction_static or (0.88 if device.type == "cuda" else 0.25)
    capacity = args.max_total_tokens
    if capacity is None:
        budget = memory_token_budget(cfg, dtype, device, echo, frac, args.kv_cache_dtype)
        capacity = min(budget, context * max_running)
    if capacity < 2:
        raise ServerArgError(f"the KV pool of {capacity} tokens is too small to serve")
    buffer = hisparse_buffer_size(args)
    kv_cache = build_kv_backend(
        start, cfg, capacity, max_running, chunk, args.kv_cache_dtype, hisparse_buffer=buffer
    )
    use_graph = start.cuda_graphs(args.disable_cuda_graph)
    steps = StepRunner(
        model,
        kv_cache,
        capacity,
        max_running,
        context,
        use_cuda_graph=use_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
    # Every decode shape captured now, before the server says it is ready
    # (runtime/cuda_graph.py): no capture lands in a client's step. Under MTP the rounds'
    # shapes instead (runtime/spec_graphs.py): a round replaces every decode step.
    captured = steps.capture_decode_graphs() if use_graph and q == 1 else 0
    tokenizer = load_tokenizer(args.model_path)
    detok = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
    fake = None
    if args.disaggregation_mode == "decode":
        from sglang_echo.runtime.fake_transfer import FakeTransfer

        fake = FakeTransfer(model, kv_cache, steps, loaded.synthetic_kv_locality, dtype)
    rounds = None
    if q > 1:
        draft = load_draft(args.model_path, start, model)
        rounds = SpecRounds(model, draft, steps, q - 1, capacity, graphs=use_graph)
        if rounds.graphs is not None:
            bound = min(args.cuda_graph_max_bs or max_running, max_running)
            with on_engine_stream(device):
                captured = rounds.graphs.capture_all(list(range(1, bound + 1)), q - 1)
    scheduler = Scheduler(
        steps,
        max_running,
        chunk,
        context,
        list(cfg.eos_token_ids),
        detok,
        prompt_source=fake,
        overlap=not args.disable_overlap_schedule,
        speculative=rounds,
    )
    info = {
        "model_path": args.model_path,
        "served_model_name": args.served_model_name or args.model_path,
        "tokenizer_path": args.model_path if tokenizer is not None else None,
        "is_generation": True,
        "device": str(device),
        "dtype": dtype_name,
        "kv_cache_dtype": args.kv_cache_dtype if args.kv_cache_dtype != "auto" else dtype_name,
        "context_length": context,
        "max_total_tokens": capacity,
        "max_running_requests": max_running,
        "chunked_prefill_size": chunk,
        "cuda_graph": use_graph,
        "cuda_graph_max_bs": args.cuda_graph_max_bs if use_graph else 0,
        "overlap_schedule": scheduler.overlap,
        "speculative_algorithm": "NEXTN" if q > 1 else None,
        "speculative_num_steps": q - 1 if q > 1 else None,
        "cuda_graphs_captured": captured,
        "kv_backend": "hisparse" if buffer else "echo" if echo.offload else "no-offload",
        "device_buffer_size": buffer,
        "nsa_dev_cache_size": echo.dev_cache_size if echo.offload else None,
        "index_topk": topk,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_hidden_layers,
        "disaggregation_mode": args.disaggregation_mode,
        "locality_source": fake.locality.source if fake is not None else None,
        "model_loader": args.model_loader,
        "model_loader_info": loaded.info,
    }
    return Serving(args, model, kv_cache, scheduler, tokenizer, echo, info)
