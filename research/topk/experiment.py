"""One trace experiment: held-out requests at several context lengths, run through the
trained model and its untrained twin (same architecture, the training run's own initial
weights), plus a greedy-token check of the trained checkpoint against transformers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from research.topk.driver import run_requests
from research.topk.tracer import TopkTracer
from research.train.data import BYTE_OFFSET, load_corpus
from research.train.spec import build_model
from scripts.make_tiny_checkpoint import TinySpec
from sglang_echo.model.loader import load_model

NONE_U16 = np.iinfo(np.uint16).max


@dataclass
class HeldOutRequest:
    name: str
    tokens: list[int]
    prompt_len: int


def read_train_spec(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "train_spec.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the untrained twin and the held-out split come from the "
            "training run's train_spec.json (written by scripts/train_tiny_dsa.py)."
        )
    return json.loads(path.read_text())


def untrained_twin(info: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The training run's step-0 model: same spec, same seed, same initialization."""
    spec = TinySpec(**info["model_spec"])
    seed = int(info.get("train", {}).get("seed", spec.seed))
    return build_model(spec, seed).to(device=device, dtype=dtype).eval()


def held_out_docs(info: dict, data_roots: list[tuple[str, Path]] | None) -> tuple[list, list]:
    """Held-out files of the training run's split (names, token arrays), content-hash order.

    Without ``data_roots``: the training run's roots when they exist here, else this
    machine's defaults (the split rule is the same; the files may differ).
    """
    fraction = float(info.get("eval_fraction", 0.02))
    if data_roots is None:
        trained_on = [(r["label"], Path(r["path"])) for r in info.get("data", {}).get("roots", [])]
        if trained_on and all(path.is_dir() for _, path in trained_on):
            data_roots = trained_on
    corpus = load_corpus(data_roots, eval_fraction=fraction, with_train_stream=False)
    names = [f"{f.root}:{f.rel}" for f in corpus.eval_files]
    return names, corpus.eval_docs


def pick_requests(
    names: list[str], docs: list[np.ndarray], lengths: list[int], decode_steps: int
) -> list[HeldOutRequest]:
    """For each target context length L (prompt L - decode_steps, then decode_steps steps),
    the first unused held-out file long enough, or consecutive unused files joined."""
    used: set[int] = set()
    requests: list[HeldOutRequest] = []
    for length in sorted(lengths, reverse=True):
        need = length + 1
        if length - decode_steps < 1:
            raise ValueError(f"context length {length} must exceed --decode-steps {decode_steps}")
        pick = next((i for i, d in enumerate(docs) if i not in used and d.size >= need), None)
        if pick is not None:
            used.add(pick)
            toks, name = docs[pick][:need], names[pick]
        else:
            parts, picked, total = [], [], 0
            for i, d in enumerate(docs):
                if i in used:
                    continue
                parts.append(d)
                picked.append(i)
                total += d.size
                if total >= need:
                    break
            if total < need:
                raise ValueError(
                    f"held-out text ({sum(d.size for d in docs)} tokens) cannot supply a "
                    f"{length}-token request; lower --lengths or raise the eval fraction."
                )
            used.update(picked)
            toks = np.concatenate(parts)[:need]
            name = "+".join(names[i] for i in picked[:3]) + ("+..." if len(picked) > 3 else "")
        requests.append(HeldOutRequest(name, toks.astype(np.int64).tolist(), length - decode_steps))
    return requests


def trace_model(
    model: torch.nn.Module, requests: list[HeldOutRequest], decode_steps: int
) -> dict[str, np.ndarray]:
    tracer = TopkTracer(model)
    with tracer:
        out = run_requests(
            model,
            [r.tokens for r in requests],
            [r.prompt_len for r in requests],
            decode_steps,
            tracer=tracer,
        )
    arrays = tracer.arrays()
    arrays["prefill_nll"] = np.concatenate([x.numpy() for x in out.prefill_nll]).astype(np.float32)
    arrays["decode_nll"] = out.decode_nll.numpy().astype(np.float32)
    return arrays


