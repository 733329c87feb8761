"""Every engine: bytes written come back identical, across devices, batch shapes
and threads; bad requests raise typed errors naming device, offset, length."""

import contextlib
import ctypes
import errno
import os
import threading

import numpy as np
import pytest

from kvblock.devices import Device
from kvblock.errors import AlignmentError, ConfigError, IOFailedError
from kvblock.io import IOBatch, open_engine
from kvblock.io.uring import probe
from kvblock.memory import HostBuffer

MIB = 1 << 20


def _random(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_scattered_batch_round_trip(engine_name, target):
    path = target(16 * MIB)
    with Device(path) as dev, open_engine([dev], engine_name, queue_depth=8) as eng:
        rng = np.random.default_rng(1)
        n, io = 300, 16384
        slots = rng.permutation(16 * MIB // io)[:n]
        offsets = slots.astype(np.uint64) * io
        with HostBuffer(n * io) as src, HostBuffer(n * io) as dst:
            src.array[:] = _random(n * io)
            addrs = np.arange(n, dtype=np.uint64) * io
            res = eng.write(IOBatch(addrs + src.address, 0, offsets, io), latency=True)
            assert res.nbytes == n * io and res.latency_ns.shape == (n,)
            assert (res.latency_ns > 0).all()
            eng.flush()
            # read back in a different order than written
            order = rng.permutation(n)
            eng.read(IOBatch(addrs[order] + dst.address, 0, offsets[order], io))
            assert np.array_equal(dst.array, src.array)
    # and what is on the medium is what we wrote (independent reader)
    with open(path, "rb") as f:
        f.seek(int(offsets[5]))
        assert f.read(io) == src_bytes_at(5, io)


def src_bytes_at(i, io):
    return _random(300 * io)[i * io:(i + 1) * io].tobytes()


def test_two_devices_in_one_batch(engine_name, target):
    paths = [target(4 * MIB), target(4 * MIB)]
    with Device(paths[0]) as d0, Device(paths[1]) as d1, \
            open_engine([d0, d1], engine_name) as eng, HostBuffer(2 * MIB) as src, \
            HostBuffer(2 * MIB) as dst:
        src.array[:] = _random(2 * MIB, 2)
        addrs = np.array([0, MIB], dtype=np.uint64)
        eng.write(IOBatch(addrs + src.address, [0, 1], [MIB, 2 * MIB], MIB))
        eng.read(IOBatch(addrs + dst.address, [1, 0], [2 * MIB, MIB], MIB))
        assert np.array_equal(dst.array[:MIB], src.array[MIB:])
        assert np.array_equal(dst.array[MIB:], src.array[:MIB])


def test_large_io_is_split_and_correct(engine_name, file_target):
    with Device(file_target(32 * MIB)) as dev, \
            open_engine([dev], engine_name, max_io=MIB) as eng, \
            HostBuffer(20 * MIB + 4096) as src, HostBuffer(20 * MIB + 4096) as dst:
        src.array[:] = _random(src.nbytes, 3)
        eng.write(IOBatch.single(src.address, 0, 4096, src.nbytes))
        eng.read(IOBatch.single(dst.address, 0, 4096, dst.nbytes))
        assert np.array_equal(src.array, dst.array)


def test_unaligned_user_buffers_are_staged(engine_name, target):
    with Device(target(4 * MIB)) as dev, open_engine([dev], engine_name) as eng:
        raw = bytearray(3 * 65536 + 7)
        payload = memoryview(raw)[7:7 + 3 * 65536]
        payload[:] = _random(3 * 65536, 4).tobytes()
        eng.write_from(0, 65536, payload)
        back = np.zeros(3 * 65536 + 3, dtype=np.uint8)[3:]  # misaligned numpy view
        assert back.ctypes.data % 4096 != 0
        eng.read_into(0, 65536, back)
        assert back.tobytes() == bytes(payload)


def test_concurrent_threads_share_one_engine(engine_name, target):
    with Device(target(16 * MIB)) as dev, open_engine([dev], engine_name, queue_depth=4) as eng:
        errors = []

        def worker(k):
            try:
                with HostBuffer(MIB) as src, HostBuffer(MIB) as dst:
                    for rep in range(5):
                        src.array[:] = _random(MIB, k * 10 + rep)
                        off = (k * 4 + rep % 4) * MIB
                        eng.write(IOBatch.contiguous(src.address, 0, off, MIB, 65536))
                        eng.read(IOBatch.contiguous(dst.address, 0, off, MIB, 65536))
                        assert np.array_equal(src.array, dst.array)
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_misaligned_offset_or_length(engine_name, file_target):
    with Device(file_target(MIB)) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(8192) as buf:
        with pytest.raises(AlignmentError, match=r"offset 100 / length 4096.*4096-byte"):
            eng.read(IOBatch.single(buf.address, 0, 100, 4096))
        with pytest.raises(AlignmentError, match=r"length 1000"):
            eng.read(IOBatch.single(buf.address, 0, 0, 1000))
        with pytest.raises(AlignmentError):
            eng.read(IOBatch.single(buf.address, 0, 0, 0))


def test_alignment_follows_the_devices_logical_block_size(engine_name, loop_device):
    """512-byte sectors take I/O at 512-byte offsets; on a device with 4 KiB
    sectors (an NVMe namespace with 4 KiB LBAs) the same I/O is refused
    before the kernel sees it (which would answer EINVAL)."""
    with Device(loop_device(4 * MIB)) as small, Device(loop_device(4 * MIB, 4096)) as big, \
            open_engine([small, big], engine_name) as eng, HostBuffer(8192) as buf:
        assert (small.block_size, big.block_size) == (512, 4096)
        buf.array[:4096] = _random(4096, 9)
        eng.write(IOBatch.single(buf.address, 0, 512, 4096))
        eng.read(IOBatch.single(buf.address + 4096, 0, 512, 4096))
        assert np.array_equal(buf.array[4096:], buf.array[:4096])
        with pytest.raises(AlignmentError, match=rf"{big.path}: offset 512 / length 4096 .*"
                                                 r"4096-byte logical block size"):
            eng.read(IOBatch.single(buf.address, 1, 512, 4096))
        with pytest.raises(AlignmentError, match="length 512"):
            eng.write(IOBatch.single(buf.address, 1, 0, 512))


def test_staged_buffers_start_on_each_devices_block_in_a_mixed_batch(engine_name,
                                                                      loop_device):
    """Unaligned host buffers are staged; in one batch over a 512-byte-sector
    and a 4 KiB-sector device, every staging slot starts on its own device's
    logical block (a 4 KiB device's slot placed right after a 512-byte entry
    was only 512-aligned: kernels that check buffer alignment against the
    logical block refuse it with EINVAL), and the bytes still round-trip."""
    with Device(loop_device(4 * MIB)) as small, Device(loop_device(4 * MIB, 4096)) as big, \
            open_engine([small, big], engine_name) as eng, HostBuffer(4 * 8192) as buf:
        seen = []
        run = eng._run

        def recording_run(op, batch, *args):
            seen.append((batch.addrs.copy(), batch.devs.copy()))
            return run(op, batch, *args)

        eng._run = recording_run
        buf.array[:] = _random(buf.nbytes, 10)
        src, dst = buf.address + 8, buf.address + 2 * 8192 + 8
        lens, devs, offs = [512, 4096, 512, 4096], [0, 1, 0, 1], [0, 0, 4096, 8192]
        starts = np.cumsum([0] + lens[:-1]).astype(np.uint64)
        eng.write(IOBatch(starts + np.uint64(src), devs, offs, lens))
        eng.read(IOBatch(starts + np.uint64(dst), devs, offs, lens))
        total = sum(lens)
        assert np.array_equal(buf.array[2 * 8192 + 8:][:total], buf.array[8:8 + total])
        assert len(seen) == 2
        for addrs, devs_run in seen:
            blocks = np.array([small.block_size, big.block_size], dtype=np.uint64)[devs_run]
            assert (addrs % blocks == 0).all(), (addrs % 4096, devs_run)


def test_close_releases_the_staging_buffers_of_unaligned_ios(engine_name, file_target,
                                                             monkeypatch):
    """The aligned staging memory an engine made for unaligned host buffers
    (one per calling thread, as large as the largest such batch) is released
    by close(), not kept while the closed engine is still referenced."""
    import weakref

    from kvblock.io import engine as engine_mod

    made = []

    class RecordedBuffer(HostBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(engine_mod, "HostBuffer", RecordedBuffer)
    with Device(file_target(4 * MIB)) as dev:
        eng = open_engine([dev], engine_name)
        payload = np.zeros(2 * MIB + 8, dtype=np.uint8)[8:]
        payload[:] = _random(2 * MIB, 11)
        eng.write_from(0, 0, payload)
        back = np.zeros(2 * MIB + 8, dtype=np.uint8)[8:]
        eng.read_into(0, 0, back)
        assert np.array_equal(back, payload)
        assert made, "the unaligned I/O was not staged"
        eng.close()
        held = [r() for r in made if r() is not None and not r().closed]
        assert not held, f"{eng.name}: {len(held)} staging buffer(s) of " \
                         f"{sum(b.nbytes for b in held)} bytes kept after close()"


def test_a_close_racing_an_unaligned_io_leaves_no_staging_behind(engine_name, file_target,
                                                                  monkeypatch):
    """close() from another thread can land while an unaligned I/O makes its
    staging buffer: either the I/O is refused (engine closed) or close waits
    for it, but no staging buffer outlives close() in the closed engine."""
    import weakref

    from kvblock.io import engine as engine_mod

    made, closers = [], []

    class CloseMeanwhile(HostBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))
            closer = threading.Thread(target=eng.close)
            closers.append(closer)
            closer.start()
            closer.join(0.5)              # done, unless it waits for this I/O

    monkeypatch.setattr(engine_mod, "HostBuffer", CloseMeanwhile)
    with Device(file_target(4 * MIB)) as dev:
        eng = open_engine([dev], engine_name)
        back = np.zeros(MIB + 8, dtype=np.uint8)[8:]
        try:
            eng.read_into(0, 0, back)
        except ConfigError as e:
            assert "engine is closed" in str(e)
        else:
            assert not back.any()
        closers[0].join(20)
        assert not closers[0].is_alive() and eng.closed
        held = [r() for r in made if r() is not None and not r().closed]
        assert len(made) == 1 and not held, f"{eng.name}: a staging buffer kept after close()"


def test_out_of_range_and_bad_device_index(engine_name, file_target):
    path = file_target(MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, HostBuffer(8192) as buf:
        with pytest.raises(IOFailedError, match=rf"{path}: range \[1044480, 1052672\)") as exc:
            eng.read(IOBatch.single(buf.address, 0, MIB - 4096, 8192))
        assert exc.value.offset == MIB - 4096 and exc.value.length == 8192
        with pytest.raises(ConfigError, match="device index 3 out of range"):
            eng.read(IOBatch.single(buf.address, 3, 0, 4096))


@pytest.mark.parametrize("size", [2, 40], ids=["few", "many"])
def test_bad_entry_of_a_batch_is_named(engine_name, file_target, size):
    """Batches of up to FEW_IOS I/Os are checked with Python ints, larger ones
    with numpy (one I/O takes a scalar fast path too): either way the first
    bad entry of the first kind checked is the one named (device index, then
    alignment, then the device's end)."""
    from kvblock.io.engine import FEW_IOS

    assert FEW_IOS < 40 and (size <= FEW_IOS) == (size == 2)
    path = file_target(MIB)

    def batch(*bad):
        """``size`` good 4 KiB reads, the last ones replaced by ``bad``
        (dev, offset, length) entries."""
        entries = [(0, 4096 * i, 4096) for i in range(size - len(bad))] + list(bad)
        assert len(entries) == size
        devs, offs, lens = zip(*entries)
        return IOBatch(np.array([buf.address] * size), np.array(devs), np.array(offs),
                       np.array(lens))
    with Device(path) as dev, open_engine([dev], engine_name) as eng, HostBuffer(8192) as buf:
        with pytest.raises(AlignmentError, match=r"offset 100 / length 4096.*4096-byte"):
            eng.read(batch((0, 100, 4096)))
        with pytest.raises(AlignmentError, match=r"offset 0 / length 0 "):
            eng.read(batch((0, 0, 0)))
        with pytest.raises(IOFailedError, match=rf"{path}: range \[1044480, 1052672\)") as exc:
            eng.read(batch((0, MIB - 4096, 8192)))
        assert exc.value.offset == MIB - 4096 and exc.value.length == 8192
        # offset + length past 2**64 (a length computed as a negative uint64):
        # past the end all the same, not wrapped round to a small end
        for off, length in [(8192, 2 ** 64 - 4096), (2 ** 64 - 4096, 8192)]:
            with pytest.raises(IOFailedError, match=rf"{path}: range \[{off}, {off + length}\) "
                                                    "ends past the device's 1048576 bytes"):
                eng.read(batch((0, off, length)))
        with pytest.raises(ConfigError, match="device index 2 out of range"):
            eng.read(batch((2, 0, 4096)))
        # an entry past the end before a misaligned one: the misaligned one is named
        with pytest.raises(AlignmentError, match=r"offset 8192 / length 100"):
            eng.read(batch((0, MIB - 4096, 8192), (0, 8192, 100)))
        # a misaligned entry before a bad device index: the device is named
        with pytest.raises(ConfigError, match="device index 5 out of range"):
            eng.read(batch((0, 100, 4096), (5, 0, 4096)))


def test_short_read_is_reported(engine_name, file_target):
    path = file_target(MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, HostBuffer(65536) as buf:
        os.truncate(path, 8192)  # the file shrinks under the open device
        with pytest.raises(IOFailedError, match=rf"short read at offset 4096 on {path}: "
                                               r"4096 of 65536 bytes") as exc:
            eng.read(IOBatch.single(buf.address, 0, 4096, 65536))
        assert exc.value.path == path and exc.value.length == 65536


def test_native_reports_per_io_errno(engine_name, file_target):
    """A kernel error (EBADF: writing a device opened read-only) comes back per
    I/O from C and becomes one error naming device, offset and length."""
    path = file_target(MIB)
    with Device(path, writable=False) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(2 * 4096) as buf:
        with pytest.raises(IOFailedError, match=rf"write of 4096 bytes at offset 8192 on {path} "
                                               r"failed: EBADF.*\(2 of 2 I/Os failed\)") as exc:
            eng.write(IOBatch(np.array([buf.address, buf.address + 4096]), 0, [8192, 12288], 4096))
        assert exc.value.errno == errno.EBADF
        assert (exc.value.offset, exc.value.length, exc.value.failed) == (8192, 4096, 2)


def test_closed_engine_refuses(engine_name, file_target):
    with Device(file_target(MIB)) as dev:
        eng = open_engine([dev], engine_name)
        eng.close()
        with pytest.raises(ConfigError, match="closed"):
            eng.read(IOBatch.single(0, 0, 0, 4096))


def test_rings_of_finished_threads_are_freed(file_target):
    """One ring per thread, freed with its thread: an engine used from many
    short-lived threads (a loader thread per load) does not leak rings or fds."""
    import gc
    import os

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    with Device(file_target(MIB)) as dev, open_engine([dev], "uring") as eng, \
            HostBuffer(4096) as buf:
        eng.read(IOBatch.single(buf.address, 0, 0, 4096))
        fds_before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            t = threading.Thread(target=eng.read, args=(IOBatch.single(buf.address, 0, 0, 4096),))
            t.start()
            t.join()
        gc.collect()
        assert eng.live_rings == 1          # only this thread's
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


def test_a_rings_holder_collected_while_its_thread_runs_a_batch_leaves_it_to_that_thread(
        file_target, monkeypatch):
    """A thread's ring holder is collected (the engine's close drops every
    thread's holder) while that thread still runs a batch on the ring: the
    finalizer destroyed the ring under the native call (freed memory under
    it, or a NULL handle to the next call: a segfault).  It is left to the
    thread, which destroys it as it releases it; and two destroyers racing
    free it once."""
    from kvblock.io import uring

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    destroyed = []
    real = uring.native.lib().kvb_ring_destroy
    with Device(file_target(MIB)) as dev, HostBuffer(4096) as buf:
        eng = open_engine([dev], "uring")
        try:
            eng.read(IOBatch.single(buf.address, 0, 0, 4096))
            ring = eng._ring()                 # this thread's
            ring.lock.acquire()                # held by _run's with (a batch runs)
            handle = ring.handle

            class Lib:                         # counts the frees
                def __getattr__(self, name):
                    return getattr(uring.native.lib(), name)

                def kvb_ring_destroy(self, h):
                    destroyed.append(h)
                    return real(h)
            monkeypatch.setattr(uring.native, "lib", lambda lib=Lib(): lib)
            eng._forget(ring)                  # the holder's finalizer, from another path
            assert ring.handle is handle and destroyed == [], "destroyed under its batch"
            ring.lock.release()                # the batch ends
            eng._release(ring)
            assert ring.handle is None and destroyed == [handle]
            ring.destroy()                     # a second destroyer: nothing more
            assert destroyed == [handle]
        finally:
            eng.close()


def test_a_buffer_closes_while_another_thread_opens_an_engine(file_target):
    """A registered buffer's close() asks every uring engine to retire its
    idle rings, from whatever thread closes it (or a GC finalizer's).  The
    engines were a WeakSet, iterated in Python: an engine opened in another
    thread meanwhile raised RuntimeError ('Set changed size during
    iteration') out of close(), the buffer left mapped.  The other thread is
    played by a trace function: it opens an engine between two lines of
    whatever Python iterates during the close (where the GIL may change
    hands)."""
    import linecache
    import sys

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    opened = []
    with Device(file_target(MIB)) as dev, open_engine([dev], "uring"):
        buf = HostBuffer(4096)

        def lines(frame, event, arg):
            # inside a loop over the engines, taking one of them
            if event == "line" and not opened and frame.f_code.co_name == "__iter__" and \
                    "ref()" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                opened.append(open_engine([dev], "uring"))   # "another thread"
            return lines

        def tracer(frame, event, arg):
            return lines if "weakref" in frame.f_code.co_filename else None

        sys.settrace(tracer)
        try:
            buf.close()
        finally:
            sys.settrace(None)
            for other in opened:
                other.close()
        assert buf.closed


def test_a_closed_engine_is_not_kept_by_a_thread_that_used_it(file_target):
    """An engine opened and closed again and again from one long-lived thread
    (an engine's main thread reopening a store) is freed each time: its
    per-thread ring holder must not keep it alive."""
    import gc
    import weakref

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    refs = []
    with Device(file_target(MIB)) as dev, HostBuffer(4096) as buf:
        for _ in range(20):
            eng = open_engine([dev], "uring")
            eng.read(IOBatch.single(buf.address, 0, 0, 4096))
            eng.close()
            refs.append(weakref.ref(eng))
            del eng
        gc.collect()
        assert sum(r() is not None for r in refs) == 0



def _pinned_bytes() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPin:"):
                return int(line.split()[1]) * 1024
    return None


def test_a_closed_buffer_is_not_left_pinned_by_idle_rings(file_target):
    """A registered HostBuffer is pinned by every ring that registered it.
    Closed while a thread that used it sits idle (a tier or server worker
    between requests), its memory must be given back, not stay pinned in
    that thread's ring until it next does I/O or the engine closes."""
    import time

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    if _pinned_bytes() is None:
        pytest.skip("no VmPin in /proc/self/status")
    size = 32 * MIB
    with Device(file_target(MIB)) as dev, open_engine([dev], "uring") as eng:
        buf = HostBuffer(size)
        used, stop = threading.Event(), threading.Event()

        def worker():
            eng.read(IOBatch.single(buf.address, 0, 0, 4096))
            used.set()
            stop.wait(60)      # idle, as a worker between requests

        t = threading.Thread(target=worker)
        t.start()
        try:
            assert used.wait(30)
            assert _pinned_bytes() >= size
            buf.close()
            deadline = time.monotonic() + 5   # ring teardown is asynchronous
            while _pinned_bytes() >= size and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _pinned_bytes() < size, "the closed buffer's pages are still pinned"
            # the idle thread's next batch still works (on a fresh ring)
            with HostBuffer(4096) as small:
                done = []
                t2 = threading.Thread(target=lambda: done.append(
                    eng.read(IOBatch.single(small.address, 0, 0, 4096)).nbytes))
                t2.start()
                t2.join()
                assert done == [4096]
        finally:
            stop.set()
            t.join()


CLOSE_WHILE_READING = """
import sys, threading, time, numpy as np
from kvblock.devices import Device
from kvblock.io import IOBatch, open_engine
from kvblock.memory import HostBuffer
dev = Device(sys.argv[1])
eng = open_engine([dev], sys.argv[2], queue_depth=8, mapped_reads=False)
buf = HostBuffer(16 << 20)
n = 256
b = IOBatch(np.uint64(buf.address) + np.arange(n, dtype=np.uint64) * np.uint64(65536), 0,
            np.arange(n, dtype=np.uint64) * np.uint64(65536), 65536)
errors, started = [], threading.Event()
def reader():
    try:
        while True:
            started.set()
            eng.read(b)
    except Exception as e:
        errors.append(type(e).__name__)
t = threading.Thread(target=reader)
t.start()
started.wait()
time.sleep(float(sys.argv[3]))
eng.close()
t.join()
print(errors)
"""


@pytest.mark.parametrize("delay", ["0.05", "0.2"])
def test_close_waits_for_io_in_flight(engine_name, file_target, delay):
    """close() while another thread reads through the engine: it waits for
    the batch in flight (freeing the rings under it crashed the process),
    and the reader's next call is refused with a typed error.  Run in a
    child process, where a crash cannot take the test run with it."""
    import subprocess
    import sys

    path = file_target(16 << 20)
    res = subprocess.run([sys.executable, "-c", CLOSE_WHILE_READING, path, engine_name, delay],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "['ConfigError']"


def test_a_second_close_returns_only_once_the_io_in_flight_is_done(engine_name, file_target,
                                                                   monkeypatch):
    """Two threads close the engine (a store's close and an exit handler)
    while a third has a batch in flight: the second close() returned at
    once, and its caller closed the devices' fds under the running batch
    (whose preads then hit whatever file took the number).  It returns
    once the first close() is done, the batch with it."""
    import time

    with Device(file_target(4 * MIB)) as dev, HostBuffer(MIB) as buf:
        eng = open_engine([dev], engine_name)
        inside, go, order = threading.Event(), threading.Event(), []
        real = eng._run

        def held(*args):
            inside.set()
            go.wait()
            real(*args)
            order.append("batch done")

        monkeypatch.setattr(eng, "_run", held)
        reader = threading.Thread(target=eng.read, args=(IOBatch.single(buf.address, 0, 0, MIB),))
        reader.start()
        assert inside.wait(10)
        first = threading.Thread(target=eng.close)
        first.start()
        while not eng.closed:         # the first close() is waiting for the batch
            time.sleep(0.001)
        release = threading.Timer(0.3, go.set)   # (only a close returning early beats it)
        release.start()
        try:
            eng.close()
            order.append("second close returned")
        finally:
            go.set()
            for t in (release, reader, first):
                t.join()
        assert order == ["batch done", "second close returned"]


@pytest.mark.parametrize("where", ["native", "mapped", "staged", "hashed"])
def test_a_buffer_closed_while_a_batch_reads_into_it_waits_for_the_batch(
        engine_name, file_target, shm_target, monkeypatch, where):
    """HostBuffer.close() in one thread while another thread's engine batch
    reads into the buffer: the memory was unmapped under the read (EFAULT
    at best; on a mapped device, or in the staged copy-back and the hash
    after a small read_hashed, the bytes went into, or were read from,
    whatever was mapped there next).  close() now waits for the batches
    in flight that target the buffer, then unmaps it; the batch completes
    with the right bytes.  Held at each point the engine touches the
    buffer (the native read, the mapped copy, the staged copy-back, the
    hash after the read), the closer is seen waiting before the batch
    goes on: no sleeps."""
    from kvblock.format.checksum import data_checksum
    from kvblock.io import native

    path = (shm_target if where == "mapped" else file_target)(MIB)
    data = _random(2 * 4096, 11)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    inside, go, waiting, closed = (threading.Event() for _ in range(4))
    got, errors = [], []
    with Device(path) as dev, open_engine([dev], engine_name,
                                          mapped_reads=where == "mapped") as eng:
        assert eng.mapped(0) == (where == "mapped")
        buf = HostBuffer(2 * 4096)
        at = buf.address + (1 if where == "staged" else 0)

        def held(real, snap=True):
            def call(*args, **kwargs):
                inside.set()
                assert go.wait(10)
                if buf.closed:       # (the real call would touch unmapped memory)
                    raise RuntimeError("the buffer was unmapped under the batch")
                out = real(*args, **kwargs)
                if snap:
                    got.append(ctypes.string_at(at, 4096))
                return out
            return call

        if where == "native":
            monkeypatch.setattr(eng, "_run", held(eng._run))
        elif where == "mapped":
            monkeypatch.setattr(eng, "_copy_part", held(eng._copy_part))
        elif where == "staged":
            real_stage = eng._stage

            def stage(*args):
                staged = real_stage(*args)
                return staged[0], held(staged[1])
            monkeypatch.setattr(eng, "_stage", stage)
        else:
            monkeypatch.setattr(native, "hash_pieces", held(native.hash_pieces, snap=False))

        class Seen(threading.Condition):
            def wait(self, timeout=None):
                waiting.set()
                return super().wait(timeout)
        eng._map_idle = Seen()

        def read():
            try:
                batch = IOBatch.single(at, 0, 0, 4096)
                if where == "hashed":
                    got.append(int(eng.read_hashed(batch, [0], [7])[0]))
                else:
                    eng.read(batch)
            except BaseException as e:
                errors.append(e)

        def close():
            buf.close()
            closed.set()
            waiting.set()

        reader = threading.Thread(target=read)
        reader.start()
        closer = threading.Thread(target=close)
        try:
            assert inside.wait(10)
            closer.start()
            assert waiting.wait(10)
            assert not closed.is_set() and not buf.closed, \
                "close() unmapped the buffer with a batch reading into it"
        finally:
            go.set()
            reader.join()
            if closer.is_alive() or closer.ident:
                closer.join()
        assert closed.is_set() and buf.closed and not errors
        want = data_checksum(data[:4096], 7) if where == "hashed" else data[:4096].tobytes()
        assert got == [want]


def test_degenerate_arguments_get_typed_errors(engine_name, file_target):
    dev = Device(file_target(1 << 20))
    with open_engine([dev], engine_name) as eng, HostBuffer(4096) as buf:
        batch = IOBatch.single(buf.address, 0, 0, 4096)
        with pytest.raises(ConfigError, match="qd must be at least 1"):
            eng.submit(0, batch, qd=-1)
        empty = IOBatch(np.zeros(0, np.uint64), 0, np.zeros(0, np.uint64), 0)
        assert eng.read_hashed(empty, [], []).size == 0
        with pytest.raises(ConfigError, match="device index"):
            IOBatch(np.array([buf.address], np.uint64), np.array([2 ** 32]), 0, 4096)
    dev.close()


@pytest.mark.parametrize("kind", ["disk", "shm"])
@pytest.mark.parametrize("op", [2, -1, "read", None, 1.0])
def test_submit_refuses_an_op_that_is_neither_read_nor_write(engine_name, kind, file_target,
                                                             shm_target, op):
    """submit(op, ...) takes OP_READ or OP_WRITE: any other number was run as
    a write by the native calls (op == READ ? read : write), overwriting the
    device with the buffer, except on a mapped device, where the engine
    copied it as a read; a string or None failed inside the native call."""
    from kvblock.io import OP_READ, OP_WRITE

    path = (shm_target if kind == "shm" else file_target)(MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(4096) as buf:
        buf.array[:] = 0x77
        with pytest.raises(ConfigError, match=r"op must be OP_READ \(0\) or OP_WRITE \(1\)"):
            eng.submit(op, IOBatch.single(buf.address, 0, 0, 4096))
        assert (buf.array == 0x77).all()
        eng.submit(np.int64(OP_READ), IOBatch.single(buf.address, 0, 0, 4096))
        assert not buf.array.any()
        assert eng.submit(OP_WRITE, IOBatch(np.zeros(0, np.uint64), 0, [], 0)).nbytes == 0
    with open(path, "rb") as f:
        assert f.read() == bytes(MIB), "a refused op wrote to the device"


def test_a_batch_of_fields_of_different_lengths_is_refused_by_name():
    """Lengths and device indices are one per address (or one for all);
    offsets one per address: anything else is a ConfigError naming the field
    and both counts, not numpy's broadcast error."""
    addrs = np.array([4096, 8192], np.uint64)
    for fields, name in [((0, [0, 4096], [4096] * 3), "3 lens"),
                         (([0, 0, 0], [0, 4096], 4096), "3 devs"),
                         ((0, [0], 4096), "1 offsets")]:
        with pytest.raises(ConfigError, match=rf"IOBatch: 2 addresses but {name}"):
            IOBatch(addrs, *fields)
    one = IOBatch(addrs, [1], [0, 4096], [4096])     # one for all, as a scalar
    assert one.devs.tolist() == [1, 1] and one.lens.tolist() == [4096, 4096]


def test_a_negative_offset_or_length_is_a_config_error(engine_name, file_target):
    """A negative offset or length (a caller's subtraction gone wrong) does
    not fit a uint64 field: ConfigError naming the value, not numpy's
    OverflowError, whichever way the batch is built."""
    with Device(file_target(MIB)) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(4096) as buf:
        with pytest.raises(ConfigError, match="IOBatch: offset -4096, .*out of range"):
            eng.read_into(0, -4096, buf.array)
        with pytest.raises(ConfigError, match="IOBatch: -4096: a value out of range"):
            IOBatch([buf.address], 0, [-4096], 4096)
        with pytest.raises(ConfigError, match="IOBatch: -8192: a value out of range"):
            IOBatch.listed([buf.address], 0, [0], [-8192])


def test_a_negative_numpy_value_is_a_config_error_not_a_wrapped_uint64(engine_name,
                                                                         shm_target):
    """A negative value in a signed numpy array (a vectorised subtraction gone
    wrong) is refused as a Python int is: cast to uint64 it wrapped to near
    2**64, so a negative address on a mapped device was a copy to a kernel
    address (the process died of SIGSEGV)."""
    with Device(shm_target(MIB)) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(4096) as buf:
        assert eng.mapped(0)
        at = np.array([buf.address], np.int64)
        for fields, value in [((at, 0, np.array([-4096]), 4096), -4096),
                              ((at, 0, [0], np.array([-8192])), -8192),
                              ((at - 2 * buf.address, 0, [0], 4096), -buf.address)]:
            with pytest.raises(ConfigError, match=rf"IOBatch: {value}: a value out of range"):
                eng.read(IOBatch(*fields))
        # numpy scalars (an offset taken from an array) in the few-I/O constructors
        with pytest.raises(ConfigError, match="IOBatch: offset -4096, .*out of range"):
            eng.read_into(0, np.int64(-4096), buf.array)
        with pytest.raises(ConfigError, match="IOBatch: -8192: a value out of range"):
            eng.read(IOBatch.listed([buf.address], 0, [0], [np.int64(-8192)]))


def test_a_listed_batch_equals_the_batch_the_constructor_builds():
    """IOBatch.listed (the few-I/O paths' batches) skips __post_init__'s
    conversions: same dtypes and values, on one device (an int of any kind)
    or one per entry."""
    addrs, offsets, lens = [4096, 8192, 1 << 40], [0, 4096, (1 << 63) + 4096], [4096] * 3
    for dev, devs in [(2, [2, 2, 2]), (np.int64(1), [1, 1, 1]), ([0, 1, 0], [0, 1, 0])]:
        got, want = IOBatch.listed(addrs, dev, offsets, lens), IOBatch(addrs, devs, offsets,
                                                                       lens)
        for field in ("addrs", "devs", "offsets", "lens"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist(), field


def test_a_listed_batch_of_fields_of_different_lengths_is_refused(engine_name, file_target):
    """IOBatch.listed takes lists of equal length, as the constructor does:
    one offset (or length, or device) short, the batch kept the lists as
    they came, _validate's zip stopped at the shortest and the native call
    read the missing entry's offset past the end of its array, so a write
    landed at whatever offset that memory held, reported as a success."""
    path = file_target(MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(2 * 4096) as buf:
        buf.array[:] = 0x5A
        two = [buf.address, buf.address + 4096]
        for fields, name in [((0, [0], [4096, 4096]), "1 offsets"),
                             ((0, [0, 4096], [4096]), "1 lens"),
                             (([0], [0, 4096], [4096, 4096]), "1 devs"),
                             ((0, [0, 4096, 8192], [4096] * 3), "3 offsets")]:
            with pytest.raises(ConfigError, match=rf"IOBatch: 2 addresses but {name}"):
                eng.write(IOBatch.listed(two, *fields))
    with open(path, "rb") as f:
        assert f.read() == bytes(MIB), "a refused batch wrote to the device"


@pytest.mark.parametrize("built", ["constructor", "single", "listed", "concat", "contiguous",
                                   "split", "staged"])
def test_a_batchs_fields_cannot_be_changed_after_it_is_built(engine_name, file_target, built):
    """The native calls index every field up to the address count, as the
    batch was built and checked: a field replaced afterwards by a shorter
    array (or one of another dtype) was read past its end (a length from
    whatever memory followed: a write of that many bytes from the buffer),
    one changed in place (lengths grown past the host buffer) read or
    wrote past the caller's buffer.  Each field is fixed once built:
    replacing one is a ConfigError, writing into one numpy's read-only
    error, whichever way the batch was made; the batch still runs as built."""
    path = file_target(MIB)
    with Device(path) as dev, open_engine([dev], engine_name, max_io=4096) as eng, \
            HostBuffer(4 * 4096) as buf:
        buf.array[:] = 0x5A
        addrs = [buf.address + i * 4096 for i in range(4)]
        offs = [i * 4096 for i in range(4)]
        if built == "constructor":
            batch = IOBatch(np.array(addrs, np.uint64), 0, np.array(offs, np.uint64), 4096)
        elif built == "single":
            batch = IOBatch.single(addrs[0], 0, 0, 4096)
        elif built == "listed":
            batch = IOBatch.listed(addrs, 0, offs, [4096] * 4)
        elif built == "concat":
            batch = IOBatch.concat([IOBatch.single(a, 0, o, 4096) for a, o in zip(addrs, offs)])
        elif built == "contiguous":
            batch = IOBatch.contiguous(addrs[0], 0, 0, 4 * 4096, 4096)
        elif built == "split":
            batch, _ = IOBatch.single(addrs[0], 0, 0, 4 * 4096).split(4096)
        else:
            batch = eng._stage(1, IOBatch.single(addrs[0] + 1, 0, 0, 4096))[0]
        n = len(batch)
        before = {f: getattr(batch, f).tolist() for f in ("addrs", "devs", "offsets", "lens")}
        for field, value in (("lens", np.array([4096], np.uint64)),
                             ("offsets", np.zeros(n, np.uint32)),
                             ("addrs", [buf.address] * n), ("devs", np.zeros(n, np.uint32))):
            with pytest.raises(ConfigError, match=f"IOBatch.*{field}.*build a new"):
                setattr(batch, field, value)
            with pytest.raises(ValueError, match="read-only"):
                getattr(batch, field)[0] = 1 << 20
        assert {f: getattr(batch, f).tolist() for f in before} == before
        batch.keep = "anything"          # (what the batch holds alive is the caller's)
        if built != "staged":
            eng.write(batch)
    with open(path, "rb") as f:
        data = f.read()
    assert data[4 * 4096:] == bytes(MIB - 4 * 4096), "a write past the batch as built"


def test_a_batch_built_from_a_callers_arrays_leaves_them_writable():
    """The read-only fields are the batch's own views: the arrays a caller
    built it from stay the caller's to change (for its next batch)."""
    addrs = np.array([4096, 8192], np.uint64)
    offsets = np.array([0, 4096], np.uint64)
    batch = IOBatch(addrs, 0, offsets, 4096)
    addrs += 4096
    offsets[:] = 0
    assert addrs.flags.writeable and offsets.flags.writeable
    assert not batch.addrs.flags.writeable and not batch.offsets.flags.writeable


@pytest.mark.parametrize("kind", ["disk", "shm"])
def test_an_engine_used_before_a_fork_works_in_the_child(engine_name, kind, file_target,
                                                        shm_target):
    """A process that used an engine forks (a DataLoader worker, a
    multiprocessing pool): the child's reads must work, not wait forever
    on helper threads that exist only in the parent (the threads engine's
    workers; the helpers of large copies on a mapped tmpfs file)."""
    path = (shm_target if kind == "shm" else file_target)(32 * MIB)
    dev = Device(path)
    eng = open_engine([dev], engine_name, queue_depth=4)
    try:
        assert eng.mapped(0) == (kind == "shm")
        src, out = HostBuffer(16 * MIB), HostBuffer(16 * MIB)
        src.array[:] = _random(16 * MIB, 7)
        eng.write(IOBatch.contiguous(src.address, 0, 0, 16 * MIB, MIB))   # helpers started
        eng.read(IOBatch.contiguous(out.address, 0, 0, 16 * MIB, MIB))
        pid = os.fork()
        if pid == 0:                       # the child: exit 0 only with the bytes read back
            code = 1
            try:
                import signal
                signal.alarm(20)           # a hang dies of SIGALRM
                out.array[:] = 0
                eng.read(IOBatch.contiguous(out.address, 0, 0, 16 * MIB, MIB))
                code = 0 if np.array_equal(out.array, src.array) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
            f"child: {'killed by signal %d' % os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'exit %d' % os.WEXITSTATUS(status)}"
    finally:
        eng.close()
        dev.close()


def test_a_child_forked_while_a_thread_runs_io_can_close_the_engine(engine_name, file_target,
                                                                    monkeypatch):
    """A process forks while another of its threads has a batch in flight
    (a DataLoader worker started beside a store's loads).  That batch is
    the parent's: the child's close() must not wait for it (it would wait
    forever), nor for the ring lock that thread held at the fork."""
    with Device(file_target(4 * MIB)) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(MIB) as buf:
        inside, go = threading.Event(), threading.Event()
        # Hold the batch in flight: uring with its ring's lock held, threads
        # between admission and its pread workers.
        hook = "_release" if engine_name == "uring" else "_run"
        real = getattr(eng, hook)

        def held(*args):
            inside.set()
            go.wait()
            return real(*args)

        monkeypatch.setattr(eng, hook, held)
        t = threading.Thread(target=eng.read, args=(IOBatch.single(buf.address, 0, 0, MIB),))
        t.start()
        try:
            assert inside.wait(10)
            pid = os.fork()
            if pid == 0:                  # exit 0 once close() returned
                code = 1
                try:
                    import signal
                    signal.alarm(20)      # a hang dies of SIGALRM
                    eng.close()
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        finally:
            go.set()
            t.join()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
            f"child: {'killed by signal %d' % os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'exit %d' % os.WEXITSTATUS(status)}"


@pytest.mark.parametrize("max_io", [0, -4096, 6000, 1.5, True, 2 << 30])
def test_a_bad_max_io_is_refused_at_open(engine_name, file_target, max_io):
    """max_io cuts large I/Os: zero or negative would cut them into nothing,
    one that is not whole blocks at unaligned offsets (EINVAL later), one
    over 1 GiB past what an io_uring length holds."""
    with Device(file_target(4 * MIB)) as dev:
        with pytest.raises(ConfigError, match="max_io must be a multiple"):
            open_engine([dev], engine_name, max_io=max_io)
        with open_engine([dev], engine_name, max_io=64 << 10) as eng:   # whole blocks: fine
            buf = HostBuffer(MIB)
            buf.array[:] = _random(MIB, 3)
            eng.write(IOBatch.single(buf.address, 0, 0, MIB))
            out = HostBuffer(MIB)
            eng.read(IOBatch.single(out.address, 0, 0, MIB))
            assert np.array_equal(out.array, buf.array)


@pytest.mark.parametrize("queue_depth", [0, 40000, "32", None, 2.5, True])
def test_a_bad_queue_depth_is_refused_at_open(engine_name, file_target, queue_depth):
    """queue_depth above what an io_uring holds (32768 entries) failed at the
    first I/O with EngineUnavailableError telling to switch engines; a
    string or None raised a bare TypeError; 2.5 became 2 silently.  All are
    a ConfigError at open naming the range."""
    with Device(file_target(MIB)) as dev:
        with pytest.raises(ConfigError, match=r"queue_depth must be an integer from 1 to 32768"):
            open_engine([dev], engine_name, queue_depth=queue_depth)
        with open_engine([dev], engine_name, queue_depth=np.int64(3)) as eng, \
                HostBuffer(65536) as buf:
            assert eng.queue_depth == 3
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 65536, 4096))


@pytest.mark.parametrize("qd", [2.5, "4", 0, False])
def test_a_bad_qd_of_one_batch_is_a_config_error(engine_name, file_target, qd):
    """qd of one call as queue_depth: a float or a string raised a bare
    TypeError from inside the native call (or a comparison)."""
    with Device(file_target(MIB)) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(65536) as buf:
        batch = IOBatch.contiguous(buf.address, 0, 0, 65536, 4096)
        with pytest.raises(ConfigError, match=r"qd must be at least 1 \(an integer"):
            eng.read(batch, qd=qd)
        eng.read(batch, qd=np.int64(2))


def test_close_waits_for_a_ring_re_registering_buffers_in_its_thread(file_target, monkeypatch):
    """A thread that closes a registered buffer re-registers its own ring's
    buffers (a native call, the GIL released).  close() from another thread
    at that moment destroyed the ring under the call (use after free); it
    must wait for it, as it waits for batches in flight."""
    from kvblock.io import native, uring

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    real = native.lib()
    entered, go = threading.Event(), threading.Event()
    seen = {}

    class Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_ring_set_buffers(self, handle, *args):
            ring = seen.get("ring")
            if ring is not None and threading.get_ident() == ring.thread:
                entered.set()
                go.wait(10)
                seen["destroyed"] = ring.handle is None
                if ring.handle is None:      # the real call would use freed memory
                    return -errno.EBADF
            return real.kvb_ring_set_buffers(handle, *args)

    with Device(file_target(MIB)) as dev:
        eng = open_engine([dev], "uring")
        monkeypatch.setattr(uring.native, "lib", lambda: Lib())
        other = HostBuffer(MIB)

        def worker():
            with HostBuffer(4096) as buf:
                eng.read(IOBatch.single(buf.address, 0, 0, 4096))
                seen["ring"] = eng._local.holder.ring
                other.close()        # re-registers this thread's (idle) ring

        t = threading.Thread(target=worker)
        t.start()
        assert entered.wait(10)
        closer = threading.Thread(target=eng.close)
        closer.start()
        closer.join(1.0)
        go.set()
        closer.join(10)
        t.join(10)
        assert seen["destroyed"] is False, "close() destroyed a ring in use by its thread"
        assert eng.live_rings == 0


def test_an_interrupted_threads_read_leaves_no_io_running(file_target, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while the threads engine waits for its
    workers: read() raised at once and the workers went on reading into
    the caller's buffer, which the caller frees or reuses from then on
    (bytes landing in another read's memory).  The batch's remaining I/Os
    are dropped and read() raises only once no worker is left in it."""
    from concurrent.futures import Future

    from kvblock.io import native

    real = native.lib()
    go = threading.Event()

    class Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_pio_run(self, *args):
            go.wait(10)                  # the workers are busy when the interrupt comes
            return real.kvb_pio_run(*args)

    real_result = Future.result

    def interrupted(self, timeout=None):
        threading.Timer(0.3, go.set).start()
        raise KeyboardInterrupt

    path = file_target(4 * MIB)
    with open(path, "r+b") as f:
        f.write(bytes(range(256)) * (4 * MIB // 256))
    with Device(path) as dev, HostBuffer(4 * MIB) as buf:
        eng = open_engine([dev], "threads", queue_depth=4)
        buf.array[:] = 0xAA
        monkeypatch.setattr(native, "lib", lambda: Lib())
        monkeypatch.setattr(Future, "result", interrupted)
        with pytest.raises(KeyboardInterrupt):
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 4 * MIB, 64 << 10))
        monkeypatch.setattr(Future, "result", real_result)
        go.set()
        eng.close()                      # waits for the pool's workers
        assert (buf.array == 0xAA).all(), "I/Os of the interrupted read landed after it raised"


def test_latency_is_one_per_io_of_the_batch_when_ios_are_split(engine_name, file_target):
    """IOResult.latency_ns holds one latency per I/O of the batch: an I/O
    longer than max_io (split into pieces) returned one per piece, so a
    batch of 2 I/Os of 2 MiB at max_io 1 MiB gave 4 numbers (kvblock bench
    --bs above max_io reported the pieces' percentiles)."""
    with Device(file_target(8 * MIB)) as dev, \
            open_engine([dev], engine_name, max_io=MIB) as eng, HostBuffer(4 * MIB) as buf:
        batch = IOBatch(np.array([buf.address, buf.address + 2 * MIB], np.uint64), 0,
                        [0, 4 * MIB], 2 * MIB)
        for op in (eng.write, eng.read):
            lat = op(batch, latency=True).latency_ns
            assert lat.shape == (2,) and (lat > 0).all()


def test_a_split_io_that_fails_counts_as_one_failed_io(engine_name, file_target):
    """IOFailedError.failed and its "(N of M I/Os failed)" count the I/Os of
    the caller's batch.  An I/O longer than max_io is run as pieces: when
    several pieces of one I/O failed, the error counted the pieces (4 of 4
    for one I/O), and the store's _read_failed, which drops only the run an
    error names when failed <= 1, dropped every run of the batch instead."""
    path = file_target(MIB)
    with Device(path) as dev, open_engine([dev], engine_name, max_io=65536,
                                          mapped_reads=False) as eng, \
            HostBuffer(4 * 65536) as buf:
        os.truncate(path, 8192)  # the file shrinks under the open device: every piece is short
        with pytest.raises(IOFailedError) as exc:
            eng.read(IOBatch(np.array([buf.address], np.uint64), 0, [0], 4 * 65536))
        assert exc.value.failed == 1
        assert "I/Os failed" not in str(exc.value)
        # two I/Os of two pieces each, both failing: 2 of 2, not 4 of 4
        with pytest.raises(IOFailedError, match=r"\(2 of 2 I/Os failed\)") as exc:
            eng.read(IOBatch(np.array([buf.address, buf.address + 2 * 65536], np.uint64), 0,
                             [0, 2 * 65536], 2 * 65536))
        assert exc.value.failed == 2


@contextlib.contextmanager
def _patterned_engine(file_target, engine_name):
    """An engine over a 1 MiB file whose first 16 KiB count bytes 0-255 over
    and over, and an 8 KiB host buffer: (engine, buffer)."""
    path = file_target(MIB)
    with open(path, "r+b") as f:
        f.write(bytes(range(256)) * 64)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(8192) as buf:
        yield eng, buf


def test_a_fractional_offset_or_length_is_a_config_error_not_truncated(engine_name,
                                                                        file_target):
    """A float offset, length, address or device index (a division gone
    wrong: ``nbytes / 2``) was cast to an integer, its fraction dropped: an
    offset of 4096.5 read the bytes at 4096 and reported a success, where any
    other misaligned offset is refused (a string was parsed).  Each
    constructor now refuses a value that is no whole number with a
    ConfigError naming the field."""
    with _patterned_engine(file_target, engine_name) as (eng, buf):
        a = buf.address
        with pytest.raises(ConfigError, match=r"IOBatch: offset 4096\.5 .*integer"):
            eng.read_into(0, 4096.5, buf.array[:4096])
        with pytest.raises(ConfigError, match=r"IOBatch: offsets .*integer"):
            IOBatch([a], 0, [4096.5], 4096)
        with pytest.raises(ConfigError, match=r"IOBatch: offsets .*integer"):
            IOBatch([a], 0, np.array([4096.25]), 4096)
        with pytest.raises(ConfigError, match=r"IOBatch: offsets .*integer"):
            IOBatch([a], 0, np.array([np.nan]), 4096)
        with pytest.raises(ConfigError, match=r"IOBatch: lens .*integer"):
            IOBatch([a], 0, [0], 4096.9)
        with pytest.raises(ConfigError, match=r"IOBatch: devs .*integer"):
            IOBatch([a], 0.7, [0], 4096)
        with pytest.raises(ConfigError, match=r"IOBatch: addrs .*integer"):
            IOBatch([str(a)], 0, [0], 4096)
        with pytest.raises(ConfigError, match=r"IOBatch: offsets .*integer"):
            IOBatch.listed([a], 0, [4096.5], [4096])
        with pytest.raises(ConfigError, match=r"IOBatch: devs .*integer"):
            IOBatch.listed([a], [0.5], [0], [4096])
        with pytest.raises(ConfigError, match=r"IOBatch: length 4096\.5 .*integer"):
            IOBatch.single(a, 0, 0, 4096.5)
        # integers of any kind still go, and floats of whole values (as before)
        eng.read(IOBatch([a], 0, np.array([4096.0]), 4096))
        eng.read(IOBatch.single(a, 0, 4096.0, 4096))
        eng.read(IOBatch([np.uint64(a)], np.int32(0), np.array([4096], np.int64), 4096))
        eng.read(IOBatch.listed([a], np.int64(0), [np.uint64(4096)], [4096]))
        eng.read(IOBatch.single(np.uint64(a), np.int64(0), np.int64(4096), 4096))
        assert buf.array[:4096].tobytes() == bytes(range(256)) * 16


def test_a_contiguous_batch_of_a_bad_piece_size_or_length_is_a_config_error():
    """IOBatch.contiguous cut a range into ``io_size`` pieces with np.arange:
    a piece size of 0 raised ZeroDivisionError, a negative one (or a
    negative length) numpy's OverflowError, outside kvblock's errors."""
    for length, io_size in [(8192, 0), (8192, -4096), (-8192, 4096), (8192, 4096.5)]:
        with pytest.raises(ConfigError, match=rf"IOBatch.contiguous: .*{length}.*{io_size}"):
            IOBatch.contiguous(4096, 0, 0, length, io_size)
    assert IOBatch.contiguous(4096, 0, 0, 8192, 4096).lens.tolist() == [4096, 4096]
    assert len(IOBatch.contiguous(4096, 0, 0, 0, 4096)) == 0


def test_an_engine_over_a_closed_device_is_refused(engine_name, file_target):
    """An engine opened over a Device already closed took its descriptor,
    -1, into its table: every I/O then failed as an IOFailedError EBADF
    with device_fault True, which a store takes for a bad sector (and drops
    the runs it names), where the device was only closed."""
    path = file_target(MIB)
    dev = Device(path)
    dev.close()
    with pytest.raises(ConfigError, match=f"{path}: the device is closed"):
        open_engine([dev], engine_name)


def test_a_contiguous_batch_at_a_fractional_or_negative_offset_is_a_config_error(
        engine_name, file_target):
    """IOBatch.contiguous checked its length and piece size, but put the
    offset and address through np.uint64 as they came: an offset of 4096.5
    lost its fraction, so the read that any other misaligned offset is
    refused for read the bytes at 4096 and reported success (a wrong read),
    and a negative offset or address raised numpy's bare OverflowError."""
    with _patterned_engine(file_target, engine_name) as (eng, buf):
        a = buf.address
        with pytest.raises(ConfigError, match=r"IOBatch: offset 4096\.5 .*integer"):
            eng.read(IOBatch.contiguous(a, 0, 4096.5, 8192, 4096))
        with pytest.raises(ConfigError, match=r"IOBatch: address 4096\.5 .*integer"):
            IOBatch.contiguous(4096.5, 0, 0, 8192, 4096)
        with pytest.raises(ConfigError, match=r"IOBatch: device 0\.5 .*integer"):
            IOBatch.contiguous(a, 0.5, 0, 8192, 4096)
        for address, offset in [(a, -4096), (-4096, 0), (a, 1 << 64)]:
            with pytest.raises(ConfigError, match=r"IOBatch: .*out of range"):
                IOBatch.contiguous(address, 0, offset, 8192, 4096)
        b = IOBatch.contiguous(a, np.int64(0), np.uint64(4096), 8192, 4096)
        assert b.offsets.tolist() == [4096, 8192] and b.addrs.tolist() == [a, a + 4096]
        assert IOBatch.contiguous(a, 0, 4096.0, 4096, 4096).offsets.tolist() == [4096]


def test_closing_a_device_closes_the_engines_over_it(engine_name, file_target, tmp_path):
    """A Device closed while an engine over it was still open: the engine
    kept the descriptor's number in its table, and once another file took
    that number its I/O went there (the threads engine's pwrite; a uring
    ring made later, in another thread, registered it): the bytes written
    into an unrelated file.  Closing the device closes the engines over it
    first (waiting for their I/O in flight); their later I/O is refused."""
    path = file_target(MIB)
    other = tmp_path / "other"
    other.write_bytes(b"\0" * MIB)
    dev = Device(path)
    eng = open_engine([dev], engine_name)
    fd = -1
    try:
        with HostBuffer(4096) as buf:
            buf.array[:] = 0xAB
            eng.write_from(0, 0, buf.array)
            number = dev.fd
            dev.close()
            fd = os.open(other, os.O_RDWR)
            if fd != number:       # the freed number, as the next open usually gets it
                # (only while nothing else holds it: another thread's file
                # there, dup2 would close it under that thread)
                with pytest.raises(OSError):
                    os.fstat(number)
                os.dup2(fd, number)
                os.close(fd)
                fd = number
            raised = []

            def write():
                try:
                    eng.write_from(0, 0, buf.array)
                except Exception as e:
                    raised.append(e)

            t = threading.Thread(target=write)
            t.start()
            t.join()
            assert len(raised) == 1 and isinstance(raised[0], ConfigError), raised
            assert "closed" in str(raised[0])
    finally:
        eng.close()
        if fd >= 0:
            os.close(fd)
    assert other.read_bytes() == b"\0" * MIB
    with open(path, "rb") as f:
        assert f.read(4096) == b"\xab" * 4096


def test_a_threads_worker_that_cannot_start_leaves_no_io_running(file_target, monkeypatch):
    """A threads batch's helper that cannot start (the pool's submit
    raising RuntimeError "can't start new thread"): read() raised at once
    while the helpers already started went on reading into the caller's
    buffer, which the caller frees or reuses from then on.  The workers
    share the batch through one cursor, so this thread takes the missing
    helpers' place: the read completes, and returns only once no worker is
    left in it."""
    from kvblock.io import native

    real = native.lib()
    go = threading.Event()
    running = []
    lock = threading.Lock()

    class Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_pio_run(self, *args):
            with lock:
                running.append(1)
            try:
                go.wait(10)              # the started helper is busy as submit fails
                return real.kvb_pio_run(*args)
            finally:
                with lock:
                    running.pop()

    path, data = _file_of_a_pattern(file_target, 4 * MIB)
    with Device(path) as dev, HostBuffer(4 * MIB) as buf, \
            open_engine([dev], "threads", queue_depth=4) as eng:
        buf.array[:] = 0xAA
        real_submit = eng._pool.submit
        calls = []

        def submit(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                threading.Timer(0.3, go.set).start()
                raise RuntimeError("can't start new thread")
            return real_submit(*args, **kwargs)

        monkeypatch.setattr(native, "lib", lambda: Lib())
        monkeypatch.setattr(eng._pool, "submit", submit)
        try:
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 4 * MIB, 64 << 10))
        finally:
            left = len(running)
            go.set()
        assert left == 0, "read() returned with a worker still reading into the buffer"
        assert np.array_equal(buf.array, data)


def test_a_threads_worker_queued_by_a_raising_submit_starting_late_makes_no_native_call(
        file_target, monkeypatch):
    """A pool submit that raised ("can't start new thread") may still have
    queued its worker, which may start only once read() has returned and
    the caller has freed or reused the batch's arrays: it must not enter
    kvb_pio_run with them (the batch is closed to it)."""
    from kvblock.io import native

    real = native.lib()
    calls = []

    class Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_pio_run(self, *args):
            calls.append(threading.current_thread().name)
            return real.kvb_pio_run(*args)

    path, data = _file_of_a_pattern(file_target, 4 * MIB)
    with Device(path) as dev, HostBuffer(4 * MIB) as buf, \
            open_engine([dev], "threads", queue_depth=4) as eng:
        real_submit = eng._pool.submit
        queued = []

        def submit(fn, *args, **kwargs):
            if queued:
                return real_submit(fn, *args, **kwargs)
            queued.append((fn, args, kwargs))     # queued, its thread not started
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(native, "lib", lambda: Lib())
        monkeypatch.setattr(eng._pool, "submit", submit)
        eng.read(IOBatch.contiguous(buf.address, 0, 0, 4 * MIB, 64 << 10))
        assert np.array_equal(buf.array, data)
        before = len(calls)
        fn, args, kwargs = queued[0]
        late = threading.Thread(target=fn, args=args, kwargs=kwargs, name="late-worker")
        late.start()
        late.join(10)
        assert "late-worker" not in calls[before:], \
            "a worker starting after read() returned entered the native call"


def _file_of_a_pattern(file_target, size: int):
    """(path, its bytes): a file of ``size`` bytes holding 0, 1, ..., 255 over and over."""
    path = file_target(size)
    data = np.frombuffer(bytes(range(256)) * (size // 256), np.uint8)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    return path, data


@pytest.mark.parametrize("ring", ["new", "reused"])
def test_a_failure_registering_buffers_leaves_the_ring_unlocked(file_target, monkeypatch,
                                                                ring):
    """_ring() hands the ring over locked and registered this thread's
    buffers after taking the lock, outside _run's try: an error there (no
    memory for the arrays, a Ctrl-C) left the lock held, and close() then
    waited for it for good (tested here by the lock, not by a close that
    would hang)."""
    from kvblock.io import uring

    if not probe()[0]:
        pytest.skip("io_uring unavailable")
    with Device(file_target(MIB)) as dev, HostBuffer(4096) as buf:
        eng = open_engine([dev], "uring")
        try:
            if ring == "reused":
                eng.read(IOBatch.single(buf.address, 0, 0, 4096))

            def no_memory(self):
                raise MemoryError("injected")
            monkeypatch.setattr(uring._Ring, "sync_buffers", no_memory)
            with pytest.raises(MemoryError):
                eng.read(IOBatch.single(buf.address, 0, 0, 4096))
            monkeypatch.undo()
            assert eng._rings and not any(r.lock.locked() for r in eng._rings), \
                "a ring's lock held after a failed batch"
            eng.read(IOBatch.single(buf.address, 0, 0, 4096))   # the thread goes on
        finally:
            for r in eng._rings:            # (failing: close() would wait for good)
                if r.lock.locked():
                    r.lock.release()
            eng.close()


class _InterruptedAsAcquired:
    """A ring's lock whose first acquire() call is cut by a KeyboardInterrupt
    as it returns, the lock taken (CPython runs a pending signal's handler
    as a call into C returns).  The with form is the lock's own: no call
    returns between taking the lock and entering the block."""

    def __init__(self, lock):
        self.inner, self.armed = lock, True

    def acquire(self, *a, **kw):
        got = self.inner.acquire(*a, **kw)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return got

    def release(self):
        self.inner.release()

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def test_an_interrupt_as_the_ring_lock_is_taken_leaves_it_free(file_target):
    """Before: _run took its thread's ring lock with acquire() (in _ring)
    before the try whose finally releases it; a Ctrl-C landing there left
    the lock held, and the thread's next batch on that ring waited on it
    for good.  Taken by a with statement, no call returns in between."""
    if not probe()[0]:
        pytest.skip(f"io_uring unavailable here: {probe()[1]}")
    path = file_target(4 * MIB)
    data = np.random.default_rng(11).integers(0, 256, MIB, dtype=np.uint8)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    with Device(path) as dev, open_engine([dev], "uring") as eng, HostBuffer(MIB) as buf:
        batch = IOBatch.single(buf.address, 0, 0, MIB)
        eng.read(batch)                          # this thread's ring
        ring = eng._local.holder.ring
        real = ring.lock
        ring.lock = _InterruptedAsAcquired(real)
        try:
            eng.read(batch)
        except KeyboardInterrupt:
            pass                                 # (the lock taken by an acquire() call)
        finally:
            ring.lock = real
        held = real.locked()
        if held:
            real.release()                       # (or the engine's close waits on it)
        assert not held, "the ring's lock was left held"
        buf.array[:] = 0
        eng.read(batch)
        assert np.array_equal(buf.array, data)


@pytest.mark.parametrize("max_io", [0, -4096, 1.5, 4096.0 + 0.5, "4096", None])
def test_split_refuses_a_piece_size_that_is_no_whole_number_from_1(max_io):
    """IOBatch.split of a piece size that is no whole number of bytes from 1
    raised numpy's OverflowError (0, negative) or a TypeError, or cut the
    entries into pieces of a size nobody asked for (1.5: 1-byte pieces).  A ConfigError names it."""
    batch = IOBatch([0, MIB], 0, [0, MIB], [3 * MIB, 4096])
    with pytest.raises(ConfigError, match=r"split.*piece"):
        batch.split(max_io)


def test_split_keeps_every_byte_of_an_entry_near_2_64_bytes():
    """An entry whose length was within max_io of 2**64 was cut into no
    piece at all (lens + max_io - 1 wrapped in uint64), so split() dropped
    it silently: every piece now covers the entry, however long."""
    top = 2 ** 64 - 4096
    batch = IOBatch([0, 0], 0, [0, 0], [top, 3 * 4096])
    pieces, parent = batch.split(1 << 62)
    assert parent.tolist() == [0, 0, 0, 0, 1]
    assert sum(pieces.lens[:4].tolist()) == top and pieces.lens[4] == 3 * 4096
    assert pieces.offsets[:4].tolist() == [k << 62 for k in range(4)]
    exact, parent = IOBatch.single(0, 0, 0, 4 * 4096).split(4096)
    assert exact.lens.tolist() == [4096] * 4 and parent.tolist() == [0] * 4
