"""GPU data path: reads straight into CUDA memory with KvikIO (cuFile GDS where
the platform supports it, KvikIO's POSIX compat path otherwise).

KvikIO needs libcuda.so even for host buffers, so it is imported only here,
lazily, and only when a CUDA tensor is the destination.  ``gpu_path(store)``
decides once per store between "kvikio" (read into device memory) and "host"
(io_uring into host memory, then a host-to-device copy per unit read) by timing
both on the store's own data, unless KVBLOCK_GPU_PATH says which.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvblock.errors import ConfigError, EngineUnavailableError

logger = logging.getLogger("kvblock")

GPU_PATHS = ("kvikio", "host")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class KvikioReader:
    """One kvikio.CuFile per store device, read-only."""

    def __init__(self, paths):
        try:
            import kvikio
        except ImportError as e:
            raise EngineUnavailableError(f"kvikio is not installed ({e}); pip install "
                                         "kvikio-cu12 (or cu13), or use KVBLOCK_GPU_PATH=host")
        self.kvikio = kvikio
        self.files = []
        try:
            for p in paths:
                self.files.append(kvikio.CuFile(p, "r"))
        except BaseException:
            # a device kvikio cannot open: the caller never gets this reader
            # to close, so the files opened before it are closed here
            self.close()
            raise

    @property
    def mode(self) -> str:
        # a submodule that `import kvikio` leaves unloaded (kvikio 26.10):
        # self.kvikio.defaults raised AttributeError, failing the first load
        # into CUDA memory of every store that times the two paths
        import kvikio.defaults as defaults

        try:
            compat = defaults.is_compat_mode_preferred()
        except AttributeError:  # older kvikio
            compat = bool(defaults.compat_mode())
        return "posix-compat" if compat else "gds"

    def read(self, dev: int, offset: int, dst, nbytes: int):
        """Start reading ``nbytes`` at ``offset`` of device ``dev`` into the CUDA
        buffer ``dst`` (anything with __cuda_array_interface__); returns a future."""
        return self.files[dev].pread(dst, nbytes, offset)

    def close(self):
        """Close every file (once), even past one whose close raises."""
        files, self.files = self.files, []
        error = None
        for f in files:
            try:
                f.close()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error


def gpu_path(store, sample_bytes: int = 64 << 20, device=None) -> str:
    """"kvikio" or "host" for loads into CUDA memory from this store (cached
    while the store's verify stays as it was when chosen: a store server's
    client following the server's default takes a restarted server's).
    ``device``: the CUDA device the loads go to (the cache's), where both
    paths are timed; None times them on the current device."""
    chosen = _cached(store)
    if chosen:
        return chosen
    verify = store.verify
    chosen = _choose(store, sample_bytes, device)
    store._gpu_path_verify = verify     # (read before: a change meanwhile chooses again)
    return chosen


def _choose(store, sample_bytes: int, device=None) -> str:
    """gpu_path's choice, made now (and cached on the store)."""
    forced = os.environ.get("KVBLOCK_GPU_PATH", "").strip().lower()
    if forced:
        if forced not in GPU_PATHS:
            raise ConfigError(f"KVBLOCK_GPU_PATH must be one of {GPU_PATHS}, got {forced!r}")
        if forced == "kvikio" and store.verify == "always":
            # kvikio reads land in GPU memory, past the host checksums: the
            # store's promise (verify every read) wins over the override
            logger.warning("kvblock: KVBLOCK_GPU_PATH=kvikio ignored for a store opened with "
                           "verify='always' (checksums are computed on the host); open it "
                           "with verify='never' to read through kvikio")
            store._gpu_path = "host"
            store._gpu_path_reason = "KVBLOCK_GPU_PATH=kvikio, but verify=always checks on the host"
            return "host"
        store._gpu_path, store._gpu_path_reason = forced, "KVBLOCK_GPU_PATH"
        return forced
    if store.verify == "always":
        # Checksums are computed on the host: reading into host memory first is
        # the only way to verify before the bytes reach the model.
        store._gpu_path, store._gpu_path_reason = "host", "verify=always checks on the host"
        return "host"
    # Measured once per store: two first loads at once would both time the
    # one reader, and the one that found the host faster would close it
    # (_drop_reader) under the other's kvikio load (and flip the choice).
    with _CHOOSING:
        chosen = _cached(store)
        return chosen if chosen else _measure(store, sample_bytes, device)


def _cached(store) -> str | None:
    """The store's cached choice, or None when there is none or the store's
    verify has changed since it was made (a RemoteStore(verify=None)
    reconnected to a server with another --verify): kvikio reads land in
    GPU memory past the host checksums, so a kvikio choice must not outlive
    verify="always", nor a host choice made only for verify="always"
    outlive it."""
    chosen = getattr(store, "_gpu_path", None)
    if not chosen:
        return None
    made_for = getattr(store, "_gpu_path_verify", None)
    if made_for is not None and made_for != store.verify:
        store._gpu_path = None
        return None
    return chosen


_CHOOSING = threading.Lock()


def _measure(store, sample_bytes: int, device=None) -> str:
    """gpu_path's choice by timing both paths (under _CHOOSING), on
    ``device`` (the loads' GPU: its link and memory, not the current one's)."""
    try:
        reader = store._kvikio_reader()
    except Exception as e:  # no kvikio / no driver: host path
        store._gpu_path, store._gpu_path_reason = "host", f"kvikio unavailable: {e}"
        return "host"
    try:
        if device is None:
            kv_s, host_s, timed = _time_paths(store, reader, sample_bytes)
        else:
            import torch

            with torch.cuda.device(device):
                kv_s, host_s, timed = _time_paths(store, reader, sample_bytes)
    except Exception as e:   # kvikio opened the devices but cannot read them (GDS refusing
        # the file, a driver error): every load would raise it; the host path reads them
        logger.warning("kvblock: a kvikio read of the store failed (%s); loads into CUDA "
                       "memory take the host path", e)
        store._gpu_path, store._gpu_path_reason = "host", f"a kvikio read failed: {e}"
        _drop_reader(store, reader)
        return "host"
    store._gpu_path = "kvikio" if kv_s <= host_s else "host"
    # (of the bytes timed: at most half a region, fewer than sample_bytes
    # on a store of regions under 128 MiB)
    store._gpu_path_reason = (f"measured: kvikio ({reader.mode}) {timed / kv_s / 2**30:.2f}"
                              f" GiB/s, io_uring+copy {timed / host_s / 2**30:.2f} GiB/s")
    if store._gpu_path == "host":
        _drop_reader(store, reader)
    return store._gpu_path


def _drop_reader(store, reader) -> None:
    """Close the kvikio reader gpu_path opened to time it, once the host
    path is chosen: no load uses it, and open it holds a file (and GDS
    registration) per device until the store closes."""
    if getattr(store, "_kvikio", None) is reader:
        store._kvikio = None
    try:
        reader.close()
    except Exception as e:      # the choice stands; the handles are gone either way
        logger.warning("kvblock: closing the unused kvikio reader failed: %s", e)


def _time_paths(store, reader, nbytes):
    """(kvikio's seconds, the host path's seconds, the bytes each read in
    that time): up to ``nbytes`` of the store's first region.  Each path is
    warmed up on as many bytes just before those it times: kvikio's
    POSIX compat path reads through the page cache, so a timed read of the
    bytes its warm-up had just read came from memory (and the host path,
    not warmed at all, paid its first read into a fresh buffer)."""
    import torch

    from kvblock.io import IOBatch
    from kvblock.memory import HostBuffer

    dev, off = store.regions.address(0)
    nbytes = min(nbytes, store.regions.size // 2) // 4096 * 4096
    warm, timed = off, off + nbytes
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    reader.read(dev, warm, dst, nbytes).get()          # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    reader.read(dev, timed, dst, nbytes).get()
    torch.cuda.synchronize()
    kv_s = time.perf_counter() - t
    with HostBuffer(nbytes) as host:
        pinned = torch.from_numpy(host.array)
        store.io.read(IOBatch.contiguous(host.address, dev, warm, nbytes, 8 << 20))  # warm-up
        dst.copy_(pinned)
        torch.cuda.synchronize()
        t = time.perf_counter()
        store.io.read(IOBatch.contiguous(host.address, dev, timed, nbytes, 8 << 20))
        dst.copy_(pinned)
        torch.cuda.synchronize()
        host_s = time.perf_counter() - t
    return kv_s, host_s, nbytes
