"""Write a SYNTHETIC InfiniteBench-format task folder (``<task>.jsonl`` per task).

For running ``e2e_test_pd_infini_task.sh`` where the real InfiniteBench files are absent:
each record is random words as ``context`` plus a task-style ``input`` question, with
``"synthetic": true``. Lengths are sized to the model's context; the benchmark truncates
the middle to fit, as it does for real files. Not a substitute for the real tasks'
content, only for their shape (one file per task, per-task output lengths).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASKS = {
    "passkey": "What is the pass key?",
    "kv_retrieval": "Extract the value corresponding to the specified key.",
    "longbook_qa_eng": "Answer the question based on the book.",
    "code_debug": "Which function has a deliberate error?",
}
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "that",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
]


def write_tasks(out: Path, num: int, context_tokens: int, seed: int = 0) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = []
    for task, question in TASKS.items():
        path = out / f"{task}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i in range(num):
                n_chars = int(context_tokens * rng.uniform(0.9, 1.1))
                words: list[str] = []
                size = 0
                while size < n_chars:
                    w = rng.choice(WORDS)
                    words.append(w)
                    size += len(w) + 1
                rec = {
                    "id": i,
                    "context": " ".join(words)[:n_chars],
                    "input": question,
                    "answer": [""],
                    "synthetic": True,
                }
                f.write(json.dumps(rec) + "\n")
        files.append(path)
    (out / "README.txt").write_text(
        "SYNTHETIC InfiniteBench-format tasks written by sglang_echo.bench.make_tasks "
        "(random words; shapes only, not the real benchmark content).\n"
    )
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_echo.bench.make_tasks", description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--num", type=int, default=8, help="records per task")
    p.add_argument("--model-path", default=None, help="read max_position_embeddings from it")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ctx = args.context_length
    if ctx is None and args.model_path:
        cfg = json.loads((Path(args.model_path) / "config.json").read_text())
        ctx = int(cfg.get("max_position_embeddings", 4096))
    ctx = min(ctx or 4096, 131072)
    for f in write_tasks(args.out, args.num, ctx, args.seed):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
