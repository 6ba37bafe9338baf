"""Synthetic prompt KV for a PD decode node's fake transfer: deterministic MLA rows and
indexer keys, with a stable fraction of each step's top-k set by one number.

Why: a PD decode node receives each prompt's KV from a prefill node; SGLang benchmarks a
decode node alone with a ``fake`` transfer backend. Here the KV a 100K-token prompt would
bring is generated on the node (on the device, in one pass per layer) and written straight
into the KV backend, so a request starts decoding at once, admitted in milliseconds instead
of a prefill's seconds. Rows are random but deterministic by (seed, layer): two runs, or
two backends, see the same prompt. The MLA rows are a window into a per-layer bank of
random rows made once (model/periodic_rows.py), so a prompt's rows cost no generation and
go to the host pool by copy engine; the index keys, which decide every selection, are
drawn per prompt. Indexer keys are encoded exactly as the model caches its
own (fp8 + scale after a Hadamard rotation, or plain values in bf16 mode).

Locality: each layer has a *favoured direction* u (``favoured_directions``: a unit vector
on the key dims the indexer does not rope). Keys are random with their u-component removed
("cold"), except ``Locality.hot_count`` positions per request and layer whose keys carry a
large u-component ("hot", ``index_keys``). This module only makes keys: the hot keys stay
in every step's top-k only when the served indexers prefer u, which a model loader arranges
by changing their weights (the repository's benchmark loader, benchmark/study/locality.py
``install_preference``). The runtime never changes weights; it reads the stable fraction
from the loader's info (runtime/model_loader.py, ``synthetic_kv_locality``; default 0 =
random keys, labelled "random").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from sglang_echo.model.config import DeepseekV32Config, fp8_row_bytes
from sglang_echo.model.indexer import hadamard_matrix, pack_fp8_rows, quantize_fp8
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.periodic_rows import PeriodicRows

# The hot keys' u-component, in units of a cold key's norm (~sqrt(D)).
HOT_KEY_SCALE = 2.0

# The MLA rows' bank (model/periodic_rows.py): at most this many rows per layer, and at most
# this many bytes for all layers (a fake transfer's only standing device memory).
ROW_BANK_MAX_ROWS = 16384
ROW_BANK_MIN_ROWS = 1024
ROW_BANK_MAX_BYTES = 256 << 20
# A transfer makes its index keys a group of layers at a time, in float32 scratch of at
# most this many bytes (runtime/fake_transfer.py).
KEY_GROUP_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Locality:
    """``stable_fraction`` in [0, 1]: the fraction of each request's top-k per layer that
    a fixed set of its prompt tokens holds (see the module docstring)."""

    stable_fraction: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.stable_fraction <= 1.0:
            raise ValueError(f"stable_fraction must be in [0, 1], got {self.stable_fraction}")

    @property
    def source(self) -> str:
        """The label every result carries: where its top-k locality comes from."""
        if self.stable_fraction == 0.0:
            return "random"
        return f"synthetic-keys:{self.stable_fraction:g}"

    def hot_count(self, topk: int, prompt_len: int) -> int:
        return min(prompt_len, round(self.stable_fraction * topk))


def favoured_directions(
    num_layers: int, head_dim: int, rope_dim: int, seed: int = 0
) -> torch.Tensor:
    """[L, D] float32 unit vectors, zero on the first ``rope_dim`` (roped) dims."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(num_layers, head_dim, generator=gen)
    u[:, :rope_dim] = 0.0
    return u / u.norm(dim=-1, keepdim=True)


