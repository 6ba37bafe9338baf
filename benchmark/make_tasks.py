"""Write a SYNTHETIC InfiniteBench-format task folder (``<task>.jsonl`` per task).

For running ``e2e_test_pd_infini_task.sh`` where the real InfiniteBench files are absent:
each record is random words as ``context`` plus a task-style ``input`` question, with
``"synthetic": true``. Each task's lengths follow its published mean input length
(InfiniteBench's paper, in tokens; ``TASK_MEAN_TOKENS``, +-10%), capped at the model's
context, so the four tasks of ECHO's Figure 14 keep their length mix: code_run's ~75K
prompts stay shorter than the others, which fill the context; the benchmark truncates the
middle to fit, as it does for real files. One character stands for one token (the
project's byte-level tokenizer). Not a substitute for the real tasks' content, only for
their shape (one file per task, per-task input and output lengths).
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
    "code_run": "What is the return value of the function?",
    "longbook_choice_eng": "Which option is correct?",
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


# Mean input length per task in tokens, as InfiniteBench's paper reports them (published,
# not measured here).
TASK_MEAN_TOKENS = {
    "passkey": 122_400,
    "kv_retrieval": 121_100,
    "longbook_qa_eng": 192_600,
    "longbook_choice_eng": 184_400,
    "code_debug": 114_700,
    "code_run": 75_200,
}
FIGURE_14_TASKS = ("code_debug", "code_run", "longbook_choice_eng", "longbook_qa_eng")


def write_tasks(
    out: Path,
    num: int,
    context_tokens: int,
    seed: int = 0,
    tasks: tuple[str, ...] | None = None,
) -> list[Path]:
    """``tasks`` (default: all of ``TASKS``) -> ``<task>.jsonl`` with ``num`` records each,
    of about min(context, the task's published mean length) characters."""
    unknown = set(tasks or ()) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; known: {sorted(TASKS)}")
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = []
    for task in tasks or tuple(TASKS):
        question = TASKS[task]
        path = out / f"{task}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i in range(num):
                mean = min(context_tokens, TASK_MEAN_TOKENS[task])
                n_chars = int(mean * rng.uniform(0.9, 1.1))
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
        "SYNTHETIC InfiniteBench-format tasks written by benchmark.make_tasks "
        "(random words; shapes only, not the real benchmark content).\n"
    )
    return files


def _model_context(model_path: Path) -> int:
    """max_position_embeddings of a checkpoint, or of a study-worker folder's spec."""
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("study_worker.json", "max_position"),
    ):
        if (model_path / name).is_file():
            return int(json.loads((model_path / name).read_text()).get(key, 4096))
    return 4096


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.make_tasks", description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--num", type=int, default=8, help="records per task")
    p.add_argument("--model-path", default=None, help="read max_position_embeddings from it")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tasks",
        default=",".join(FIGURE_14_TASKS),
        help=f"comma-separated tasks (default: ECHO's Figure 14 mix); known: {', '.join(TASKS)}",
    )
    args = p.parse_args(argv)
    ctx = args.context_length
    if ctx is None and args.model_path:
        ctx = _model_context(Path(args.model_path))
    ctx = min(ctx or 4096, 131072)
    try:
        files = write_tasks(args.out, args.num, ctx, args.seed, tuple(args.tasks.split(",")))
    except ValueError as exc:
        p.error(str(exc))
    for f in files:
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
