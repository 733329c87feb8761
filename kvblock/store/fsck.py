"""Consistency check (and repair) of a store: superblock copies, checkpoints,
journal, index against allocation, and (deep) every data checksum."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvblock.errors import IOFailedError, KVBlockError, ReadOnlyStoreError, UnsupportedVersionError
from kvblock.format import FORMAT_VERSION
from kvblock.format import checkpoint as cpfmt
from kvblock.format import superblock as sbfmt
from kvblock.format import trailer as trailerfmt
from kvblock.format.checksum import data_checksum
from kvblock.io import IOBatch
from kvblock.memory import HostBuffer
from kvblock.store.digests import block_digests_at


@dataclass
class FsckReport:
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    dropped_runs: int = 0       # by this check's --repair (inconsistent runs)
    dropped_blocks: int = 0
    # by the open, before any check: a damaged journal record or a stale
    # checkpoint (what was removed is unknown, so no run is trusted)
    dropped_at_open: int = 0
    runs_checked: int = 0
    bytes_verified: int = 0
    # filled in by check_checkpoints; present (empty) in every report, so
    # that scripts read the same keys from an unusable store's
    info: dict = field(default_factory=lambda: {"checkpoint_slots": [],
                                                "journal_records_replayed": 0})
    unusable: bool = False      # the store could not be opened: nothing was checked

    @property
    def status(self) -> str:
        if self.unusable:
            return "unusable"
        if not self.problems:
            return "clean"
        return "repaired" if self.repaired else "problems"

    def as_dict(self) -> dict:
        return {"status": self.status, "problems": self.problems, "repaired": self.repaired,
                "dropped_runs": self.dropped_runs, "dropped_blocks": self.dropped_blocks,
                "dropped_at_open": self.dropped_at_open,
                "runs_checked": self.runs_checked, "bytes_verified": self.bytes_verified,
                **self.info}


def check_superblocks(store, report: FsckReport, repair: bool) -> None:
    io = store.io
    for i, dev in enumerate(io.devices):
        good = store.superblocks[i]
        for off in sbfmt.COPY_OFFSETS:
            newer = False
            try:
                sb = sbfmt.Superblock.decode(io.read_bytes(i, off, sbfmt.SIZE), dev.path, off)
                ok = sb == good
            except IOFailedError as e:
                if not e.device_fault:
                    raise
                ok, why = False, f"{dev.path}: superblock copy at offset {off} is unreadable ({e})"
            except UnsupportedVersionError as e:
                # a newer release's copy (an upgrade of it begun since the
                # open): writing ours over it would downgrade that store
                ok, why = False, str(e)
                if newer := (e.version or 0) > FORMAT_VERSION:
                    why = (f"{dev.path}: superblock copy at offset {off} has on-device format "
                           f"version {e.version} (written by a newer kvblock release): not "
                           "rewritten, fsck never writes an older copy over a newer one; "
                           f"upgrade kvblock to a release that reads format version {e.version}")
            except KVBlockError as e:
                ok, why = False, str(e)
            else:
                why = f"{dev.path}: superblock copy at offset {off} " + _how_it_differs(
                    sb, good, [o for o in sbfmt.COPY_OFFSETS if o != off][0])
            if ok:
                continue
            report.problems.append(why)
            if repair and not newer:
                io.write_bytes(i, off, good.encode())
                io.flush([i])
                report.repaired.append(f"{dev.path}: rewrote superblock copy at offset {off}")


def _how_it_differs(sb, good, other: int) -> str:
    """What a superblock copy that decodes but is not the one in use is:
    pick() refused copies of two stores or differing at one sequence, so
    this one is the same store's, older (an update of the copies cut short)."""
    return (f"is older than the copy at offset {other} (sequence {sb.sequence} < "
            f"{good.sequence})")


