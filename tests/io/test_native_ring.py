"""The native core's batch calls (native/kvblock_io.c) called through the
cffi binding, with entries the engines never build themselves (their
batches are checked and cut first): the C contract holds for any caller,
and the io_uring and pread paths answer alike."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvblock.io import native
from kvblock.io.uring import probe

pytestmark = pytest.mark.skipif(not probe()[0], reason="io_uring unavailable here")

KIB16 = 16 << 10
GIB4 = 4 << 30


@pytest.fixture
def small_file(tmp_path):
    """A 16 KiB file of known bytes, opened read-only (buffered: a read past
    its end comes back short, whatever length was asked)."""
    data = np.random.default_rng(11).integers(0, 256, KIB16, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield fd, data
    finally:
        os.close(fd)


def _arrays(buf, offsets, lens):
    n = len(offsets)
    return (np.full(n, buf.ctypes.data, dtype=np.uint64), np.zeros(n, dtype=np.uint32),
            np.array(offsets, dtype=np.uint64), np.array(lens, dtype=np.uint64),
            np.full(n, -12345, dtype=np.int64))


def ring_read(fd, buf, offsets, lens):
    """kvb_ring_run of reads into ``buf`` on a fresh ring: (return, results)."""
    lib, ffi, p = native.lib(), native.ffi, native.ptr
    addrs, devs, offs, lns, res = _arrays(buf, offsets, lens)
    err = ffi.new("int *")
    ring = lib.kvb_ring_create(8, err)
    assert ring != ffi.NULL, err[0]
    try:
        fds = np.array([fd], dtype=np.int32)
        lib.kvb_ring_set_files(ring, p("int *", fds), 1)
        ret = lib.kvb_ring_run(ring, 0, len(offsets), p("uint64_t *", addrs),
                               p("uint32_t *", devs), p("uint64_t *", offs),
                               p("uint64_t *", lns), 4, p("int64_t *", res), ffi.NULL, ffi.NULL)
    finally:
        lib.kvb_ring_destroy(ring)
    return ret, res.tolist()


def pio_read(fd, buf, offsets, lens):
    """kvb_pio_run of the same reads on this thread: (return, results)."""
    lib, ffi, p = native.lib(), native.ffi, native.ptr
    addrs, devs, offs, lns, res = _arrays(buf, offsets, lens)
    fds = np.array([fd], dtype=np.int32)
    ret = lib.kvb_pio_run(0, len(offsets), p("uint64_t *", addrs), p("uint32_t *", devs),
                          p("int *", fds), 1, p("uint64_t *", offs), p("uint64_t *", lns),
                          p("int64_t *", res), ffi.NULL, ffi.new("uint64_t *", 0), ffi.NULL)
    return ret, res.tolist()


@pytest.mark.parametrize("length", [GIB4, GIB4 + 4096, 2 * GIB4 + KIB16])
@pytest.mark.parametrize("run", [ring_read, pio_read])
def test_an_io_of_4_gib_or_more_is_not_cut_to_its_low_32_bits(small_file, run, length):
    """io_uring takes an I/O's length as 32 bits: cast down, a read of
    exactly 4 GiB asked the kernel for 0 bytes (result 0: 'end of device')
    and one of 4 GiB + 4 KiB for 4 KiB.  The file's 16 KiB come back, as
    pread's loop reads them (the ring returns a short transfer for the
    caller to go on from, never fewer bytes than were there)."""
    fd, data = small_file
    buf = np.zeros(4 * KIB16, dtype=np.uint8)
    assert run(fd, buf, [0], [length]) == (0, [KIB16])
    assert np.array_equal(buf[:KIB16], data)
    assert not buf[KIB16:].any()
