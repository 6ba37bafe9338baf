"""The end-to-end study's harness (issue 14): one DP worker's MoE at equal bytes, synthetic
prompt KV for a fake-transfer decode node, and a top-k locality knob. Used by
benchmark/e2e_study.py; nothing in the serving runtime depends on it."""