def check_checkpoints(store, report: FsckReport) -> None:
    sb = store.sb
    valid, damaged = [], list(getattr(store, "damaged_checkpoint_slots", []))
    unreadable = set()     # slots a read of failed (EIO): media damage, which no crash leaves
    for slot in (0, 1):
        off = sb.checkpoint_offset + slot * sb.checkpoint_bytes
        try:
            raw = store.io.read_bytes(0, off, cpfmt.HEADER_BYTES)
        except IOFailedError as e:
            if not e.device_fault:
                raise
            raw = b"\xff"        # a bad sector: damaged
            unreadable.add(slot)
        head = cpfmt.decode_header(raw)
        # The open read only the slot it loaded: the other one (the fallback)
        # is checked whole here.  A slot never written is all zeros.
        failed = []
        if head is not None and store._slot_checkpoint(slot, head, failed) is None:
            head = None
        if failed:
            unreadable.add(slot)
        if head is None and any(raw) and slot not in damaged:
            damaged.append(slot)
        valid.append(head.generation if head else None)
    report.info["checkpoint_slots"] = valid
    stale = getattr(store, "stale_checkpoint", False)   # reported below, with its loss
    for slot in [] if stale else sorted(damaged):
        off = sb.checkpoint_offset + slot * sb.checkpoint_bytes
        # A slot that reads but does not decode is what a crash inside a
        # checkpoint write leaves (sectors old and new) as much as rot:
        # only a read error tells media damage apart.
        what = ("is damaged (unreadable)" if slot in unreadable else
                "does not decode: torn by a crash while it was written, or damaged")
        report.problems.append(
            f"{store.io.devices[0].path}: checkpoint slot {slot} at offset {off} {what}; "
            "the store opened from the other slot and lost nothing, but has no fallback "
            "checkpoint until it is rewritten")
        if not store.readonly and valid[slot] is not None:   # the open wrote a new one there
            report.repaired.append(f"{store.io.devices[0].path}: rewrote checkpoint slot {slot}")
    report.info["journal_records_replayed"] = store.counters["replayed_records"]
    path, base = store.io.devices[0].path, sb.journal_offset
    for pos, length, e, rewritten in getattr(store, "journal_unreadable", []):
        report.problems.append(
            f"{path}: the journal at offset {base + pos} ({length} bytes) is unreadable ({e}): "
            "replay stops there if it reaches it (the records from there on are lost); "
            "a writable open (--repair) rewrites it")
        if rewritten:
            report.repaired.append(f"{path}: rewrote the unreadable journal at offset "
                                   f"{base + pos} ({length} bytes)")
    gap = getattr(store, "journal_gap", None)
    if gap:
        report.problems.append(
            f"{store.io.devices[0].path}: the journal stops at record {gap['stopped_at_seq']} "
            f"(torn or damaged), but {gap['records_not_replayed']} intact record(s) from "
            f"{gap['first_seq']} on follow at offset {gap['offset']}: the runs they published "
            "are lost (a crash inside one commit leaves a few such records; more mean the "
            "journal was damaged). The rest of the store is consistent; a writable open "
            "(--repair) starts a new journal")
    rotten = getattr(store, "journal_damaged", None)
    if rotten:
        report.dropped_at_open += rotten["runs_dropped"]
        report.problems.append(
            f"{store.io.devices[0].path}: the journal record at offset {rotten['offset']} "
            f"(number {rotten['seq']}) is damaged, not torn by a crash: what it removed is "
            f"unknown, so the store's {rotten['runs_dropped']} runs cannot be trusted and "
            "were dropped at open (the cache restarts empty); a writable open (--repair) "
            "starts a new journal")
    foreign = getattr(store, "journal_foreign_puts", [])
    if foreign:
        report.problems.append(
            f"{store.io.devices[0].path}: the journal holds {len(foreign)} PUT record(s) this "
            f"store cannot have written (run {foreign[0][0]}: {foreign[0][1]}): written by a bug "
            "or damaged, they were not replayed (no run of theirs is in the store); a "
            "writable open (--repair) starts a new journal")
    reclaims = getattr(store, "journal_foreign_reclaims", [])
    if reclaims:
        report.problems.append(
            f"{store.io.devices[0].path}: the journal holds {len(reclaims)} RECLAIM record(s) "
            f"naming a region the store lacks (region {reclaims[0][0]}, generation "
            f"{reclaims[0][1]}; the store has {store.regions.count}): written by a bug or "
            "damaged, they were not replayed (no run was touched); a writable open "
            "(--repair) starts a new journal")
    if (gap or foreign or reclaims or rotten) and not store.readonly:   # the open wrote a new epoch
        report.repaired.append(f"{store.io.devices[0].path}: started a new journal")
    if getattr(store, "stale_checkpoint", False):
        report.dropped_at_open += store.counters["stale_checkpoint_runs_dropped"]
        report.problems.append(
            f"{store.io.devices[0].path}: the newest checkpoint is unreadable and the journal "
            "had moved on from the older one; its "
            f"{store.counters['stale_checkpoint_runs_dropped']} runs cannot be trusted and "
            "were dropped at open (the cache restarts empty)")
        if not store.readonly:
            report.repaired.append(f"{store.io.devices[0].path}: wrote a new checkpoint of "
                                   "the (empty) cache")


