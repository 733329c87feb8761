"""A rank does its own I/O at the places its store server answers: an
answer that names a place outside the store's data area (a buggy or older
server, a stray process on the socket) must be refused with a typed error
before a byte is written or read there, never taken as the run's space."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import KVBlockError, ServerError
from kvblock.store.client import RemoteStore
from kvblock.store.server import serve_in_background
from tests.store.workload import GEOM, REGION, run_data, run_keys

MIB = 1 << 20


@pytest.fixture
def served(tmp_path):
    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([path], sock)
    try:
        yield path, sock, server
    finally:
        server.stop()
        os.unlink(path)


def _metadata(path: str, server) -> bytes:
    """The bytes before the data area: superblocks, checkpoints, journal."""
    with open(path, "rb") as f:
        return f.read(server.store.regions.data_offsets[0])


def _bad_places(server):
    data0 = server.store.regions.data_offsets[0]
    count, size = server.store.regions.count, server.store.regions.size
    align = server.store.alignment
    return {
        "superblock": lambda r, o: (r, -data0 - r * size),   # device offset 0
        "before_data": lambda r, o: (-1, o),                 # a region before region 0
        "past_regions": lambda r, o: (count, o),             # past the last region
        "past_region_end": lambda r, o: (r, size - align),   # spills into the next region
        "unaligned": lambda r, o: (r, o + 512),
        "not_a_number": lambda r, o: (str(r), o),
    }


@pytest.mark.parametrize("bad", ["superblock", "before_data", "past_regions",
                                 "past_region_end", "unaligned", "not_a_number"])
def test_an_allocation_outside_the_data_area_is_refused_before_a_write(served, monkeypatch,
                                                                       bad):
    path, sock, server = served
    real = server._op_allocate
    move = _bad_places(server)[bad]

    def allocate(s, nblocks):
        a = real(s, nblocks)
        a["region"], a["offset"] = move(a["region"], a["offset"])
        return a
    monkeypatch.setattr(server, "_op_allocate", allocate)
    before = _metadata(path, server)
    r = RemoteStore(sock)
    try:
        keys = run_keys(1, 3)
        with pytest.raises(ServerError, match="allocate"):
            r.put_run(keys, run_data(keys))
        assert _metadata(path, server) == before, "the rank wrote over the store's metadata"
        monkeypatch.setattr(server, "_op_allocate", real)
        assert int(server.store.regions.pins.sum()) == 0     # the allocation given back
    finally:
        r.close()
    assert not server.store.closed


def test_put_runs_refuses_an_allocation_over_the_superblock(served, monkeypatch):
    """The same check on put_runs' grouped path (its commit_runs)."""
    path, sock, server = served
    real = server._op_allocate
    move = _bad_places(server)["superblock"]
    calls = []

    def allocate(s, nblocks):
        a = real(s, nblocks)
        calls.append(a)
        if len(calls) == 2:                  # the group's second run
            a["region"], a["offset"] = move(a["region"], a["offset"])
        return a
    monkeypatch.setattr(server, "_op_allocate", allocate)
    before = _metadata(path, server)
    r = RemoteStore(sock)
    try:
        runs = [run_keys(1, 2), run_keys(2, 2)]
        with pytest.raises(ServerError, match="allocate"):
            r.put_runs([(keys, run_data(keys)) for keys in runs])
        assert _metadata(path, server) == before, "the rank wrote over the store's metadata"
        assert int(server.store.regions.pins.sum()) == 0
        assert r.lookup(runs[0]) == 0                     # none of the group published
    finally:
        r.close()
