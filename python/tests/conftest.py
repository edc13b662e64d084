import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import zhelpers  # noqa: E402


@pytest.fixture
def daemon():
    d = zhelpers.Daemon()
    yield d
    d.stop()


@pytest.fixture
def make_daemon():
    started = []

    def make(**kw):
        started.append(zhelpers.Daemon(**kw))
        return started[-1]
    yield make
    for d in started:
        d.stop()
