"""fsck (kvblock/store/fsck.py) on stores with faults the CLI tests cannot make."""

from __future__ import annotations

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.devices import create_file
from kvblock.layout import Geometry
from kvblock.store.fsck import fsck
from tests.store.workload import run_data, run_keys
from tests.support.faults import BadSectors

MIB = 1 << 20
GEOM = Geometry(2, 2, 32, "float16", 16, 2, 2)


@pytest.mark.parametrize("repair", [False, True])
def test_deep_fsck_reports_an_unreadable_run_and_checks_the_rest(tmp_path, repair):
    """A bad sector under one run (EIO) stopped `fsck --deep` at that run
    with an I/O error (exit 9): no report, the runs after it never checked,
    and --repair could not drop it.  It is a problem of that run, as a
    checksum mismatch is; the rest are verified; --repair drops it."""
    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    runs = [run_keys(40 + i, 2) for i in range(4)]
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        for keys in runs:
            store.put_run(keys, run_data(keys))
    bad = BadSectors()
    with KVStore.open([str(path)], readonly=not repair, storeio_factory=bad.factory()) as store:
        ids = sorted(store.index.runs)
        run = store.index.runs[ids[1]]
        dev, off = store.regions.address(run.region, run.offset)
        bad.add(dev, off + 4096, 4096)
        report = fsck(store, deep=True, repair=repair)
        assert report.runs_checked == 4
        assert report.bytes_verified == 3 * store.layout(2).run_bytes
        assert len(report.problems) == 1, report.problems
        assert f"run {run.run_id}: unreadable" in report.problems[0]
        assert str(path) in report.problems[0] and "EIO" in report.problems[0]
        assert report.dropped_runs == (1 if repair else 0)
        assert report.status == ("repaired" if repair else "problems")
    with KVStore.open([str(path)], readonly=True) as store:
        assert len(store.index.runs) == (3 if repair else 4)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["payload", "magic"])
def test_fsck_reports_damage_to_the_fallback_checkpoint_slot(tmp_path, where):
    """The older checkpoint slot (the fallback if the newest goes bad)
    damaged in its payload, or in its header's magic: the store opens from
    the newest and loses nothing, but fsck said "clean" although the
    fallback was gone (only a header checksum failure with the magic intact
    was reported).  It is reported as the damaged slot it is."""
    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
        sb = store.sb
    with KVStore.open([str(path)], readonly=True) as store:
        older = 1 - store._cp_slot
        assert fsck(store).status == "clean"
    _flip(path, sb.checkpoint_offset + older * sb.checkpoint_bytes
          + (4096 + 40 if where == "payload" else 0))
    with KVStore.open([str(path)], readonly=True) as store:
        assert store.lookup(run_keys(1, 2)) == 2
        report = fsck(store)
        assert report.status == "problems", report.problems
        assert len(report.problems) == 1
        assert f"checkpoint slot {older}" in report.problems[0]
        assert "damaged" in report.problems[0] and str(path) in report.problems[0]
        assert report.info["checkpoint_slots"][older] is None
    KVStore.open([str(path)]).close()              # a writable open rewrites it
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean"
        assert store.lookup(run_keys(1, 2)) == 2



def test_fsck_does_not_call_a_checkpoint_slot_torn_by_a_crash_media_damage(tmp_path):
    """A crash inside a checkpoint write (its header landed, its payload
    not) leaves that slot failing its checksum: an expected state after a
    crash, which the older slot covers.  fsck called it "damaged" as it
    does a bad sector, although a slot that reads but does not decode may
    as well be torn (only an unreadable one is sure media damage): it says
    so, and still reports it (the store has no fallback until it is
    rewritten)."""
    from tests.support.faults import CrashPlan, SimulatedCrash

    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    KVStore.format([str(path)], GEOM, region_size=256 << 10).close()
    plan = CrashPlan()
    store = KVStore.open([str(path)], storeio_factory=plan.factory())
    store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
    torn_slot = 1 - store._cp_slot
    plan.crash_at, plan.torn = plan.ops + 2, True     # flush, then the slot's write
    with pytest.raises(SimulatedCrash):
        store.checkpoint()
    store._release_devices()
    store.closed = True
    with KVStore.open([str(path)], readonly=True) as store:
        assert store.lookup(run_keys(1, 2)) == 2
        assert store.damaged_checkpoint_slots == [torn_slot]
        report = fsck(store)
        assert report.status == "problems" and len(report.problems) == 1, report.problems
        problem = report.problems[0]
        assert f"checkpoint slot {torn_slot}" in problem and "torn by a crash" in problem
        assert "is damaged" not in problem, problem


