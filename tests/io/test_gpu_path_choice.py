"""Which path a load into CUDA memory takes (kvblock.io.gpu.gpu_path),
decided without a GPU: the environment override, and verify="always",
whose checksums are computed on the host, winning over it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvblock.errors import ConfigError
from kvblock.io.gpu import gpu_path


def _store(verify):
    def no_kvikio():
        raise AssertionError("kvikio must not be opened for this choice")
    return SimpleNamespace(verify=verify, _kvikio_reader=no_kvikio)


@pytest.mark.parametrize("forced,verify,want", [("host", "never", "host"),
                                                ("kvikio", "never", "kvikio"),
                                                ("host", "always", "host"),
                                                ("kvikio", "always", "host")])
def test_the_override_and_verify(monkeypatch, caplog, forced, verify, want):
    monkeypatch.setenv("KVBLOCK_GPU_PATH", forced)
    store = _store(verify)
    with caplog.at_level(logging.WARNING, logger="kvblock"):
        assert gpu_path(store) == want
    assert gpu_path(store) == want                    # cached on the store
    ignored = forced == "kvikio" and verify == "always"
    assert ("KVBLOCK_GPU_PATH=kvikio ignored" in caplog.text) == ignored


def _store_opening(reader_class):
    """A stand-in store whose _kvikio_reader opens one ``reader_class`` (once)."""
    store = SimpleNamespace(verify="never", _kvikio=None)

    def reader():
        if store._kvikio is None:
            store._kvikio = reader_class()
        return store._kvikio
    store._kvikio_reader = reader
    return store


def test_verify_always_reads_on_the_host_without_an_override(monkeypatch):
    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)
    assert gpu_path(_store("always")) == "host"


def test_a_bad_override_is_refused(monkeypatch):
    monkeypatch.setenv("KVBLOCK_GPU_PATH", "bogus")
    with pytest.raises(ConfigError, match="KVBLOCK_GPU_PATH must be one of"):
        gpu_path(_store("never"))


def test_a_kvikio_reader_that_cannot_open_a_device_closes_those_it_opened(monkeypatch):
    """KvikioReader opens one kvikio.CuFile per store device; when one
    could not be opened (a device kvikio cannot read), the files opened
    before it stayed open (their descriptors leaked: gpu_path then falls
    back to the host path and the reader is never closed)."""
    import sys
    import types

    from kvblock.io.gpu import KvikioReader

    opened, closed = [], []

    class CuFile:
        def __init__(self, path, flags):
            if path == "/dev/bad":
                raise RuntimeError("cuFileHandleRegister failed")
            self.path = path
            opened.append(path)

        def close(self):
            closed.append(self.path)

    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(CuFile=CuFile))
    with pytest.raises(RuntimeError, match="cuFileHandleRegister"):
        KvikioReader(["/dev/a", "/dev/b", "/dev/bad", "/dev/c"])
    assert opened == ["/dev/a", "/dev/b"]
    assert sorted(closed) == ["/dev/a", "/dev/b"]


def test_a_kvikio_read_that_fails_while_timing_the_paths_chooses_the_host(monkeypatch, caplog):
    """kvikio opened the devices but its first read failed (GDS refusing
    the file, a driver error): gpu_path raised it, chose nothing, and every
    load into CUDA memory raised it again instead of reading on the host."""
    import kvblock.io.gpu as gpu

    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)
    calls = []

    def failing(store, reader, nbytes):
        calls.append(nbytes)
        raise RuntimeError("cuFile pread failed: 5030")
    monkeypatch.setattr(gpu, "_time_paths", failing)
    store = SimpleNamespace(verify="never", _kvikio_reader=lambda: object())
    with caplog.at_level(logging.WARNING, logger="kvblock"):
        assert gpu_path(store) == "host"
    assert "cuFile pread failed" in store._gpu_path_reason and "host path" in caplog.text
    assert gpu_path(store) == "host" and len(calls) == 1          # chosen once, cached


@pytest.mark.parametrize("timing", ["fails", "host faster"])
def test_a_kvikio_reader_the_choice_does_not_use_is_closed(monkeypatch, timing):
    """gpu_path opened the store's kvikio reader (one CuFile per device)
    to time it; when the host path won (kvikio's read failed, or it was
    slower) no load ever uses that reader, yet it stayed open, holding its
    files (and GDS registrations) until the store closed."""
    import kvblock.io.gpu as gpu

    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)

    class Reader:
        mode = "gds"
        closes = 0

        def close(self):
            Reader.closes += 1

    def timed(store, reader, nbytes):
        if timing == "fails":
            raise RuntimeError("cuFile pread failed: 5030")
        return 2.0, 1.0, nbytes          # kvikio took twice as long

    monkeypatch.setattr(gpu, "_time_paths", timed)
    store = _store_opening(Reader)
    assert gpu_path(store) == "host"
    assert Reader.closes == 1 and store._kvikio is None


def test_two_first_loads_at_once_never_close_the_reader_the_other_chose(monkeypatch):
    """Two loads into CUDA memory begin at once on a fresh store: both time
    the paths with the store's one kvikio reader.  The first chose kvikio
    and its load reads through that reader; the second measured the host
    faster, and closing the "unused" reader closed it under the first
    load's reads (and flipped the choice)."""
    import threading

    import kvblock.io.gpu as gpu

    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)

    class Reader:
        mode = "gds"
        closed = False

        def close(self):
            self.closed = True

    first_done, first_timing, second_timing = (threading.Event() for _ in range(3))

    def timed(store, reader, nbytes):
        if threading.current_thread().name == "second":
            second_timing.set()
            first_done.wait(5)
            return 2.0, 1.0, nbytes          # noise: the host this time
        first_timing.set()
        second_timing.wait(1)                # (both timing at once, unless one waits)
        return 1.0, 2.0, nbytes              # kvikio faster

    monkeypatch.setattr(gpu, "_time_paths", timed)
    store = _store_opening(Reader)
    chosen = {}

    def first():
        chosen["first"] = gpu_path(store)
        chosen["reader"] = store._kvikio_reader()     # what its load reads through
        first_done.set()

    def second():
        chosen["second"] = gpu_path(store)
    threads = [threading.Thread(target=first, name="first"),
               threading.Thread(target=second, name="second")]
    threads[0].start()
    assert first_timing.wait(5)
    threads[1].start()
    for t in threads:
        t.join(10)
    assert chosen["first"] == "kvikio"
    assert not chosen["reader"].closed, "the reader a kvikio load uses was closed under it"
    assert gpu_path(store) == chosen["second"] == "kvikio"     # one choice per store


