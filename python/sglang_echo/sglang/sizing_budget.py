"""What one GPU and one node have for ECHO's pools, twice (``sizing.py`` checks the plan's
totals against it):

- at argument resolution (``Budget``, an estimate, before anything loads): sglang's
  static-fraction rule gives the KV pools ``mem_fraction_static x (GPU memory - start-up
  overhead) - weights``. sglang budgets against the free memory it samples before loading
  (``pre_model_load_memory``: the GPU less the CUDA context and the communicators' buffers),
  less ``(1 - mem_fraction_static)`` of it, less what the load took. It has no constant for
  that overhead, so ``STARTUP_OVERHEAD`` is one, stated as an estimate. The weights come
  from ``sizing_weights.py``. The host pools of a node must fit sglang's host-memory rule
  (available memory less its fixed reserve, as HiCache's host pools are checked).
- in each scheduler (``MeasuredBudget``; ``guards.profile_guard``, before any pool is
  allocated): the bytes sglang's profile returned, exact at the measured fraction.

``Graphs`` is sglang's default fraction as a function of the decode graphs' max batch
(probed by ``args_sizing.graph_fractions``).

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from sglang_echo.sglang.sizing_weights import GiB, WeightBytes, gib

HOST_RESERVE = 10 * 2**30  # sglang's HICACHE_HOST_MEMORY_RESERVE_BYTES

# What sglang's profile loses before it samples the memory it budgets against
# (``pre_model_load_memory``, after the process groups are built and before the weights
# load): the CUDA context, NCCL's and the custom all-reduce's buffers, the other start-up
# allocations. sglang has no constant for it. AN ESTIMATE: issue 50 puts it in a range of
# a few GiB per GPU on 8-GPU nodes; the early check takes the low end (the value below), so
# that it refuses only plans that cannot fit, and the scheduler's exact check (``MeasuredBudget``) decides the rest.
# The CUDA graphs need no term of their own: sglang reserves their memory in its default
# fraction (``handle_gpu_memory_settings``), in the 1 - fraction share the budget leaves.
STARTUP_OVERHEAD = 3 * GiB // 2


@dataclass(frozen=True)
class Budget:
    """What one GPU and one node will have, estimated at argument resolution (before the
    weights load): sglang's static-fraction rule over the memory its profile will see."""

    gpu_memory: int  # bytes of one GPU (sglang's get_device_memory_capacity)
    mem_fraction_static: float
    weights: WeightBytes
    ranks_per_node: int
    host_available: int | None = None  # the node's available memory; None: not checked
    host_reserve: int = HOST_RESERVE
    startup_overhead: int = STARTUP_OVERHEAD  # an estimate: see STARTUP_OVERHEAD

    @property
    def free_before_load(self) -> int:
        """What sglang's profile will find free before loading (estimated)."""
        return self.gpu_memory - self.startup_overhead

    @property
    def static_bytes(self) -> int:
        return int(self.free_before_load * self.mem_fraction_static)

    @property
    def kv_bytes(self) -> int:
        """sglang's static-fraction rule: what is left for KV after the weights."""
        return self.static_bytes - self.weights.total

    @property
    def host_limit(self) -> int | None:
        if self.host_available is None:
            return None
        return self.host_available - self.host_reserve

    def at_fraction(self, fraction: float) -> Budget:
        return replace(self, mem_fraction_static=fraction)

    def runtime_reserve(self, fraction: float) -> int:
        """What sglang keeps outside its static share at ``fraction`` (its activations and
        CUDA graphs): (1 - fraction) x the memory free before loading."""
        return int(self.free_before_load * (1 - fraction))

    def formula(self) -> str:
        return (
            f"{self.mem_fraction_static} x ({gib(self.gpu_memory)} - start-up "
            f"{gib(self.startup_overhead)}) - weights {gib(self.weights.total)}"
        )

    def detail_lines(self) -> list[str]:
        return self.weights.lines()

    def gpu_name(self) -> str:
        return "the GPU"

    def note(self) -> str | None:
        return (
            f"the start-up overhead ({gib(self.startup_overhead)}) is an estimate: each "
            "scheduler checks again against the memory sglang measures after loading"
        )

    def empty_message(self) -> str:
        """When the weights alone fill sglang's static share: nothing ECHO sizes matters."""
        return (
            f"the weights alone ({gib(self.weights.total)} per GPU) fill sglang's static "
            f"share of the GPU ({self.mem_fraction_static} x ({gib(self.gpu_memory)} - "
            f"start-up {gib(self.startup_overhead)}) = {gib(self.static_bytes)}): no KV pool "
            "fits; use GPUs with more memory, more GPUs for the weights, or a smaller "
            "checkpoint."
        )


