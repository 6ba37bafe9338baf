"""Shared fixtures: tiny DeepSeek-V3.2 checkpoints generated once per session."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from sglang_echo.config import reset_settings

# benchmark/, research/ and scripts/ live outside the wheel, as packages at the repository root
# (docs/DEVELOPMENT.md: Layout): the tests import them from there, as `python -m benchmark...`
# does. The product tests here import the tiny-checkpoint maker from scripts/, never research/
# (tests/repo/test_layout.py); the repository tooling's tests are in tests/repo/.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint  # noqa: E402

# Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine the
# thread pool's contention made small ops ~50x slower.
torch.set_num_threads(1)
# Triton kernels run under the interpreter on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Three oracle configurations: different seeds and shapes, MoE on, index_topk below the
# prompt lengths (so sparsity matters), >= 8 indexer heads, one with YaRN rope.
ORACLE_SPECS = {
    "default-rope": TinySpec(seed=0),
    "yarn": TinySpec(
        seed=1,
        layers=2,
        hidden=48,
        heads=3,
        q_lora_rank=40,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        experts=6,
        experts_per_tok=3,
        n_group=2,
        topk_group=2,
        index_heads=16,
        index_dim=64,
        index_topk=24,
        rope="yarn",
        max_position=2048,
    ),
    "wide-moe": TinySpec(
        seed=2,
        layers=4,
        dense_layers=2,
        hidden=64,
        heads=2,
        q_lora_rank=32,
        kv_lora_rank=64,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=32,
        experts=16,
        experts_per_tok=4,
        n_group=4,
        topk_group=2,
        shared_experts=2,
        index_heads=12,
        index_dim=16,
        index_topk=12,
    ),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    paths = {name: make_tiny_checkpoint(root / name, spec) for name, spec in ORACLE_SPECS.items()}
    # DeepSeek's deployed indexer: Hadamard-rotated fp8 keys (transformers has no such mode).
    fp8 = shutil.copytree(paths["default-rope"], root / "fp8-indexer")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["indexer_mode"] = "fp8_hadamard"
    (fp8 / "config.json").write_text(json.dumps(cfg))
    paths["fp8-indexer"] = fp8
    return paths


@pytest.fixture(scope="session")
def small_checkpoint(checkpoints):
    return checkpoints["default-rope"]


@pytest.fixture(autouse=True)
def _fresh_echo_settings():
    """The process's settings (sglang_echo.config.settings()) are parsed once, at a
    start-up or on first use. Each test starts and ends without them, so its first reader
    parses the environment the test set, and nothing carries over to the next test (a
    test that changes a variable after a reader ran calls config.reset_settings())."""
    reset_settings()
    yield
    reset_settings()


# ------------------------------------------------------------- sm_90 compile recording
# Every kernel launch under the interpreter is recorded (argument types and constexpr
# values) so that tests/test_zz_compile_sm90.py can compile the same launches for the
# GPU; see tests/sm90_compile.py for why. The check compiles what this process recorded,
# so it must run after every other test of the session: pytest_collection_modifyitems
# below moves it last, whatever the order of the files on the command line.
RECORDED_LAUNCHES: dict[str, dict] = {}
# Why nothing is recorded, when nothing can be (None: recording is on).
RECORDING_OFF: str | None = None
SM90_CHECK_FILE = "test_zz_compile_sm90.py"
# Under pytest-xdist with --dist loadgroup (make test: two workers on two cores), the
# files that launch our kernels run in one worker, with the sm_90 check last among them,
# so the check compiles every launch of those files.
KERNEL_GROUP = "kernels"
KERNEL_GROUP_FILES = ("test_kernel_", "test_lossless.py", "test_decode_write.py", "test_pdl.py")


def _in_kernel_group(name: str) -> bool:
    return name == SM90_CHECK_FILE or name.startswith(KERNEL_GROUP_FILES)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The sm_90 compile check last: it compiles the launches the tests before it ran."""
    last = [it for it in items if it.path.name == SM90_CHECK_FILE]
    if last:
        items[:] = [it for it in items if it.path.name != SM90_CHECK_FILE] + last
    for it in items:
        if _in_kernel_group(it.path.name):
            it.add_marker(pytest.mark.xdist_group(KERNEL_GROUP))


def _triton_type(value: object) -> str:
    names = {
        torch.int64: "*i64",
        torch.int32: "*i32",
        torch.int16: "*i16",
        torch.int8: "*i8",
        torch.uint8: "*u8",
        torch.bool: "*i1",
        torch.float32: "*fp32",
        torch.float16: "*fp16",
        torch.bfloat16: "*bf16",
        torch.float64: "*fp64",
        torch.float8_e4m3fn: "*fp8e4nv",
    }
    if isinstance(value, torch.Tensor):
        return names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _record_launches() -> str | None:
    """Wraps the interpreter's launch to record each one; returns why it could not."""
    import inspect

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as exc:
        return f"triton's interpreter cannot be imported ({exc})"
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        fn = self.fn
        params = inspect.signature(fn).parameters
        own = {k: v for k, v in kwargs.items() if k in params}  # not grid=, warmup=
        bound = inspect.signature(fn).bind_partial(*args, **own).arguments
        signature, constexprs = {}, {}
        for name, param in params.items():
            if name not in bound:
                continue
            value = bound[name]
            if param.annotation in ("tl.constexpr", "constexpr") or "constexpr" in str(
                param.annotation
            ):
                signature[name] = "constexpr"
                constexprs[name] = value
            else:
                signature[name] = _triton_type(value)
        key = json.dumps([fn.__module__, fn.__name__, signature, constexprs], default=str)
        RECORDED_LAUNCHES.setdefault(
            key,
            {
                "module": fn.__module__,
                "kernel": fn.__name__,
                "signature": signature,
                "constexprs": constexprs,
            },
        )
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    return None


if os.environ.get("TRITON_INTERPRET") == "1":
    RECORDING_OFF = _record_launches()
else:
    RECORDING_OFF = f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, not '1'"
