"""The SGLang plugin: ECHO on sglang 0.5.23's DSA path, without a fork.

Entry point ``sglang.srt.plugins: echo = sglang_echo.plugin:register``. Only ``install``
and ``coordinator`` import sglang; ``args``, ``storage``, ``topk_resolve`` and
``prefetch`` are plain Python/torch so that they import (and are tested) without it.
"""
