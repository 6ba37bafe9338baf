"""Benchmark workloads: real dataset files when given, else clearly labelled synthetic ones.

Real: InfiniteBench jsonl (``context`` + ``input`` per line, or a prepared ``prompt``),
ShareGPT json (first human turn -> prompt, the reply's length -> output length), or a
custom jsonl (``prompt``/``text``/``input_ids`` + ``output_len``). Synthetic (no file):
random token ids with the same length distributions — InfiniteBench's 100K-110K-token
inputs scaled to the server's context, outputs capped (default 256); ShareGPT-like
log-normal chat lengths; or uniform ``random`` lengths as SGLang's ``random`` dataset.
Every returned workload says whether it is synthetic.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# InfiniteBench's generation lengths per task (its own configuration); capped by the caller.
INFINITEBENCH_OUTPUT_LEN = {
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40,
    "longbook_qa_eng": 40,
    "longbook_qa_chn": 40,
    "longdialogue_qa_eng": 40,
    "math_find": 3,
    "math_calc": 30000,
    "code_run": 5,
    "code_debug": 5,
}
INFINITEBENCH_INPUT_RANGE = (100_000, 110_000)
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 1024, 2048  # SGLang's ShareGPT length filter


class DatasetError(ValueError):
    """A dataset file or option the benchmark cannot use; the message says what to fix."""


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (sent as input_ids)
    prompt_len: int
    output_len: int
    task: str | None = None


@dataclass
class Workload:
    requests: list[BenchRequest]
    synthetic: bool
    description: str


class TokenCounter:
    """Counts / truncates text with the model's tokenizer, or four characters per token."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int] | None:
        return None if self.tokenizer is None else self.tokenizer.encode(text).ids

    def count(self, text: str) -> int:
        ids = self.encode(text)
        return len(ids) if ids is not None else max(1, math.ceil(len(text) / 4))

    def truncate_middle(self, text: str, max_tokens: int) -> tuple[str, int]:
        """Keep the head and tail (InfiniteBench truncates the middle of long contexts)."""
        ids = self.encode(text)
        if ids is None:
            if len(text) <= max_tokens * 4:
                return text, self.count(text)
            half = max_tokens * 2
            return text[:half] + text[-half:], max_tokens
        if len(ids) <= max_tokens:
            return text, len(ids)
        half = max_tokens // 2
        kept = self.tokenizer.decode(ids[:half]) + self.tokenizer.decode(
            ids[-(max_tokens - half) :]
        )
        return kept, len(self.tokenizer.encode(kept).ids)


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = 3 if vocab > 16 else 0  # keep clear of bos/eos/pad ids of small vocabularies
    return [rng.randrange(lo, vocab) for _ in range(n)]