def index_keys(
    n: int,
    directions: torch.Tensor,
    hot_positions: torch.Tensor,
    generators: list[torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """Unrotated float32 keys [G, n, D] of G layers (``directions`` [G, D], sorted
    ``hot_positions`` [G, m], one generator per layer): cold keys ~ N(0, I) with the
    layer's u-component removed; keys at the hot positions get HOT_KEY_SCALE x sqrt(D) x u
    added. Each layer's draw comes from its own generator, the arithmetic is one pass over
    the group: a transfer's launches do not grow with the layer count."""
    g, d = directions.shape
    u = directions.to(device=device, dtype=torch.float32)
    k = torch.empty(g, n, d, device=device)
    for i, gen in enumerate(generators):
        torch.randn(n, d, generator=gen, device=device, out=k[i])
    k -= torch.bmm(k, u.unsqueeze(2)) * u.unsqueeze(1)
    if hot_positions.numel():
        layer = torch.arange(g, device=device).unsqueeze(1)
        k[layer, hot_positions] += HOT_KEY_SCALE * d**0.5 * u.unsqueeze(1)
    return k


def _generator(device: torch.device, seed: int, layer: int, stream: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + layer) * 7 + stream)
    return gen


class SyntheticKV:
    """Per-layer rows of a synthetic prompt of length n and seed s, for one model."""

    def __init__(
        self,
        config: DeepseekV32Config,
        directions: torch.Tensor,
        locality: Locality,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.config = config
        # [L, D], from favoured_directions; on the device once, so that writing a
        # prompt makes no blocking host-to-device copy (the decode node writes on a side
        # stream, and a blocking copy there would hold the engine thread until the stream
        # drained, stalling the running batch as before).
        self.directions = directions.to(device)
        self.locality = locality
        self.dtype = dtype
        self.device = torch.device(device)
        self._row_bank: torch.Tensor | None = None  # made at first use (kv_window)

    def hot_positions(self, layers: range, length: int, seed: int) -> torch.Tensor:
        """[len(layers), m] sorted prompt positions whose keys carry each layer's favoured
        direction."""
        m = self.locality.hot_count(self.config.index_topk, length)
        # Drawn where the keys are made: on CUDA no host permutation of 100K positions per
        # layer (a few ms of the engine thread per admission) and no copy to wait for.
        perm = torch.empty(len(layers), length, dtype=torch.int64, device=self.device)
        for i, layer in enumerate(layers):
            gen = _generator(self.device, seed, layer, 0)
            torch.randperm(length, generator=gen, device=self.device, out=perm[i])
        return perm[:, :m].sort(dim=1).values

    def encode_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Unrotated float keys [..., n, D] -> the rows the model caches (``index_row_dim``)."""
        k = keys.to(self.dtype)
        if self.config.indexer_mode != "fp8_hadamard":
            return k
        d = self.config.index_head_dim
        rotated = k.reshape(-1, d) @ hadamard_matrix(d, k.device, k.dtype)
        packed = pack_fp8_rows(*quantize_fp8(rotated), fp8_row_bytes(d))
        return packed.reshape(*keys.shape[:-1], -1)

    @property
    def bank_rows(self) -> int:
        """P, the bank's rows per layer: as many as the byte bound allows, within bounds."""
        cfg = self.config
        row_bytes = cfg.kv_row_dim * torch.empty(0, dtype=self.dtype).element_size()
        fit = ROW_BANK_MAX_BYTES // max(1, cfg.num_hidden_layers * row_bytes)
        return max(ROW_BANK_MIN_ROWS, min(ROW_BANK_MAX_ROWS, fit))

    def bank(self) -> torch.Tensor:
        """[L, P, kv_row_dim] random rows in the model dtype, made once (seeded)."""
        if self._row_bank is None:
            cfg = self.config
            self._row_bank = torch.stack(
                [
                    torch.randn(
                        self.bank_rows,
                        cfg.kv_row_dim,
                        generator=_generator(self.device, 0, layer, 1),
                        device=self.device,
                    ).to(self.dtype)
                    for layer in range(cfg.num_hidden_layers)
                ]
            )
        return self._row_bank

    def kv_window(self, layer: int, length: int, seed: int) -> PeriodicRows:
        """The prompt's MLA rows in ``layer``: a window into the layer's bank at an offset
        drawn from (seed, layer), so prompts (and layers) get different rows."""
        offset = random.Random(seed * 1_000_003 + layer).randrange(self.bank_rows)
        return PeriodicRows(self.bank()[layer], offset, length)

    def keys(self, layer: int, length: int, seed: int) -> torch.Tensor:
        """The prompt's index-key rows [n, index_row_dim] in ``layer``, made as a group of one
        (a transfer makes them by ``layer_groups``; the same draws, the arithmetic batched
        differently, so on CUDA the bits may differ: every server writes by groups)."""
        return self.keys_of(range(layer, layer + 1), length, seed)[0]

    def keys_of(self, layers: range, length: int, seed: int) -> torch.Tensor:
        """The prompt's index-key rows [len(layers), n, index_row_dim] of ``layers``, each
        layer's drawn from its own generator."""
        raw = index_keys(
            length,
            self.directions[layers.start : layers.stop],
            self.hot_positions(layers, length, seed),
            [_generator(self.device, seed, layer, 2) for layer in layers],
            self.device,
        )
        return self.encode_keys(raw)

    def layer_groups(self, length: int) -> list[range]:
        """The model's layers in groups whose float32 keys for ``length`` tokens fit
        KEY_GROUP_MAX_BYTES (at least one layer per group): the transfer makes each
        group's keys in one pass."""
        per_layer = max(1, length * self.config.index_head_dim * 4)
        size = max(1, KEY_GROUP_MAX_BYTES // per_layer)
        layers = self.config.num_hidden_layers
        return [range(a, min(a + size, layers)) for a in range(0, layers, size)]

    def rows(self, layer: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLA rows [n, kv_row_dim] in the model dtype, index-key rows [n, index_row_dim])."""
        return self.kv_window(layer, length, seed).materialize(), self.keys(layer, length, seed)

    def write(self, kv_cache: KVCache, locs: torch.Tensor, seed: int) -> None:
        """Write a prompt of ``len(locs)`` tokens at token locations ``locs`` (positions
        0..n-1 in order) into every layer: ECHO's ``write_prompt`` (host rows + device
        index keys, no device slots) where the backend has it, else ``write`` (the plain
        pool's device rows)."""
        n = int(locs.numel())
        for group in self.layer_groups(n):
            keys = self.keys_of(group, n, seed)
            for i, layer in enumerate(group):
                kv = self.kv_window(layer, n, seed).materialize()
                kv_cache.write_prompt(layer, locs, kv, keys[i])
