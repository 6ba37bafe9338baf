"""The end-to-end study's harness behind ``benchmark/e2e_study.py`` (its CLI), one job per
module, so each can be read and checked alone:

- ``plan``: the run's sizes, engines and their order, derived from the args alone;
- ``engines``: building each engine's KV cache and step runner (no-offload, ECHO, the
  HiSparse-like baseline) and reading a built one's bytes, evictions and leaks;
- ``timing``: the run's clock and log, CUDA-event step timing, graph-replayed timing;
- ``measure``: a block's engines admitting, warming up and timing decode steps;
- ``profiler``: device time per step by kernel category;
- ``components``: a layer's weight side and the step's fixed part, timed alone;
- ``runs``: reading the measurements (every repeat of a phase, ratios with their spread);
- ``lossless``: the greedy-output comparisons across engines;
- ``extrapolate``: the 61-layer estimate and capacities (a cost model, not a measurement);
- ``metrics`` and ``record``: the JSON record's metrics, config and file;
- ``study``: one run's order of work.

The DP-worker emulation it drives (model, MoE, decode node, locality knob) is
``benchmark.study``."""