# ------------------------------------------------------------------ InfiniteBench
def _infinitebench_files(path: Path, task: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DatasetError(f"--dataset-path {str(path)!r} does not exist")
    if task:
        f = path / f"{task}.jsonl"
        if not f.is_file():
            found = sorted(p.stem for p in path.glob("*.jsonl"))
            raise DatasetError(f"no {f.name} in {str(path)!r}; tasks there: {found}")
        return [f]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise DatasetError(f"{str(path)!r} holds no *.jsonl InfiniteBench files")
    return files


def load_infinitebench(
    path: Path,
    task: str | None,
    counter: TokenCounter,
    num_prompts: int,
    context_length: int,
    max_output_len: int,
) -> Workload:
    requests: list[BenchRequest] = []
    for file in _infinitebench_files(path, task):
        name = task or file.stem
        default_out = INFINITEBENCH_OUTPUT_LEN.get(name, max_output_len)
        for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{file}:{lineno}: not JSON ({exc.msg})") from exc
            if "prompt" in rec:
                text = str(rec["prompt"])
            else:
                text = f"{rec.get('context', '')}\n\n{rec.get('input', '')}".strip()
            out_len = int(rec.get("output_len", default_out))
            out_len = max(1, min(out_len, max_output_len))
            text, n = counter.truncate_middle(text, max(1, context_length - out_len - 8))
            requests.append(BenchRequest(text, n, out_len, name))
            if len(requests) >= num_prompts:
                break
        if len(requests) >= num_prompts:
            break
    if not requests:
        raise DatasetError(f"no InfiniteBench records found under {str(path)!r}")
    return Workload(requests, False, f"InfiniteBench from {path}")


def synthetic_infinitebench(
    num_prompts: int,
    context_length: int,
    max_output_len: int,
    vocab: int,
    seed: int,
    input_range: tuple[int, int] = INFINITEBENCH_INPUT_RANGE,
) -> Workload:
    """Random-id prompts of ``input_range`` tokens (InfiniteBench's by default; the in-process
    study's narrower range when a served run is compared with it), scaled to the context."""
    rng = random.Random(seed)
    out_cap = max(1, min(max_output_len, context_length // 4))
    lo, hi = input_range
    scale = min(1.0, (context_length - out_cap) / hi)
    reqs = []
    for _ in range(num_prompts):
        n = max(1, round(rng.uniform(lo, hi) * scale))
        out = rng.randint(max(1, out_cap // 2), out_cap)
        reqs.append(BenchRequest(_random_ids(rng, n, vocab), n, out, "synthetic"))
    return Workload(
        reqs,
        True,
        f"SYNTHETIC InfiniteBench-like: inputs {lo}-{hi} tokens x {scale:.4g} "
        f"(context {context_length}), outputs <= {out_cap}",
    )


# ---------------------------------------------------------------------- ShareGPT
def load_sharegpt(
    path: Path, counter: TokenCounter, num_prompts: int, context_length: int, seed: int
) -> Workload:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read ShareGPT json {str(path)!r}: {exc}") from exc
    rng = random.Random(seed)
    rng.shuffle(data)
    max_total = min(SHAREGPT_MAX_TOTAL, context_length)
    reqs = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        if len(conv) < 2:
            continue
        prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        p_len, o_len = counter.count(prompt), counter.count(reply)
        if p_len < 4 or o_len < 4 or p_len > SHAREGPT_MAX_PROMPT or p_len + o_len > max_total:
            continue
        reqs.append(BenchRequest(prompt, p_len, o_len, "sharegpt"))
        if len(reqs) >= num_prompts:
            break
    if not reqs:
        raise DatasetError(f"no usable ShareGPT conversations in {str(path)!r}")
    return Workload(reqs, False, f"ShareGPT from {path}")


def synthetic_sharegpt(num_prompts: int, context_length: int, vocab: int, seed: int) -> Workload:
    """Log-normal chat lengths (medians 200 prompt / 150 reply tokens, long tails),
    filtered as SGLang filters ShareGPT and scaled down to fit a small context."""
    rng = random.Random(seed)
    max_total = min(SHAREGPT_MAX_TOTAL, context_length)
    shrink = min(1.0, max_total / SHAREGPT_MAX_TOTAL)
    reqs = []
    while len(reqs) < num_prompts:
        p = round(rng.lognormvariate(math.log(200), 0.9) * shrink)
        o = round(rng.lognormvariate(math.log(150), 0.8) * shrink)
        if p < 4 or o < 4 or p > SHAREGPT_MAX_PROMPT or p + o > max_total:
            continue
        reqs.append(BenchRequest(_random_ids(rng, p, vocab), p, o, "synthetic"))
    return Workload(
        reqs, True, f"SYNTHETIC ShareGPT-like chats (lengths x {shrink:.3g}, total <= {max_total})"
    )


# ------------------------------------------------------------------ random/custom
def synthetic_random(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        o = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        reqs.append(BenchRequest(_random_ids(rng, n, vocab), n, o, "random"))
    return Workload(reqs, True, f"random token ids: input <= {input_len}, output <= {output_len}")


def load_custom(path: Path, counter: TokenCounter, num_prompts: int, default_out: int) -> Workload:
    reqs = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read --dataset-path {str(path)!r}: {exc.strerror}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
        out = int(rec.get("output_len", rec.get("max_new_tokens", default_out)))
        if "input_ids" in rec:
            ids = list(rec["input_ids"])
            reqs.append(BenchRequest(ids, len(ids), out, "custom"))
        else:
            text = rec.get("prompt", rec.get("text"))
            if not isinstance(text, str):
                raise DatasetError(f"{path}:{lineno}: needs 'prompt', 'text' or 'input_ids'")
            reqs.append(BenchRequest(text, counter.count(text), out, "custom"))
        if len(reqs) >= num_prompts:
            break
    if not reqs:
        raise DatasetError(f"{str(path)!r} holds no requests")
    return Workload(reqs, False, f"custom from {path}")
