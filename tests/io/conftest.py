"""Fixtures for the I/O engine tests."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iotest_helpers import ENGINES, engine_or_skip  # noqa: E402


@pytest.fixture(params=ENGINES)
def engine(request):
    e = engine_or_skip(request.param, block_size=1 << 16, queue_depth=8)
    yield e
    e.close()
