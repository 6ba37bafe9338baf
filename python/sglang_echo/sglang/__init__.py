"""The SGLang plugin: ECHO on sglang 0.5.23's DSA path, without a fork.

Entry point ``sglang.srt.plugins: echo = sglang_echo.plugin:register``. ``install`` and
``coordinator`` import sglang; ``args`` imports it lazily, only to read sglang's memory
and model-config rules for the start-up sizing; ``sizing``, ``storage`` and
``topk_resolve`` are plain Python/torch so that they import (and are tested) without it.
"""
