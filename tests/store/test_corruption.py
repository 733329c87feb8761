"""Random byte flips in the superblocks, checkpoints, journal and data: reopening
gives a typed error or a smaller-but-correct cache, never wrong bytes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import KVBlockError
from kvblock.index.keys import normalize_key
from tests.store.workload import GEOM, REGION, Journal, check_store, run_data, run_keys, workload

TRIALS = 25


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A store with checkpointed runs and journal records after the checkpoint."""
    path = tmp_path_factory.mktemp("corrupt") / "base.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    log = Journal()
    store = KVStore.open([str(path)])
    workload(store, log, runs=12)
    sb = store.sb
    data_runs = [store.regions.address(r.region, r.offset)[1] for r in store.index.runs.values()]
    store._release_devices()  # leave journal records unreplayed
    areas = {
        "superblock": (0, 8192),
        "checkpoint": (sb.checkpoint_offset, sb.checkpoint_offset + 2 * sb.checkpoint_bytes),
        "journal": (sb.journal_offset, sb.journal_offset + (64 << 10)),
        "data": (min(data_runs), max(data_runs) + (64 << 10)),
    }
    return path, log, areas


@pytest.mark.parametrize("area", ["superblock", "checkpoint", "journal", "data"])
def test_random_flips(image, tmp_path, area):
    base, log, areas = image
    lo, hi = areas[area]
    rng = np.random.default_rng(area.encode()[0])
    outcomes = {"error": 0, "opened": 0}
    for trial in range(TRIALS):
        path = tmp_path / "trial.img"
        shutil.copy(base, path)
        with open(path, "r+b") as f:
            for pos in rng.integers(lo, hi, rng.integers(1, 9)):
                f.seek(int(pos))
                byte = f.read(1)
                f.seek(int(pos))
                f.write(bytes([byte[0] ^ int(rng.integers(1, 256))]))
        try:
            store = KVStore.open([str(path)])
        except KVBlockError:
            outcomes["error"] += 1
            continue
        with store:
            # a corrupt cache may be smaller (or forget a delete), never wrong
            check_store(store, log, evicting=True, live=True, corrupted=True)
        outcomes["opened"] += 1
    assert sum(outcomes.values()) == TRIALS
    if area in ("data", "journal"):
        assert outcomes["opened"] > 0, outcomes  # damage there shrinks the cache, no more


def _history(path, journal_after: bool):
    """Run X checkpointed (generation k), then reclaimed and its place
    rewritten by other runs, then checkpoint k+1 (and, ``journal_after``,
    one more run journaled in its epoch), then a crash: no clean close, so
    no later checkpoint.  Returns (X's keys, the other runs' keys, the
    newest slot, the superblock)."""
    from tests.store.workload import run_data, run_keys

    x = run_keys(900, 4)
    others = []
    store = KVStore.format([str(path)], GEOM, region_size=REGION)
    store.put_run(x, run_data(x))
    run = store.index.locate(normalize_key(x[0]))[0]
    where = store.regions.address(run.region, run.offset)
    store.checkpoint()
    store.evict(all=True)
    while not any(store.regions.address(r.region, r.offset) == where
                  for r in store.index.runs.values()):
        keys = run_keys(1000 + len(others), 1)
        store.put_run(keys, run_data(keys))
        others.append(keys)
    store.checkpoint()
    if journal_after:
        z = run_keys(2000, 1)
        store.put_run(z, run_data(z))
    slot, sb = store._cp_slot, store.sb
    store._release_devices()
    store.closed = True
    return x, others, slot, sb


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["header", "payload"])
def test_an_unreadable_newest_checkpoint_never_brings_back_reclaimed_runs(tmp_path, where):
    """The newest checkpoint slot goes bad after its journal began: the
    older slot still reads, but its index predates regions reclaimed and
    rewritten since.  Open must not serve those runs (with verify="never"
    they would come back as another run's bytes): it starts empty and fsck
    says why."""
    from kvblock.store.fsck import fsck
    from tests.store.workload import run_data, run_keys

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    x, others, slot, sb = _history(path, journal_after=True)
    _flip(path, sb.checkpoint_offset + slot * sb.checkpoint_bytes
          + (8 if where == "header" else 4096 + 100))
    with KVStore.open([str(path)], readonly=True) as store:
        report = fsck(store)
        assert report.status == "problems" and "cannot be trusted" in report.problems[0]
        assert report.as_dict()["dropped_at_open"] == 1 and report.dropped_runs == 0
    with KVStore.open([str(path)], verify="never") as store:
        assert store.stats()["stale_checkpoint_runs_dropped"] == 1      # X, long gone
        assert store.lookup(x) == 0 and store.stats()["runs"] == 0
        # the writable open (fsck --repair's) wrote a trusted checkpoint
        assert fsck(store, repair=True).status == "repaired"
        assert store.get_run(x, np.zeros(4 * GEOM.block_bytes, np.uint8)) == 0
        fresh = run_keys(3000, 2)
        assert store.put_run(fresh, run_data(fresh)) == 2
    with KVStore.open([str(path)], verify="never") as store:     # and from there on, clean
        got = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(fresh, got) == 2 and np.array_equal(got, run_data(fresh))
        assert store.lookup(x) == 0 and store.stats()["stale_checkpoint_runs_dropped"] == 0


def test_a_newest_checkpoint_torn_before_its_journal_began_loses_nothing(tmp_path):
    """The same damage before the newest checkpoint's journal got a record
    (a checkpoint torn by a crash): the older slot and its journal are
    whole, so open replays them and keeps every run."""
    from tests.store.workload import run_data

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    x, others, slot, sb = _history(path, journal_after=False)
    _flip(path, sb.checkpoint_offset + slot * sb.checkpoint_bytes + 4096 + 100)
    with KVStore.open([str(path)], verify="never") as store:
        assert store.stats()["stale_checkpoint_runs_dropped"] == 0
        assert store.lookup(x) == 0
        got = np.zeros(GEOM.block_bytes, np.uint8)
        for keys in others:
            if store.lookup(keys):
                assert store.get_run(keys, got) == 1 and np.array_equal(got, run_data(keys))
        assert sum(store.lookup(k) for k in others) == store.stats()["runs"] > 0


