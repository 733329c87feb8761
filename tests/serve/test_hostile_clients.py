"""A store server is shared by the ranks of an engine: a client that speaks
the wire protocol wrongly (a bug, another release, a hostile peer) must get
a typed error or lose its connection, and never close the store for the
others, corrupt it or leak pins.  These tests talk to the server over a raw
Unix socket, then check that another client is still served correctly."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.store.client import RemoteStore
from kvblock.store.protocol import encode_keys, encode_msg, recv_msg
from kvblock.store.server import serve_in_background
from tests.store.workload import GEOM, REGION, run_data, run_keys

MIB = 1 << 20


@pytest.fixture
def store_file(tmp_path):
    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    yield path
    os.unlink(path)


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "kv.sock")


def _raw(sock_path) -> socket.socket:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(20)
    raw.connect(sock_path)
    return raw


def _ask(raw, **req) -> dict:
    raw.sendall(encode_msg(req))
    return recv_msg(raw)


def _still_serves(server, sock_path, tag: int) -> None:
    """Another client puts and reads a run back byte for byte; nothing stays pinned."""
    r = RemoteStore(sock_path)
    try:
        keys = run_keys(tag, 3)
        assert r.put_run(keys, run_data(keys)) == 3
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert r.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))
        assert r.stats()["pinned_regions"] == 0
    finally:
        r.close()
    assert not server.store.closed


@pytest.mark.parametrize("checksums", ["string", "nested"])
def test_a_commit_with_malformed_checksums_is_refused_not_fatal(store_file, sock, checksums):
    """A commit whose checksums have the right count but are not a list of
    64-bit integers (a string of that length, a list of lists) passed the
    count check and failed only in the journal commit's leader, which
    closed the store: the server stopped, for every rank."""
    with serve_in_background([store_file], sock) as server:
        nr = server.store.geometry.run_checksums
        bad = "7" * nr if checksums == "string" else [[1, 2]] * nr
        raw = _raw(sock)
        try:
            key = os.urandom(16)
            admit = _ask(raw, op="admit", keys=encode_keys([key]))
            assert admit["ok"], admit
            alloc = _ask(raw, op="allocate", nblocks=1)
            assert alloc["ok"], alloc
            reply = _ask(raw, op="commit", wid=alloc["result"]["wid"],
                         keys=encode_keys([key]), checksums=bad,
                         clears=admit["result"]["clears"])
            assert not server.store.closed, f"one client's bad commit closed the store: {reply}"
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "checksums" in reply["message"]
            assert int(server.store.regions.pins.sum()) == 0   # the allocation given back
        finally:
            raw.close()
        _still_serves(server, sock, 1)
