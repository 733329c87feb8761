"""io_uring failures that cannot be caused on purpose on this kernel,
injected with an LD_PRELOAD shim over liburing (tests/support/uring_faults.c,
built here with the C compiler the native core was built with): a ring that
breaks after taking a batch's I/Os, and a kernel too old for SINGLE_ISSUER
(whose rings a forked child shares with its parent)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvblock.devices import create_file
from kvblock.io.uring import probe

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "support" / "uring_faults.c"
pytestmark = pytest.mark.skipif(not probe()[0], reason="io_uring unavailable here")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (make install builds the native core with one)"
    out = tmp_path_factory.mktemp("shim") / "uring_faults.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SHIM), "-ldl"],
                   check=True, capture_output=True, text=True)
    return str(out)


def _child(shim, case, path, **env) -> dict:
    res = subprocess.run([sys.executable, "-m", "tests.io.uring_faults_child", case, path],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_PRELOAD": shim,
                              "KVBLOCK_IO_ENGINE": "uring", **env})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_broken_ring_is_drained_and_replaced(shim, tmp_path):
    """Before: the I/Os the broken ring had taken landed later, and the next
    batch took their completions for its own (success, with its buffer
    partly unread); then every batch of that thread failed.  A batch whose
    I/Os all completed before the ring was retired has its bytes: no error
    (before: IOFailedError for a batch read in full)."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring", path, KVB_FAULT_SUBMIT_AT="1")
    del out["first_seconds"]
    assert out == {"first": "no error", "first_equal": True, "second_equal": True,
                   "again_equal": True}


def test_a_broken_ring_that_took_nothing_fails_at_once(shim, tmp_path):
    """The kernel took none of the batch's I/Os: each is ECANCELED and the
    call returns at once (before: it waited 5 s for completions that could
    never come).  The error names the device, the first I/O that did not
    run, and the way out."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring", path, KVB_FAULT_SUBMIT_AT="1", KVB_FAULT_SUBMIT_NONE="1")
    assert out.pop("first_seconds") < 4
    assert out == {"first": "IOFailedError 12", "failed": 8, "second_equal": True,
                   "again_equal": True,
                   "named": {"path": True, "offset": True, "fix": True}}


def test_a_broken_ring_counts_the_callers_ios_not_their_pieces(shim, tmp_path):
    """Before: the broken-ring error counted the pieces the engine had cut
    the batch into (8 for two 4 MiB reads split at 1 MiB), and a store
    reading one run split into pieces took failed > 1 for 'several I/Os
    failed' and dropped every run of the batch, not the one named."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring_split", path, KVB_FAULT_SUBMIT_AT="1",
                 KVB_FAULT_SUBMIT_NONE="1")
    assert out == {"first": "IOFailedError 12", "failed": 2, "says": True}