class _RecordingReader:
    """Stands in for KvikioReader on a CPU machine: reads with pread into the
    (CPU) tensor it is handed, and records (offset, bytes, clock ticks so
    far) per read."""

    mode = "gds"

    def __init__(self, path, ticks):
        import os

        self.fd = os.open(path, os.O_RDONLY)
        self.ticks = ticks
        self.reads = []

    def read(self, dev, offset, dst, nbytes):
        import os

        self.reads.append((offset, nbytes, len(self.ticks)))
        got = os.preadv(self.fd, [dst[:nbytes].numpy()], offset)
        return SimpleNamespace(get=lambda: got)

    def close(self):
        import os

        os.close(self.fd)


def _timing_on_cpu(monkeypatch, tmp_path, region_size):
    """Run the real gpu_path timing (_time_paths) on the CPU: CPU tensors
    for CUDA ones, a pread stand-in for kvikio, a clock that advances
    1/1024 s per look.  Returns (store, reader, ticks, host reads)."""
    torch = pytest.importorskip("torch")
    import kvblock.io.gpu as gpu
    from kvblock import Geometry, KVStore, create_file

    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ticks = []

    def clock():
        ticks.append(None)
        return len(ticks) / 1024
    monkeypatch.setattr(gpu, "time", SimpleNamespace(perf_counter=clock))
    path = tmp_path / "kv.img"
    create_file(path, 64 << 20)
    store = KVStore.format([str(path)], Geometry(2, 2, 64, "bfloat16", 16),
                           region_size=region_size, verify="never", force=True)
    reader = _RecordingReader(str(path), ticks)
    monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
    host_reads = []
    real_read = store.io.read

    def host_read(batch):
        host_reads.append((int(batch.offsets.min()), int(batch.lens.sum()), len(ticks)))
        return real_read(batch)
    monkeypatch.setattr(store.io, "read", host_read)
    return store, reader, ticks, host_reads


def test_the_measured_bandwidths_are_of_the_bytes_timed(monkeypatch, tmp_path):
    """gpu_path reports what it measured (stats()["gpu_path_reason"]) in
    GiB/s: it divided the 64 MiB it asks for by the time, but it reads at
    most one region (a store under 1 GiB has regions under 64 MiB): a
    16 MiB region's bandwidths were reported 4 times too high."""
    store, reader, ticks, _ = _timing_on_cpu(monkeypatch, tmp_path, 4 << 20)
    try:
        assert gpu_path(store) == "kvikio"              # (a tie: kvikio)
        timed = [n for _, n, at in reader.reads if at == 1]    # between ticks 1 and 2
        assert len(timed) == 1 and timed[0] <= store.regions.size
        gib_s = timed[0] * 1024 / 2**30
        assert f"kvikio (gds) {gib_s:.2f} GiB/s" in store._gpu_path_reason, \
            store._gpu_path_reason
        assert f"io_uring+copy {gib_s:.2f} GiB/s" in store._gpu_path_reason
    finally:
        reader.close()
        store.close()


