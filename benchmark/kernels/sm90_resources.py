"""What the sparse-MLA kernel's launch configs cost in registers, on the CPU, before any
device time is spent: each config compiled for an H200 (sm_90a) by triton with its own
ptxas, which reports registers per thread and bytes spilled to local memory. Compiled as
the JIT specializes the real decode launch (16-byte alignment and multiples of 16 on every
pointer and integer argument), since that changes what is measured.

Why: a decode-kernel config that spills, or whose gathered row loads are not software-
pipelined, is latency-bound however it is tuned on the GPU; both show at compile time. The
report gives per config: registers, spill stores/loads (bytes per thread), shared memory,
how the KV tiles are stored to shared memory (16-byte vectors or element by element), wgmma
instructions (Hopper's warpgroup MMA; 0 = the older mma.sync path), and whether
the loop's 2-D gathered loads of KV rows went through asynchronous copies
(``ttg.async_copy_global_to_local``) or are plain loads into registers that the loop waits
for (``tt.load``). Compile-only facts; speed is for sparse_mla_bench.py on the GPU.

    python benchmark/kernels/sm90_resources.py --out benchmark/results
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save_record
from sparse_mla_bench import CONFIG_KEYS, CONFIGS, LAT, ROPE, launcher_default

TOPK = 2048  # DeepSeek-V3.2's index_topk
COMBINE_SPLITS = (2, 4, 8, 16)  # the split merges the benchmarks launch
SIGNATURE = {
    "q_ptr": "*bf16",
    "buf_ptr": "*bf16",
    "rows_ptr": "*i32",
    "out_ptr": "*bf16",
    "part_ptr": "*fp32",
    "stats_ptr": "*fp32",
    "scale": "fp32",
    "n_heads": "i32",
    "q_stride_t": "i32",
    "q_stride_h": "i32",
    "buf_stride": "i32",
    "rows_stride": "i32",
    "out_stride_t": "i32",
    "out_stride_h": "i32",
}
# What Triton's JIT specializes at the real decode launch: every pointer is 16-byte aligned
# and every integer argument a multiple of 16 at DeepSeek-V3.2's widths (128 heads, strides
# 128 x 576, 576, 2048, 128 x 512, 512; row strides 576 elements or 656 bytes), so it compiles
# with tt.divisibility 16 on each, which changes vectorization, spills and shared memory. A
# compile without it describes a kernel that is never launched.
SPECIALIZED_DIV16 = tuple(k for k, v in SIGNATURE.items() if v != "fp32")
PTXAS_USAGE = re.compile(r"Used (\d+) registers")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
ROW_TILE = re.compile(r"tensor<\d+x\d+x!tt\.ptr<bf16>")  # a 2-D tile of KV-row pointers


def ptxas_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(kernel) -> tuple:
    """(registers match, spill match) of ptxas -v on a compiled kernel's PTX for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run(
            [ptxas_path(), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return PTXAS_USAGE.search(report), PTXAS_SPILL.search(report)


def compile_combine(splits: int) -> dict:
    """The split merge (``_combine_kernel``) as the launcher runs it for ``splits``: its
    registers and spills (a merge tile too large spills, which made split K lose)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_echo.kernels import sparse_mla as k

    ints = ("part_ptr", "stats_ptr", "out_ptr", "n_heads", "out_stride_t", "out_stride_h")
    const = dict(
        LAT=LAT, BLOCK_C=min(k.COMBINE_BLOCK_C, LAT), BLOCK_H=k.COMBINE_BLOCK_H, SPLITS=splits
    )
    sig = {
        "part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16", "n_heads": "i32",
        "out_stride_t": "i32", "out_stride_h": "i32", **dict.fromkeys(const, "constexpr"),
    }  # fmt: skip
    names = list(sig)
    src = ASTSource(
        fn=k._combine_kernel,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in const.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ints},
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": k.COMBINE_NUM_WARPS}
    )
    regs, spill = ptxas_report(kernel)
    return {
        "splits": splits,
        "block_h": const["BLOCK_H"],
        "block_c": const["BLOCK_C"],
        "num_warps": k.COMBINE_NUM_WARPS,
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spill.group(1)) if spill else None,
        "spill_load_bytes": int(spill.group(2)) if spill else None,
    }


def compile_config(config: tuple[int, int, int, int, int], fp8: bool = False) -> dict:
    """Compile the sparse-MLA kernel for sm_90a at one (block_h, block_k, warps, stages,
    splits) config, DeepSeek-V3.2's row widths, bf16 (``fp8``: 656-byte fp8 KV rows,
    dequantized in registers); -> its resource facts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_echo.kernels.sparse_mla import _sparse_mla_kernel

    block_h, block_k, warps, stages, splits = config
    chunk = triton.cdiv(triton.cdiv(TOPK, block_k), splits) * block_k
    const = dict(
        LAT=LAT, ROPE=ROPE, TOPK=TOPK, BLOCK_LAT=LAT, BLOCK_ROPE=ROPE, BLOCK_H=block_h,
        BLOCK_K=block_k, SPLITS=splits, CHUNK=chunk, PRECISION="tf32", FP8=fp8,
    )  # fmt: skip
    sig = {**SIGNATURE, "buf_ptr": "*u8" if fp8 else "*bf16", **dict.fromkeys(const, "constexpr")}
    names = list(sig)
    src = ASTSource(
        fn=_sparse_mla_kernel,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in const.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in SPECIALIZED_DIV16},
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    regs, spill = ptxas_report(kernel)
    ttgir = kernel.asm["ttgir"].splitlines()
    row_loads = [ln for ln in ttgir if ROW_TILE.search(ln)]
    return {
        **dict(zip(CONFIG_KEYS, config, strict=True)),
        "kv": "fp8_e4m3" if fp8 else "bfloat16",
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spill.group(1)) if spill else None,
        "spill_load_bytes": int(spill.group(2)) if spill else None,
        "shared_bytes": kernel.metadata.shared,
        # How the loop's KV tiles reach shared memory for the MMA: 16-byte vector stores, or
        # element by element (a per-element gather in the tile's math forces that layout).
        "shared_stores_v4": kernel.asm["ptx"].count("st.shared.v4."),
        "shared_stores_scalar": len(re.findall(r"st\.shared\.b(?:8|16) ", kernel.asm["ptx"])),
        "wgmma": kernel.asm["ptx"].count("wgmma.mma_async"),
        "row_loads_async": sum("async_copy_global_to_local" in ln for ln in row_loads),
        "row_loads_sync": sum(" tt.load " in ln for ln in row_loads),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--only-default", action="store_true", help="the launcher's default alone")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
    import triton

    default = launcher_default()
    configs = [default] if args.only_default else [default, *(c for c in CONFIGS if c != default)]
    rows = []
    for i, config in enumerate(configs, 1):
        rows.append(compile_config(config))
        print(f"[{i}/{len(configs)}]", rows[-1], flush=True)
    fp8_default = compile_config(default, fp8=True)
    print("[fp8]", fp8_default, flush=True)
    merges = [compile_combine(n) for n in COMBINE_SPLITS]
    for m in merges:
        print("[merge]", m, flush=True)
    metrics = {
        "kernel": "kernels/sparse_mla.py _sparse_mla_kernel (bf16, 576/512 rows, top-k 2048)",
        "target": "sm_90a",
        "default": rows[0],
        "fp8_default": fp8_default,
        "configs": rows,
        "spill_free": [r for r in rows if r["spill_store_bytes"] == 0],
        "merge": merges,
    }
    device = f"cpu: compile only, triton {triton.__version__} and its ptxas, target sm_90a"
    path = save_record(args.out, "sm90_resources", device, metrics)
    print(f"record {path}")
    return metrics


if __name__ == "__main__":
    main()
