"""DeepSeek's NextN (MTP) layer: its forward against a plain-torch + transformers reference,
its loading and the loader's errors, and the config's ``num_nextn_predict_layers``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV32ForCausalLM as HFModel
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32DecoderLayer,
    DeepseekV32RotaryEmbedding,
)

from scripts.make_tiny_checkpoint import NEXTN_FILE, TinySpec, hf_config, make_tiny_checkpoint
from sglang_echo.model.config import DeepseekV32Config, ModelConfigError, load_config
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model, load_nextn

from oracle_utils import lowest_index_tie_break

ATOL = 1e-4  # float32, as tests/test_model_oracle.py
PREFILL, DECODE = 18, 6  # index_topk 16: both the prefill and the decode steps are sparse
SPECS = {
    # L = 3 >= first_k_dense_replace = 1: a MoE NextN layer, as DeepSeek's.
    "moe": TinySpec(seed=4, num_nextn_predict_layers=1),
    # Every layer dense (first_k_dense_replace = 3 > L = 2): a dense NextN layer.
    "dense": TinySpec(seed=5, layers=2, dense_layers=3, num_nextn_predict_layers=1),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("nextn")
    return {name: make_tiny_checkpoint(root / name, spec) for name, spec in SPECS.items()}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hf_layer(spec: TinySpec, raw: dict[str, torch.Tensor]) -> DeepseekV32DecoderLayer:
    """transformers' decoder layer for index L with the checkpoint's NextN weights (its
    experts packed back into transformers' [E, 2I, H] / [E, H, I] parameters)."""
    index = spec.layers
    cfg = hf_config(spec, layers=index + 1)
    cfg._attn_implementation = "eager"
    layer = DeepseekV32DecoderLayer(cfg, index).eval()
    prefix = f"model.layers.{index}."
    state = {n[len(prefix) :]: t for n, t in raw.items() if n.startswith(prefix)}
    experts = layer.state_dict()
    if "mlp.experts.gate_up_proj" in experts:
        n = experts["mlp.experts.gate_up_proj"].shape[0]
        gate_up, down = [], []
        for e in range(n):
            p = f"mlp.experts.{e}."
            gate_up.append(
                torch.cat([state.pop(p + "gate_proj.weight"), state.pop(p + "up_proj.weight")])
            )
            down.append(state.pop(p + "down_proj.weight"))
        state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state["mlp.experts.down_proj"] = torch.stack(down)
    keep = set(experts)
    layer.load_state_dict({n: t for n, t in state.items() if n in keep}, strict=True)
    return layer


def _reference(spec: TinySpec, path, next_ids: torch.Tensor, hidden: torch.Tensor):
    """(logits, out_hidden) at every position, from the checkpoint's raw tensors: the
    NextN head in plain torch, the decoder layer from transformers, no KV cache."""
    raw = {}
    for file in sorted(path.glob("*.safetensors")):
        raw.update(load_file(str(file)))
    prefix = f"model.layers.{spec.layers}."
    eps = load_config(path).rms_norm_eps
    embedded = raw[prefix + "embed_tokens.weight"][next_ids]
    x = (
        torch.cat(
            [
                _rms(embedded, raw[prefix + "enorm.weight"], eps),
                _rms(hidden, raw[prefix + "hnorm.weight"], eps),
            ],
            dim=-1,
        )
        @ raw[prefix + "eh_proj.weight"].T
    )
    layer = _hf_layer(spec, raw)
    n = x.shape[0]
    positions = torch.arange(n).unsqueeze(0)
    cos_sin = DeepseekV32RotaryEmbedding(layer.self_attn.config)(x[None], positions)
    mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
    with torch.no_grad(), lowest_index_tie_break():
        y = layer(
            x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
        )[0]
    out_hidden = _rms(y, raw[prefix + "shared_head.norm.weight"], eps)
    return (out_hidden @ raw[prefix + "shared_head.head.weight"].T).float(), out_hidden


def _inputs(path, spec: TinySpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Next ids and the target's final-normed hidden states (transformers') for a prompt."""
    g = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(3, spec.vocab_size, (PREFILL + DECODE + 1,), generator=g)
    hf = HFModel.from_pretrained(str(path)).eval()
    with torch.no_grad(), lowest_index_tie_break():
        hidden = hf.model(ids[None, :-1]).last_hidden_state[0]
    return ids[1:], hidden


def _run_ours(layer, next_ids: torch.Tensor, hidden: torch.Tensor):
    """A prefill of PREFILL tokens, then DECODE one-token steps, on a one-layer KV pool."""
    total = next_ids.shape[0]
    cache = PlainKVCache.for_model(layer.config, total, torch.float32, "cpu")
    locs = torch.arange(1, total + 1)
    batch = ForwardBatch.whole_prompt(next_ids[:PREFILL], locs[:PREFILL])
    logits, out_hidden = layer(batch, hidden[:PREFILL], cache)
    all_logits, all_hidden = [logits], [out_hidden]
    for p in range(PREFILL, total):
        step = ForwardBatch(
            input_ids=next_ids[p : p + 1],
            positions=torch.tensor([p]),
            out_locs=locs[p : p + 1],
            context_locs=locs.unsqueeze(0),
            extend_lens=[1],
            context_lens=[p + 1],
            is_decode=True,
            logits_indices=torch.tensor([0]),
        )
        logits, out_hidden = layer(step, hidden[p : p + 1], cache)
        all_logits.append(logits)
        all_hidden.append(out_hidden)
    return torch.cat(all_logits), torch.cat(all_hidden)


@pytest.mark.parametrize("name", list(SPECS))
def test_nextn_prefill_and_decode_match_reference(ckpts, name):
    spec, path = SPECS[name], ckpts[name]
    target = load_model(path)
    layer = load_nextn(path, target=target)
    assert layer.config.mlp_layer_types == (load_config(path).mlp_layer_type(spec.layers),)
    next_ids, hidden = _inputs(path, spec)
    logits, out_hidden = _run_ours(layer, next_ids, hidden)
    ref_logits, ref_hidden = _reference(spec, path, next_ids, hidden)
    assert logits.dtype == torch.float32 and logits.shape == ref_logits.shape
    diff = (logits - ref_logits).abs().max().item()
    assert diff < ATOL, f"{name}: NextN logits differ by {diff}"
    assert torch.allclose(out_hidden, ref_hidden, atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_nextn_logits_indices_pick_rows(ckpts):
    spec, path = SPECS["moe"], ckpts["moe"]
    layer = load_nextn(path)
    next_ids, hidden = _inputs(path, spec)
    n = PREFILL
    locs = torch.arange(1, n + 1)
    full = layer(
        ForwardBatch.whole_prompt(next_ids[:n], locs),
        hidden[:n],
        PlainKVCache.for_model(layer.config, n, torch.float32, "cpu"),
    )
    batch = ForwardBatch.whole_prompt(next_ids[:n], locs)
    batch.logits_indices = torch.tensor([n - 1, 3])
    cache = PlainKVCache.for_model(layer.config, n, torch.float32, "cpu")
    picked = layer(batch, hidden[:n], cache)
    for ours, ref in zip(picked, full, strict=True):
        assert torch.allclose(ours, ref[[n - 1, 3]], atol=1e-6, rtol=0)


def test_nextn_shares_target_vocab_matrices_and_falls_back_to_them(ckpts, tmp_path):
    path = ckpts["moe"]
    target = load_model(path)
    shared = load_nextn(path, target=target)  # its copies equal the target's: shared
    assert shared.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert shared.shared_head.head.weight.data_ptr() == target.lm_head.weight.data_ptr()

    copy = shutil.copytree(path, tmp_path / "no-copies")
    tensors = load_file(str(copy / NEXTN_FILE))
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        del tensors[f"model.layers.3.{name}"]
    save_file(tensors, str(copy / NEXTN_FILE))
    own = load_nextn(path).state_dict()
    for loaded in (load_nextn(copy), load_nextn(copy, target=target)):  # read, or target's
        state = loaded.state_dict()
        assert state.keys() == own.keys()
        assert all(torch.equal(state[n], own[n]) for n in own)


def _edit_nextn(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / NEXTN_FILE))
    edit(tensors)
    save_file(tensors, str(dst / NEXTN_FILE))


def test_load_nextn_errors(ckpts, checkpoints, tmp_path):
    path = ckpts["moe"]
    with pytest.raises(ModelConfigError, match="no NextN"):
        load_nextn(checkpoints["default-rope"])

    missing = tmp_path / "missing"
    _edit_nextn(path, missing, lambda t: t.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(ModelConfigError, match=r"model\.layers\.3\.eh_proj\.weight"):
        load_nextn(missing)

    bad = tmp_path / "bad-shape"
    _edit_nextn(path, bad, lambda t: t.update({"model.layers.3.enorm.weight": torch.ones(65)}))
    with pytest.raises(ModelConfigError, match=r"model\.layers\.3\.enorm\.weight has shape"):
        load_nextn(bad)

    none = shutil.copytree(path, tmp_path / "none")
    (none / NEXTN_FILE).unlink()
    with pytest.raises(ModelConfigError, match=r"no model\.layers\.3\.\* tensors"):
        load_nextn(none)


def test_load_model_ignores_the_nextn_layer(ckpts, tmp_path):
    spec = SPECS["moe"]
    plain_spec = TinySpec(**{**spec.__dict__, "num_nextn_predict_layers": 0})
    plain = make_tiny_checkpoint(tmp_path / "plain", plain_spec)
    ours, ref = load_model(ckpts["moe"]).state_dict(), load_model(plain).state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[n], ref[n]) for n in ref)


def _config(**changes) -> dict:
    base = json.loads(hf_config(TinySpec()).to_json_string())
    base.update(changes)
    return base


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True, [1]])
def test_config_rejects_bad_num_nextn_predict_layers(bad):
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers"):
        DeepseekV32Config.from_dict(_config(num_nextn_predict_layers=bad))


def test_config_num_nextn_predict_layers_and_mlp_type_of_nextn_layer():
    assert DeepseekV32Config.from_dict(_config()).num_nextn_predict_layers == 0
    unset = DeepseekV32Config.from_dict(_config(num_nextn_predict_layers=None))
    assert unset.num_nextn_predict_layers == 0
    cfg = DeepseekV32Config.from_dict(_config(num_nextn_predict_layers=2))
    assert cfg.num_nextn_predict_layers == 2
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse")
    assert [cfg.mlp_layer_type(i) for i in range(5)] == ["dense"] + ["sparse"] * 4
    one = cfg.nextn_layer_config()
    assert (one.num_hidden_layers, one.mlp_layer_types) == (1, ("sparse",))

    # Without first_k_dense_replace, the rule is the list's leading dense layers.
    raw = _config(num_nextn_predict_layers=1, mlp_layer_types=["dense", "dense", "dense"])
    del raw["first_k_dense_replace"]
    assert DeepseekV32Config.from_dict(raw).mlp_layer_type(3) == "dense"
    raw = _config(num_hidden_layers=3, first_k_dense_replace=5)
    del raw["mlp_layer_types"]
    assert DeepseekV32Config.from_dict(raw).mlp_layer_type(3) == "dense"
    with pytest.raises(ModelConfigError, match="no NextN"):
        DeepseekV32Config.from_dict(_config()).nextn_layer_config()


def test_the_targets_hidden_feeds_the_draft(ckpts):
    """``forward_with_hidden``: the same logits as ``forward`` (the very rows), and every
    position's final-normed hidden state, which equals transformers' ``last_hidden_state``
    (the input the NextN reference above is driven by), so the draft runs on our own
    target's states."""
    spec, path = SPECS["moe"], ckpts["moe"]
    target = load_model(path)
    _, hf_hidden = _inputs(path, spec)
    n = PREFILL + DECODE
    g = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(3, spec.vocab_size, (n + 1,), generator=g)[:-1]  # _inputs' prompt
    locs = torch.arange(1, n + 1)

    def run(method):
        cache = PlainKVCache.for_model(target.config, n, torch.float32, "cpu")
        batch = ForwardBatch.whole_prompt(ids, locs)
        return method(batch, cache)

    logits, hidden = run(target.forward_with_hidden)
    assert torch.equal(logits, run(target.forward))
    assert hidden.shape == hf_hidden.shape
    assert torch.allclose(hidden, hf_hidden, atol=ATOL, rtol=0)