def test_the_timed_reads_are_of_bytes_no_warm_up_read_and_both_paths_are_warmed(monkeypatch,
                                                                                 tmp_path):
    """gpu_path warmed kvikio up with a read of the very bytes it then
    timed: kvikio's POSIX compat path reads through the page cache, so the
    timed read came from memory (not the device), against an io_uring read
    with O_DIRECT that was not warmed up at all (its first read into a
    fresh buffer): a choice biased to kvikio, whose loads then read cold
    data.  Each timed read must be of bytes no earlier read of its path
    touched, and the host path warmed as kvikio is."""
    store, reader, ticks, host_reads = _timing_on_cpu(monkeypatch, tmp_path, 4 << 20)
    try:
        gpu_path(store)
        assert len(ticks) == 4          # t0, kvikio's time, t0, the host's time

        def check(reads, window, what):
            timed = [(o, o + n) for o, n, at in reads if at == window]
            before = [(o, o + n) for o, n, at in reads if at < window]
            assert len(timed) == 1 and timed[0][1] > timed[0][0], (what, reads)
            lo, hi = timed[0]
            assert before, f"{what}: not warmed up before its timed read"
            assert all(b <= lo or hi <= a for a, b in before), \
                f"{what}: timed [{lo}, {hi}) after a warm-up read of {before}"
            return hi - lo
        assert check(reader.reads, 1, "kvikio") == check(host_reads, 3, "host")
        assert reader.reads[-1][0] >= store.regions.address(0)[1]
        assert reader.reads[-1][0] + reader.reads[-1][1] <= \
            store.regions.address(0)[1] + store.regions.size          # region 0 only
    finally:
        reader.close()
        store.close()


def test_the_paths_are_timed_on_the_caches_device(monkeypatch, tmp_path):
    """A load into a cache on cuda:1 (a rank's GPU, while the current
    device is still cuda:0) had gpu_path time kvikio and the host copy
    into a staging tensor on the current device: the bandwidths of another
    GPU (its PCIe link, its NUMA node), and memory taken there.  The
    timing runs with the cache's device current.  On the CPU: a stand-in
    for torch.cuda.device records which device the staging tensor is
    made under."""
    torch = pytest.importorskip("torch")
    from kvblock.tensors import transfer

    store, reader, _ticks, _ = _timing_on_cpu(monkeypatch, tmp_path, 4 << 20)
    current, made_on = [None], []
    staging_empty = torch.empty            # (_timing_on_cpu's: drops device=)

    def empty(*a, **k):
        made_on.append(current[0])
        return staging_empty(*a, **k)
    monkeypatch.setattr(torch, "empty", empty)

    class device:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            self.prev, current[0] = current[0], str(self.d)

        def __exit__(self, *exc):
            current[0] = self.prev
    monkeypatch.setattr(torch.cuda, "device", device)

    class CudaTensor:                      # the cache's sample, on cuda:1
        is_cuda = True
        device = "cuda:1"
    CudaTensor.__module__ = "torch.stand_in"
    layout = SimpleNamespace(sample=lambda: CudaTensor())
    try:
        assert transfer._job_class(store, layout) is transfer._KvikioLoadJob
        assert made_on == ["cuda:1"], made_on
    finally:
        reader.close()
        store.close()


@pytest.mark.parametrize("api", ["is_compat_mode_preferred", "compat_mode"])
def test_the_kvikio_mode_is_read_from_its_defaults_submodule(tmp_path, monkeypatch, api):
    """kvikio 26.10's `import kvikio` leaves kvikio.defaults unloaded: the
    reader's mode read kvikio.defaults as an attribute (AttributeError), so
    the first load into CUDA memory of a store that times the two paths
    (verify='never', no override) failed (seen on an H200).  Stood in by a
    package laid out as kvikio's: its defaults a submodule the package does
    not import, with the newer or the older function."""
    import sys

    from kvblock.io.gpu import KvikioReader

    pkg = tmp_path / "kvikio"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class CuFile:\n"
                                     "    def __init__(self, path, flags): pass\n"
                                     "    def close(self): pass\n")
    (pkg / "defaults.py").write_text(f"def {api}():\n    return True\n")
    for name in ("kvikio", "kvikio.defaults"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    reader = KvikioReader(["/dev/a"])
    assert reader.mode == "posix-compat"
    reader.close()