def test_a_broken_ring_waits_for_every_io_it_took(shim, tmp_path):
    """A device slow to complete what a broken ring took (6 s here): the
    call returns only once every such I/O has landed (before: it gave up
    after 5 s, and an I/O landing later wrote into a buffer its caller had
    reused)."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring", path, KVB_FAULT_SUBMIT_AT="1",
                 KVB_FAULT_REAP_AFTER_MS="6000")
    assert out.pop("first_seconds") >= 5.9
    assert out == {"first": "no error", "first_equal": True, "second_equal": True,
                   "again_equal": True}


def test_a_forked_child_leaves_the_parents_ring_alone_on_older_kernels(shim, tmp_path):
    path = str(create_file(tmp_path / "f.img", 8 << 20))
    out = _child(shim, "fork_old_kernel", path, KVB_FAULT_OLD_KERNEL="1")
    assert out == {"fixed_files": True, "parent_read_ok": True}


def test_a_broken_ring_slot_never_written_is_not_taken_for_a_completed_io(
        file_target, monkeypatch):
    """When the ring's drain cannot even wait (io_uring_wait_cqe_timeout
    failing other than ETIME/EINTR) it stops, and the result slots of I/Os
    the kernel took but did not complete are never written.  The engine
    took the results array from np.empty: memory left there by an earlier
    batch of the same size holds that batch's lengths, so those unfinished
    I/Os read as done (before: the batch 'succeeded' with part of its buffer
    unread, or the error undercounted the I/Os that did not finish)."""
    import errno

    import numpy as np

    import kvblock.io.engine as engine_mod
    from kvblock.devices import Device
    from kvblock.errors import IOFailedError
    from kvblock.io import IOBatch, native, open_engine
    from kvblock.memory import HostBuffer

    KIB64 = 64 << 10
    path = file_target(16 << 20)
    real = native.lib()

    class DrainStopped:
        """kvb_ring_run on a ring that broke: the first `done` I/Os
        completed, the next ones were taken and never reaped (their slots
        unwritten), the last `cancelled` never ran."""

        def __init__(self, done, cancelled):
            self.done, self.cancelled = done, cancelled

        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results,
                         latency, hasher):
            for i in range(self.done):
                results[i] = lens[i]
            for i in range(n - self.cancelled, n):
                results[i] = -errno.ECANCELED
            return -errno.ENXIO

    # np.empty hands back whatever memory held: here an earlier results
    # array of the same size, every I/O of it complete (64 KiB each)
    class LeftOver:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float):
            out = np.empty(shape, dtype)
            if np.dtype(dtype) == np.int64:
                out.fill(KIB64)
            return out

    with Device(path) as dev, open_engine([dev], "uring", queue_depth=8) as eng, \
            HostBuffer(8 * KIB64) as buf:
        batch = IOBatch.contiguous(buf.address, 0, 0, 8 * KIB64, KIB64)
        eng.read(batch)                     # a ring for this thread, a batch done
        monkeypatch.setattr(engine_mod, "np", LeftOver())
        for done, cancelled, failed in ((6, 0, 2), (3, 2, 5)):
            monkeypatch.setattr(native, "lib", lambda p=DrainStopped(done, cancelled): p)
            with pytest.raises(IOFailedError) as e:
                eng.read(batch)
            assert e.value.failed == failed, str(e.value)
            assert e.value.errno == errno.ENXIO and e.value.offset == done * KIB64
            assert not e.value.device_fault
        monkeypatch.setattr(native, "lib", lambda: real)
        monkeypatch.setattr(engine_mod, "np", np)
        eng.read(batch)                     # the engine goes on with a new ring


def test_a_broken_ring_says_which_writes_it_could_not_wait_for(file_target, monkeypatch):
    """A broken ring whose drain could not wait for every I/O the kernel had
    taken returns with those still in flight: a write may land later, on
    space its caller gives up as failed (a served rank then aborted its
    allocation, the server gave it back at once, and the late write landed
    on another rank's run).  The error says how many may still land
    (``in_flight``) and where the first goes; the ones the kernel answered
    (even with EIO) and those that never ran are not counted."""
    import errno

    from kvblock.devices import Device
    from kvblock.errors import IOFailedError
    from kvblock.io import IOBatch, native, open_engine
    from kvblock.memory import HostBuffer

    KIB64 = 64 << 10
    path = file_target(16 << 20)
    real = native.lib()

    class DrainStopped:
        """kvb_ring_run of a write on a ring that broke: I/Os 0-1 done, 2
        answered EIO, 3-4 taken and never reaped (slots unwritten), 5-7
        never ran."""

        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results,
                         latency, hasher):
            for i in range(2):
                results[i] = lens[i]
            results[2] = -errno.EIO
            for i in range(5, n):
                results[i] = -errno.ECANCELED
            return -errno.ENXIO

    with Device(path) as dev, open_engine([dev], "uring", queue_depth=8) as eng, \
            HostBuffer(8 * KIB64) as buf:
        batch = IOBatch.contiguous(buf.address, 0, 0, 8 * KIB64, KIB64)
        eng.write(batch)                    # a ring for this thread, a batch done
        monkeypatch.setattr(native, "lib", lambda: DrainStopped())
        with pytest.raises(IOFailedError) as e:
            eng.write(batch)
        assert e.value.failed == 6 and e.value.in_flight == 2, str(e.value)
        assert e.value.path == path and not e.value.device_fault
        assert "2 of them may still be in flight" in str(e.value)
        assert f"write at offset {3 * KIB64} on {path}" in str(e.value)
        monkeypatch.setattr(native, "lib", lambda: real)
        eng.write(batch)                    # the engine goes on with a new ring
        # one the drain waited for (or that never ran) is not in flight
        monkeypatch.setattr(native, "lib", lambda: _Drained(real))
        with pytest.raises(IOFailedError) as e:
            eng.write(batch)
        assert e.value.failed == 8 and e.value.in_flight == 0, str(e.value)
        assert "in flight" not in str(e.value)


class _Drained:
    """kvb_ring_run on a ring that broke and drained: every slot answered."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results, latency,
                     hasher):
        import errno

        for i in range(n):
            results[i] = -errno.EIO if i < 2 else -errno.ECANCELED
        return -errno.ENXIO


