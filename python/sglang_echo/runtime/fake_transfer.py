"""A decode node's "transfer" with SGLang's fake backend: prompt KV synthesized on the node.

A PD decode node receives each prompt's KV (and the first token) from a prefill node. To
measure a decode node alone, SGLang's fake transfer backend skips the transfer; here the
KV a prompt would bring is generated on the node instead: deterministic rows and indexer
keys for every layer (``study.synthetic_kv``), seeded by the prompt's token ids, so the
same prompt gets the same KV on a no-offload and an ECHO server and their outputs can be
compared token for token. Rows go where a transfer would put them: the device pool
without offload, the host pool (index keys on the device, no cache slots) under ECHO.
The request then decodes at once; its first token stands in for the prefill node's.
"""

from __future__ import annotations

import random
import zlib

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.runtime.request import SeqState
from sglang_echo.runtime.step_runner import StepRunner


def prompt_seed(ids: list[int]) -> int:
    """A stable seed from the prompt's ids (the same on every server and run)."""
    return zlib.crc32(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())


class FakeTransfer:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        steps: StepRunner,
        locality: float,
        dtype: torch.dtype,
    ) -> None:
        from sglang_echo.study.locality import Locality, favoured_directions, install_preference
        from sglang_echo.study.synthetic_kv import SyntheticKV

        cfg = model.config
        directions = favoured_directions(
            cfg.num_hidden_layers, cfg.index_head_dim, cfg.qk_rope_head_dim
        )
        if locality > 0:
            install_preference(model, directions)  # the indexers favour the hot keys
        self.locality = Locality(locality)
        self.synth = SyntheticKV(cfg, directions, self.locality, dtype, steps.device)
        self.kv_cache = kv_cache
        self.steps = steps
        self.vocab_size = cfg.vocab_size

    def receive(self, req: SeqState) -> int:
        """Place ``req``'s prompt KV (the request is admitted: it has a table row) and
        return its first output token."""
        n = len(req.prompt)
        locs = self.steps.allocator.alloc(n)
        self.steps.place(req, 0, locs)
        seed = prompt_seed(req.prompt)
        loc_t = torch.tensor(locs, dtype=torch.int64, device=self.steps.device)
        self.synth.write(self.kv_cache, loc_t, seed)
        req.cached_len = n
        return random.Random(seed).randrange(self.vocab_size)
