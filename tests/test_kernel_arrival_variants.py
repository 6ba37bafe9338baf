"""The kernels each decode-node arrival and each finished request launch compile one variant
for every prompt: a served H200 run logged a compile per new arrival shape while serving
(the placed rows' slot row, whose alignment follows the prompt's length; the release's
count; the reservation's locations, a view into a table row). On the CPU the kernels'
declared specializations are checked (interpreted or compiled form); on CUDA the compiled
variants are counted over prompts of many lengths."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels import decode_write, placed_rows, release
from sglang_echo.offload.device_cache import DeviceCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# kernel name -> (the kernel, ints that change per prompt, pointers whose alignment does)
PER_PROMPT = {
    "placed_rows": (placed_rows._placed_rows_kernel, {"n", "offset"}, {"slots"}),
    "release": (release._release_kernel, {"n"}, {"ids_ptr"}),
    "place_all_layers": (decode_write._place_all_layers_kernel, {"lanes"}, {"locs_ptr"}),
}


def _declared(kernel) -> tuple[set[str], set[str]]:
    """(not specialized on value, not specialized on alignment), from either form Triton
    gives a kernel (the interpreter keeps the decorator's arguments)."""
    if hasattr(kernel, "params"):
        params = kernel.params
        return (
            {p.name for p in params if p.do_not_specialize},
            {p.name for p in params if p.do_not_specialize_on_alignment},
        )
    kw = kernel.kwargs
    return set(kw.get("do_not_specialize") or ()), set(
        kw.get("do_not_specialize_on_alignment") or ()
    )


@pytest.mark.parametrize("name", list(PER_PROMPT))
def test_per_prompt_arguments_are_not_specialized(name: str) -> None:
    kernel, values, aligned = PER_PROMPT[name]
    got_values, got_aligned = _declared(kernel)
    assert values <= got_values, f"specialized on {sorted(values - got_values)}"
    assert aligned <= got_aligned, (
        f"specialized on the alignment of {sorted(aligned - got_aligned)}"
    )


def _variants(kernel) -> int:
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts compiled GPU variants")
def test_arrivals_of_any_length_reuse_one_variant_per_kernel() -> None:
    layers, slots, host, width = 3, 4096, 1 << 15, 288
    cache = DeviceCache(layers, slots, host, width, torch.bfloat16, DEV)
    bank = torch.randn(2048, width, device=DEV).to(torch.bfloat16)
    counts = []
    for step, n in enumerate((1, 17, 33, 250, 1023, 16, 7, 129)):
        table_row = torch.randperm(host - 1, device=DEV)[: n + step] + 1
        locs = table_row[step:]  # a view at an odd offset, as a table row's slice
        dest = decode_write.place_slots_all_layers_kernel(cache, locs, priority=step + 1)
        for layer in range(layers):  # rows of [layers, n]: their alignment follows n
            placed_rows.write_placed_rows_kernel(
                cache.rows[layer], dest[layer], bank, cache.scratch_slot, period=1000, offset=step
            )
        errors = torch.zeros(1, dtype=torch.int64, device=DEV)
        release.release_kernel(cache, locs[: max(1, n - step)], errors)
        torch.cuda.synchronize()
        counts.append([_variants(k) for k, _, _ in PER_PROMPT.values()])
    # Other tests in the process may have compiled other constexpr variants first: what
    # counts is that no arrival after the first adds one.
    assert all(c == counts[0] for c in counts), f"variants per arrival: {counts}"