@pytest.mark.parametrize("which", ["older", "newest"])
def test_an_unreadable_checkpoint_slot_is_a_damaged_one(tmp_path, which):
    """A bad sector (EIO) under either checkpoint slot's header failed the
    open with an I/O error: the store could not be opened (nor fsck run)
    although the other slot was whole, which is what two slots are for.
    The unreadable slot is now a damaged one: the store opens from the
    other, keeps its runs, and fsck names the slot."""
    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
        sb = store.sb
    with KVStore.open([str(path)], readonly=True) as store:
        slot = store._cp_slot if which == "newest" else 1 - store._cp_slot
    off = sb.checkpoint_offset + slot * sb.checkpoint_bytes
    bad = BadSectors()
    bad.add(0, off, 4096)
    with KVStore.open([str(path)], readonly=True, storeio_factory=bad.factory()) as store:
        assert store.lookup(run_keys(1, 2)) == 2
        report = fsck(store)
        assert report.status == "problems" and len(report.problems) == 1, report.problems
        assert f"checkpoint slot {slot} at offset {off} is damaged" in report.problems[0]
        assert report.info["checkpoint_slots"][slot] is None
    with KVStore.open([str(path)], storeio_factory=bad.factory()) as store:
        assert store.lookup(run_keys(1, 2)) == 2     # a writable open rewrites the slot
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean" and store.lookup(run_keys(1, 2)) == 2


def test_an_older_superblock_copy_is_reported_as_older(tmp_path):
    """Copy B of the same store with a lower sequence (an update of the
    copies cut short) is reported as older; --repair rewrites it.  Copies
    of two stores, or differing at one sequence, are refused at open
    (tests/store/test_corruption.py; fsck calls that store unusable)."""
    import struct

    import xxhash

    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    KVStore.format([str(path)], GEOM, region_size=256 << 10).close()
    buf = bytearray(path.read_bytes()[:4096])
    struct.pack_into("<Q", buf, 184, 0)                   # sequence
    struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(buf)
    with KVStore.open([str(path)], readonly=True) as store:
        report = fsck(store)
        assert report.problems == [f"{path}: superblock copy at offset 4096 is older than the "
                                   "copy at offset 0 (sequence 0 < 1)"]
    with KVStore.open([str(path)]) as store:
        assert fsck(store, repair=True).repaired == [
            f"{path}: rewrote superblock copy at offset 4096"]
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean"


@pytest.mark.parametrize("copy", [0, 4096])
def test_an_unreadable_superblock_copy_is_a_bad_one(tmp_path, copy):
    """A bad sector (EIO) under one superblock copy failed every open with
    an I/O error, though the other copy was whole.  The store opens from
    the other copy; fsck names the unreadable one, and --repair rewrites it."""
    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
    bad = BadSectors()
    bad.add(0, copy, 4096)
    with KVStore.open([str(path)], readonly=True, storeio_factory=bad.factory()) as store:
        assert store.lookup(run_keys(1, 2)) == 2
        report = fsck(store)
        assert report.status == "problems" and len(report.problems) == 1, report.problems
        assert f"{path}: superblock copy at offset {copy} is unreadable" in report.problems[0]
        assert "EIO" in report.problems[0]
    with KVStore.open([str(path)], storeio_factory=bad.factory()) as store:
        report = fsck(store, repair=True)
        assert report.repaired == [f"{path}: rewrote superblock copy at offset {copy}"]
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean" and store.lookup(run_keys(1, 2)) == 2


@pytest.mark.parametrize("other", ["blank", "damaged"])
def test_an_unreadable_superblock_copy_beside_an_invalid_one_is_an_io_error(tmp_path, other):
    """Copy A unreadable (EIO) and copy B blank (a format cut short before
    it) or damaged: the open said "no kvblock superblock at offset 0 (not
    formatted, or overwritten)" or blamed copy B's checksum, a
    NotAStoreError whose fix is a reformat, though nothing proved copy A
    bad.  It is the IOFailedError of copy A (an I/O error is no proof of
    corruption), for a read-only and a writable open alike."""
    from kvblock.errors import IOFailedError, NotAStoreError

    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    KVStore.format([str(path)], GEOM, region_size=256 << 10).close()
    with open(path, "r+b") as f:
        f.seek(4096 if other == "blank" else 4096 + 300)
        f.write(bytes(4096) if other == "blank" else b"\xee" * 8)
    bad = BadSectors()
    bad.add(0, 0, 4096)
    for readonly in (True, False):
        with pytest.raises(IOFailedError) as ei:
            KVStore.open([str(path)], readonly=readonly, storeio_factory=bad.factory()).close()
        assert not isinstance(ei.value, NotAStoreError)
        assert ei.value.path == str(path) and ei.value.offset == 0


