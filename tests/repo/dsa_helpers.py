"""Shared by the DSA training and top-k trace tests: a synthetic corpus and a tiny run."""

from __future__ import annotations

from pathlib import Path

from research.train import cli

TINY_TRAIN_ARGS = [
    "--device", "cpu", "--eval-fraction", "0.1", "--steps", "4", "--dense-steps", "2",
    "--seq-len", "96", "--batch-size", "2", "--long-seq-len", "160", "--long-batch-size", "1",
    "--long-every", "2", "--kl-rows", "16", "--eval-every", "3", "--eval-windows", "2",
    "--log-every", "1", "--warmup-steps", "2", "--amp", "none", "--lr", "3e-3",
    "--layers", "2", "--hidden", "32", "--heads", "2", "--q-lora-rank", "16",
    "--kv-lora-rank", "16", "--qk-nope-head-dim", "8", "--qk-rope-head-dim", "8",
    "--v-head-dim", "8", "--intermediate", "32", "--index-heads", "2", "--index-dim", "16",
    "--index-topk", "8", "--max-position", "512", "--init-std", "0.1",
]  # fmt: skip


def write_corpus(root: Path) -> Path:
    """A deterministic synthetic Python corpus (no dependence on what is installed):
    60 distinct files, one duplicate and one empty file."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(60):
        lines = [f"# module {i}", "import math", ""]
        for j in range(8 + i % 7):
            lines += [
                f"def f_{i}_{j}(x, y={j}):",
                f'    """Return a mix of {i} and {j}."""',
                f"    return math.sqrt(x * {i + 1}) + y * {j} - {i * j % 11}",
                "",
            ]
        (root / f"mod_{i:02d}.py").write_text("\n".join(lines))
    (root / "dup.py").write_text((root / "mod_00.py").read_text())
    (root / "empty.py").write_text("")
    return root


def train_tiny(out: Path, corpus: Path) -> tuple[Path, dict]:
    """A 4-step run of the training CLI (2 dense, 2 sparse): (checkpoint dir, record)."""
    argv = [
        "--out", str(out / "ckpt"), "--log-json", str(out / "topk_train.json"),
        "--data-roots", str(corpus), *TINY_TRAIN_ARGS,
    ]  # fmt: skip
    return out / "ckpt", cli.main(argv)
