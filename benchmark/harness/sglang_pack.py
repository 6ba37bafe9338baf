"""Pack the sglang sources the GPU harness imports into one small archive.

The harness machine cannot pip-install sglang (standins.py says why), so the harness takes
sglang 0.5.23's own Python files with it: those its import chain (``CHAIN``) loads, traced
here in the sglang environment, plus every ``__init__.py`` above them and the data files
sglang reads while importing them. The chain is traced twice and the union packed: as
this machine is (no GPU), and on sglang's CUDA branch (``torch.cuda.is_available()``
faked true, the harness machine's stand-ins forced in), because several modules import
different siblings on a GPU.

    python -m benchmark.harness.sglang_pack --out .harness/sglang-py.tar.xz

On the harness machine, ``use_pack(archive)`` extracts it, puts it first on ``sys.path``
and installs the stand-ins (standins.py), before anything imports sglang.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmark.harness.standins import STANDINS, install_standins, installed

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = Path.home() / ".cache/sglang-echo/sglang-0.5.23/bin/python"  # make sglang-env

# What the harness imports: module, attribute (None: the module itself).
CHAIN: tuple[tuple[str, str | None], ...] = (
    ("sglang.srt.mem_cache.allocator.hisparse", "HiSparseTokenToKVPoolAllocator"),
    ("sglang.srt.mem_cache.hisparse_memory_pool", "HiSparseDSATokenToKVPool"),
    ("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool"),
    ("sglang.srt.mem_cache.memory_pool", "DSATokenToKVPool"),
    ("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator"),
    ("sglang.srt.disaggregation.decode", "DecodeReqToTokenPool"),
    ("sglang.srt.disaggregation.decode", "alloc_for_decode_prealloc_hisparse"),
    ("sglang.srt.managers.schedule_batch", "Req"),
    ("sglang.srt.sampling.sampling_params", "SamplingParams"),
    ("sglang.srt.mem_cache.common", "backup_kv_cache"),
    ("sglang.srt.layers.radix_attention", "RadixAttention"),
    ("sglang.srt.managers.hisparse_coordinator", "HiSparseCoordinator"),
    ("sglang.srt.mem_cache.sparsity", "parse_hisparse_config"),
    ("sglang.srt.plugins.hook_registry", "HookRegistry"),
    ("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost"),
    ("sglang.srt.mem_cache.pool_host.common", "_cuda_host_register"),
    ("sglang_echo.sglang.coordinator", "EchoCoordinator"),
    # A coordinator, when built, hooks sglang's step-result processing (resolved by name).
    (
        "sglang.srt.managers.scheduler_components.batch_result_processor",
        "SchedulerBatchResultProcessor",
    ),
    # With the decode prefetch on, it hooks the DSA indexer's paged top-k too.
    ("sglang.srt.layers.attention.dsa.dsa_indexer", "Indexer"),
)

# Folders sglang checks for at import (sglang.kernels.jit.utils.compile.paths raises
# unless both exist); packed whole: they are the JIT kernels' sources.
DATA_DIRS = ("sglang/kernels/jit/include", "sglang/kernels/jit/csrc")

# Packages whose .py files are packed whole: their functions import sibling modules
# lazily on a GPU's paths that a trace on the CPU never takes (seen on the H200: the DSA
# pool's KV write probes sglang.kernels.ops.kvcache.set_mla_kv_buffer when the device
# supports launch chaining).
WHOLE_PACKAGES = ("sglang/kernels", "sglang/srt/mem_cache")

# The harness machine's Python distributions besides torch's own (its ``pip list``); on
# the CUDA branch the trace hides every other installed package, as that machine lacks it.
TARGET_DISTRIBUTIONS = frozenset((
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal",
    "annotated-doc", "anyio", "attrs", "certifi", "charset-normalizer", "click", "cloudpickle",
    "einops", "filelock", "frozenlist", "fsspec", "h11", "httpcore", "httpx",
    "huggingface-hub", "idna", "jinja2", "markupsafe", "msgpack", "multidict", "networkx",
    "ninja", "numpy", "packaging", "pandas", "pillow", "pip", "pluggy", "prometheus-client",
    "propcache", "protobuf", "psutil", "pyarrow", "pybind11", "pyyaml", "regex", "requests",
    "rich", "safetensors", "scipy", "sentencepiece", "setuptools", "six", "sympy", "tabulate",
    "tiktoken", "tokenizers", "tqdm", "typing-extensions", "urllib3", "uvloop", "wheel",
    "xxhash", "yarl", "zipp", "pytest", "torch", "triton", "transformers",
))  # fmt: skip


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _absent_on_target() -> set[str]:
    """Top-level names installed here whose distributions the harness machine lacks
    (``TARGET_DISTRIBUTIONS`` and what they require are present)."""
    present = {_normalize(name) for name in TARGET_DISTRIBUTIONS}
    todo = list(present)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            name = _normalize(re.match(r"[A-Za-z0-9._-]+", requirement).group())
            if name not in present:
                present.add(name)
                todo.append(name)
    own = {"sglang", "sglang_echo", "benchmark", *STANDINS}
    return {
        name
        for name, distributions in metadata.packages_distributions().items()
        if name not in own and not any(_normalize(d) in present for d in distributions)
    }


class _Hide(importlib.abc.MetaPathFinder):
    """Makes ``names`` not found, for imports and ``importlib.util.find_spec`` alike."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        real = importlib.util.find_spec

        def find_spec(name: str, package: str | None = None) -> Any:
            return None if name.split(".")[0] in self.names else real(name, package)

        importlib.util.find_spec = find_spec

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def _assume_cuda() -> None:
    """sglang's CUDA branch on a machine without a GPU: what it asks of torch.cuda while
    importing answers as an H200 would."""
    import torch

    props = types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, total_memory=141 << 30,
        multi_processor_count=132, L2_cache_size=60 << 20, warp_size=32, gcnArchName="",
    )  # fmt: skip
    torch.cuda.is_available = lambda: True
    torch.version.cuda = torch.version.cuda or "12.9"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_name = lambda *args, **kwargs: props.name
    torch.cuda.get_device_properties = lambda *args, **kwargs: props


