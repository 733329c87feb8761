"""Fixtures of the vLLM tier's tests."""

from __future__ import annotations

import pytest

import kvblock

STORE_BYTES = 96 << 20


@pytest.fixture(params=["disk", "shm"])
def store_file(request, tmp_path):
    """A pre-sized store file on disk, or on tmpfs (read and written through
    a shared mapping: kvblock/io/mapped.py)."""
    if request.param == "shm":
        return request.getfixturevalue("shm_target")(STORE_BYTES, "kv.img")
    return str(kvblock.create_file(tmp_path / "kv.img", STORE_BYTES))