def check_allocation(store, report: FsckReport) -> tuple[list, set]:
    """Runs that do not fit their region or name a stale generation, and
    the ids of the runs that overlap another (reported here; which of them
    to drop is decided by their data: see fsck())."""
    bad, fitting = [], []
    for run in store.index.runs.values():
        size = store.layout(run.nblocks).run_bytes
        if run.region >= store.regions.count or run.offset + size > store.regions.size:
            report.problems.append(f"run {run.run_id}: [{run.offset}, {run.offset + size}) "
                                   f"outside region {run.region}")
            bad.append(run)
            continue
        if run.generation != int(store.regions.generation[run.region]):
            report.problems.append(f"run {run.run_id}: generation {run.generation}, region "
                                   f"{run.region} is at {int(store.regions.generation[run.region])}")
            bad.append(run)
            continue
        fitting.append(run)
    overlapping = set()
    for a, b, region in _overlaps(store, fitting):
        report.problems.append(f"runs {a.run_id} and {b.run_id} overlap in region {region}")
        overlapping |= {a.run_id, b.run_id}
    return bad, overlapping


def _overlaps(store, runs) -> list:
    """(a, b, region): run b overlapping a, the run kept before it that
    reaches furthest (not only its neighbour: a long run may hold several
    short ones); b counts as dropped."""
    by_region: dict[int, list] = {}
    for run in runs:
        by_region.setdefault(run.region, []).append(
            (run.offset, store.layout(run.nblocks).run_bytes, run))
    found = []
    for region, placed in by_region.items():
        placed.sort(key=lambda r: r[0])
        off_a, size_a, a = placed[0]
        for off_b, size_b, b in placed[1:]:
            if off_a + size_a > off_b:
                found.append((a, b, region))
            else:
                off_a, size_a, a = off_b, size_b, b
    return found


def check_data(store, report: FsckReport, progress=None, runs=None) -> list:
    """Read every run (or ``runs``); verify every range checksum, the block
    digest trailer's, and each block against the trailer."""
    bad = []
    runs = list(store.index.runs.values()) if runs is None else list(runs)
    total = len(runs)
    for k, run in enumerate(runs):
        lay = store.layout(run.nblocks)
        dev, base = store.regions.address(run.region, run.offset)
        with HostBuffer(lay.run_bytes, register=False) as buf:
            try:
                store.io.read(IOBatch.single(buf.address, dev, base, lay.run_bytes))
            except IOFailedError as e:
                # the engine failed (no path, or a broken io_uring), not the
                # device: says nothing of the run
                if not e.device_fault:
                    raise
                # a bad sector is this run's problem, as a bad checksum is: the rest are checked
                report.problems.append(f"run {run.run_id}: unreadable at "
                                       f"{store.io.devices[dev].path} offset {base} ({e})")
                bad.append(run)
                if progress:
                    progress(k + 1, total)
                continue
            problem = _run_data_problem(run, lay, buf.array[:lay.run_bytes], buf.address)
            if problem:
                what, at = problem
                report.problems.append(f"run {run.run_id}: checksum mismatch in {what} at "
                                       f"{store.io.devices[dev].path} offset {base + at}")
                bad.append(run)
        report.bytes_verified += lay.run_bytes
        if progress:
            progress(k + 1, total)
    return bad


