"""The parts of a step timed alone, outside the decode node: a layer's weight side (the
MoE against its bytes table, the attention-side weight GEMMs) at each batch with the HBM
copy bandwidth as their ceiling; the step's fixed part (embedding, final norm, LM head,
sampling), which the 61-layer estimate keeps once; and the MoE's check against its dense
reference before anything is timed."""

from __future__ import annotations

import torch

from benchmark.e2e.extrapolate import DSV32_VOCAB
from benchmark.e2e.plan import StudyPlan
from benchmark.e2e.profiler import profile_graph
from benchmark.e2e.timing import graph_us, log, time_ms
from benchmark.study.moe import bytes_table


def check_moe(setup: StudyPlan, model, device: torch.device, components: dict) -> None:
    """The grouped-GEMM MoE against its dense reference on this device (bf16)."""
    moe = model.model.layers[0].mlp
    x = torch.randn(4, setup.cfg.hidden_size, device=device, dtype=setup.plan.dtype)
    ref = moe.reference(x)
    err = ((moe(x).float() - ref).norm() / ref.norm()).item()
    moe.touched.zero_()
    moe.forwards.zero_()
    components["moe_check_rel_err"] = err
    log(f"MoE grouped GEMM vs dense reference: rel err {err:.2e}")
    if not err < 2e-2:
        raise RuntimeError(f"MoE grouped GEMM disagrees with its reference ({err:.3e})")


def measure_components(setup: StudyPlan, model, device: torch.device, components: dict) -> None:
    """Graph-replayed parts of one layer at each batch: the MoE (against the bytes
    table) and the attention-side weight GEMMs; the HBM copy bandwidth as ceiling."""
    if device.type != "cuda":
        return
    hbm = _hbm_copy_gbps(device)
    layer = model.model.layers[0]
    moe, attn = layer.mlp, layer.self_attn
    table = {r["batch"]: r for r in bytes_table(setup.plan.moe_batches)}
    rows = []
    for b in setup.plan.moe_batches:
        x = torch.randn(b, setup.cfg.hidden_size, device=device, dtype=setup.plan.dtype)
        moe_us = graph_us(lambda x=x: moe(x))
        proj_us = graph_us(lambda x=x: _attention_weights(attn, x))
        t = table[b]
        rows.append(
            {
                "batch": b,
                "moe_us": round(moe_us, 2),
                "moe_bytes": t["moe_bytes"],
                "moe_roofline_us": round(t["moe_bytes"] / hbm / 1e3, 2),
                "moe_gbps": round(t["moe_bytes"] / moe_us / 1e3, 1),
                "attn_weights_us": round(proj_us, 2),
                "attn_weight_bytes": t["attention_weight_bytes"],
                "attn_gbps": round(t["attention_weight_bytes"] / proj_us / 1e3, 1),
                "experts_touched_formula": t["experts_touched"],
                "layer_weights_us": round(moe_us + proj_us, 2),
                "layer_roofline_us": round(t["layer_weight_bytes"] / hbm / 1e3, 2),
            }
        )
        log(f"  components b={b}: moe {moe_us:.1f} us ({rows[-1]['moe_gbps']} GB/s), "
            f"attention weights {proj_us:.1f} us")  # fmt: skip
    kernels = {}
    for b in (3, 16):
        x = torch.randn(b, setup.cfg.hidden_size, device=device, dtype=setup.plan.dtype)
        try:
            kernels[f"moe_b{b}"] = profile_graph(lambda x=x: moe(x))
        except Exception as exc:
            kernels[f"moe_b{b}"] = {"error": f"{type(exc).__name__}: {exc}"}
    moe.touched.zero_()
    moe.forwards.zero_()
    components.update(
        {"hbm_copy_gbps": round(hbm, 1), "per_batch": rows, "moe_kernels_us": kernels}
    )


