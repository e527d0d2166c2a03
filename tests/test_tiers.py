"""The unit tier starts no process and builds nothing (issue 28): tests/conftest.py fails a unit test
that starts a process, while it sets up as well as while it runs, so a fixture of module or session
scope (compiling C, starting a daemon) set up for a unit test fails it too, naming that test.

Each test runs a small suite in this process (pytester) with tests/conftest.py as its plugin."""

from __future__ import annotations

import pytest

pytest_plugins = ("pytester",)

def _outcome(pytester: pytest.Pytester, module: str) -> pytest.RunResult:
    """Run `module` as a suite of its own, with tests/conftest.py (its tiers and guard) as a plugin."""
    pytester.makepyfile(test_inner=module)
    return pytester.runpytest_inprocess("-p", "tests.conftest", "-p", "no:cacheprovider", "-q")


def test_a_module_fixture_that_starts_a_compiler_fails_the_unit_test_that_uses_it(pytester: pytest.Pytester) -> None:
    result = _outcome(pytester, """
import subprocess
import pytest

@pytest.fixture(scope="module")
def built():
    subprocess.run(["cc", "--version"], check=True)

def test_uses_it(built):
    pass
""")
    result.assert_outcomes(errors=1)
    # The inner test's own name: the guard of the inner suite caught it, not this test's.
    result.stdout.fnmatch_lines(["*test_inner.py::test_uses_it is a unit test but starts a process (*cc*--version*): "
                                 "mark it @pytest.mark.integration*"])


def test_a_session_fixture_that_forks_fails_the_unit_test_that_uses_it(pytester: pytest.Pytester) -> None:
    result = _outcome(pytester, """
import os
import pytest

@pytest.fixture(scope="session")
def forked():
    os.fork()

def test_uses_it(forked):
    pass
""")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_inner.py::test_uses_it is a unit test but starts a process*"])


def test_a_unit_test_body_that_starts_a_process_fails(pytester: pytest.Pytester) -> None:
    result = _outcome(pytester, """
import subprocess

def test_runs_true():
    subprocess.run(["true"])
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_inner.py::test_runs_true is a unit test but starts a process (*true*)*"])