def _run_data_problem(run, lay, image: np.ndarray, address: int):
    """(what, offset in the run) of the first bad checksum of a run's
    on-device image (at ``address``), or None."""
    g = lay.geometry
    ranges = image[:lay.data_bytes].reshape(g.ranges, lay.range_bytes)
    for r in range(g.ranges):
        if data_checksum(ranges[r], run.run_id) != int(run.checksums[r]):
            return f"range {r}", r * lay.range_bytes
    trailer = image[lay.data_bytes:]
    if trailerfmt.checksum(trailer, run.run_id) != int(run.checksums[g.ranges]):
        return "the block digest trailer", lay.data_bytes
    want = trailerfmt.decode(trailer, g.ranges, run.nblocks).reshape(-1)
    gbb = g.group_block_bytes
    at = (np.repeat(np.arange(g.ranges, dtype=np.uint64) * np.uint64(lay.range_bytes),
                    run.nblocks)
          + np.tile(np.arange(run.nblocks, dtype=np.uint64) * np.uint64(gbb), g.ranges))
    bad = np.nonzero(block_digests_at(at + np.uint64(address), gbb, run.run_id) != want)[0]
    if bad.size:
        r, b = divmod(int(bad[0]), run.nblocks)
        return (f"the trailer's digest of block {b} of range {r}",
                lay.data_bytes + int(bad[0]) * 8)
    return None


def fsck(store, *, repair: bool = False, deep: bool = False, progress=None) -> FsckReport:
    """Check an open store (open it writable to repair)."""
    if repair and store.readonly:
        # Refused before any check: a repair's writes fail on a read-only
        # store (EBADF), a run drop only after the runs left the index.
        raise ReadOnlyStoreError(
            f"{store.io.devices[0].path}: fsck cannot repair a store opened read-only "
            "(readonly=True); open it without readonly=True to repair, or check it "
            "without repair")
    report = FsckReport()
    check_superblocks(store, report, repair)
    check_checkpoints(store, report)
    bad, overlapping = check_allocation(store, report)
    report.runs_checked = len(store.index.runs)
    if deep:
        bad += check_data(store, report, progress)
    elif overlapping:
        # Of two runs sharing bytes, the one written last holds them: their
        # data tell which (dropping always the one further on kept a run
        # whose bytes another's write had replaced, and dropped the whole
        # one).  Counted as verified: those bytes were.
        bad += check_data(store, report,
                          runs=[store.index.runs[i] for i in sorted(overlapping)])
    unique = {r.run_id: r for r in bad}
    # Overlaps left among the runs kept (both whole, or one's damage not
    # read): the one further on goes, as the data cannot tell.
    kept = [r for r in store.index.runs.values() if r.run_id not in unique]
    for a, b, region in _overlaps(store, kept):
        if b.run_id not in overlapping:       # met only now: a run it overlapped went
            report.problems.append(f"runs {a.run_id} and {b.run_id} overlap in region {region}")
        unique[b.run_id] = b
    if repair and unique:
        # the blocks the store lost (_drop_runs' count, as delete's and
        # eviction's): a position a newer run took over stays stored there
        report.dropped_blocks = store._drop_runs(list(unique.values()))
        report.dropped_runs = len(unique)
        report.repaired.append(f"dropped {len(unique)} inconsistent run(s), "
                               f"{report.dropped_blocks} block(s)")
    return report