def probe(cfg: dict[str, Any]) -> None:
    """In the sglang environment: import CHAIN and write the files of the sglang modules
    loaded and of the files opened under the sglang package (sglang's import-time data)."""
    root = cfg["root"]
    opened: set[str] = set()

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(root):
            opened.add(args[0])

    sys.addaudithook(audit)
    import torch

    if not torch.cuda.is_available():  # sglang asks it while importing model code
        torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    if cfg["cuda_branch"]:
        install_standins(STANDINS, force=True)
        sys.meta_path.insert(0, _Hide(_absent_on_target()))
        _assume_cuda()
    for module, attr in cfg["chain"]:
        loaded = importlib.import_module(module)
        if attr:
            getattr(loaded, attr)
    if not sys.modules["sglang"].__file__.startswith(root):
        raise SystemExit(f"sglang was imported from {sys.modules['sglang'].__file__}, not {root}")
    modules = {
        getattr(module, "__file__", None)
        for name, module in list(sys.modules.items())
        if name == "sglang" or name.startswith("sglang.")
    }
    result = {"modules": sorted(m for m in modules if m), "opened": sorted(opened)}
    Path(cfg["out"]).write_text(json.dumps(result))


def has_sglang() -> bool:
    """Whether sglang's server package imports here (False also when no package named
    sglang exists at all: find_spec of a dotted name then raises)."""
    try:
        return importlib.util.find_spec("sglang.srt") is not None
    except ModuleNotFoundError:
        return False


def use_pack(archive: str | Path) -> list[str]:
    """Make a pack this process's sglang: extract it, put it first on ``sys.path``, stand
    in for what the machine lacks. Returns the names stood in (for a record)."""
    target = tempfile.mkdtemp(prefix="sglang-pack-")
    with tarfile.open(archive) as tar:
        tar.extractall(target)
    sys.path.insert(0, target)
    install_standins(STANDINS)
    return installed()


def sglang_root(python: Path) -> Path:
    """The sglang package folder that ``python`` imports (found, not imported)."""
    code = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).resolve()