@dataclass(frozen=True)
class MeasuredBudget:
    """What one GPU has as sglang measured it, in the scheduler, before it built any pool:
    the bytes ``KVCacheConfigurator._profile_available_bytes`` returned for its KV pools
    (the memory free after loading less (1 - fraction) x the memory free before loading,
    ``pre_model_load_memory``; both the least over the ranks). Exact at the measured
    fraction; at another one sglang's rule moves the budget by the change x the memory
    free before loading. The host pools are not checked here (argument resolution did)."""

    free_before_load: int  # sglang's pre_model_load_memory, in bytes
    measured_kv_bytes: int  # what sglang's profile returned
    measured_fraction: float  # the --mem-fraction-static it was measured at
    mem_fraction_static: float  # the fraction this budget is for (searches vary it)
    gpu_memory: int | None = None  # the device's capacity, for the message
    ranks_per_node: int = 1
    host_available: int | None = None
    host_reserve: int = HOST_RESERVE

    @classmethod
    def measured(
        cls, free_before_load: int, kv_bytes: int, fraction: float, gpu_memory: int | None
    ) -> MeasuredBudget:
        return cls(free_before_load, kv_bytes, fraction, fraction, gpu_memory)

    @property
    def kv_bytes(self) -> int:
        if self.mem_fraction_static == self.measured_fraction:
            return self.measured_kv_bytes
        change = (self.mem_fraction_static - self.measured_fraction) * self.free_before_load
        return int(self.measured_kv_bytes + change)

    @property
    def free_after_load(self) -> int:
        """What sglang's profile found free after loading (its budget, plus its slack)."""
        return self.measured_kv_bytes + int((1 - self.measured_fraction) * self.free_before_load)

    @property
    def host_limit(self) -> int | None:
        return None

    def at_fraction(self, fraction: float) -> MeasuredBudget:
        return replace(self, mem_fraction_static=fraction)

    def runtime_reserve(self, fraction: float) -> int:
        return int(self.free_before_load * (1 - fraction))

    def formula(self) -> str:
        return (
            f"{gib(self.free_after_load)} free after loading - (1 - "
            f"{self.mem_fraction_static}) x {gib(self.free_before_load)} free before"
        )

    def detail_lines(self) -> list[str]:
        gpu = self.gpu_memory
        total = (
            "" if gpu is None else f" of {gib(gpu)} (start-up {gib(gpu - self.free_before_load)})"
        )
        loaded = self.free_before_load - self.free_after_load
        return [
            f"sglang's profile per GPU: free before loading {gib(self.free_before_load)}{total},",
            f"  free after loading {gib(self.free_after_load)} (the weights as loaded and "
            f"other start-up allocations: {gib(loaded)})",
        ]

    def gpu_name(self) -> str:
        return "the GPU as sglang measured it"

    def note(self) -> str | None:
        return None

    def empty_message(self) -> str:
        return (
            f"what sglang measured leaves no KV budget ({gib(self.kv_bytes)} = "
            f"{self.formula()}): no KV pool fits; use GPUs with more memory, more GPUs for "
            "the weights, or a smaller checkpoint."
        )


AnyBudget = Budget | MeasuredBudget


@dataclass(frozen=True)
class Graphs:
    """sglang's default --mem-fraction-static as a function of
    --cuda-graph-max-bs-decode (``fraction_at``: sglang's own rule, probed by
    ``args_sizing.graph_fractions``; it reserves memory per captured decode batch), at the
    launch's ``max_bs``. Only where the fraction is sglang's default: a fraction the user
    set does not move with the graphs."""

    max_bs: int
    fraction_at: Callable[[int], float]
