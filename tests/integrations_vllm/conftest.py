"""Fixtures of the vLLM tier's tests."""

from __future__ import annotations

import pytest

import kvblock

MIB = 1 << 20
# The store file's size, unless a test asks for another with
# @store_bytes(n): each of the ~160 cases creates one (on tmpfs for half).
# make_tier formats it with regions of STORE_REGION_BYTES (the default
# region of a 96 MiB store: 1/16 of it, and 1/64 more for runs' trailers),
# so jobs are cut into pieces of 3 slots (1/8 of a region) as the tests
# were written for; 32 MiB holds 4 of them, twice what any such test uses.
STORE_BYTES = 32 * MIB
STORE_REGION_BYTES = 6 * MIB + 6 * MIB // 64


def store_bytes(n: int):
    """The mark of a test whose store file must be ``n`` bytes: one that
    formats it with other regions (a model test: the default ones, which
    the file's size sets) or needs more room."""
    return pytest.mark.store_bytes(n)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "store_bytes(n): the vLLM tier test's store file is n bytes")


@pytest.fixture(params=["disk", "shm"])
def store_file(request, tmp_path):
    """A pre-sized store file on disk, or on tmpfs (read and written through
    a shared mapping: kvblock/io/mapped.py)."""
    mark = request.node.get_closest_marker("store_bytes")
    size = STORE_BYTES if mark is None else mark.args[0]
    if request.param == "shm":
        return request.getfixturevalue("shm_target")(size, "kv.img")
    return str(kvblock.create_file(tmp_path / "kv.img", size))
