"""Launcher dry parse, as ``python -m sglang.launch_server`` does it up to the server:
load the plugins, parse argv, resolve once, pickle the record (what children receive).

Run as a script, one process per plugin set-up (plugins load once per process):
``dry_parse.py CASES.json`` where each case is {"argv": [...], "env": {...}}; prints
one JSON line per case: the resolved fields read back from the unpickled record, or the
error. Only the device-capability query is stubbed (no GPU here).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import sys

import torch

torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)


def resolved_fields(server_args) -> dict:
    from sglang.srt.arg_groups.arg_utils import field_names
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(server_args)
    return {
        name: repr(getattr(view, name, None)) for name in sorted(field_names(type(server_args)))
    }


def run_case(case: dict) -> dict:
    from sglang.srt.server_args import prepare_server_args

    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):  # argparse reports there, then exits
            server_args = prepare_server_args(case["argv"])
        server_args.resolve_once()
        before = resolved_fields(server_args)
        after = resolved_fields(pickle.loads(pickle.dumps(server_args)))
        return {"fields": after, "pickle_stable": before == after}
    except SystemExit as exc:  # the parser refused the command line
        return {"error": f"SystemExit({exc.code}): {stderr.getvalue().strip()[-2000:]}"}
    except Exception as exc:  # reported to the test, which decides
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.managers.hisparse_coordinator as hisparse

    with open(sys.argv[1]) as f:
        cases = json.load(f)
    from sglang.srt.model_executor.model_runner import ModelRunner

    state = {
        "coordinator": hisparse.HiSparseCoordinator.__qualname__,
        # ECHO's AFTER hook (guards.runner_guard) wraps the coordinator's construction.
        "runner_guarded": hasattr(ModelRunner.maybe_init_hisparse_coordinator, "__wrapped__"),
        "echo_installed": "sglang_echo.sglang.install" in sys.modules,
        "echo_plugin_loaded": "sglang_echo.plugin" in sys.modules,
    }
    print("STATE " + json.dumps(state), flush=True)
    for case in cases:
        print("CASE " + json.dumps(run_case(case)), flush=True)


if __name__ == "__main__":
    main()
