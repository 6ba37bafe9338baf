"""pytest plugin for `make test-sglang` (``-p require_tests_ran``, tests/sglang on
PYTHONPATH): a run of the SGLang plugin tests in which no test passed did not test the
plugin, so it fails.

pytest itself exits 5 when nothing is collected, but exits 0 when every test is skipped
(e.g. each module skipped itself). ECHO_REQUIRE_SGLANG=1 turns a missing sglang into an
error (plugin_testenv.require_sglang); this catches every other way of skipping it all.
Not a conftest.py: see plugin_testenv's docstring.
"""

from __future__ import annotations

import pytest


class RequireTestsRan:
    def __init__(self) -> None:
        self.passed = 0
        self.failed_run = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.passed += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.OK and self.passed == 0:
            self.failed_run = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.failed_run:
            terminalreporter.write_line(
                "require_tests_ran: FAILED: no test passed (every test was skipped or "
                "deselected), so the SGLang plugin was not tested; see the skip reasons above.",
                red=True,
                bold=True,
            )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(RequireTestsRan(), "require_tests_ran_gate")