def oracle_check(
    model: torch.nn.Module,
    model_dir: str | Path,
    prompts: list[list[int]],
    new_tokens: int,
    tie_break,
) -> dict:
    """Greedy tokens of our model (all prompts in one batch) vs transformers (one by one)."""
    from transformers import DeepseekV32ForCausalLM as HFModel

    device = model.lm_head.weight.device
    hf = HFModel.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    ours = run_requests(
        model, prompts, [len(p) for p in prompts], new_tokens, greedy=True
    ).generated.tolist()
    theirs = []
    with torch.no_grad(), tie_break():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p], device=device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            theirs.append(out[0, len(p) :].tolist())
    first_diff = []
    for a, b in zip(ours, theirs, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        first_diff.append(diff)
    return {
        "prompts": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
        "new_tokens": new_tokens,
        "identical": all(d is None for d in first_diff),
        "first_mismatch": first_diff,
        "sample_text": bytes(max(0, t - BYTE_OFFSET) for t in ours[0] if t >= BYTE_OFFSET).decode(
            "utf-8", "replace"
        ),
    }


def pack(arrays: dict[str, np.ndarray], tag: str) -> dict[str, np.ndarray]:
    """Compact npz entries: selections as uint16 (65535 = none), the rest float32/int32."""
    out = {}
    for key, value in arrays.items():
        if key in ("sel", "prefill_sel"):
            if value.max(initial=0) >= NONE_U16:
                raise ValueError("positions >= 65535 do not fit the uint16 trace format")
            value = np.where(value >= 0, value, NONE_U16).astype(np.uint16)
        elif value.dtype.kind == "f":
            value = value.astype(np.float32)
        else:
            value = value.astype(np.int32)
        out[f"{tag}__{key}"] = value
    return out


def unpack(npz) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """-> (meta dict, {tag: arrays}) with selections back to int64 positions (-1 none)."""
    meta = json.loads(str(npz["meta"]))
    models: dict[str, dict[str, np.ndarray]] = {}
    for key in npz.files:
        if "__" not in key:
            continue
        tag, name = key.split("__", 1)
        value = npz[key]
        if name in ("sel", "prefill_sel"):
            value = np.where(value == NONE_U16, -1, value.astype(np.int64))
        models.setdefault(tag, {})[name] = value
    return meta, models


def run_experiment(
    model_dir: str | Path,
    lengths: list[int],
    decode_steps: int,
    device: torch.device,
    dtype: torch.dtype,
    data_roots: list[tuple[str, Path]] | None = None,
    oracle_prompts: int = 4,
    oracle_prompt_len: int = 512,
    oracle_tokens: int = 64,
    tie_break=None,
    log=print,
) -> tuple[dict, dict[str, np.ndarray]]:
    t0 = time.time()
    info = read_train_spec(model_dir)
    names, docs = held_out_docs(info, data_roots)
    requests = pick_requests(names, docs, lengths, decode_steps)
    log(
        f"{len(requests)} held-out requests: "
        + ", ".join(f"{r.prompt_len}+{decode_steps} ({r.name})" for r in requests)
    )
    trained = load_model(model_dir, device=device, dtype=dtype)
    k = trained.config.index_topk
    packed: dict[str, np.ndarray] = {}
    timings = {}
    for tag, make in (("trained", lambda: trained), ("untrained", None)):
        model = make() if make else untrained_twin(info, device, dtype)
        t = time.time()
        arrays = trace_model(model, requests, decode_steps)
        timings[tag] = time.time() - t
        log(f"traced {tag} in {timings[tag]:.1f} s")
        packed.update(pack(arrays, tag))
        if make is None:
            del model
    oracle = None
    if oracle_prompts > 0 and oracle_tokens > 0:
        # Held-out files long enough for the longest prompt first; lengths alternate
        # L, L/2 (mixed lengths in one decode batch, both above k for the defaults).
        ordered = sorted(range(len(docs)), key=lambda i: docs[i].size < oracle_prompt_len)
        prompts = []
        for j, i in enumerate(ordered[:oracle_prompts]):
            n = max(2, min(docs[i].size, oracle_prompt_len >> (j % 2)))
            prompts.append(docs[i][:n].astype(np.int64).tolist())
        t = time.time()
        oracle = oracle_check(trained, model_dir, prompts, oracle_tokens, tie_break)
        timings["oracle"] = time.time() - t
        log(f"oracle (ours vs transformers greedy): {oracle}")
    meta = {
        "model_dir": str(model_dir),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "index_topk": k,
        "layers": trained.config.num_hidden_layers,
        "decode_steps": decode_steps,
        "lengths": sorted(lengths, reverse=True),
        "prompt_lens": [r.prompt_len for r in requests],
        "requests": [r.name for r in requests],
        "prefill_lens": [r.prompt_len for r in requests],
        "untrained": "the training run's initial weights (same spec and seed)",
        "oracle": oracle,
        "timings_s": {**timings, "total": time.time() - t0},
        "train": {
            key: info.get("results", {}).get(key)
            for key in ("steps_done", "dense_steps", "tokens_seen", "train_seconds")
        },
    }
    return meta, packed