def _crashed_with_three_commits(path):
    """Runs a, b, c put in three journal commits after the open's checkpoint,
    then a crash (no clean close): all three are in the journal only.
    Returns (their keys, the journal offset of each commit)."""
    create_file(path, 8 * MIB)
    KVStore.format([str(path)], GEOM, region_size=256 << 10).close()
    store = KVStore.open([str(path)])
    runs, at = [run_keys(60 + i, 2) for i in range(3)], []
    for keys in runs:
        at.append(store.sb.journal_offset + store._jhead)
        store.put_run(keys, run_data(keys))
    store._release_devices()
    store.closed = True
    return runs, at


@pytest.mark.parametrize("where", ["replayed", "old"])
def test_an_unreadable_journal_block_does_not_make_the_store_unopenable(tmp_path, where):
    """A bad sector (EIO) anywhere in the journal -- under the records a
    replay needs, or under old records of an earlier epoch -- failed every
    open with an I/O error (kvblock fsck exited 9, no report, no repair):
    recovery read the whole journal in one read.  The store now opens:
    records before the unreadable block are replayed, those from it on are
    not (as after a torn record; the last one here: with intact records
    after it, every run is dropped, test_corruption.py); fsck names the
    device and offset; a writable open rewrites the block."""
    path = tmp_path / "store.img"
    runs, at = _crashed_with_three_commits(path)
    if where == "old":       # a clean close: the three records are an old epoch's
        KVStore.open([str(path)]).close()
    bad, where_bad = BadSectors(), at[2] if where == "replayed" else at[1]
    bad.add(0, where_bad, 4096)
    with KVStore.open([str(path)], readonly=True, storeio_factory=bad.factory()) as store:
        found = [store.lookup(keys) for keys in runs]
        assert found == ([2, 2, 0] if where == "replayed" else [2, 2, 2])
        report = fsck(store)
        assert report.status == "problems", report.problems
        assert any(f"{path}: the journal at offset {where_bad}" in p and "unreadable" in p
                   and "EIO" in p for p in report.problems), report.problems
    with KVStore.open([str(path)], storeio_factory=bad.factory()) as store:
        report = fsck(store, repair=True)
        assert report.status == "repaired", report.problems
        assert f"{path}: rewrote the unreadable journal at offset {where_bad}" \
            in "\n".join(report.repaired)
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean"
        assert [store.lookup(keys) for keys in runs] == found
        got = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(runs[0], got) == 2 and np.array_equal(got, run_data(runs[0]))


@pytest.mark.parametrize("damage", ["fallback slot", "journal gap"])
def test_fsck_repair_says_repaired_when_the_writable_open_repaired(tmp_path, damage):
    """fsck --repair opens the store writable, and that open already
    repairs: it rewrites the fallback checkpoint slot and starts a new
    journal past a gap.  The report said "clean" for a fallback slot whose
    magic was damaged (the open did not count it), and "problems" for a
    journal gap, though both were gone: both are problems, repaired."""
    path = tmp_path / "store.img"
    runs, at = _crashed_with_three_commits(path)
    with KVStore.open([str(path)], readonly=True) as store:
        sb, older = store.sb, 1 - store._cp_slot
    if damage == "fallback slot":
        _flip(path, sb.checkpoint_offset + older * sb.checkpoint_bytes)
    else:                                # b's commit never written: c's follows intact
        with open(path, "r+b") as f:     # (zeros: a tear, damage would drop every run)
            f.seek(at[1])
            f.write(bytes(4096))
    with KVStore.open([str(path)]) as store:
        report = fsck(store, repair=True)
        assert len(report.problems) == 1, report.problems
        assert ("checkpoint slot" if damage == "fallback slot" else "the journal stops") \
            in report.problems[0]
        assert report.status == "repaired" and len(report.repaired) == 1, report.repaired
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean"
        assert store.lookup(runs[0]) == 2


