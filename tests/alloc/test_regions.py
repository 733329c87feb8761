"""The log-structured region allocator: addressing, allocation, release, eviction."""

from __future__ import annotations

import pytest

from kvblock.alloc.regions import FREE, OPEN, SEALED, RegionTable

MIB = 1 << 20


def table(count=6, size=MIB, ndev=1, offsets=None) -> RegionTable:
    return RegionTable(count, size, ndev, offsets or [(d + 1) * 8 * MIB for d in range(ndev)])


# ------------------------------------------------------------------ addressing
def test_address_one_device():
    t = table(count=4, size=MIB, ndev=1, offsets=[3 * MIB])
    for r in range(4):
        assert t.device_of(r) == 0
        assert t.address(r) == (0, 3 * MIB + r * MIB)
    assert t.address(2, 4096) == (0, 3 * MIB + 2 * MIB + 4096)


def test_address_three_devices_striped():
    offsets = [10 * MIB, 20 * MIB, 30 * MIB]
    t = RegionTable(9, 2 * MIB, 3, offsets)
    assert [t.device_of(r) for r in range(9)] == [0, 1, 2] * 3
    expected = {
        0: (0, 10 * MIB), 1: (1, 20 * MIB), 2: (2, 30 * MIB),
        3: (0, 12 * MIB), 4: (1, 22 * MIB), 5: (2, 32 * MIB),
        6: (0, 14 * MIB), 7: (1, 24 * MIB), 8: (2, 34 * MIB),
    }
    for r, addr in expected.items():
        assert t.address(r) == addr
    assert t.address(7, 12345) == (1, 24 * MIB + 12345)
    # no two regions overlap on a device
    spans = sorted(t.address(r) for r in range(9))
    for (d1, o1), (d2, o2) in zip(spans, spans[1:]):
        assert d1 != d2 or o2 - o1 >= 2 * MIB


# ------------------------------------------------------------------ allocation
def test_initial_state():
    t = table(count=3)
    assert list(t.free) == [0, 1, 2]
    assert t.open is None
    assert all(t.state == FREE)
    assert t.used_bytes == 0


def test_bump_pointer_in_open_region():
    t = table(count=3, size=MIB)
    assert t.allocate(4096, now=1.0) == (0, 0)
    assert t.open == 0 and t.state[0] == OPEN
    assert t.last_access[0] == 1.0
    assert t.allocate(8192, now=2.0) == (0, 4096)
    assert t.allocate(4096, now=3.0) == (0, 12288)
    assert int(t.fill[0]) == 16384
    assert t.used_bytes == 16384
    assert list(t.free) == [1, 2]


def test_full_region_is_sealed_and_next_opened():
    t = table(count=3, size=MIB)
    assert t.allocate(768 * 1024, 1.0) == (0, 0)
    assert t.allocate(256 * 1024, 2.0) == (0, 768 * 1024)   # exactly fills region 0
    assert t.state[0] == OPEN and int(t.fill[0]) == MIB
    assert t.allocate(4096, 3.0) == (1, 0)                   # does not fit: seal, open 1
    assert t.state[0] == SEALED and t.seal_seq[0] == 1
    assert t.open == 1 and t.state[1] == OPEN
    assert t.allocate(MIB, 4.0) == (2, 0)                    # 4096 + 1 MiB > 1 MiB
    assert t.state[1] == SEALED and t.seal_seq[1] == 2
    assert t.used_bytes == MIB + 4096 + MIB


def test_none_when_no_free_region():
    t = table(count=2, size=MIB)
    assert t.allocate(MIB, 1.0) == (0, 0)
    assert t.allocate(MIB, 2.0) == (1, 0)
    assert t.allocate(1, 3.0) is None
    # the full open region was sealed on the way
    assert t.state[1] == SEALED and t.open is None
    assert t.allocate(1, 4.0) is None


def test_allocation_larger_than_region_is_refused():
    t = table(count=2, size=MIB)
    with pytest.raises(ValueError, match="do not fit"):
        t.allocate(MIB + 1, 1.0)
    assert t.open is None and list(t.free) == [0, 1]


