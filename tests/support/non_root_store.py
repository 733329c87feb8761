"""Run by tests/store/test_non_root.py as an unprivileged user: a store's
whole life on TARGET (a device or file this user was given), then what
happens when it is busy.  Prints one line per step; exits non-zero on any
failure."""

import sys

import numpy as np

from kvblock import Geometry, KVStore
from kvblock.errors import DeviceBusyError

target = sys.argv[1]
geom = Geometry(2, 2, 64, "bfloat16", 16)
keys = [bytes([i]) * 16 for i in range(1, 6)]
data = np.random.default_rng(1).integers(0, 256, len(keys) * geom.block_bytes, np.uint8)
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