def test_fsck_finds_every_run_overlapping_a_long_one_and_repair_leaves_none(tmp_path):
    """Runs overlapping were looked for between neighbours only (sorted by
    offset): a long run A with two short ones B and C inside it had A/C
    missed, so `fsck --repair` dropped B, said "repaired", and left C
    sharing A's bytes; only a second fsck found it.  Each run is checked
    against every run kept before it."""
    from kvblock.format import checkpoint as cpfmt

    path = tmp_path / "store.img"
    create_file(path, 4 * MIB)
    a, b, c = run_keys(90, 8), run_keys(91, 1), run_keys(92, 1)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        for keys in (a, b, c):
            store.put_run(keys, run_data(keys))
        sb, one = store.sb, store.layout(1).run_bytes
        assert store.layout(8).run_bytes >= 2 * one + 4096
    with KVStore.open([str(path)], readonly=True) as store:
        off = sb.checkpoint_offset + store._cp_slot * sb.checkpoint_bytes
    with open(path, "r+b") as f:        # B and C moved inside A (checksums whole)
        f.seek(off)
        raw = f.read(sb.checkpoint_bytes)
        cp = cpfmt.decode_payload(cpfmt.decode_header(raw), raw[cpfmt.HEADER_BYTES:])
        big = int(np.flatnonzero(cp.runs["nblocks"] == 8)[0])
        at = int(cp.runs["offset"][big])
        short = np.flatnonzero(cp.runs["nblocks"] == 1)
        assert (cp.runs["region"][short] == cp.runs["region"][big]).all()
        cp.runs["offset"][short[0]] = at + 4096
        cp.runs["offset"][short[1]] = at + 4096 + one
        f.seek(off)
        f.write(cp.encode())
    with KVStore.open([str(path)]) as store:
        report = fsck(store, repair=True)
        assert report.dropped_runs == 2, report.problems
        assert sum("overlap" in p for p in report.problems) == 2, report.problems
        assert fsck(store).status == "clean", fsck(store).problems
        assert store.lookup(a) == 8


@pytest.mark.parametrize("where", ["payload", "magic"])
def test_fsck_repair_reports_the_damaged_fallback_checkpoint_slot_it_rewrote(tmp_path, where):
    """The older checkpoint slot damaged in its payload (its header whole):
    a writable open (fsck --repair) judged the slot by its header alone, so
    it rewrote the slot without a word and fsck said "clean"; a slot whose
    header was damaged was reported and its rewrite named.  Both are."""
    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
        sb = store.sb
    with KVStore.open([str(path)], readonly=True) as store:
        older = 1 - store._cp_slot
    _flip(path, sb.checkpoint_offset + older * sb.checkpoint_bytes
          + (4096 + 40 if where == "payload" else 0))
    with KVStore.open([str(path)]) as store:
        assert store.lookup(run_keys(1, 2)) == 2
        report = fsck(store, repair=True)
        assert report.status == "repaired", report.problems
        assert len(report.problems) == 1 and f"checkpoint slot {older}" in report.problems[0]
        assert report.repaired == [f"{path}: rewrote checkpoint slot {older}"]
    with KVStore.open([str(path)], readonly=True) as store:
        assert fsck(store).status == "clean" and store.lookup(run_keys(1, 2)) == 2


def test_fsck_repair_counts_the_blocks_the_store_lost_not_a_superseded_position(tmp_path):
    """A damaged run whose position a newer run took over (its key stored
    again): --repair said "dropped 1 run(s), 4 block(s)" and dropped_blocks 4,
    but the store lost 3 blocks (the newer run still holds the fourth key),
    which its stats, delete() and eviction count.  The blocks counted are
    those the store no longer holds."""
    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    a = run_keys(1, 4)
    newer = a[1:2] + run_keys(2, 1)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        store.put_run(a, run_data(a))
        store.put_run(newer, run_data(newer))
        run = next(r for r in store.index.runs.values() if r.nblocks == 4)
        dev, off = store.regions.address(run.region, run.offset)
    _flip(path, off + 100)
    with KVStore.open([str(path)]) as store:
        before = store.stats()["blocks"]
        report = fsck(store, deep=True, repair=True)
        lost = before - store.stats()["blocks"]
        assert lost == 3 and store.lookup(newer) == 2
        assert report.dropped_runs == 1, report.problems
        assert report.dropped_blocks == lost
        assert report.repaired == ["dropped 1 inconsistent run(s), 3 block(s)"]


