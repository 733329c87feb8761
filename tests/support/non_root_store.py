"""Run by tests/store/test_non_root.py as an unprivileged user: a store's
whole life on TARGET (a device or file this user was given), what happens
when it is busy, and with SOCK, a rank of the store served there.  Prints
one line per step; exits non-zero on any failure."""

import sys

import numpy as np

from kvblock import Geometry, KVStore
from kvblock.errors import DeviceBusyError

target = sys.argv[1]
geom = Geometry(2, 2, 64, "bfloat16", 16)
keys = [bytes([i]) * 16 for i in range(1, 6)]
data = np.random.default_rng(1).integers(0, 256, len(keys) * geom.block_bytes, np.uint8)


def standalone() -> None:
    with KVStore.format([target], geom, model="m") as store:
        assert store.put_run(keys, data) == 5
        out = np.zeros_like(data)
        assert store.get_run(keys, out) == 5 and np.array_equal(out, data)
        print("engine", store.stats()["engine"])
        try:
            KVStore.open([target])
        except DeviceBusyError as e:
            print("busy", e)
        else:
            sys.exit("a second open of a store in use was not refused")
    with KVStore.open([target], geometry=geom, model="m") as store:
        out = np.zeros_like(data)
        assert store.get_run(keys, out) == 5 and np.array_equal(out, data)
        print("reopened", store.stats()["blocks"])


def served(sock: str) -> None:
    """A rank of the store served on SOCK by a `kvblock serve` this user
    runs: it does its own direct I/O at the offsets the server hands out."""
    from kvblock.store import connect

    with connect(sock) as remote:
        more = [bytes([i]) * 16 for i in range(10, 12)]
        extra = np.random.default_rng(2).integers(0, 256, 2 * geom.block_bytes, np.uint8)
        assert remote.put_run(more, extra) == 2
        out = np.zeros_like(data)
        assert remote.get_run(keys, out) == 5 and np.array_equal(out, data)
        print("served", remote.stats()["blocks"])


if len(sys.argv) > 2:
    served(sys.argv[2])
else:
    standalone()
