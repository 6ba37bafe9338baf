"""SGLang plugin entry point (``sglang.srt.plugins``: ``echo``).

SGLang calls ``register()`` early in every process. With ``NSA_KV_OFFLOAD`` unset or 0
it does nothing at all (not even import sglang modules or parse ECHO's other variables),
so sglang behaves exactly as without the plugin. With ``NSA_KV_OFFLOAD=1`` it parses the
variables of the registry that the plugin reads, once for this process
(``config.load_settings``), and installs ECHO (``sglang_echo.sglang``). If
SGLANG_PLUGINS is set, it must name ``echo`` for the plugin to load.
"""

from __future__ import annotations

from sglang_echo.config import ConfigError, load_settings, offload_requested


def register() -> None:
    try:
        if not offload_requested():
            return
        # Every variable the plugin reads, parsed and validated before anything is patched.
        load_settings(reader="plugin")
    except ConfigError as error:
        from sglang_echo.sglang.install import install_error

        install_error(error)
        return
    from sglang_echo.sglang.install import install

    install()