def test_release_bumps_generation_and_frees():
    t = table(count=2, size=MIB)
    t.allocate(MIB, 1.0)
    t.allocate(MIB, 2.0)
    t.seal(1)
    t.live[0] = 3
    assert t.allocate(1, 3.0) is None
    t.release(0)
    assert t.generation[0] == 1 and t.generation[1] == 0
    assert t.state[0] == FREE and int(t.fill[0]) == 0 and t.live[0] == 0
    assert list(t.free) == [0]
    assert t.allocate(4096, 4.0) == (0, 0)
    assert t.last_access[0] == 4.0
    t.release(0)                 # releasing the open region closes it
    assert t.open is None and t.generation[0] == 2
    assert list(t.free) == [0]


def test_release_returns_regions_in_fifo_order():
    t = table(count=3, size=MIB)
    for i in range(3):
        t.allocate(MIB, float(i))
    t.seal(2)
    t.release(2)
    t.release(0)
    assert list(t.free) == [2, 0]
    assert t.allocate(MIB, 5.0) == (2, 0)
    assert t.allocate(MIB, 6.0) == (0, 0)


def test_reopened_region_resets_hits():
    t = table(count=1, size=MIB)
    t.allocate(MIB, 1.0)
    t.hits[0] = 42
    t.seal(0)
    t.release(0)
    t.allocate(10, 2.0)
    assert t.hits[0] == 0 and t.last_access[0] == 2.0


# ------------------------------------------------------------------ eviction
def filled(count=5) -> RegionTable:
    """Every region sealed, in order 0..count-1."""
    t = table(count=count, size=MIB)
    for i in range(count):
        assert t.allocate(MIB, float(i)) == (i, 0)
    t.seal(count - 1)
    assert list(t.seal_seq) == list(range(1, count + 1))
    return t


def test_victim_none_when_nothing_sealed():
    t = table(count=3)
    assert t.victim("fifo") is None and t.victim("lru") is None
    t.allocate(10, 1.0)  # open, not sealed
    assert t.victim("fifo") is None and t.victim("lru") is None


def test_victim_fifo_oldest_sealed():
    t = filled()
    assert t.victim("fifo") == 0
    t.last_access[:] = [9, 1, 2, 3, 4]   # recency does not matter to fifo
    assert t.victim("fifo") == 0
    t.release(0)
    assert t.victim("fifo") == 1
    # a region reused and sealed again is the youngest
    t.allocate(MIB, 10.0)
    t.seal(0)
    assert t.seal_seq[0] == 6
    t.release(1)
    t.release(2)
    assert t.victim("fifo") == 3


def test_victim_lru_least_recent_access():
    t = filled()
    t.last_access[:] = [50.0, 10.0, 30.0, 20.0, 40.0]
    assert t.victim("lru") == 1
    t.last_access[1] = 60.0      # region 1 was read
    assert t.victim("lru") == 3


def test_victim_lru_ties_broken_by_fewer_hits():
    t = filled()
    t.last_access[:] = [5.0, 5.0, 5.0, 9.0, 9.0]
    t.hits[:] = [7, 2, 4, 0, 0]
    assert t.victim("lru") == 1
    t.hits[1] = 8
    assert t.victim("lru") == 2
    # hits never outrank recency
    t.last_access[3] = 1.0
    t.hits[3] = 1000
    assert t.victim("lru") == 3


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_victim_never_pinned_or_open(policy):
    t = table(count=4, size=MIB)
    for i in range(3):
        t.allocate(MIB, float(i))
    t.allocate(10, 3.0)   # seals region 2 (full), opens region 3
    assert t.open == 3
    assert list(t.state) == [SEALED, SEALED, SEALED, OPEN]
    t.last_access[:] = [5.0, 6.0, 7.0, 0.0]  # the open region is the "oldest"
    t.pins[0] = 1
    assert t.victim(policy) == 1
    t.pins[1] = 2
    assert t.victim(policy) == 2
    t.pins[2] = 1
    assert t.victim(policy) is None
    t.pins[1] = 0
    assert t.victim(policy) == 1


def test_release_twice_is_refused():
    t = RegionTable(4, 1 << 20, 1, [0])
    r, _ = t.allocate(4096, 0.0)
    t.seal(r)
    t.release(r)
    with pytest.raises(ValueError, match="released twice"):
        t.release(r)
    assert list(t.free).count(r) == 1
