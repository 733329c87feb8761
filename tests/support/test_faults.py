"""The crash harness itself: it stops I/O at the planned point, tears and rolls back."""

import numpy as np
import pytest

from kvblock.devices import Device
from kvblock.io import IOBatch, open_engine
from kvblock.memory import HostBuffer
from tests.support.faults import CrashPlan, SimulatedCrash


def _io(path, plan):
    dev = Device(path)
    return plan.factory()([dev], open_engine([dev]))


def _content(path, n=3 * 8192):
    with open(path, "rb") as f:
        return f.read(n)


def test_crash_point_stops_all_later_io(file_target):
    path = file_target(1 << 20)
    plan = CrashPlan(crash_at=2)
    io = _io(path, plan)
    try:
        io.write_bytes(0, 0, b"a" * 4096)
        with pytest.raises(SimulatedCrash):
            io.write_bytes(0, 4096, b"b" * 4096)
        with pytest.raises(SimulatedCrash):
            io.read_bytes(0, 0, 4096)
        with pytest.raises(SimulatedCrash):
            io.flush()
    finally:
        io.close()
    data = _content(path)
    assert data[:4096] == b"a" * 4096 and data[4096:8192] == bytes(4096)


def test_torn_write_lands_half(file_target):
    path = file_target(1 << 20)
    io = _io(path, CrashPlan(crash_at=1, torn=True))
    try:
        with pytest.raises(SimulatedCrash):
            io.write_bytes(0, 0, b"x" * 16384)
    finally:
        io.close()
    data = _content(path, 16384)
    assert data[:8192] == b"x" * 8192 and data[8192:] == bytes(8192)


def test_lose_unflushed_rolls_back_to_last_flush(file_target):
    path = file_target(1 << 20)
    io = _io(path, CrashPlan(crash_at=4, lose_unflushed=True))
    try:
        io.write_bytes(0, 0, b"1" * 4096)       # 1
        io.flush()                              # 2: durable
        io.write_bytes(0, 0, b"2" * 4096)       # 3: lost
        with pytest.raises(SimulatedCrash):
            io.write_bytes(0, 4096, b"3" * 4096)  # 4: crash
    finally:
        io.close()
    data = _content(path, 8192)
    assert data == b"1" * 4096 + bytes(4096)


def test_counts_without_crash(file_target):
    plan = CrashPlan()
    io = _io(file_target(1 << 20), plan)
    try:
        with HostBuffer(8192) as buf:
            io.write(IOBatch(np.array([buf.address, buf.address + 4096]), 0, [0, 4096], 4096))
        io.flush()
        io.discard(0, 0, 4096)
    finally:
        io.close()
    assert plan.ops == 3 and not plan.crashed