def trace(python: Path, root: Path, cuda_branch: bool) -> dict[str, list[str]]:
    """Run CHAIN in a fresh ``python`` importing sglang from ``root``; the files of the
    sglang modules it loaded and the files it opened under ``root``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        cfg = {
            "path": [str(root.parent), str(REPO), str(REPO / "python")],  # sglang first
            "root": str(root),
            "chain": CHAIN,
            "cuda_branch": cuda_branch,
            "out": str(out),
        }
        run = subprocess.run(
            [str(python), "-m", "benchmark.harness.sglang_pack", "--probe", json.dumps(cfg)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(cfg["path"])},
        )
        if run.returncode != 0:
            sys.stderr.write(run.stderr[-4000:])
            raise SystemExit(f"tracing the import chain failed (cuda_branch={cuda_branch})")
        return json.loads(out.read_text())


def files_to_pack(root: Path, traces: Iterable[dict[str, list[str]]]) -> list[Path]:
    """The traced sglang ``.py`` files and opened data files, the ``__init__.py`` of
    every package above them, ``DATA_DIRS`` and ``WHOLE_PACKAGES``; paths under
    ``root``, sorted."""
    chosen: set[Path] = set()
    for found in traces:
        for name in found["modules"] + found["opened"]:
            path = Path(name).resolve()
            if root in path.parents and "__pycache__" not in path.parts:
                if path.suffix in (".so", ".pyd"):
                    raise SystemExit(f"the chain loads a compiled module: {path}")
                chosen.add(path)
    for path in list(chosen):
        for parent in path.parents:
            if parent == root.parent:
                break
            if (parent / "__init__.py").exists():
                chosen.add(parent / "__init__.py")
    for folder in DATA_DIRS:
        chosen.update(p for p in (root.parent / folder).rglob("*") if p.is_file())
    for folder in WHOLE_PACKAGES:
        chosen.update(
            p for p in (root.parent / folder).rglob("*.py") if "__pycache__" not in p.parts
        )
    return sorted(chosen)


def write_archive(out: Path, root: Path, files: list[Path], manifest: dict) -> int:
    """A reproducible tar.xz (xz: the device call carries 64 MiB with the tree) of ``files`` (named from ``root``'s parent) and a manifest
    ``SGLANG_PACK.json``; returns the bytes packed, uncompressed."""

    def info(name: str, size: int) -> tarfile.TarInfo:
        entry = tarfile.TarInfo(name)
        entry.size, entry.mode, entry.mtime = size, 0o644, 0
        return entry

    out.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with (
        open(out, "wb") as raw,
        lzma.LZMAFile(raw, mode="wb", preset=9 | lzma.PRESET_EXTREME) as zipped,
        tarfile.open(fileobj=zipped, mode="w") as tar,
    ):
        for path in files:
            data = path.read_bytes()
            total += len(data)
            tar.addfile(info(str(path.relative_to(root.parent)), len(data)), io.BytesIO(data))
        body = json.dumps(manifest, indent=1).encode()
        tar.addfile(info("SGLANG_PACK.json", len(body)), io.BytesIO(body))
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.harness.sglang_pack",
        description=__doc__.split("\n\n")[0]
        + " Traces sglang's import of the harness's classes (CHAIN) in the sglang "
        "environment and packs the .py files it loaded, their packages' __init__.py, "
        "and the data sglang needs at import.",
    )
    parser.add_argument("--out", type=Path, help="the .tar.xz to write (required)")
    parser.add_argument(
        "--python",
        type=Path,
        default=DEFAULT_PYTHON,
        help=f"the sglang environment's interpreter (default {DEFAULT_PYTHON})",
    )
    parser.add_argument(
        "--sglang-root",
        type=Path,
        help="the sglang package folder to pack (default: the one --python imports)",
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # the traced run, internal
    args = parser.parse_args(argv)
    if args.probe:
        probe(json.loads(args.probe))
        return 0
    if args.out is None:
        parser.error("--out is required")
    root = (args.sglang_root or sglang_root(args.python)).resolve()
    traces = [trace(args.python, root, cuda_branch) for cuda_branch in (False, True)]
    files = files_to_pack(root, traces)
    version_file = (root / "_version.py").read_text()
    version = re.search(r"^__version__ = .*?['\"]([^'\"]+)", version_file, re.MULTILINE)
    manifest = {
        "sglang_version": version.group(1) if version else None,
        "sglang_root": str(root),
        "chain": CHAIN,
        "standins": STANDINS,
        "files": len(files),
    }
    total = write_archive(args.out, root, files, manifest)
    size = args.out.stat().st_size
    py = sum(1 for path in files if path.suffix == ".py")
    print(f"packed {len(files)} files ({py} .py), {total:,} bytes, from {root}")
    print(f"wrote {args.out}: {size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
