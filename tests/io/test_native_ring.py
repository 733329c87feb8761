"""The native core's batch calls (native/kvblock_io.c) called through the
cffi binding, with entries the engines never build themselves (their
batches are checked and cut first): the C contract holds for any caller,
and the io_uring and pread paths answer alike."""

from __future__ import annotations

import errno
import os
import threading

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
    """Entry i reads into ``buf`` at i * 16 KiB."""
    n = len(offsets)
    addrs = np.arange(n, dtype=np.uint64) * np.uint64(KIB16) + np.uint64(buf.ctypes.data)
    return (addrs, np.zeros(n, dtype=np.uint32),
            np.array(offsets, dtype=np.uint64), np.array(lens, dtype=np.uint64),
            np.full(n, -12345, dtype=np.int64))


def new_ring(fd):
    """A ring (made on this thread) whose device 0 is ``fd``."""
    lib, ffi = native.lib(), native.ffi
    err = ffi.new("int *")
    ring = lib.kvb_ring_create(8, err)
    assert ring != ffi.NULL, err[0]
    fds = np.array([fd], dtype=np.int32)
    lib.kvb_ring_set_files(ring, native.ptr("int *", fds), 1)
    return ring


def run_reads(ring, buf, offsets, lens):
    """kvb_ring_run of reads into ``buf``: (return, results)."""
    lib, ffi, p = native.lib(), native.ffi, native.ptr
    addrs, devs, offs, lns, res = _arrays(buf, offsets, lens)
    ret = lib.kvb_ring_run(ring, 0, len(offsets), p("uint64_t *", addrs),
                           p("uint32_t *", devs), p("uint64_t *", offs),
                           p("uint64_t *", lns), 4, p("int64_t *", res), ffi.NULL, ffi.NULL)
    return ret, res.tolist()


def ring_read(fd, buf, offsets, lens):
    """kvb_ring_run of reads into ``buf`` on a fresh ring: (return, results)."""
    ring = new_ring(fd)
    try:
        return run_reads(ring, buf, offsets, lens)
    finally:
        native.lib().kvb_ring_destroy(ring)


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


@pytest.mark.parametrize("run", [ring_read, pio_read])
def test_an_offset_past_2_63_is_refused_not_read_at_the_file_position(small_file, run):
    """An offset of 2**64 - 1 is -1 to the kernel, which io_uring takes for
    'the file's current position': the ring read the 4 KiB there and moved
    the position, where pread refuses it (EINVAL).  Every offset past
    2**63 is now refused before it is issued; the batch's other I/Os run."""
    fd, data = small_file
    os.lseek(fd, 8192, os.SEEK_SET)
    buf = np.zeros(3 * KIB16, dtype=np.uint8)
    ret, res = run(fd, buf, [2**64 - 1, 4096, 2**63], [4096, 4096, 4096])
    assert (ret, res) == (2, [-errno.EINVAL, 4096, -errno.EINVAL])
    assert not buf[:KIB16].any() and not buf[2 * KIB16:].any()
    assert np.array_equal(buf[KIB16:KIB16 + 4096], data[4096:8192])
    assert os.lseek(fd, 0, os.SEEK_CUR) == 8192
    # a batch of nothing but refusals returns (nothing in flight to wait for)
    assert run(fd, buf, [2**64 - 1] * 5, [4096] * 5) == (5, [-errno.EINVAL] * 5)


def test_a_run_from_another_thread_is_refused_and_leaves_the_ring_to_its_owner(small_file):
    """A ring belongs to the thread that made it.  Another thread's run
    failed (EEXIST, from a single-issuer kernel) only after putting its
    SQEs in the owner's queue, and marked the ring broken: every later run
    of its owner was refused (EIO).  (On kernels without SINGLE_ISSUER the
    stray run went through, on a queue its owner's liburing state no longer
    matched.)  Now it is refused before it touches the ring."""
    fd, data = small_file
    ring = new_ring(fd)
    try:
        buf = np.zeros(2 * KIB16, dtype=np.uint8)
        out = []
        stray = threading.Thread(target=lambda: out.append(
            run_reads(ring, buf, [0, 4096], [4096, 4096])))
        stray.start()
        stray.join()
        assert out == [(-errno.EEXIST, [-errno.ECANCELED] * 2)]
        assert not buf.any()
        assert run_reads(ring, buf, [0, 8192], [4096, 4096]) == (0, [4096, 4096])
        assert np.array_equal(buf[:4096], data[:4096])
        assert np.array_equal(buf[KIB16:KIB16 + 4096], data[8192:12288])
    finally:
        native.lib().kvb_ring_destroy(ring)
