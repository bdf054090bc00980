"""``--fail-on-skip`` (``make test``, CI): a skipped test fails the run unless it is marked
``gpu``; without the option a skip stays a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("a reason")

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("no GPU here")

@pytest.mark.xfail(reason="known")
def test_known_failure():
    assert False
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(Path(__file__).parents[1].joinpath("conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.makepyfile(
        test_cases=TESTS, test_module_skip='import pytest\npytest.importorskip("no_such_module")'
    )
    return pytester


def test_skips_fail_except_gpu_tests(suite):
    result = suite.runpytest("--fail-on-skip", "--continue-on-collection-errors")
    result.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*skipped under --fail-on-skip (only gpu tests may skip): could not import*",
            "*skipped under --fail-on-skip (only gpu tests may skip): a reason",
        ]
    )


def test_skips_pass_without_the_option(suite):
    suite.runpytest().assert_outcomes(passed=1, skipped=3, xfailed=1)
