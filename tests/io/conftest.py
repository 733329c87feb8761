"""Fixtures shared by the engine tests."""

import pytest

from kvblock.io import ENGINES
from kvblock.io.uring import probe


@pytest.fixture(params=ENGINES)
def engine_name(request):
    """Each engine by name; uring is skipped, with the reason, where the kernel refuses it."""
    if request.param == "uring" and not probe()[0]:
        pytest.skip(f"io_uring unavailable here: {probe()[1]}")
    return request.param