def test_fsck_repair_of_two_overlapping_runs_keeps_the_one_whose_bytes_are_there(tmp_path):
    """Run B placed inside run A (metadata pointing B's space into A's, B's
    bytes written there over A's tail): of two overlapping runs `fsck
    --repair` always dropped the one further on, B, whose data is whole, and
    kept A, whose bytes B overwrote; it said "repaired", and the next `fsck
    --deep` found A damaged.  The overlapping runs' data are checked (without
    --deep too): the damaged one goes, the whole one stays."""
    from kvblock.format import checkpoint as cpfmt

    path = tmp_path / "store.img"
    create_file(path, 4 * MIB)
    a, b = run_keys(90, 8), run_keys(91, 1)
    with KVStore.format([str(path)], GEOM, region_size=256 << 10) as store:
        for keys in (a, b):
            store.put_run(keys, run_data(keys))
        sb, one = store.sb, store.layout(1).run_bytes
        big = store.layout(8).run_bytes
        assert big >= one + 4096
        run_b = next(r for r in store.index.runs.values() if r.nblocks == 1)
        b_at = store.regions.address(run_b.region, run_b.offset)[1]
    with KVStore.open([str(path)], readonly=True) as store:
        off = sb.checkpoint_offset + store._cp_slot * sb.checkpoint_bytes
    with open(path, "r+b") as f:        # B moved over A's tail, its bytes with it
        f.seek(off)
        raw = f.read(sb.checkpoint_bytes)
        cp = cpfmt.decode_payload(cpfmt.decode_header(raw), raw[cpfmt.HEADER_BYTES:])
        i_a = int(np.flatnonzero(cp.runs["nblocks"] == 8)[0])
        i_b = int(np.flatnonzero(cp.runs["nblocks"] == 1)[0])
        new_b = int(cp.runs["offset"][i_a]) + big - one
        moved = new_b - int(cp.runs["offset"][i_b])
        cp.runs["offset"][i_b] = new_b
        f.seek(off)
        f.write(cp.encode())
        f.seek(b_at)
        data = f.read(one)
        f.seek(b_at + moved)
        f.write(data)
    with KVStore.open([str(path)]) as store:
        report = fsck(store, repair=True)
        assert report.dropped_runs == 1, report.problems
        assert any("overlap" in p for p in report.problems), report.problems
        after = fsck(store, deep=True)
        assert after.status == "clean", after.problems
        out = np.zeros(store.geometry.block_bytes, np.uint8)
        assert store.get_run(b, out) == 1 and np.array_equal(out, run_data(b))
        assert store.lookup(a) == 0


def test_fsck_repair_of_a_read_only_store_is_refused_before_it_checks(tmp_path):
    """fsck(repair=True) of a store opened read-only began the check and
    failed at its first repair with an I/O error (EBADF writing the
    superblock copy: no word of read-only, or of the fix), and a repair
    of overlapping runs would take them out of the index before its
    journal write failed.  It is refused up front with ReadOnlyStoreError
    naming the device and the fix; the store is left as it was."""
    from kvblock.errors import ReadOnlyStoreError

    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    KVStore.format([str(path)], GEOM, region_size=256 << 10).close()
    _flip(path, 4096 + 100)                       # superblock copy B damaged
    with KVStore.open([str(path)], readonly=True) as store:
        with pytest.raises(ReadOnlyStoreError) as e:
            fsck(store, repair=True)
        assert str(path) in str(e.value) and "readonly" in str(e.value)
        assert not store.closed
        report = fsck(store)                      # a check without repair goes on
        assert report.status == "problems" and len(report.problems) == 1, report.problems
    with KVStore.open([str(path)], readonly=True) as store:
        assert len(fsck(store).problems) == 1     # nothing was rewritten


def test_fsck_repair_never_writes_over_a_superblock_copy_of_a_newer_release(tmp_path):
    """A superblock copy that turned into a newer release's (its in-place
    upgrade began while this store was open) was "repaired" by fsck
    --repair with the older copy: a downgrade of what that release wrote.
    It is reported as a newer release's and left as it is."""
    import struct

    import xxhash

    from kvblock.format import FORMAT_VERSION

    path = tmp_path / "store.img"
    create_file(path, 8 * MIB)
    KVStore.format([str(path)], GEOM, region_size=256 << 10).close()
    with KVStore.open([str(path)]) as store:
        buf = bytearray(path.read_bytes()[4096:8192])
        struct.pack_into("<I", buf, 8, FORMAT_VERSION + 1)
        struct.pack_into("<Q", buf, 184, 2)
        struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
        with open(path, "r+b") as f:
            f.seek(4096)
            f.write(buf)
        report = fsck(store, repair=True)
        assert report.repaired == [] and len(report.problems) == 1, report
        assert (f"{path}: superblock copy at offset 4096 has on-device format version "
                f"{FORMAT_VERSION + 1}" in report.problems[0])
        assert "not rewritten" in report.problems[0]
        assert "upgrade kvblock" in report.problems[0]
    assert path.read_bytes()[4096:8192] == bytes(buf)
