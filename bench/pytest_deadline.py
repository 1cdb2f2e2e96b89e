"""A per-test time limit for the GPU suite's pytest run: ``pytest -p pytest_deadline --test-deadline S``.

A test still running after S seconds fails there (SIGALRM raises in the test's own thread; a
child process it waits on is killed by ``subprocess.run`` on the way out), and the run goes on
to the next test, so one hung launch costs S seconds, not the step's whole cap. The suite's
pytest step also asks for ``--durations``: the slowest tests are named in its log. POSIX only.
"""

from __future__ import annotations

import signal

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--test-deadline", type=float, default=None, metavar="SECONDS",
                     help="fail a test that runs longer than this (setup, call and teardown each)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _Deadline(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _Deadline(item):
        yield


class _Deadline:
    """SIGALRM after the limit, for the duration of one test phase."""

    def __init__(self, item: pytest.Item):
        self.limit = item.config.getoption("--test-deadline")

    def __enter__(self):
        if self.limit:
            self.previous = signal.signal(signal.SIGALRM, self.expire)
            signal.setitimer(signal.ITIMER_REAL, self.limit)

    def expire(self, signum, frame):
        pytest.fail(f"still running after the {self.limit:g} s per-test deadline (--test-deadline)", pytrace=False)

    def __exit__(self, *exc):
        if self.limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False
