"""SGLang plugin entry point (``sglang.srt.plugins``: ``echo``).

SGLang calls ``register()`` early in every process. With ``NSA_KV_OFFLOAD`` unset or 0
it does nothing at all (not even import sglang modules), so sglang behaves exactly as
without the plugin. With ``NSA_KV_OFFLOAD=1`` it installs ECHO (``sglang_echo.sglang``).
If SGLANG_PLUGINS is set, it must name ``echo`` for the plugin to load.
"""

from __future__ import annotations

import os

from sglang_echo.config import ENV_OFFLOAD, ConfigError, EchoConfig, parse_flag


def register() -> None:
    try:
        if not parse_flag(ENV_OFFLOAD, os.environ.get(ENV_OFFLOAD)):
            return
        EchoConfig.from_env()  # every ECHO setting, validated before anything is patched
    except ConfigError as error:
        from sglang_echo.sglang.install import install_error

        install_error(error)
        return
    from sglang_echo.sglang.install import install

    install()
