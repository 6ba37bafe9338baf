"""Stands in for ``python3`` on PATH (and ``$PYTHON``) while an e2e script runs with
ENGINE=sglang: records each command line (and the ECHO/SGLang environment it got) instead
of starting a server or a benchmark, then answers as the real process would, so the
script carries on to its next launch.

Run as ``launch_recorder.py ARGS...`` (what the script passed to python3); writes one
JSON file per call into $E2E_RECORD_DIR.
"""

from __future__ import annotations

import json
import os
import sys
import time

READY = {
    "sglang.launch_server": "The server is fired up and ready to roll!",
    "sglang_router.launch_router": "Router ready",
    "sglang_echo.bench_serving": None,  # the benchmark client (as $PYTHON)
}


def main() -> int:
    argv = sys.argv[1:]
    module = argv[1] if len(argv) > 1 and argv[0] == "-m" else None
    if module not in READY:
        print(f"launch_recorder: unexpected python3 call {argv}", file=sys.stderr)
        return 3
    env = {k: v for k, v in os.environ.items() if k.startswith(("NSA_", "SGLANG_"))}
    record = os.path.join(os.environ["E2E_RECORD_DIR"], f"{time.time_ns()}-{os.getpid()}.json")
    with open(record, "w") as f:
        json.dump({"module": module, "argv": argv[2:], "env": env}, f)
    if READY[module] is None:
        return 0
    print(READY[module], flush=True)
    time.sleep(60)  # a server stays up until the script stops it (killall_sglang.sh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
