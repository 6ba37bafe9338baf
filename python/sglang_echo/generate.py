"""Offline greedy generation: ``python -m sglang_echo.generate --help``.

Reads prompts (JSON lines of ``{"input_ids": [...]}`` or ``{"text": "..."}``), runs them
through the DeepSeek-V3.2 model with the no-offload pool or ECHO (``NSA_KV_OFFLOAD=1``),
writes ``{"input_ids", "output_ids"[, "text"]}`` lines in input order, and prints a
summary to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_echo.config import ConfigError, HelpFormatter, help_epilog
from sglang_echo.kernels.fp8_kv import KV_CACHE_DTYPES
from sglang_echo.model.config import ModelConfigError
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.assemble import (
    build_kv_backend,
    check_context,
    check_kv_dtype,
    resolve_start_up,
)
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import describe_kv_cache
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
        + ". Greedy decoding of a DeepSeek-V3.2 checkpoint; set NSA_KV_OFFLOAD=1 for ECHO "
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
    return p


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise InputError(f"{name} must be >= 1, got {value}")


def run(args: argparse.Namespace) -> dict:
    for name in (
        "max_new_tokens",
        "batch_size",
        "chunked_prefill_size",
        "max_total_tokens",
        "context_length",
    ):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    # The start-up the server shares (runtime/assemble.py): settings parsed once, handed down.
    start = resolve_start_up(args.device, args.dtype, error=InputError)
    device = start.device
    model = load_model(args.model_path, device=device, dtype=start.dtype, kernels=start.kernels)
    cfg = model.config
    context_limit = check_context(cfg, args.context_length, InputError)
    tokenizer = load_tokenizer(args.model_path)
    prompts = read_prompts(
        args.prompts_file,
        tokenizer,
        cfg.vocab_size,
        context_limit - args.max_new_tokens,
        context_limit,
    )
    batch = min(args.batch_size, len(prompts))
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    per_batch = sum(sorted((len(p) + args.max_new_tokens for p in prompts), reverse=True)[:batch])
    capacity = args.max_total_tokens or per_batch
    if capacity < longest:
        raise InputError(
            f"--max-total-tokens {capacity} cannot hold the longest request ({longest} tokens "
            "incl. new tokens); raise it"
        )
    if capacity < per_batch:
        raise InputError(
            f"--max-total-tokens {capacity} cannot hold one batch of {batch} requests "
            f"({per_batch} tokens); raise it or lower --batch-size"
        )
    check_kv_dtype(cfg, start.dtype, args.kv_cache_dtype, InputError)
    kv_cache = build_kv_backend(
        start, cfg, capacity, batch, args.chunked_prefill_size, args.kv_cache_dtype
    )
    engine = Engine(
        model,
        kv_cache,
        capacity,
        batch,
        longest,
        args.chunked_prefill_size,
        args.ignore_eos,
        use_cuda_graph=start.cuda_graphs(args.disable_cuda_graph),
    )
    from tqdm import tqdm

    bar = tqdm(
        total=len(prompts), desc="generate", unit="req", disable=args.quiet or None, file=sys.stderr
    )
    results = engine.generate(prompts, args.max_new_tokens, on_request_done=lambda _: bar.update(1))
    bar.close()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as out:
        for req in results:
            record = {"input_ids": req.prompt, "output_ids": req.output}
            if tokenizer is not None:
                record["text"] = tokenizer.decode(req.output)
            out.write(json.dumps(record) + "\n")
    s = engine.stats
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
        "cuda_graph": engine.decode_runner is not None,
        "kv": kv_cache.stats(),
    }
    print(describe_kv_cache(summary), file=sys.stderr)
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