class _CutShort:
    """kvb_ring_run as the kernel may answer it: the I/O at index ``short``
    of the first ``times`` runs transfers only its first half (its length
    handed to the real run halved: the hasher sees a piece cut short), and
    the one at ``again`` comes back -EAGAIN (older kernels let a block
    device's BLK_STS_AGAIN through, liburing #766 / #1269) with nothing read."""

    def __init__(self, real, short=None, again=None, times=1):
        self.real, self.short, self.again, self.times = real, short, again, times
        self.runs = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results, latency,
                     hasher):
        import ctypes

        from kvblock.io import native

        self.runs += 1
        if self.runs > self.times:
            return self.real.kvb_ring_run(handle, op, n, addrs, devs, offsets, lens, qd,
                                          results, latency, hasher)
        cut = native.ffi.new("uint64_t[]", [lens[i] for i in range(n)])
        if self.short is not None and self.short < n:
            cut[self.short] = lens[self.short] // 2
        ret = self.real.kvb_ring_run(handle, op, n, addrs, devs, offsets, cut, qd, results,
                                     latency, hasher)
        if self.again is not None and self.again < n:
            if op == 0:     # a read: nothing landed (a write's source is the caller's)
                ctypes.memset(addrs[self.again], 0xEE, lens[self.again])
            results[self.again] = -11                                   # -EAGAIN
        return ret


def _patterned(path, size, seed):
    import numpy as np

    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    return data


@pytest.mark.parametrize("fault", ["short", "again", "both"])
def test_a_read_cut_short_or_refused_for_now_is_completed(file_target, monkeypatch, fault):
    """io_uring hands back a partial transfer, or -EAGAIN, as the kernel
    answered it (the threads engine's pread loop completes the first).
    Before: the batch failed with IOFailedError ("short read ... end of
    device", or EAGAIN) and the store dropped a good run as a device
    fault.  Now what is left of such an I/O is issued again."""
    import numpy as np

    from kvblock.devices import Device
    from kvblock.io import IOBatch, native, open_engine
    from kvblock.memory import HostBuffer

    MIB = 1 << 20
    path = file_target(8 * MIB)
    data = _patterned(path, 8 * MIB, 3)
    real = native.lib()
    short, again = {"short": (1, None), "again": (None, 2), "both": (1, 2)}[fault]
    proxy = _CutShort(real, short=short, again=again)
    with Device(path) as dev, open_engine([dev], "uring", queue_depth=4) as eng, \
            HostBuffer(4 * MIB) as buf:
        buf.array[:] = 0xEE
        monkeypatch.setattr(native, "lib", lambda: proxy)
        batch = IOBatch.contiguous(buf.address, 0, MIB, 4 * MIB, MIB)
        res = eng.read(batch, latency=True)
        assert res.nbytes == 4 * MIB and res.latency_ns.shape == (4,)
        assert np.array_equal(buf.array, data[MIB:5 * MIB])
        assert proxy.runs == 2           # the batch, then what was left of it
        # and a write cut short the same way is completed
        proxy.runs = 0
        written = np.random.default_rng(4).integers(0, 256, 4 * MIB, dtype=np.uint8)
        buf.array[:] = written
        eng.write(IOBatch.contiguous(buf.address, 0, 0, 4 * MIB, MIB))
        assert proxy.runs == 2
    with open(path, "rb") as f:
        assert f.read(4 * MIB) == written.tobytes()


