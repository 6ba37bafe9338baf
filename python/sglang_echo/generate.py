"""Offline generation: ``python -m sglang_echo.generate --help``.

Reads prompts (JSON lines of ``{"input_ids": [...]}`` or ``{"text": "..."}``), runs them
through the DeepSeek-V3.2 model with the no-offload pool or ECHO (``NSA_KV_OFFLOAD=1``),
writes ``{"input_ids", "output_ids"[, "text"]}`` lines in input order, and prints a
summary to stderr. Greedy by default; ``--temperature`` (with ``--top-p``, ``--top-k`` and
``--seed``) samples with the server's seeded sampler (runtime/sampling.py).

With ``--speculative-algorithm NEXTN`` (SGLang's flags; ``EAGLE`` is the same chain draft)
the checkpoint's MTP layer drafts and the model verifies (runtime/speculative.py): the
same tokens (greedy, or seeded sampling token for token), fewer target forwards when
drafts are accepted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from sglang_echo.config import ConfigError, HelpFormatter, help_epilog
from sglang_echo.kernels.fp8_kv import KV_CACHE_DTYPES
from sglang_echo.model.config import ModelConfigError
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.assemble import (
    StartUp,
    build_kv_backend,
    check_context,
    check_kv_dtype,
    load_draft,
    resolve_start_up,
)
from sglang_echo.runtime.engine import Engine, Request, RunStats
from sglang_echo.runtime.kv_factory import describe_kv_cache
from sglang_echo.runtime.protocol import SEED_RANGE
from sglang_echo.runtime.request import SamplingParams
from sglang_echo.runtime.speculative import SpeculativeGenerator
from sglang_echo.runtime.speculative_flags import (
    add_speculative_flags,
    check_nextn_layer,
)
from sglang_echo.runtime.speculative_flags import speculative_steps as validate_speculative
from sglang_echo.tokenizer import load_tokenizer


class InputError(ValueError):
    """A prompt or prompts file the model cannot run; the message says which line and why."""


def read_prompts(
    path: Path, tokenizer, vocab_size: int, max_prompt_len: int, context_limit: int
) -> list[list[int]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read prompts file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(
            f"prompts file {str(path)!r} is not UTF-8 text (byte {exc.start}); "
            "write JSON lines in UTF-8"
        ) from exc
    prompts: list[list[int]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object with 'input_ids' or 'text'")
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InputError(f"{where}: 'input_ids' must be a list of integers")
        elif "text" in record:
            if tokenizer is None:
                raise InputError(
                    f"{where}: has 'text' but the checkpoint ships no tokenizer.json; "
                    "give 'input_ids' instead"
                )
            if not isinstance(record["text"], str):
                raise InputError(f"{where}: 'text' must be a string")
            ids = tokenizer.encode(record["text"]).ids
        else:
            raise InputError(f"{where}: needs 'input_ids' (list of ints) or 'text' (string)")
        if not ids:
            raise InputError(f"{where}: the prompt is empty")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise InputError(
                f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        if len(ids) > max_prompt_len:
            raise InputError(
                f"{where}: prompt of {len(ids)} tokens plus the requested new tokens exceeds "
                f"the context limit of {context_limit}; shorten it or lower --max-new-tokens"
            )
        prompts.append(ids)
    if not prompts:
        raise InputError(f"prompts file {str(path)!r} holds no prompts")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_echo.generate",
        description=__doc__.split("\n\n")[0].split(": ")[0]
        + ". Greedy (or seeded sampled) decoding of a DeepSeek-V3.2 checkpoint; set NSA_KV_OFFLOAD=1 for ECHO "
        "(NSA_DEV_CACHE_SIZE = device cache slots per layer).",
        epilog=help_epilog(),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model-path", required=True, help="checkpoint folder (config.json, *.safetensors)"
    )
    p.add_argument(
        "--prompts-file",
        required=True,
        type=Path,
        help='JSON lines: {"input_ids": [...]} or {"text": "..."}',
    )
    p.add_argument(
        "--max-new-tokens", required=True, type=int, help="tokens to generate per prompt"
    )
    p.add_argument("--output", required=True, type=Path, help="JSON lines out, in input order")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda if available"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype (default float32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="how the MLA KV rows are stored: auto = the model dtype; fp8_e4m3 = fp8 rows "
        "(e4m3 latent in tiles of 128 with float32 scales, bf16 rope; SGLang's layout)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default 8)")
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool tokens (host pool under ECHO); default: what one batch needs",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="prompt tokens per prefill forward (default 8192)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + new tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token"
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode eagerly on CUDA (decode steps are captured in CUDA graphs by default)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_sampling_flags(p)
    add_speculative_flags(p)
    return p


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The server's sampling parameters, as flags applied to every prompt."""
    g = p.add_argument_group("sampling (the server's seeded sampler; greedy by default)")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 to 100; below 1e-5 = greedy (the default 0)",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, (0, 1] (default 1)")
    g.add_argument("--top-k", type=int, default=-1, help="-1 (all, the default) or >= 1")
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="noise key of every request: with the output index it fixes each sampled "
        "token, so a seeded run repeats (speculative or not); default: fresh randomness",
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags' SamplingParams, refused outside the ranges the server accepts."""
    if not 0.0 <= args.temperature <= 100.0:
        raise InputError(f"--temperature must be in [0, 100], got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 1 and args.top_k != -1:
        raise InputError(f"--top-k must be -1 (all) or >= 1, got {args.top_k}")
    if args.seed is not None and not SEED_RANGE[0] <= args.seed < SEED_RANGE[1]:
        raise InputError(f"--seed must be an integer in [-2**63, 2**64), got {args.seed}")
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise InputError(f"{name} must be >= 1, got {value}")


def speculative_steps(args: argparse.Namespace) -> int | None:
    """S, the draft tokens per round, when ``--speculative-algorithm`` is given (else None):
    the server's validation (runtime/speculative_flags.py), refused as an InputError."""
    return validate_speculative(args, InputError)


def _speculate(
    args: argparse.Namespace,
    start: StartUp,
    model: DeepseekV32ForCausalLM,
    kv_cache: KVCache,
    prompts: list[list[int]],
    steps: int,
    sizes: tuple[int, int, int],
) -> tuple[list[tuple[list[int], list[int]]], RunStats, dict]:
    """MTP speculative generation (runtime/speculative.py) with the Engine path's model,
    KV backend and sizes (token capacity, batch, context): the (prompt, output) pairs,
    the run's totals and the speculative statistics of the summary."""
    capacity, batch, longest = sizes
    draft = load_draft(args.model_path, start, model)
    gen = SpeculativeGenerator(
        model,
        draft,
        kv_cache,
        steps,
        capacity,
        batch,
        longest,
        args.chunked_prefill_size,
        eos_token_ids=[] if args.ignore_eos else None,
        record_logits=False,
        cuda_graphs=start.cuda_graphs(args.disable_cuda_graph),
    )
    done = gen.generate(prompts, args.max_new_tokens, sampling_params(args))
    rounds = sum(len(r.accept_lens) for r in done)
    stats = RunStats(
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(len(r.tokens) for r in done),
        prefill_s=gen.phase_s["prefill"],
        decode_s=gen.phase_s["decode"] if rounds else 0.0,  # none: one token each
    )
    speculative = {
        "algorithm": "NEXTN",
        "num_steps": steps,
        "num_draft_tokens": steps + 1,
        "rounds": rounds,
        "accept_length": round(sum(sum(r.accept_lens) for r in done) / rounds, 4)
        if rounds
        else None,
    }
    return [(p, r.tokens) for p, r in zip(prompts, done, strict=True)], stats, speculative


def generate_sampled(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[Request]:
    """Sampled outputs of ``prompts`` through the engine's scheduler, every request with
    ``params`` (its seed becomes the noise key at admission). ``Engine.generate`` is
    greedy only; this is its loop with the flags' sampling, and the reference that the
    speculative path's seeded output equals."""
    sched = engine.scheduler
    requests = [
        Request(list(p), rid=f"offline-{i}", params=replace(params), index=i)
        for i, p in enumerate(prompts)
    ]
    for req in requests:
        sched.add(req)
    while sched.has_work():
        sched.step()
    failed = [r for r in requests if r.finish_reason and r.finish_reason["type"] == "abort"]
    if failed:
        raise RuntimeError(f"request {failed[0].index} failed: {failed[0].finish_reason}")
    return requests


def run(args: argparse.Namespace) -> dict:
    for name in (
        "max_new_tokens",
        "batch_size",
        "chunked_prefill_size",
        "max_total_tokens",
        "context_length",
    ):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    steps = speculative_steps(args)
    params = sampling_params(args)
    # The start-up the server shares (runtime/assemble.py): settings parsed once, handed down.
    start = resolve_start_up(args.device, args.dtype, error=InputError)
    device = start.device
    model = load_model(args.model_path, device=device, dtype=start.dtype, kernels=start.kernels)
    cfg = model.config
    if steps is not None:
        check_nextn_layer(
            cfg.num_nextn_predict_layers, args.speculative_algorithm, args.model_path, InputError
        )
    context_limit = check_context(cfg, args.context_length, InputError)
    tokenizer = load_tokenizer(args.model_path)
    prompts = read_prompts(
        args.prompts_file,
        tokenizer,
        cfg.vocab_size,
        context_limit - args.max_new_tokens,
        context_limit,
    )
    # A speculative round places its S drafts past the accepted tokens: S more positions
    # and token locations per request.
    extra = steps or 0
    batch = min(args.batch_size, len(prompts))
    longest = max(len(p) for p in prompts) + args.max_new_tokens + extra
    if longest > context_limit:
        raise InputError(
            f"a prompt of {longest - args.max_new_tokens - extra} tokens plus the requested "
            f"new tokens and {extra} draft positions exceeds the context limit of "
            f"{context_limit}; shorten it, or lower --max-new-tokens or --speculative-num-steps"
        )
    per_batch = sum(
        sorted((len(p) + args.max_new_tokens + extra for p in prompts), reverse=True)[:batch]
    )
    capacity = args.max_total_tokens or per_batch
    if capacity < longest:
        raise InputError(
            f"--max-total-tokens {capacity} cannot hold the longest request ({longest} tokens "
            f"incl. new tokens{' and draft positions' if extra else ''}); raise it"
        )
    if capacity < per_batch:
        raise InputError(
            f"--max-total-tokens {capacity} cannot hold one batch of {batch} requests "
            f"({per_batch} tokens); raise it or lower --batch-size"
        )
    check_kv_dtype(cfg, start.dtype, args.kv_cache_dtype, InputError)
    if steps is not None:  # the capacity rule with Q = S + 1 query tokens per request
        start.echo.check_verify_batch(batch, cfg.index_topk, steps + 1)
    chunk = args.chunked_prefill_size
    kv_cache = build_kv_backend(start, cfg, capacity, batch, chunk, args.kv_cache_dtype)
    from tqdm import tqdm

    bar = tqdm(
        total=len(prompts), desc="generate", unit="req", disable=args.quiet or None, file=sys.stderr
    )
    speculative = None
    if steps is None:
        engine = Engine(
            model,
            kv_cache,
            capacity,
            batch,
            longest,
            chunk,
            args.ignore_eos,
            use_cuda_graph=start.cuda_graphs(args.disable_cuda_graph),
        )
        if params.greedy:
            done = engine.generate(
                prompts, args.max_new_tokens, on_request_done=lambda _: bar.update(1)
            )
        else:
            done = generate_sampled(engine, prompts, params)
            bar.update(len(done))
        results = [(req.prompt, req.output) for req in done]
        s, cuda_graph = engine.stats, engine.decode_runner is not None
    else:
        results, s, speculative = _speculate(
            args, start, model, kv_cache, prompts, steps, (capacity, batch, longest)
        )
        bar.update(len(results))
        cuda_graph = start.cuda_graphs(args.disable_cuda_graph)
    bar.close()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as out:
        for prompt, output in results:
            record = {"input_ids": prompt, "output_ids": output}
            if tokenizer is not None:
                record["text"] = tokenizer.decode(output)
            out.write(json.dumps(record) + "\n")
    summary = {
        "requests": len(results),
        "prompt_tokens": s.prompt_tokens,
        "output_tokens": s.output_tokens,
        "prefill_s": round(s.prefill_s, 4),
        "decode_s": round(s.decode_s, 4),
        "output_tokens_per_s": round(s.output_tokens / s.decode_s, 2) if s.decode_s else None,
        "total_tokens_per_s": round((s.prompt_tokens + s.output_tokens) / s.total_s, 2)
        if s.total_s
        else None,
        "device": str(device),
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "cuda_graph": cuda_graph,
        "kv": kv_cache.stats(),
    }
    print(describe_kv_cache(summary), file=sys.stderr)
    if speculative is not None:
        summary["speculative"] = speculative
        print(
            f"speculative: {speculative['algorithm']}  steps {steps}  rounds "
            f"{speculative['rounds']}  accept length {speculative['accept_length'] or '-'} "
            "tokens/round",
            file=sys.stderr,
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (InputError, ModelConfigError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
