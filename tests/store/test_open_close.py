"""Opening and closing a store: what a failed open or format leaves behind,
Devices the caller opened, read-only opens, reopen right after close."""

from __future__ import annotations

import os

import pytest

from kvblock import KVStore, create_file
from kvblock.devices import Device
from kvblock.errors import DeviceNotFoundError, NotAStoreError
from tests.store.workload import GEOM, REGION, run_data, run_keys

MIB = 1 << 20


def test_a_failed_open_leaves_the_callers_devices_open(tmp_path, monkeypatch):
    """A Device the caller opened and passed in stays the caller's when the
    open fails: it was closed (a device after it missing, the device not a
    store), so the caller's next use of it -- formatting the blank device
    an open-or-format falls back to, or its own close -- met a closed
    descriptor.  format() already left the caller's Devices open."""
    a, blank = tmp_path / "a.img", tmp_path / "blank.img"
    create_file(a, 8 * MIB)
    create_file(blank, 8 * MIB)
    KVStore.format([str(a)], GEOM, region_size=REGION).close()

    dev = Device(str(a))
    with pytest.raises(DeviceNotFoundError):
        KVStore.open([dev, str(tmp_path / "missing.img")])
    assert not dev.closed
    dev.close()

    dev = Device(str(blank))
    with pytest.raises(NotAStoreError):
        KVStore.open([dev])
    assert not dev.closed
    keys = run_keys(1, 2)
    with KVStore.format([dev], GEOM, region_size=REGION) as store:   # the open-or-format
        assert store.put_run(keys, run_data(keys)) == 2
    with KVStore.open([str(blank)]) as store:
        assert store.lookup(keys) == 2

    # format's own open failing (after the devices were formatted)
    dev = Device(str(blank))

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(KVStore, "_recover", interrupted)
    with pytest.raises(KeyboardInterrupt):
        KVStore.format([dev], GEOM, region_size=REGION, force=True)
    assert not dev.closed
    dev.close()
