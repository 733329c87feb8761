"""StoreIO's small metadata transfers (journal records, checkpoints)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvblock.devices import Device
from kvblock.io import open_engine
from kvblock.store import storeio
from kvblock.store.storeio import StoreIO

MIB = 1 << 20


@pytest.fixture
def io(target):
    path = target(8 * MIB)
    dev = Device(path)
    sio = StoreIO([dev], open_engine([dev]))
    yield sio
    sio.close()


def test_a_short_record_after_a_long_one_is_padded_with_zeros(io):
    """write_bytes reuses a per-thread buffer: what an earlier, longer
    record left in it must not reach the device past a shorter one."""
    bs = io.devices[0].block_size                   # 512 (loop device) or 4096
    io.write_bytes(0, 0, b"\xab" * 12000)
    io.write_bytes(0, 16384, b"\xcd" * 5000)
    io.write_bytes(0, 16384, b"ok")                  # one block
    assert io.read_bytes(0, 0, 12288) == b"\xab" * 12000 + bytes(288)
    long_end = -(-5000 // bs) * bs
    assert io.read_bytes(0, 16384, 8192) == (b"ok" + bytes(bs - 2) + b"\xcd" * (5000 - bs)
                                             + bytes(8192 - 5000))
    assert long_end <= 8192


def test_records_larger_than_the_reused_buffer_and_from_several_threads(io):
    big = np.random.default_rng(1).integers(0, 256, storeio.META_BUFFER_BYTES + 5000,
                                            dtype=np.uint8).tobytes()
    io.write_bytes(0, MIB, big)
    assert io.read_bytes(0, MIB, len(big)) == big

    def write(i):
        for round_ in range(20):
            io.write_bytes(0, 2 * MIB + i * 65536, bytes([i + round_]) * (1000 + 997 * i))
    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        n = 1000 + 997 * i
        got = io.read_bytes(0, 2 * MIB + i * 65536, -(-n // 4096) * 4096)
        assert got == bytes([i + 19]) * n + bytes(len(got) - n)
