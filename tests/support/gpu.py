"""Helpers of the GPU tests (tests/gpu): raw words to compare, and which
path a load's reads took."""

from __future__ import annotations

import pytest


def bits(t):
    """``t``'s raw 16-bit words on the host (bf16 NaNs compare unequal)."""
    import torch

    return t.cpu().view(torch.int16)


def use_path(monkeypatch, path_kind: str) -> None:
    """Force the GPU path ``path_kind`` (KVBLOCK_GPU_PATH); kvikio's needs kvikio."""
    if path_kind == "kvikio":
        pytest.importorskip("kvikio")
    monkeypatch.setenv("KVBLOCK_GPU_PATH", path_kind)


def count_reads(store, monkeypatch) -> dict:
    """Count the reads a load makes from now on through kvikio (and the
    devices they read) and through the store's engine (host staging):
    {"kvikio": n, "host": n, "kvikio_devs": {device index, ...}}."""
    from kvblock.io.gpu import KvikioReader

    taken = {"kvikio": 0, "host": 0, "kvikio_devs": set()}
    kvikio_read, host_read = KvikioReader.read, store.io.read

    def via_kvikio(self, dev, *args, **kwargs):
        taken["kvikio"] += 1
        taken["kvikio_devs"].add(dev)
        return kvikio_read(self, dev, *args, **kwargs)

    def via_host(batch):
        taken["host"] += 1
        return host_read(batch)
    monkeypatch.setattr(KvikioReader, "read", via_kvikio)
    monkeypatch.setattr(store.io, "read", via_host)
    return taken


def took(taken: dict, path_kind: str) -> None:
    """The reads counted went through ``path_kind`` only (a load that
    silently read on the host, GDS bypassed, fails here)."""
    other = "host" if path_kind == "kvikio" else "kvikio"
    assert taken[path_kind] > 0 and taken[other] == 0, taken


class LoadedRuntime:
    """The libcudart a process loaded, stood in (kvblock.memory.cudapin's
    _loaded_cudart): only its last error, which cudaGetLastError clears."""

    last_error = 0

    def cudaGetLastError(self):
        err, self.last_error = self.last_error, 0
        return err


def mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process now."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if lo <= address < hi:
                return True
    return False