def test_an_unreadable_newest_checkpoint_and_journal_start_drop_the_older_runs(tmp_path):
    """The newest checkpoint slot and the journal's first block both
    unreadable (EIO): whether the journal had moved on from the older
    checkpoint cannot be told, so its runs (reclaimed and rewritten since)
    are not trusted: the store opens empty rather than serving them."""
    from kvblock.store.fsck import fsck
    from tests.support.faults import BadSectors

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    x, others, slot, sb = _history(path, journal_after=True)
    bad = BadSectors()
    bad.add(0, sb.checkpoint_offset + slot * sb.checkpoint_bytes, 4096)
    bad.add(0, sb.journal_offset, 4096)
    with KVStore.open([str(path)], verify="never", storeio_factory=bad.factory()) as store:
        assert store.lookup(x) == 0 and store.stats()["runs"] == 0
        assert store.get_run(x, np.zeros(4 * GEOM.block_bytes, np.uint8)) == 0
        report = fsck(store)
        assert any("cannot be trusted" in p for p in report.problems), report.problems
    with KVStore.open([str(path)], verify="never") as store:
        assert store.lookup(x) == 0 and fsck(store).status == "clean"



def test_a_second_unreadable_newest_checkpoint_after_a_stale_open_still_drops_the_older_runs(
        tmp_path):
    """The stale-checkpoint open (newest slot and journal start unreadable)
    writes its checkpoint generations past the older slot's (as far as it
    assumes the journal went).  If that slot is unreadable again at a later
    open, before another checkpoint, the journal's first record is of that
    newer epoch: the older slot is still stale (it names X, whose place
    holds other bytes) and must not be trusted."""
    from tests.support.faults import BadSectors

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    x, others, slot, sb = _history(path, journal_after=True)
    bad = BadSectors()
    bad.add(0, sb.checkpoint_offset + slot * sb.checkpoint_bytes, 4096)
    bad.add(0, sb.journal_offset, 4096)
    store = KVStore.open([str(path)], verify="never", storeio_factory=bad.factory())
    assert store.stale_checkpoint and store.lookup(x) == 0
    checkpoints = store.stats()["checkpoints"]
    i = 0
    while store._jhead < sb.journal_bytes * 3 // 8:   # over the older epoch's records
        z = run_keys(5000 + i, 1)
        store.put_run(z, run_data(z))    # records of the new epoch
        i += 1
    assert store.stats()["checkpoints"] == checkpoints
    store._release_devices()             # a crash: no further checkpoint
    store.closed = True
    again = BadSectors()                 # the journal block remapped; the slot bad again
    again.add(0, sb.checkpoint_offset + slot * sb.checkpoint_bytes, 4096)
    with KVStore.open([str(path)], verify="never", readonly=True,
                      storeio_factory=again.factory()) as store:
        out = np.zeros(4 * GEOM.block_bytes, np.uint8)
        got = store.get_run(x, out)
        assert got == 0 or np.array_equal(out, run_data(x))
        assert store.lookup(x) == 0, "the older checkpoint's reclaimed run X is served"



def test_an_unreadable_journal_start_and_a_damaged_older_slot_keep_the_newest_checkpoint(
        tmp_path):
    """The journal's first block unreadable (EIO) and the OLDER checkpoint
    slot damaged (its header whole, naming an older generation: a torn
    write or rot), the newest slot whole: no checkpoint newer than the one
    loaded was ever written (a journal of a newer epoch begins only after
    its checkpoint is durable in the damaged slot, whose header would name
    it), so the journal cannot have moved on.  The writable open dropped
    every run of the newest checkpoint as stale (and said the newest
    checkpoint was unreadable), while a read-only open kept them."""
    from tests.support.faults import BadSectors

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    store = KVStore.format([str(path)], GEOM, region_size=REGION)
    a, b = run_keys(10, 2), run_keys(11, 2)
    store.put_run(a, run_data(a))
    store.checkpoint()                   # the older slot
    store.put_run(b, run_data(b))
    store.checkpoint()                   # the newest slot: a and b
    newest, sb = store._cp_slot, store.sb
    store._release_devices()             # a crash
    store.closed = True
    _flip(path, sb.checkpoint_offset + (1 - newest) * sb.checkpoint_bytes + 4096 + 100)
    bad = BadSectors()
    bad.add(0, sb.journal_offset, 4096)
    for readonly in (True, False):
        with KVStore.open([str(path)], readonly=readonly,
                          storeio_factory=bad.factory()) as store:
            assert not store.stale_checkpoint, readonly
            assert store.lookup(a) == 2 and store.lookup(b) == 2, readonly
            got = np.zeros(2 * GEOM.block_bytes, np.uint8)
            assert store.get_run(b, got) == 2 and np.array_equal(got, run_data(b))


@pytest.mark.parametrize("field, value", [("region", 1000), ("offset", 1 << 30)])
def test_a_checkpoint_run_outside_its_region_is_a_typed_error(tmp_path, field, value):
    """A checkpoint (its checksums whole: written so by a bug) naming a run
    in a region the store does not have failed the open with a bare
    IndexError; one past its region's end opened and sent reads outside
    the region.  Both are a NotAStoreError naming the device and slot."""
    from kvblock.errors import NotAStoreError
    from kvblock.format import checkpoint as cpfmt
    from tests.store.workload import run_data, run_keys

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
        sb, off = store.sb, None
    with KVStore.open([str(path)], readonly=True) as store:
        off = sb.checkpoint_offset + store._cp_slot * sb.checkpoint_bytes
    with open(path, "r+b") as f:
        f.seek(off)
        raw = f.read(sb.checkpoint_bytes)
        cp = cpfmt.decode_payload(cpfmt.decode_header(raw), raw[cpfmt.HEADER_BYTES:])
        cp.runs[field][0] = value
        f.seek(off)
        f.write(cp.encode())
    with pytest.raises(NotAStoreError, match=f"{path}.*offset {off}.*outside"):
        KVStore.open([str(path)], readonly=True)


def _open_with_one_run(tmp_path):
    """(path, the store open on it, keys, run): a 4 MiB store file holding one
    run of two blocks."""
    from tests.store.workload import run_data, run_keys

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    keys = run_keys(1, 2)
    store.put_run(keys, run_data(keys))
    return path, store, keys, next(iter(store.index.runs.values()))


