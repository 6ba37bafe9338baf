"""Write the trained model as a Hugging Face checkpoint, with tokenizer and model card.

The weights go through transformers' own ``DeepseekV32ForCausalLM`` (strict state-dict load,
then ``save_pretrained``), so the folder is by construction one that transformers loads;
our loader reads it by tensor name like any other checkpoint.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from scripts.make_tiny_checkpoint import TinySpec, hf_config
from sglang_echo.tokenizer import save_byte_tokenizer

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MAX_SHARD_SIZE = "15MB"  # files come back from the GPU machine at <= 16 MiB each


def save_checkpoint(
    model: nn.Module,
    spec: TinySpec,
    out_dir: str | Path,
    save_dtype: str = "bfloat16",
    metadata: dict | None = None,
    card: str | None = None,
) -> Path:
    from transformers import DeepseekV32ForCausalLM as HFModel

    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"--save-dtype must be one of {sorted(SAVE_DTYPES)}, got {save_dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()  # a previous run's shards would otherwise be read alongside the new ones
    config = hf_config(spec)
    config.architectures = ["DeepseekV32ForCausalLM"]
    hf = HFModel(config).eval()
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    hf = hf.to(SAVE_DTYPES[save_dtype])
    # transformers keeps the indexer's head weights in float32 (_keep_in_fp32_modules).
    for layer in hf.model.layers:
        layer.self_attn.indexer.weights_proj.float()
    hf.save_pretrained(str(out), max_shard_size=MAX_SHARD_SIZE)
    save_byte_tokenizer(out)
    (out / "train_spec.json").write_text(
        json.dumps({"model_spec": asdict(spec), **(metadata or {})}, indent=2) + "\n"
    )
    if card is not None:
        (out / "README.md").write_text(card)
    return out


def checkpoint_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _para(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=92)


def model_card(info: dict) -> str:
    """README.md for the checkpoint folder, from the run's summary ``info``."""
    spec, train, data, res = info["model_spec"], info["train"], info["data"], info["results"]
    params = info["parameters"]
    roots = "\n".join(
        f"| {r['label']} | `{r['path']}` | {r['files']} | {_mb(r['bytes'])} |"
        for r in data["roots"]
    )

    def ev(mode: str, key: str) -> str:
        e = res.get(f"heldout_{mode}")
        return "n/a" if e is None else f"{e[key]:.4f}"

    if train["long_every"]:
        long_note = (
            f"one phase-1 batch in {train['long_every']} is {train['long_batch_size']} x "
            f"{train['long_seq_len']} tokens instead of {train['batch_size']} x "
            f"{train['seq_len']} (so positions up to {train['long_seq_len']} are trained)."
        )
    else:
        long_note = f"batches of {train['batch_size']} x {train['seq_len']} tokens."
    stopped = " Stopped early by the time budget." if res["stopped_by_time"] else ""
    sparse_steps = res["steps_done"] - res["dense_steps"]
    amp = "bf16 autocast" if train["amp"] == "bf16" else "float32"
    intro = _para(
        "A small DeepSeek-V3.2-architecture model (MLA + the lightning indexer of DeepSeek "
        "Sparse Attention), trained so that this project's top-k, cache hit-rate and prefetch "
        "studies see realistic indexer behaviour. Byte-level; not a useful language model."
    )
    architecture = _para(
        f"`DeepseekV32ForCausalLM` (loads in transformers and in `sglang_echo.model`): "
        f"{spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads; MLA with "
        f"q_lora_rank {spec['q_lora_rank']}, kv_lora_rank {spec['kv_lora_rank']}, qk_nope "
        f"{spec['qk_nope_head_dim']}, qk_rope {spec['qk_rope_head_dim']}, v_head "
        f"{spec['v_head_dim']}; indexer {spec['index_heads']} heads x {spec['index_dim']} dims, "
        f"**index_topk {spec['index_topk']}**; a dense gated FFN (intermediate "
        f"{spec['intermediate']}) in every layer, no MoE; rope `{spec['rope']}` (theta 10000), "
        f"max_position_embeddings {spec['max_position']}; vocabulary {spec['vocab_size']} "
        f"(3 special tokens + 256 bytes). {params['total']:,} parameters "
        f"({params['non_embedding']:,} non-embedding, {params['indexer']:,} in the indexers), "
        f"stored in {info['save_dtype']} (indexer `weights_proj` in float32): "
        f"{_mb(info['checkpoint_bytes'])} of safetensors."
    )
    data_text = _para(
        f"Python sources installed on the training machine (`*.py`, files <= 1 MiB), "
        f"deduplicated by content; a file is held out when the first 32 bits of its SHA-1 "
        f"fall below {train_eval_fraction(info):.3f} of the range (a machine-independent "
        f"split). Train: {data['train_files']} files, {_mb(data['train_bytes'])} (cap "
        f"{info.get('max_train_mb', 160):g} MiB, files taken in content-hash order); held "
        f"out: {data['eval_files']} files, {_mb(data['eval_bytes'])}. Corpus fingerprint "
        f"`{data['fingerprint']}` (equal fingerprints, equal data)."
    )
    training = _para(
        f"{res['device']}, {res['train_seconds']:.0f} s of training "
        f"({res['total_seconds']:.0f} s with data loading and export), seed {train['seed']}, "
        f"{res['tokens_seen']:,} tokens. Phase 1, dense warm-up ({res['dense_steps']} steps): "
        f"dense causal attention and the LM loss; each layer's indexer learns, from detached "
        f"inputs, the KL divergence to that layer's head-averaged attention distribution on "
        f"{train['kl_rows']} query rows per sequence; {long_note} Phase 2, sparse "
        f"({sparse_steps} steps): each query attends only to its indexer "
        f"top-{spec['index_topk']}; LM loss for the model, KL over the selected keys for the "
        f"indexers. AdamW (0.9, 0.95), lr {train['lr']} with {train['warmup_steps']} warm-up "
        f"steps and cosine decay to {train['min_lr_frac']}x, weight decay "
        f"{train['weight_decay']}; model and indexer gradients clipped apart at "
        f"{train['grad_clip']}; {amp}.{stopped}"
    )
    k = spec["index_topk"]
    return f"""# tiny-dsv32-trained

{intro}

## Architecture

{architecture}

## Data

{data_text}

| root | path | files | bytes |
| --- | --- | --- | --- |
{roots}

## Training

{training}

## Losses

Nats per token (= per byte); held-out: {train["eval_windows"]} windows of {train["seq_len"]}
tokens from the held-out files.

| | LM loss | indexer KL |
| --- | --- | --- |
| last training log (phase 2) | {res["last_train_lm"]:.4f} | {res["last_train_kl"]:.4f} |
| held-out, dense attention | {ev("dense", "lm_loss")} | {ev("dense", "kl_loss")} |
| held-out, top-{k} sparse attention | {ev("sparse", "lm_loss")} | {ev("sparse", "kl_loss")} |

Loss curve: `benchmark/results/topk_train.json` and `topk_train_loss.png`. Top-k, cache and
threshold analysis against the untrained model: `benchmark/results/topk_traces.json`.

## Retrain (one command on one H200, from the repository root)

```bash
{info["retrain_command"]}
```

## Load

```python
from sglang_echo.model.loader import load_model
model = load_model("models/tiny-dsv32-trained")  # ours, float32 by default
from transformers import DeepseekV32ForCausalLM
hf = DeepseekV32ForCausalLM.from_pretrained("models/tiny-dsv32-trained", dtype="float32")
```

Our indexer sends exact score ties to the lower position; run transformers under
`tests/oracle_utils.lowest_index_tie_break()` for token-identical greedy output.
"""


def train_eval_fraction(info: dict) -> float:
    return float(info.get("eval_fraction", 0.02))
