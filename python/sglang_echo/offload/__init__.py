"""ECHO's memory system: pinned host pool, per-layer device cache, and their operations.

Engine-agnostic: no model code here. ``kernels`` <- ``offload`` <- (``runtime`` | ``sglang``).
"""