def test_a_replayed_run_past_its_region_is_not_published(tmp_path):
    """A journal PUT (checksums whole: written so by a bug) placing a run
    past its region's end was published by replay: reads of it went
    outside the region (into the next one's runs, or past the device).
    It is not replayed, as a record naming a region the store lacks is not."""
    from kvblock.format import journal as jfmt

    path, store, keys, run = _open_with_one_run(tmp_path)
    rec = jfmt.PutRun(run.run_id + 1, run.region, run.generation, REGION - GEOM.block_bytes,
                      run.keys, tuple(int(c) for c in run.checksums))
    data = jfmt.encode_commit([rec], store._seq, jfmt.epoch(store.sb.store_uuid,
                                                            store._generation))
    store.io.write_bytes(0, store.sb.journal_offset + store._jhead, data)
    store._release_devices()
    store.closed = True
    with KVStore.open([str(path)], readonly=True) as store:
        assert store.stats()["runs"] == 1 and store.lookup(keys) == 2
        assert all(r.offset + store.layout(r.nblocks).run_bytes <= REGION
                   for r in store.index.runs.values())


def test_a_region_reclaimed_in_a_journal_gap_does_not_serve_its_old_runs(tmp_path):
    """A damaged RECLAIM record with intact records after it (a journal gap):
    replay stopped there and kept the checkpoint's run of the reclaimed
    region, though an intact later PUT shows the region was written again
    (a newer generation).  With verify="never" the old run's keys read the
    new run's bytes.  The region's old runs must not be served."""
    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    old, new = run_keys(70, 2), run_keys(71, 2)
    store.put_run(old, run_data(old))
    region = store.index.segments([normalize_key(old[0])])[0][0].region
    store.checkpoint()                       # the old run is in the checkpoint
    reclaim_at = store.sb.journal_offset + store._jhead
    assert store.evict(all=True) >= 1
    store.regions.free.remove(region)        # the next put reuses the region
    store.regions.free.appendleft(region)
    store.put_run(new, run_data(new))
    assert store.index.segments([normalize_key(new[0])])[0][0].region == region
    store._release_devices()                 # a crash: no checkpoint after these
    store.closed = True
    with open(path, "r+b") as f:             # the RECLAIM record's payload rots
        f.seek(reclaim_at + 40)
        byte = f.read(1)
        f.seek(reclaim_at + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVStore.open([str(path)], verify="never", readonly=True) as store:
        assert store.journal_gap is not None
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(old, out)
        assert got == 0 or np.array_equal(out, run_data(old))
        assert store.lookup(old) == 0


@pytest.mark.parametrize("field, at, fmt, value", [
    ("alignment", 52, "<I", 0),                 # was a ZeroDivisionError
    ("journal_bytes", 96, "<Q", 1 << 40),       # was an OSError: 1 TiB allocated for it
    ("journal_offset", 88, "<Q", 0),            # opened; its first commit wrote over copy A
    ("data_offset", 80, "<Q", 3 << 20),         # opened; regions ran past the device's end
    ("region_count", 72, "<I", 1000),           # "no valid checkpoint": the wrong culprit
])
def test_a_superblock_with_an_impossible_layout_is_a_typed_error(tmp_path, field, at, fmt,
                                                                  value):
    """A superblock whose checksum is whole (written so by a bug, or crafted)
    but whose layout cannot be (areas overlapping each other or the
    superblocks, running past the device, alignment 0) was trusted: the open
    failed with an untyped error, or went on to read, write and allocate by
    it.  It is a NotAStoreError naming the device and the field, and a
    writable open writes nothing."""
    import struct

    import xxhash

    from kvblock.errors import NotAStoreError

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    with open(path, "r+b") as f:
        for off in (0, 4096):
            f.seek(off)
            buf = bytearray(f.read(4096))
            struct.pack_into(fmt, buf, at, value)
            struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
            f.seek(off)
            f.write(buf)
    before = path.read_bytes()
    for readonly in (True, False):
        with pytest.raises(NotAStoreError, match=f"{path}: superblock .*{field}") as ei:
            with KVStore.open([str(path)], readonly=readonly) as store:
                store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
        assert ei.value.path == str(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("field, changes", [
    ("region_size", [(64, "<Q", 512 << 10), (72, "<I", 6)]),   # a layout valid on its own
    ("alignment", [(52, "<I", 8192)]),
    ("geometry", [(128, "<I", 4)]),                            # num_layers
    ("fingerprint", [(152, "32s", b"\1" * 32)]),
    ("device_count", [(50, "<H", 3)]),
])
def test_devices_whose_superblocks_disagree_on_the_store_are_a_typed_error(tmp_path, field,
                                                                         changes):
    """The store's geometry, region size, alignment and device count are
    taken from device 0's superblock; another device whose (checksummed)
    superblock says otherwise (a bug, or a crafted image) was opened and
    read and written by device 0's values.  It is a NotAStoreError naming
    that device and the field, and a writable open writes nothing."""
    import struct

    import xxhash

    from kvblock.errors import NotAStoreError

    paths = [tmp_path / "d0.img", tmp_path / "d1.img"]
    for p in paths:
        create_file(p, 4 << 20)
    KVStore.format([str(p) for p in paths], GEOM, region_size=REGION).close()
    with open(paths[1], "r+b") as f:
        for off in (0, 4096):
            f.seek(off)
            buf = bytearray(f.read(4096))
            for at, fmt, value in changes:
                struct.pack_into(fmt, buf, at, value)
            struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
            f.seek(off)
            f.write(buf)
    before = [p.read_bytes() for p in paths]
    for readonly in (True, False):
        for order in (paths, paths[::-1]):
            with pytest.raises(NotAStoreError, match=f"{paths[1]}: superblock .*{field}") as ei:
                with KVStore.open([str(p) for p in order], readonly=readonly) as store:
                    store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
            assert ei.value.path == str(paths[1])
    assert [p.read_bytes() for p in paths] == before


@pytest.mark.parametrize("what", ["past its region's end", "checksums", "region", "run id"])
def test_a_foreign_journal_put_is_reported_by_fsck(tmp_path, what):
    """A journal PUT (checksums whole: written so by a bug, or crafted) that
    this store cannot have written -- its run past its region's end, the
    wrong number of checksums, a region the store lacks -- is not replayed;
    it was skipped silently and fsck called the store clean.  fsck names
    it; a writable open starts a new journal, and the store is clean."""
    from kvblock.format import journal as jfmt
    from kvblock.index.index import MAX_RUN_ID
    from kvblock.store.fsck import fsck

    path, store, keys, run = _open_with_one_run(tmp_path)
    sums = tuple(int(c) for c in run.checksums)
    region, offset, run_id = run.region, run.offset, run.run_id + 1
    if what == "past its region's end":
        offset = REGION - GEOM.block_bytes
    elif what == "checksums":
        sums = sums[:-1]
    elif what == "run id":
        # past what the index packs (run_id << 24 | position in an int64):
        # replayed, its keys' positions wrapped, and every later put's id
        # with them
        run_id = MAX_RUN_ID + 1
    else:
        region = store.regions.count
    rec = jfmt.PutRun(run_id, region, run.generation, offset, run.keys, sums)
    data = jfmt.encode_commit([rec], store._seq, jfmt.epoch(store.sb.store_uuid,
                                                            store._generation))
    store.io.write_bytes(0, store.sb.journal_offset + store._jhead, data)
    store._release_devices()
    store.closed = True
    with KVStore.open([str(path)], readonly=True) as store:
        assert store.stats()["runs"] == 1 and store.lookup(keys) == 2
        report = fsck(store)
        assert report.status == "problems" and len(report.problems) == 1, report.problems
        assert report.problems[0].startswith(f"{path}: the journal holds 1 PUT record")
        assert f"run {run_id}" in report.problems[0] and what in report.problems[0]
    with KVStore.open([str(path)]) as store:
        report = fsck(store, repair=True)
        assert report.status == "repaired"
        assert report.repaired == [f"{path}: started a new journal"]
        more = run_keys(2, 2)
        assert store.put_run(more, run_data(more)) == 2 and store.lookup(more) == 2
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean" and store.lookup(keys) == 2
        assert store.lookup(more) == 2


def test_a_journal_reclaim_of_a_region_the_store_lacks_is_reported_by_fsck(tmp_path, caplog):
    """A journal RECLAIM record (checksum whole: written so by a bug, or
    crafted) naming a region the store lacks was skipped silently by
    replay, and fsck called the store clean.  It is still not replayed (no
    run is touched), but replay logs it and fsck names it; a writable open
    starts a new journal, and the store is clean."""
    import logging

    from kvblock.format import journal as jfmt
    from kvblock.store.fsck import fsck

    path, store, keys, run = _open_with_one_run(tmp_path)
    region = store.regions.count + 3
    data = jfmt.encode_commit([jfmt.Reclaim(region, 7)], store._seq,
                              jfmt.epoch(store.sb.store_uuid, store._generation))
    store.io.write_bytes(0, store.sb.journal_offset + store._jhead, data)
    store._release_devices()
    store.closed = True
    with caplog.at_level(logging.WARNING, logger="kvblock.store.recovery"):
        with KVStore.open([str(path)], readonly=True) as store:
            assert store.stats()["runs"] == 1 and store.lookup(keys) == 2
            report = fsck(store)
    assert report.status == "problems" and len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"{path}: the journal holds 1 RECLAIM record")
    assert f"region {region}" in report.problems[0]
    assert any(f"region {region}" in r.getMessage() and "RECLAIM" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    with KVStore.open([str(path)]) as store:
        report = fsck(store, repair=True)
        assert report.status == "repaired"
        assert report.repaired == [f"{path}: started a new journal"]
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean" and store.lookup(keys) == 2


def test_a_region_recovery_freed_is_not_written_before_the_opens_checkpoint(tmp_path,
                                                                           monkeypatch):
    """Recovery frees a region its replay emptied (a DROP of its last run)
    at the region's old generation, while the checkpoint on the device
    still places that run there at that generation: written again under
    that checkpoint's epoch (the open's own checkpoint skipped), a journal
    damaged or cut where the DROP lay would bring the old run back over the
    new bytes.  Only the open's checkpoint makes the reuse safe, so an
    allocation before it is refused with a typed error naming the region
    (were a change to skip the checkpoint); after it the put goes through."""
    from kvblock.errors import InternalError
    from kvblock.store.store import KVStore as Store

    path, store, keys, run = _open_with_one_run(tmp_path)
    store.checkpoint()                        # the run is in the checkpoint
    store.delete([keys[0]])                   # ... and its DROP in the journal
    store._release_devices()                  # a crash: no checkpoint after it
    store.closed = True
    monkeypatch.setattr(Store, "_write_checkpoint", lambda self: None)
    store = KVStore.open([str(path)])
    monkeypatch.undo()                        # only the open's checkpoint was skipped
    try:
        assert store.lookup(keys) == 0
        assert run.region in store.regions.free
        assert int(store.regions.generation[run.region]) == run.generation
        more = run_keys(2, 2)
        with pytest.raises(InternalError, match=f"region {run.region} .*checkpoint"):
            store.put_run(more, run_data(more))
        store.checkpoint()
        assert store.put_run(more, run_data(more)) == 2 and store.lookup(more) == 2
    finally:
        store.close()


def test_a_damaged_last_reclaim_record_does_not_serve_the_regions_old_runs(tmp_path):
    """A RECLAIM record that rots when it is the journal's last (the region
    was trimmed, or written again by puts a crash kept from committing):
    replay stopped there and, with no intact record after it, saw no gap,
    so the region's old run stayed indexed and verify="never" served the
    region's new bytes under its keys.  A record of this epoch and the
    expected number lying in one journal block cannot be torn by a crash:
    it is damage, and what it removed is unknown, so no run is trusted."""
    from kvblock.store.fsck import fsck

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    old = run_keys(70, 2)
    store.put_run(old, run_data(old))
    run = store.index.segments([normalize_key(old[0])])[0][0]
    dev, run_at = store.regions.address(run.region, run.offset)
    store.checkpoint()                       # the old run is in the checkpoint
    reclaim_at = store.sb.journal_offset + store._jhead
    assert store.evict(all=True) >= 1
    store._release_devices()                 # a crash: no checkpoint after the RECLAIM
    store.closed = True
    with open(path, "r+b") as f:
        f.seek(run_at)                       # the region written again, never published
        f.write(bytes(range(256)) * 64)
        f.seek(reclaim_at + 40)              # the RECLAIM record's payload rots
        byte = f.read(1)
        f.seek(reclaim_at + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVStore.open([str(path)], verify="never", readonly=True) as store:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(old, out)
        assert got == 0 or np.array_equal(out, run_data(old))
        assert store.lookup(old) == 0
        report = fsck(store)
        assert any(f"{path}: the journal record at offset {reclaim_at}" in p
                   for p in report.problems), report.problems
    with KVStore.open([str(path)]) as store:
        assert fsck(store).repaired == [f"{path}: started a new journal"]
    with KVStore.open([str(path)], readonly=True) as store:   # the damage is of a dead epoch
        assert store.lookup(old) == 0 and fsck(store).status == "clean"


def test_a_run_id_a_damaged_put_record_published_is_never_given_again(tmp_path):
    """A PUT record damaged after it was acknowledged: its run id may have
    reached readers (a client that later asks the server to drop that id
    after an EIO), yet recovery, which cannot read the id, gave the next
    put the same one.  Ids start past every id the store may have
    published, as after a stale checkpoint."""
    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    store.put_run(run_keys(70, 2), run_data(run_keys(70, 2)))
    store.checkpoint()
    put_at = store.sb.journal_offset + store._jhead
    b = run_keys(80, 2)
    store.put_run(b, run_data(b))                # its PUT record: the last, rotted below
    published = store.index.segments([normalize_key(b[0])])[0][0].run_id
    store._release_devices()                     # a crash: no checkpoint after it
    store.closed = True
    with open(path, "r+b") as f:
        f.seek(put_at + 40)
        byte = f.read(1)
        f.seek(put_at + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVStore.open([str(path)]) as store:
        assert store.journal_damaged is not None and store.lookup(b) == 0
        c = run_keys(90, 2)
        store.put_run(c, run_data(c))
        assert store.index.segments([normalize_key(c[0])])[0][0].run_id > published


@pytest.mark.parametrize("after", [False, True], ids=["last", "gap"])
def test_a_store_whose_first_journal_record_rotted_is_not_reported_clean(tmp_path, after):
    """The first record after the checkpoint damaged (the last one, or with
    intact records after it: a gap): replay applies no record, yet the store
    was written after its checkpoint and its open dropped every run (what
    the damaged record removed is unknown).  `kvblock info` said "clean", as
    for a store closed cleanly, because the state looked only at the records
    replayed."""
    from kvblock.cli.admin import _info

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    a, b = run_keys(70, 2), run_keys(80, 2)
    store.put_run(a, run_data(a))
    store.put_run(b, run_data(b))
    store.checkpoint()
    drop_at = store.sb.journal_offset + store._jhead
    assert store.delete(a) == 2                  # the first record of this epoch
    if after:
        assert store.delete(b) == 2              # an intact record after it
    store._release_devices()                     # a crash: no checkpoint after them
    store.closed = True
    with open(path, "r+b") as f:                 # the DROP record's payload rots
        f.seek(drop_at + 40)
        byte = f.read(1)
        f.seek(drop_at + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVStore.open([str(path)], readonly=True) as store:
        assert store.counters["replayed_records"] == 0
        assert (store.journal_gap is not None) == after
        assert store.journal_damaged is not None
        assert not store.clean_at_open
        assert _info(store)["state"] == "dirty (0 journal records replayed)"
        # fsck's JSON counts the runs the open dropped: dropped_runs is what
        # --repair drops, 0 here, which a script read as nothing lost
        from kvblock.store.fsck import fsck
        report = fsck(store).as_dict()
        assert report["dropped_at_open"] == store.journal_damaged["runs_dropped"] >= 1
        assert report["dropped_runs"] == 0 and report["status"] == "problems"


def test_a_record_torn_inside_a_sector_of_a_mapped_store_file_is_a_tear(shm_target):
    """A store file on tmpfs is written through a shared mapping: a process
    killed inside the copy of a journal record tears it at any byte, also
    inside one 512-byte sector (a device writes a sector whole; a memcpy
    does not).  That record was never acknowledged: the journal ends there,
    as after any crash, and no run is dropped (read as damage, every run
    was: the cache lost to a kill -9)."""
    path = shm_target(8 << 20)
    KVStore.format([path], GEOM, region_size=REGION).close()
    store = KVStore.open([path])
    assert store.io.engine.mapped_for_writes(0)
    old = run_keys(71, 2)
    store.put_run(old, run_data(old))
    store.checkpoint()
    torn_at = store.sb.journal_offset + store._jhead
    assert store.evict(all=True) >= 1             # its RECLAIM record: torn below
    store._release_devices()                      # the process dies inside that write
    store.closed = True
    with open(path, "r+b") as f:
        f.seek(torn_at + 40)
        f.write(bytes(24))                        # the copy stopped part way
    with KVStore.open([path], verify="never") as store:
        assert store.journal_damaged is None
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(old, out) == 2 and np.array_equal(out, run_data(old))


def _two_stores(tmp_path):
    """A store with one run, and another store of the same layout for
    another model (its superblock copies are valid on this device too)."""
    path, other = tmp_path / "store.img", tmp_path / "other.img"
    for p in (path, other):
        create_file(p, 4 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
    KVStore.format([str(other)], GEOM, region_size=REGION, model="another").close()
    return path, other


@pytest.mark.parametrize("copy", [0, 4096])
def test_another_stores_superblock_over_one_copy_is_refused(tmp_path, copy):
    """Every copy a store writes has sequence 1 and the first valid one was
    taken: another store's superblock written over copy A (dd of its first
    MiB) opened the device as that store (its uuid, its model);
    over copy B the device opened as its own, though nothing tells which
    copy is right.  Two valid copies that disagree are refused, whichever
    is foreign, with a SuperblockConflictError naming the device, both
    offsets and the fix; nothing is written."""
    from kvblock.errors import NotAStoreError, SuperblockConflictError

    path, other = _two_stores(tmp_path)
    with open(path, "r+b") as f:
        f.seek(copy)
        f.write(other.read_bytes()[copy:copy + 4096])
    before = path.read_bytes()
    for readonly in (True, False):
        with pytest.raises(SuperblockConflictError) as ei:
            KVStore.open([str(path)], readonly=readonly).close()
        e = ei.value
        assert isinstance(e, NotAStoreError) and e.path == str(path)
        assert e.offsets == (0, 4096)
        msg = str(e)
        assert msg.startswith(f"{path}: the superblock copies at offsets 0 and 4096 ")
        assert "another store" in msg and "kvblock format --force" in msg
    assert path.read_bytes() == before


def test_superblock_copies_differing_at_the_same_sequence_are_refused(tmp_path):
    """The same store's copies with one field changed (checksums whole) and
    the same sequence: which is right cannot be told either."""
    import struct

    import xxhash

    from kvblock.errors import SuperblockConflictError

    path, _ = _two_stores(tmp_path)
    with open(path, "r+b") as f:
        buf = bytearray(f.read(4096))
        struct.pack_into("<Q", buf, 64, 2 * REGION)                    # region_size
        struct.pack_into("<I", buf, 72, 1)                             # region_count
        struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
        f.seek(4096)
        f.write(buf)
    with pytest.raises(SuperblockConflictError, match="region_size") as ei:
        KVStore.open([str(path)], readonly=True).close()
    assert ei.value.path == str(path)


@pytest.mark.parametrize("copy", [0, 4096])
def test_one_damaged_superblock_copy_still_opens(tmp_path, copy):
    """A copy failing its checksum is not a disagreement: the other is used."""
    path, _ = _two_stores(tmp_path)
    with open(path, "r+b") as f:
        f.seek(copy + 300)
        f.write(b"\xee" * 8)
    for readonly in (True, False):
        with KVStore.open([str(path)], readonly=readonly) as store:
            assert store.sb.region_size == REGION
            out = np.empty(2 * GEOM.block_bytes, np.uint8)
            assert store.get_run(run_keys(1, 2), out) == 2
            assert np.array_equal(out, run_data(run_keys(1, 2)))


def test_a_damaged_reclaim_record_with_intact_records_after_it_drops_every_run(tmp_path):
    """A RECLAIM record damaged in its sector (media damage: a crash cannot
    tear a record lying in one sector) with intact records after it that
    never name its region: replay stopped there and replayed only the
    removals the later records show, so the reclaimed region's old run
    stayed indexed while the region held other bytes, and verify="never"
    served them under its keys.  As when the damaged record is the last
    one, what it removed is unknown: no run is trusted, and the open and
    fsck say so."""
    from kvblock.store.fsck import fsck

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    old, other, later = run_keys(70, 2), run_keys(71, 2), run_keys(72, 2)
    store.put_run(old, run_data(old))
    run = store.index.segments([normalize_key(old[0])])[0][0]
    with store._lock:                        # the next runs go to another region
        store.regions.seal(run.region)
        store.regions.open = None
    store.put_run(other, run_data(other))
    assert store.index.segments([normalize_key(other[0])])[0][0].region != run.region
    dev, run_at = store.regions.address(run.region, run.offset)
    store.checkpoint()                       # both runs are in the checkpoint
    reclaim_at = store.sb.journal_offset + store._jhead
    with store._lock:                        # a RECLAIM of the old run's region only
        store._begin_reclaim(run.region)
    store._finish_reclaim(run.region)
    store.put_run(later, run_data(later))    # an unrelated record after it
    assert store.index.segments([normalize_key(later[0])])[0][0].region != run.region
    store._release_devices()                 # a crash: no checkpoint after these
    store.closed = True
    with open(path, "r+b") as f:
        f.seek(run_at)                       # the region written again, never published
        f.write(bytes(range(256)) * 64)
        f.seek(reclaim_at + 40)              # the RECLAIM record's payload rots
        byte = f.read(1)
        f.seek(reclaim_at + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVStore.open([str(path)], verify="never", readonly=True) as store:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(old, out)
        assert got == 0 or np.array_equal(out, run_data(old))
        assert store.lookup(old) == 0 and store.stats()["runs"] == 0
        assert store.journal_gap is not None and not store.clean_at_open
        assert store.journal_damaged == {"offset": reclaim_at, "seq": store._seq,
                                         "runs_dropped": 2}
        report = fsck(store)
        assert any(f"{path}: the journal record at offset {reclaim_at}" in p
                   and "2 runs" in p for p in report.problems), report.problems
    with KVStore.open([str(path)]) as store:
        assert f"{path}: started a new journal" in fsck(store).repaired
    with KVStore.open([str(path)], readonly=True) as store:   # the damage is of a dead epoch
        assert store.lookup(old) == 0 and fsck(store).status == "clean"


def test_an_unreadable_reclaim_record_with_intact_records_after_it_drops_every_run(tmp_path):
    """A bad sector (EIO) under a RECLAIM record with intact records after
    it: the records there were acknowledged (a crash leaves no record after
    an unwritten one of an earlier commit) and are lost to media damage, as
    a damaged record is.  Replay read the unreadable block as a tear and
    kept the reclaimed region's old run, serving the region's new bytes
    under its keys with verify="never".  No run is trusted."""
    from kvblock.store.fsck import fsck
    from tests.support.faults import BadSectors

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    old, other, later = run_keys(70, 2), run_keys(71, 2), run_keys(72, 2)
    store.put_run(old, run_data(old))
    run = store.index.segments([normalize_key(old[0])])[0][0]
    with store._lock:                        # the next runs go to another region
        store.regions.seal(run.region)
        store.regions.open = None
    store.put_run(other, run_data(other))
    dev, run_at = store.regions.address(run.region, run.offset)
    store.checkpoint()
    reclaim_at = store.sb.journal_offset + store._jhead
    with store._lock:                        # a RECLAIM of the old run's region only
        store._begin_reclaim(run.region)
    store._finish_reclaim(run.region)
    store.put_run(later, run_data(later))    # an unrelated record after it
    assert store.index.segments([normalize_key(later[0])])[0][0].region != run.region
    store._release_devices()                 # a crash: no checkpoint after these
    store.closed = True
    with open(path, "r+b") as f:             # the region written again, never published
        f.seek(run_at)
        f.write(bytes(range(256)) * 64)
    bad = BadSectors()
    bad.add(0, reclaim_at, 4096)
    with KVStore.open([str(path)], verify="never", readonly=True,
                      storeio_factory=bad.factory()) as store:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(old, out)
        assert got == 0 or np.array_equal(out, run_data(old))
        assert store.lookup(old) == 0 and store.stats()["runs"] == 0
        assert store.journal_gap is not None
        assert store.journal_damaged == {"offset": reclaim_at, "seq": store._seq,
                                         "runs_dropped": 2}
        assert any(f"{path}: the journal record at offset {reclaim_at}" in p
                   for p in fsck(store).problems)


@pytest.mark.parametrize("what", ["drops", "puts"])
def test_an_unreadable_block_inside_the_last_commit_is_damage_not_the_logs_end(tmp_path,
                                                                               what):
    """A bad sector (EIO) under the second journal block of the last commit
    (no intact record after it): replay stopped at the record that crosses
    into it and read the unreadable block as the log's end, a tear.  But
    the block before it shows this epoch's commit went on into it -- the
    record's header (``puts``: of this epoch and the expected number), or
    bytes after the last intact record in its sector, where a commit
    writes zero padding when it ends (``drops``: a header cut by the block
    boundary) -- and a crash leaves sectors old or new, not unreadable:
    the block held acknowledged records, lost to damage.  ``drops``: a
    delete() of 100 runs (one commit of DROP records) came back in part
    after the crash, the 15 runs whose DROPs lay in the bad block served
    again.  As for a damaged record, what was lost is unknown: no run is
    trusted, and the open and fsck say so."""
    from kvblock.store.fsck import fsck
    from tests.support.faults import BadSectors

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    if what == "drops":          # a run of every 6 stays: no region is emptied (reclaimed)
        runs = [run_keys(100 + i, 1) for i in range(120)]
        store.put_runs([(keys, run_data(keys)) for keys in runs])
        runs = [keys for i, keys in enumerate(runs) if i % 6]
    else:
        runs = [run_keys(100 + i, 2) for i in range(40)]
    store.checkpoint()
    commit_at = store.sb.journal_offset + store._jhead
    if what == "drops":          # one commit of 100 DROP records: 4800 bytes
        assert store.delete([keys[0] for keys in runs]) == len(runs)
    else:                        # one commit of 40 PUT records of 144 bytes
        store.put_runs([(keys, run_data(keys)) for keys in runs])
    assert store._jhead == 2 * 4096  # the commit is the last and takes two blocks
    store._release_devices()     # a crash: no checkpoint after the commit
    store.closed = True
    bad = BadSectors()
    bad.add(0, commit_at + 4096, 4096)
    with KVStore.open([str(path)], readonly=True, storeio_factory=bad.factory()) as store:
        assert store.journal_gap is None
        if what == "drops":
            assert sum(store.lookup(keys) for keys in runs) == 0
        assert store.stats()["runs"] == 0
        assert store.journal_damaged is not None and not store.clean_at_open
        assert store.journal_damaged["offset"] < commit_at + 4096
        assert any(f"{path}: the journal record at offset {store.journal_damaged['offset']}"
                   in p for p in fsck(store).problems)


def _newest_epoch_over_a_rewritten_region(tmp_path):
    """A store crashed in the epoch of its newest checkpoint, which followed
    the reclaim of run X's region; X's place written again since (a put
    never published); the newest checkpoint slot damaged.  The older
    checkpoint still lists X.  Returns (path, X's keys, the superblock)."""
    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    store = KVStore.format([str(path)], GEOM, region_size=REGION)
    x = run_keys(900, 2)
    store.put_run(x, run_data(x))
    run = store.index.locate(normalize_key(x[0]))[0]
    dev, run_at = store.regions.address(run.region, run.offset)
    store.checkpoint()                       # generation k: X
    store.evict(all=True)                    # epoch k: X's region reclaimed
    store.checkpoint()                       # generation k+1: no X; its epoch begins
    z = run_keys(2000, 1)
    store.put_run(z, run_data(z))            # the first record of epoch k+1
    slot, sb = store._cp_slot, store.sb
    store._release_devices()                 # a crash
    store.closed = True
    with open(path, "r+b") as f:             # X's place written again
        f.seek(run_at)
        f.write(bytes(range(256)) * 64)
    _flip(path, sb.checkpoint_offset + slot * sb.checkpoint_bytes + 8)   # newest slot
    return path, x, sb


def test_a_rotted_first_record_of_the_newest_checkpoints_epoch_is_not_the_older_ones(tmp_path):
    """The newest checkpoint slot damaged, and the first journal record of
    its epoch rotted (header whole, payload not): the older checkpoint
    predates a region reclaimed and written again since, yet open saw no
    newer epoch (it trusted only a record whose checksum holds) and served
    the older checkpoint's run in that region: with verify="never", the
    region's new bytes under its keys.  The record's header still names
    the newer epoch (a 64-bit hash of store and generation no rot
    forges): the journal moved on, and the older runs are dropped, as
    when that record is unreadable."""
    path, x, sb = _newest_epoch_over_a_rewritten_region(tmp_path)
    _flip(path, sb.journal_offset + 60)      # the first record's payload
    with KVStore.open([str(path)], verify="never", readonly=True) as store:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(x, out)
        assert got == 0 or np.array_equal(out, run_data(x))
        assert store.lookup(x) == 0 and store.stats()["runs"] == 0
        assert store.stale_checkpoint


def test_a_broken_ring_reading_the_newest_checkpoint_drops_no_run(tmp_path, monkeypatch):
    """The io_uring itself broke under the open's read of the newest
    checkpoint slot (its I/O cancelled, the device answered nothing: the
    IOFailedError has a path but device_fault False).  Recovery took it for
    an unreadable slot, fell back to the older one, found the journal of the
    newer epoch and dropped every run as a stale checkpoint (and a writable
    open wrote that loss into both slots), though the slot was whole and
    the next read, on a new ring, returns it.  The open must fail with the
    error (retryable) or keep every run; never drop them."""
    import errno

    from kvblock.errors import IOFailedError
    from kvblock.io.engine import RingBroken
    from kvblock.io.threads import ThreadEngine
    from kvblock.io.uring import UringEngine

    path = tmp_path / "store.img"
    create_file(path, 4 << 20)
    x, others, slot, sb = _history(path, journal_after=True)
    target = sb.checkpoint_offset + slot * sb.checkpoint_bytes
    broke = []

    def breaking(real):
        def run(self, op, batch, qd, results, latency, hasher):
            if not broke and int(batch.offsets[0]) == target:
                broke.append(True)
                results[:] = -errno.ECANCELED
                raise RingBroken(errno.ENOMEM)
            return real(self, op, batch, qd, results, latency, hasher)
        return run
    for cls in (UringEngine, ThreadEngine):
        monkeypatch.setattr(cls, "_run", breaking(cls._run))
    try:
        with KVStore.open([str(path)], verify="never") as store:
            assert broke
            assert not store.stale_checkpoint
            assert store.stats()["runs"] == len(others) + 1 - sum(
                store.lookup(k) == 0 for k in others)
            z = run_keys(2000, 1)
            assert store.lookup(z) == 1
    except IOFailedError as e:
        assert broke and not e.device_fault
    monkeypatch.undo()
    with KVStore.open([str(path)], verify="never") as store:   # a new ring: all there
        assert not store.stale_checkpoint
        assert store.lookup(run_keys(2000, 1)) == 1 and store.lookup(x) == 0


@pytest.mark.parametrize("at", [0, 24], ids=["magic", "seq"])
def test_a_last_reclaim_record_whose_header_rots_does_not_serve_the_regions_old_runs(
        tmp_path, at):
    """As above, but the RECLAIM record's header rots (its magic or its
    number), not its payload: the commit's record starts a journal block,
    so a sector, and a sector starting without the record was taken for
    one a crash never wrote (a tear), though the header still names this
    epoch.  The region's old run stayed indexed and verify="never" served
    the region's new bytes under its keys; fsck said clean."""
    from kvblock.store.fsck import fsck

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    old = run_keys(70, 2)
    store.put_run(old, run_data(old))
    run = store.index.segments([normalize_key(old[0])])[0][0]
    dev, run_at = store.regions.address(run.region, run.offset)
    store.checkpoint()
    reclaim_at = store.sb.journal_offset + store._jhead
    assert store.evict(all=True) >= 1
    store._release_devices()                 # a crash: no checkpoint after the RECLAIM
    store.closed = True
    with open(path, "r+b") as f:
        f.seek(run_at)                       # the region written again, never published
        f.write(bytes(range(256)) * 64)
    _flip(path, reclaim_at + at)
    with KVStore.open([str(path)], verify="never", readonly=True) as store:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(old, out)
        assert got == 0 or np.array_equal(out, run_data(old)), "wrong bytes served"
        assert store.lookup(old) == 0
        report = fsck(store)
        assert any(f"{path}: the journal record at offset {reclaim_at}" in p
                   for p in report.problems), report.problems


@pytest.mark.parametrize("at", [0, 12], ids=["magic", "reserved"])
def test_a_first_record_of_the_newest_epoch_whose_header_rots_is_not_the_older_ones(tmp_path,
                                                                                    at):
    """As above, but the first record's header rots outside its epoch (its
    magic, or a word always written 0): the header was no longer read, so
    open saw no newer epoch and served the older checkpoint's run in a
    region reclaimed and written again since (verify="never": the new
    bytes under its keys).  The epoch field alone says which checkpoint
    the journal follows."""
    path, x, sb = _newest_epoch_over_a_rewritten_region(tmp_path)
    _flip(path, sb.journal_offset + at)      # the first record's header
    with KVStore.open([str(path)], verify="never", readonly=True) as store:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        got = store.get_run(x, out)
        assert got == 0 or np.array_equal(out, run_data(x)), "wrong bytes served"
        assert store.lookup(x) == 0 and store.stats()["runs"] == 0
        assert store.stale_checkpoint


@pytest.mark.parametrize("after", [False, True], ids=["last", "gap"])
def test_a_put_record_whose_length_rots_to_another_put_length_is_damage(tmp_path, after):
    """A PUT record's length rotting to another length a PUT can have (64 KiB
    more: past its sector) was taken for a crash tear: the committed run
    was lost and, as the last record, fsck said the store was clean; with
    intact records after it, fsck blamed a gap on a crash.  The record was
    written whole (its payload's counts give its length): it is damage,
    handled as any damaged record is, and fsck names it."""
    from kvblock.store.fsck import fsck

    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    store = KVStore.open([str(path)])
    a, b, c = run_keys(70, 2), run_keys(80, 2), run_keys(90, 2)
    store.put_run(a, run_data(a))
    store.checkpoint()
    put_at = store.sb.journal_offset + store._jhead
    store.put_run(b, run_data(b))                # its PUT record: rotted below
    if after:
        store.put_run(c, run_data(c))            # an intact record after it
    store._release_devices()                     # a crash: no checkpoint after them
    store.closed = True
    _flip(path, put_at + 9)                      # its length: 64 KiB more
    with KVStore.open([str(path)], readonly=True) as store:
        assert store.journal_damaged is not None, "taken for a tear"
        assert store.journal_damaged["offset"] == put_at
        assert (store.journal_gap is not None) == after and not store.clean_at_open
        report = fsck(store)
        assert any(f"{path}: the journal record at offset {put_at}" in p
                   for p in report.problems), report.problems


def test_a_journal_put_past_a_gap_with_a_run_id_past_max_run_id_is_not_taken(tmp_path):
    """A journal PUT with a run id past MAX_RUN_ID (what the index packs,
    run_id << 24 | position in an int64) is foreign: not replayed, its id
    not taken.  Past a gap (a lost commit before it) its id was still taken
    (_removals_past_gap takes every PUT's id there), so every later put got
    an id the index cannot hold."""
    from kvblock.format import journal as jfmt
    from kvblock.index.index import MAX_RUN_ID
    from tests.store.workload import run_data, run_keys

    path, store, keys, run = _open_with_one_run(tmp_path)
    rec = jfmt.PutRun(MAX_RUN_ID + 1, run.region, run.generation, run.offset, run.keys,
                      tuple(int(c) for c in run.checksums))
    # the commit numbered _seq lost (zeros), the next one intact: a gap
    data = jfmt.encode_commit([rec], store._seq + 1, jfmt.epoch(store.sb.store_uuid,
                                                                store._generation))
    store.io.write_bytes(0, store.sb.journal_offset + store._jhead + jfmt.BLOCK, data)
    store._release_devices()
    store.closed = True
    with KVStore.open([str(path)]) as store:
        assert store.journal_gap is not None
        assert store._next_run_id <= MAX_RUN_ID
        more = run_keys(2, 2)
        assert store.put_run(more, run_data(more)) == 2
        assert store.lookup(more) == 2
