"""Opening and closing a store: what a failed open or format leaves behind,
Devices the caller opened, read-only opens, reopen right after close."""

from __future__ import annotations

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


def test_devices_given_as_an_iterable_or_with_a_bad_entry(tmp_path):
    """open() and format() of devices given as an iterator or generator
    (a Sequence is only the type hint) found none: check_distinct used
    them up, and the open raised IndexError ("list index out of range"),
    format a TypeError from len().  An entry that is no path (None from an
    unset setting, a number) was a bare TypeError from os.fspath.  Any
    iterable of paths or Devices is taken now; anything else is a
    ConfigError naming it."""
    path = tmp_path / "a.img"
    create_file(path, 8 * MIB)
    with KVStore.format(iter([str(path)]), GEOM, region_size=REGION) as store:
        keys = run_keys(1, 2)
        assert store.put_run(keys, run_data(keys)) == 2
    with KVStore.open(p for p in [str(path)]) as store:
        assert store.lookup(keys) == 2
    with KVStore.open(iter([path]), readonly=True) as store:
        assert store.lookup(keys) == 2
    from kvblock.errors import ConfigError

    for bad in ([str(path), None], [None], [3]):
        with pytest.raises(ConfigError, match="a device is a path or a Device"):
            KVStore.open(bad)
        with pytest.raises(ConfigError, match="a device is a path or a Device"):
            KVStore.format(bad, GEOM, region_size=REGION, force=True)
    with pytest.raises(ConfigError, match="list of devices"):
        KVStore.open(5)
    with pytest.raises(ConfigError, match="needs"):
        KVStore.open(iter([]))
    with KVStore.open([str(path)]) as store:     # untouched
        assert store.lookup(keys) == 2


def test_a_device_passed_that_cannot_serve_the_open_is_refused(tmp_path):
    """A Device the caller opened is taken as it is.  One opened without
    exclusive access (exclusive=False, as a rank of a served store opens
    its devices) let a second writer open the store beside the one that
    holds it: both journaled and checkpointed into one store.  One opened
    read-only failed a writable open only at its checkpoint, after the
    recovery, as "EBADF (Bad file descriptor)", and a closed one (a store
    closes the Devices it was given) failed likewise.  Each is a
    ConfigError naming the device and what to pass, before anything is
    read or written; a read-only open takes them all but a closed one."""
    from kvblock.errors import ConfigError

    path = tmp_path / "a.img"
    create_file(path, 8 * MIB)
    keys = run_keys(1, 2)
    with KVStore.format([str(path)], GEOM, region_size=REGION) as writer:
        writer.put_run(keys, run_data(keys))
        dev = Device(str(path), exclusive=False)
        with pytest.raises(ConfigError, match=r"a\.img.*exclusive"):
            KVStore.open([dev])
        with pytest.raises(ConfigError, match=r"a\.img.*exclusive"):
            KVStore.format([dev], GEOM, region_size=REGION, force=True)
        assert not dev.closed
        with KVStore.open([dev], readonly=True) as ro:     # a reader beside the writer
            assert ro.lookup(keys) == 2
    snapshot = path.read_bytes()
    dev = Device(str(path), writable=False)
    with pytest.raises(ConfigError, match=r"a\.img.*read-only.*readonly=True"):
        KVStore.open([dev])
    with pytest.raises(ConfigError, match=r"a\.img.*read-only"):
        KVStore.format([dev], GEOM, region_size=REGION, force=True)
    dev.close()
    for readonly in (False, True):
        with pytest.raises(ConfigError, match=r"a\.img.*closed"):
            KVStore.open([dev], readonly=readonly)
    assert path.read_bytes() == snapshot
    with KVStore.open([str(path)]) as store:
        assert store.lookup(keys) == 2


def test_a_host_cache_open_refuses_leaves_the_store_unwritten(tmp_path):
    """README: a bad option value is a ConfigError before anything is
    written.  host_cache_bytes holding fewer than two of the store's blocks
    (open() knows the block size only from the superblock), or more memory
    than the machine maps, was refused only after the recovery had written
    the open's new checkpoint (a new journal epoch): a refused open
    rewrote the store's metadata."""
    from kvblock.errors import ConfigError

    path = tmp_path / "a.img"
    create_file(path, 8 * MIB)
    keys = run_keys(1, 2)
    store = KVStore.format([str(path)], GEOM, region_size=REGION)
    store.put_run(keys, run_data(keys))
    snapshot = path.read_bytes()        # a journal past the checkpoint, as a crash leaves
    store.close()
    path.write_bytes(snapshot)
    for size, match in ((GEOM.block_bytes, "fewer than two"), (1 << 60, "host_cache_bytes")):
        with pytest.raises(ConfigError, match=match):
            KVStore.open([str(path)], host_cache_bytes=size)
        assert path.read_bytes() == snapshot
    with KVStore.open([str(path)]) as store:
        assert store.lookup(keys) == 2


def test_a_host_cache_format_refuses_leaves_the_old_store_whole(tmp_path):
    """README: an unknown option or a bad value is a ConfigError before
    anything is written (format(force=True) with a typo leaves the old store
    whole).  A host_cache_bytes more than the machine maps was refused only
    by the open format ends with, after the old store had been wiped and the
    new one written: its runs were gone."""
    from kvblock.errors import ConfigError

    path = tmp_path / "a.img"
    create_file(path, 8 * MIB)
    keys = run_keys(1, 2)
    with KVStore.format([str(path)], GEOM, region_size=REGION) as store:
        store.put_run(keys, run_data(keys))
    snapshot = path.read_bytes()
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        KVStore.format([str(path)], GEOM, region_size=REGION, force=True,
                       host_cache_bytes=1 << 60)
    assert path.read_bytes() == snapshot
    with KVStore.open([str(path)]) as store:
        assert store.lookup(keys) == 2