def measure_fixed_part(
    setup: StudyPlan, model, device: torch.device, runs: list[dict], components: dict
) -> bool:
    """What a decode step does besides its layers, timed alone at each batch a ratio
    measured: the embedding and rotary table, the final norm and the LM head (inside
    the measured step), and greedy sampling (DecodeNode's argmax, outside it). On a
    GPU also with a 129,280-entry LM head, DeepSeek-V3.2's vocabulary. The 61-layer
    estimate scales the rest of the step. False: no "full" phase ran, nothing timed."""
    batches = sorted({r["batch"] for r in runs if r["phase"] == "full"})
    if not batches:
        return False
    cuda = device.type == "cuda"
    dev, dtype = device, setup.plan.dtype
    big = None
    if cuda:
        big = torch.empty(DSV32_VOCAB, setup.cfg.hidden_size, device=dev, dtype=dtype)
        big.normal_(std=0.02)
    rows: dict[int, dict] = {}
    for b in batches:
        ids = torch.randint(0, setup.cfg.vocab_size, (b,), device=dev)
        pos = torch.randint(setup.plan.ctx_min, setup.plan.ctx_max, (b,), device=dev)

        def head(
            w: torch.Tensor = model.lm_head.weight,
            ids: torch.Tensor = ids,
            pos: torch.Tensor = pos,
        ) -> torch.Tensor:
            hidden = model.model.embed_tokens(ids)
            model.rotary().cos_sin(pos, hidden.dtype)
            return torch.nn.functional.linear(model.model.norm(hidden), w).float()

        logits = head()
        row = {
            "embed_norm_lm_head_ms": round(time_ms(head, cuda), 5),
            "sampling_ms": round(time_ms(lambda x=logits: x.argmax(dim=-1), cuda), 5),
        }
        if big is not None:
            big_logits = head(big)
            row["embed_norm_lm_head_129k_ms"] = round(time_ms(lambda w=big: head(w), cuda), 5)
            row["sampling_129k_ms"] = round(time_ms(lambda x=big_logits: x.argmax(dim=-1), cuda), 5)
            del big_logits
        rows[b] = row
        log(f"  fixed part b={b}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    del big
    how = "CUDA-graph replays (median)" if cuda else "wall clock (median of 20)"
    components["fixed_part"] = {
        "per_batch": rows,
        "source": "measured in this run: embedding + rotary + final norm + LM head "
        f"({setup.plan.vocab} entries, as modelled) and greedy sampling, timed alone "
        f"at each batch by {how}",
    }
    return True


def component_at(components: dict, batch: int) -> dict | None:
    """The measured layer components at the batch nearest ``batch`` (None: not measured)."""
    rows = components.get("per_batch") or []
    if not rows:
        return None
    return min(rows, key=lambda r: abs(r["batch"] - batch))


def _hbm_copy_gbps(device: torch.device) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written: the HBM ceiling."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = graph_us(lambda: dst.copy_(src), reps=5, chain=2)
    return 2 * src.numel() / copy_us / 1e3


def _attention_weights(attn, x: torch.Tensor) -> torch.Tensor:
    """The weight-reading GEMMs of one attention layer at batch b (no KV): q/kv
    projections, the absorbed W_UK / W_UV products, o_proj, the indexer's projections."""
    n = x.shape[0]
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(n, attn.n_heads, attn.nope_dim + attn.rope_dim)
    latent = attn.kv_a_proj_with_mqa(x)[:, : attn.kv_lora_rank]
    w_uk, w_uv = attn._absorbed_weights()
    q_lat = torch.einsum("thd,hdr->thr", q[..., : attn.nope_dim], w_uk)
    out = torch.einsum("thr,hvr->thv", q_lat + latent.unsqueeze(1), w_uv)
    idx = attn.indexer
    extra = idx.wq_b(q_resid).sum() + idx.wk(x).sum() + idx.weights_proj(x).sum()
    return attn.o_proj(out.reshape(n, -1)) + extra
