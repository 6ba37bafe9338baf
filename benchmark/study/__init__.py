"""The end-to-end study's harness (issue 14): one DP worker's MoE at equal bytes, the
fake-transfer decode node over the runtime's ``StepRunner``, the weight side of the top-k
locality knob, and the model loader the server takes for the study's worker folders
(``loader.py``, via ``--model-loader``). Used by benchmark/e2e_study.py and the e2e sweeps;
the synthetic prompt KV it writes is the runtime's (``sglang_echo.runtime.synthetic_kv``),
and nothing in ``sglang_echo`` imports this package."""