def test_a_hashed_read_cut_short_is_completed_and_hashed_whole(file_target, monkeypatch):
    """The native hasher marks a stream whose piece came back short as
    failed (digest 0); once the rest of the piece is read the digests are
    those of the whole bytes, not 0 (a checksum miss for a good run)."""
    import numpy as np

    from kvblock.devices import Device
    from kvblock.format.checksum import data_checksum
    from kvblock.io import IOBatch, native, open_engine
    from kvblock.memory import HostBuffer

    MIB = 1 << 20
    path = file_target(8 * MIB)
    data = _patterned(path, 8 * MIB, 5)
    proxy = _CutShort(native.lib(), short=3)
    with Device(path) as dev, open_engine([dev], "uring") as eng, HostBuffer(4 * MIB) as buf:
        monkeypatch.setattr(native, "lib", lambda: proxy)
        batch = IOBatch(np.array([buf.address, buf.address + 2 * MIB], np.uint64), 0,
                        [0, 4 * MIB], 2 * MIB)
        got = eng.read_hashed(batch, [0, 1], [7, 8])
        assert proxy.runs == 2
        assert [int(g) for g in got] == [data_checksum(data[:2 * MIB], 7),
                                         data_checksum(data[4 * MIB:6 * MIB], 8)]
        assert np.array_equal(buf.array[2 * MIB:], data[4 * MIB:6 * MIB])


def test_a_read_that_stays_short_is_still_reported(file_target, monkeypatch):
    """An I/O that keeps coming back short (or -EAGAIN) is issued again a
    few times, then reported as before, naming device, offset and length."""
    from kvblock.devices import Device
    from kvblock.errors import IOFailedError
    from kvblock.io import IOBatch, native, open_engine
    from kvblock.memory import HostBuffer

    MIB = 1 << 20
    path = file_target(8 * MIB)
    proxy = _CutShort(native.lib(), again=0, times=10 ** 6)
    with Device(path) as dev, open_engine([dev], "uring") as eng, HostBuffer(MIB) as buf:
        monkeypatch.setattr(native, "lib", lambda: proxy)
        with pytest.raises(IOFailedError, match=rf"read of {MIB} bytes at offset {2 * MIB} "
                                                rf"on {path} failed: EAGAIN") as e:
            eng.read(IOBatch.single(buf.address, 0, 2 * MIB, MIB))
        assert (e.value.offset, e.value.length, e.value.failed) == (2 * MIB, MIB, 1)
        assert 1 < proxy.runs <= 8       # a few more tries, not for ever


class _Scripted:
    """kvb_ring_run answering from a script, one entry per run: "half" (each
    I/O transfers its first half), "again" (-EAGAIN, nothing transferred) or
    None (the real run); records each run's (offset, length) pairs."""

    def __init__(self, real, script):
        self.real, self.script, self.issued = real, list(script), []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results, latency,
                     hasher):
        from kvblock.io import native

        self.issued.append([(offsets[i], lens[i]) for i in range(n)])
        step = self.script.pop(0) if self.script else None
        if step == "again":
            for i in range(n):
                results[i] = -11                                        # -EAGAIN
            return 0
        cut = lens
        if step == "half":
            cut = native.ffi.new("uint64_t[]", [lens[i] // 2 for i in range(n)])
        return self.real.kvb_ring_run(handle, op, n, addrs, devs, offsets, cut, qd, results,
                                      latency, hasher)


def test_a_retry_refused_for_now_keeps_the_bytes_already_transferred(file_target,
                                                                     monkeypatch):
    """A read cut short, whose rest then comes back -EAGAIN: the round after
    issues what is still left, from where the transfer stopped.  Before: the
    -EAGAIN overwrote the bytes counted so far and the I/O was issued again
    from its start (its first half transferred twice)."""
    import numpy as np

    from kvblock.devices import Device
    from kvblock.io import IOBatch, native, open_engine
    from kvblock.memory import HostBuffer

    MIB = 1 << 20
    path = file_target(8 * MIB)
    data = _patterned(path, 8 * MIB, 6)
    proxy = _Scripted(native.lib(), ["half", "again", "again"])
    with Device(path) as dev, open_engine([dev], "uring") as eng, HostBuffer(MIB) as buf:
        buf.array[:] = 0xEE
        monkeypatch.setattr(native, "lib", lambda: proxy)
        res = eng.read(IOBatch.single(buf.address, 0, 2 * MIB, MIB), latency=True)
        assert res.nbytes == MIB
        assert np.array_equal(buf.array, data[2 * MIB:3 * MIB])
        half = (2 * MIB + MIB // 2, MIB // 2)
        assert proxy.issued == [[(2 * MIB, MIB)], [half], [half], [half]]
