"""Offline training text: the Python sources installed on this machine, as byte tokens.

Files are deduplicated and split by the SHA-1 of their content, so the same file lands in
the same split on every machine (and a vendored copy of a held-out file cannot leak into
training). Each file becomes ``<|bos|> bytes <|eos|>`` with byte b -> token b + 3, the
layout of ``sglang_echo.tokenizer``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sglang_echo.tokenizer import SPECIAL_TOKENS

BOS_ID = SPECIAL_TOKENS.index("<|bos|>")
EOS_ID = SPECIAL_TOKENS.index("<|eos|>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}


class CorpusError(ValueError):
    """The corpus cannot support the requested training or evaluation."""


@dataclass(frozen=True)
class SourceFile:
    root: str  # label of the root directory it was found under
    rel: str  # path relative to that root
    sha1: str
    size: int

    @property
    def hash_fraction(self) -> float:
        """A uniform number in [0, 1) fixed by the content: decides the split."""
        return int(self.sha1[:8], 16) / 2**32


@dataclass
class Corpus:
    roots: list[dict]
    train_files: list[SourceFile]
    eval_files: list[SourceFile]
    train_tokens: np.ndarray  # uint16 stream of every train file, in content-hash order
    eval_docs: list[np.ndarray]  # one uint16 array per held-out file, content-hash order
    skipped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "roots": self.roots,
            "train_files": len(self.train_files),
            "train_bytes": sum(f.size for f in self.train_files),
            "train_tokens": int(self.train_tokens.size),
            "eval_files": len(self.eval_files),
            "eval_bytes": sum(f.size for f in self.eval_files),
            "skipped": self.skipped,
            "fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """SHA-1 over the content hashes of both splits: equal corpora, equal fingerprint."""
        h = hashlib.sha1()
        for f in self.train_files:
            h.update(b"t" + f.sha1.encode())
        for f in self.eval_files:
            h.update(b"e" + f.sha1.encode())
        return h.hexdigest()[:16]


def default_roots() -> list[tuple[str, Path]]:
    """The interpreter's stdlib and every site-packages directory it knows about."""
    found: list[tuple[str, Path]] = []
    paths = sysconfig.get_paths()
    candidates = [("stdlib", paths.get("stdlib"))]
    site_dirs = [paths.get("purelib"), paths.get("platlib")]
    with contextlib.suppress(AttributeError):  # some embedded interpreters lack it
        site_dirs += list(site.getsitepackages())
    candidates += [("site-packages", d) for d in site_dirs]
    seen: set[Path] = set()
    for label, raw in candidates:
        if not raw:
            continue
        path = Path(raw).resolve()
        if path in seen or not path.is_dir():
            continue
        seen.add(path)
        found.append((label, path))
    return found


def _walk_py(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / n for n in sorted(filenames) if n.endswith(".py"))
    return files


def _doc_tokens(data: bytes) -> np.ndarray:
    out = np.empty(len(data) + 2, dtype=np.uint16)
    out[0] = BOS_ID
    out[1:-1] = np.frombuffer(data, dtype=np.uint8).astype(np.uint16) + BYTE_OFFSET
    out[-1] = EOS_ID
    return out


def load_corpus(
    roots: list[tuple[str, Path]] | None = None,
    eval_fraction: float = 0.02,
    max_train_bytes: int = 160 << 20,
    max_file_bytes: int = 1 << 20,
    with_train_stream: bool = True,
) -> Corpus:
    """Read, deduplicate and split every ``*.py`` file under ``roots``.

    ``with_train_stream=False`` skips building the training token stream (evaluation only).
    """
    if not 0.0 < eval_fraction < 1.0:
        raise CorpusError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    roots = roots if roots is not None else default_roots()
    if not roots:
        raise CorpusError("no source roots found; pass --data-roots DIR[,DIR...]")
    by_sha: dict[str, tuple[SourceFile, bytes]] = {}
    root_stats = []
    skipped = {"empty": 0, "too_large": 0, "duplicate": 0, "unreadable": 0}
    for label, root in roots:
        n_files = n_bytes = 0
        for path in _walk_py(Path(root)):
            try:
                data = path.read_bytes()
            except OSError:
                skipped["unreadable"] += 1
                continue
            if not data:
                skipped["empty"] += 1
                continue
            if len(data) > max_file_bytes:
                skipped["too_large"] += 1
                continue
            sha = hashlib.sha1(data).hexdigest()
            if sha in by_sha:
                skipped["duplicate"] += 1
                continue
            rel = str(path.relative_to(root))
            by_sha[sha] = (SourceFile(label, rel, sha, len(data)), data)
            n_files += 1
            n_bytes += len(data)
        root_stats.append({"label": label, "path": str(root), "files": n_files, "bytes": n_bytes})

    ordered = sorted(by_sha.values(), key=lambda item: item[0].sha1)
    train, held_out = [], []
    train_bytes = 0
    for meta, data in ordered:
        if meta.hash_fraction < eval_fraction:
            held_out.append((meta, data))
        elif train_bytes + meta.size <= max_train_bytes:
            train.append((meta, data))
            train_bytes += meta.size
        else:
            skipped.setdefault("over_train_cap", 0)
            skipped["over_train_cap"] += 1
    if not train or not held_out:
        raise CorpusError(
            f"corpus too small: {len(train)} train and {len(held_out)} held-out files under "
            f"{[str(r) for _, r in roots]}; add roots or raise --eval-fraction."
        )
    stream = (
        np.concatenate([_doc_tokens(data) for _, data in train])
        if with_train_stream
        else np.zeros(0, dtype=np.uint16)
    )
    return Corpus(
        roots=root_stats,
        train_files=[m for m, _ in train],
        eval_files=[m for m, _ in held_out],
        train_tokens=stream,
        eval_docs=[_doc_tokens(data) for _, data in held_out],
        skipped=skipped,
    )


class WindowSampler:
    """Random fixed-length windows of a token stream, deterministic by seed.

    Offsets are drawn on a CPU generator (identical on every device); the stream lives
    on the training device as int16 (token ids < 2^15).
    """

    def __init__(self, tokens: np.ndarray, device: torch.device | str, seed: int) -> None:
        if int(tokens.max(initial=0)) >= 2**15:
            raise CorpusError("token ids must fit int16 for the device-side stream")
        self.length = int(tokens.size)
        self.tokens = torch.from_numpy(tokens.astype(np.int16)).to(device)
        self.device = self.tokens.device
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> inputs [B, T] and next-token labels [B, T], int64 on the device."""
        if self.length < seq_len + 2:
            raise CorpusError(
                f"token stream of {self.length} tokens is shorter than one window of "
                f"{seq_len + 1}; lower --seq-len or add data."
            )
        offsets = torch.randint(0, self.length - seq_len - 1, (batch,), generator=self.generator)
        idx = offsets[:, None] + torch.arange(seq_len + 1)
        window = self.tokens[idx.to(self.device)].long()
        return window[:, :-1], window[:, 1:]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def eval_windows(
    docs: list[np.ndarray], n_windows: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed held-out windows (evenly spaced over the held-out stream), on the CPU."""
    stream = np.concatenate(docs)
    if stream.size < seq_len + 2:
        raise CorpusError(
            f"held-out text has {stream.size} tokens, less than one {seq_len + 1}-token window; "
            "raise --eval-fraction or lower --seq-len."
        )
    span = stream.size - seq_len - 1
    starts = np.linspace(0, span, num=n_windows, dtype=np.int64)
    windows = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    w = torch.from_numpy(windows)
    return w[:, :-1], w[:, 1:]
