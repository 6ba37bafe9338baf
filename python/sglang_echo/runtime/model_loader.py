"""The server's one extension point for what it serves: ``--model-loader MODULE:FUNCTION``.

Without the flag the server loads the DeepSeek-V3.2 checkpoint folder at ``--model-path``
(``model/loader.py``). With it, the named function builds the model instead: the module
must be importable (on ``PYTHONPATH``), and the function is called once, at start-up,
before anything is sized::

    def load(model_path: str, *, device: torch.device, dtype: torch.dtype,
             argv: list[str], server_args: ServerArgs)
        -> DeepseekV32ForCausalLM | tuple[DeepseekV32ForCausalLM, dict]

- ``argv``: the loader's own flags: ``--model-loader-args`` split as a shell would
  (write it ``--model-loader-args="--flag value"``); the server does not read them.
- ``server_args``: every server flag, to read (e.g. to refuse a flag outside decode mode).
- It returns the model on ``device`` in ``dtype``, optionally with an info dict of JSON
  values that ``/get_model_info`` reports as ``model_loader_info``. The runtime reads one
  key of it: ``synthetic_kv_locality`` (in [0, 1], default 0), the stable fraction of each
  step's top-k in the prompt KV that a fake-transfer decode node synthesizes
  (``runtime/synthetic_kv.py``). It means something only when the loader has biased the
  indexers toward ``synthetic_kv.favoured_directions`` (seed 0); the runtime itself never
  changes a model's weights.
- A ``ValueError`` it raises is a start-up error (exit 2), reported with the loader's name.

The tokenizer still comes from ``--model-path`` (its tokenizer.json, when there is one).
The repository's e2e benchmarks serve their study worker folders through this, with the
top-k locality knob that alters weights (``benchmark/study/loader.py``, outside the wheel).
"""

from __future__ import annotations

import importlib
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.server_args import ServerArgError, ServerArgs, check_model_loader_spec

LOCALITY_KEY = "synthetic_kv_locality"


@dataclass
class LoadedModel:
    model: DeepseekV32ForCausalLM
    info: dict = field(default_factory=dict)  # the loader's, as it returned it

    @property
    def synthetic_kv_locality(self) -> float:
        return float(self.info.get(LOCALITY_KEY, 0.0))


def resolve(spec: str) -> Callable:
    """The function ``spec`` (MODULE:FUNCTION) names; a ServerArgError saying why not."""
    check_model_loader_spec(spec)
    module_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ServerArgError(
            f"--model-loader {spec}: cannot import {module_name} ({exc}); put its folder on "
            "PYTHONPATH"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ServerArgError(f"--model-loader {spec}: {module_name} has no function {func_name}")
    return func


def load_served_model(
    args: ServerArgs,
    device: torch.device,
    dtype: torch.dtype,
    kernels: ModelKernels | None = None,
) -> LoadedModel:
    """The model ``args`` asks for: the checkpoint at ``--model-path``, or the loader's.
    ``kernels``: the kernel choices the start-up's settings name (None: the registry's
    defaults); a loader's model is switched to them after it returns."""
    kernels = kernels if kernels is not None else ModelKernels()
    if args.model_loader is None:
        return LoadedModel(load_model(args.model_path, device=device, dtype=dtype, kernels=kernels))
    spec = args.model_loader
    func = resolve(spec)
    argv = shlex.split(args.model_loader_args or "")
    try:
        out = func(args.model_path, device=device, dtype=dtype, argv=argv, server_args=args)
    except ValueError as exc:
        raise ServerArgError(f"--model-loader {spec}: {exc}") from exc
    model, info = out if isinstance(out, tuple) else (out, {})
    if not isinstance(model, DeepseekV32ForCausalLM):
        raise ServerArgError(
            f"--model-loader {spec} returned {type(model).__name__}, not a DeepseekV32ForCausalLM"
        )
    if not isinstance(info, dict):
        raise ServerArgError(f"--model-loader {spec}: its info must be a dict, got {info!r}")
    try:
        json.dumps(info)
    except (TypeError, ValueError) as exc:
        raise ServerArgError(f"--model-loader {spec}: its info is not JSON ({exc})") from None
    kernels.apply(model)  # SGLANG_ECHO_TOPK / _SPARSE_MLA: the server's, not the loader's
    loaded = LoadedModel(model.eval(), info)
    locality = info.get(LOCALITY_KEY, 0.0)
    if not isinstance(locality, int | float) or not 0.0 <= locality <= 1.0:
        raise ServerArgError(f"--model-loader {spec}: {LOCALITY_KEY} {locality!r} not in [0, 1]")
    return loaded
