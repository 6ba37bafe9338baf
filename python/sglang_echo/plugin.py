"""SGLang plugin entry point (``sglang.srt.plugins``: ``echo``).

SGLang calls ``register()`` early in every process. With ``NSA_KV_OFFLOAD`` unset or 0
it does nothing at all (not even import sglang modules or parse ECHO's other variables),
so sglang behaves exactly as without the plugin. With ``NSA_KV_OFFLOAD=1`` it parses the
variables of the registry that the plugin reads, once for this process
(``config.load_settings``), and installs ECHO (``sglang_echo.sglang``). If
SGLANG_PLUGINS is set, it must name ``echo`` for the plugin to load.

A plugin that sglang does not load cannot say so (none of its code runs): the package
missing from sglang's environment, or SGLANG_PLUGINS without ``echo``. What the plugin can
see, it turns into an error: an install that fails with ``NSA_KV_OFFLOAD=1`` (sglang only
logs a plugin's exception and would serve without ECHO) stops the process with what to
change, and ``python -m sglang_echo.plugin`` (run with sglang's Python, in the launch's
environment) says whether sglang would load it there.
"""

from __future__ import annotations

import os
import sys

from sglang_echo.config import ENV_OFFLOAD, ConfigError, load_settings, offload_requested

GROUP = "sglang.srt.plugins"
NAME = "echo"
VALUE = "sglang_echo.plugin:register"
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (
    "install the sglang-echo package into sglang's Python environment (pip install -e "
    "<repo> or the wheel, which registers the entry point "
    f"'{GROUP}: {NAME} = {VALUE}'), with sglang {SGLANG_VERSION}"
)


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
    try:
        from sglang_echo.sglang.install import install

        install()
    except Exception as error:  # sglang would only log it and run without ECHO
        not_installed(error)


def not_installed(error: BaseException) -> None:
    """``NSA_KV_OFFLOAD=1`` and the plugin could not install: sglang only logs a plugin's
    exception and then serves without ECHO, so stop this process with the reason."""
    message = (
        f"sglang-echo: {ENV_OFFLOAD}=1 but the ECHO plugin could not install into this "
        f"sglang ({type(error).__name__}: {error}); sglang would run without ECHO. "
        f"{sglang_version_note()}Fix: {INSTALL_HINT}; or unset {ENV_OFFLOAD} to run plain "
        "sglang."
    )
    import logging

    logging.getLogger(__name__).error(message)
    raise SystemExit(message) from error


def sglang_version_note() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        return "sglang is not installed in this Python. "
    if found != SGLANG_VERSION:
        return f"The plugin targets sglang {SGLANG_VERSION}; this is {found}. "
    return ""


def load_problems(environ: dict[str, str] | None = None) -> list[str]:
    """Why sglang, started by this Python with ``environ``, would not run ECHO (empty: it
    would load the plugin, and with NSA_KV_OFFLOAD=1 install it)."""
    from importlib.metadata import entry_points

    env = os.environ if environ is None else environ
    problems = []
    note = sglang_version_note()
    if note:
        problems.append(note.strip())
    found = [ep for ep in entry_points(group=GROUP) if ep.name == NAME]
    if not found:
        problems.append(f"no '{NAME}' entry point in group '{GROUP}': {INSTALL_HINT}.")
    elif found[0].value != VALUE:
        problems.append(
            f"the '{NAME}' entry point is {found[0].value!r}, not {VALUE!r}: another package "
            "took the name; reinstall sglang-echo."
        )
    allowed = env.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if names and NAME not in names:
        problems.append(
            f"SGLANG_PLUGINS={allowed!r} does not name '{NAME}': sglang skips the plugin "
            f"(add '{NAME}' to it or unset it)."
        )
    try:
        requested = offload_requested(env)
    except ConfigError as error:
        problems.append(str(error))
    else:
        if not requested:
            problems.append(f"{ENV_OFFLOAD} is not 1 here: the plugin loads but does nothing.")
    return problems


def main() -> int:
    problems = load_problems()
    if problems:
        print("sglang-echo: sglang would NOT run ECHO with this Python and environment:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(
        f"sglang-echo: sglang {SGLANG_VERSION} would load the plugin and, with "
        f"{ENV_OFFLOAD}=1, run ECHO; each scheduler then logs 'sglang-echo rank ...'."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
