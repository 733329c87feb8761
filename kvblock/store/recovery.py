"""Opening a store: its checkpoint, then the journal written after it.

Replay takes the newest valid checkpoint, then applies the records of its
epoch in order (a torn or foreign record ends the journal); the open then
writes a new checkpoint, which starts a new epoch (format/journal.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvblock.alloc.regions import FREE, SEALED
from kvblock.format import checkpoint as cpfmt
from kvblock.errors import IOFailedError, NotAStoreError
from kvblock.format import journal as jfmt
from kvblock.index import KeyIndex, Run
from kvblock.index.index import MAX_RUN_ID

logger = logging.getLogger(__name__)


class Recovery:
    """KVStore's recovery on open: ``_recover`` and the steps it takes."""

    def _recover(self):
        sb = self.sb
        self.journal_gap = None
        self.journal_damaged = None     # a record damaged, not torn (fsck reports it)
        # PUT records no writer of this store makes (fsck reports them)
        self.journal_foreign_puts = []
        # RECLAIM records naming a region the store lacks (fsck reports them)
        self.journal_foreign_reclaims = []
        # Slots that were written once but no longer decode (fsck reports
        # them; the next checkpoint goes to one of them).
        self.damaged_checkpoint_slots = []
        slots, unreadable = [], []
        heads = {}          # slot -> its header, where one decodes
        for slot in (0, 1):
            off = sb.checkpoint_offset + slot * sb.checkpoint_bytes
            raw = self._read_slot(off, cpfmt.HEADER_BYTES, unreadable)
            if raw is None:     # a bad sector: damaged, the other slot may be whole
                self.damaged_checkpoint_slots.append(slot)
                continue
            head = cpfmt.decode_header(raw)
            if head is not None:
                heads[slot] = head
                slots.append((head.generation, slot, head))
            elif any(raw):      # written once (a slot never written is zeros)
                self.damaged_checkpoint_slots.append(slot)
        cp = None
        slots.sort(reverse=True)
        while slots and cp is None:
            _, slot, head = slots.pop(0)
            cp = self._slot_checkpoint(slot, head, unreadable)
            if cp is None:
                self.damaged_checkpoint_slots.append(slot)
            else:
                self._cp_slot = slot
        if not self.readonly:
            # The fallback: this open writes its checkpoint there.  Judged
            # now, by its payload too, or its damage would be overwritten
            # unreported (a read-only open leaves it to fsck).
            for _, slot, head in slots:
                if self._slot_checkpoint(slot, head, []) is None:
                    self.damaged_checkpoint_slots.append(slot)
        if cp is None:
            if unreadable:      # an I/O error is no proof of corruption: never "reformat"
                raise unreadable[0]
            raise NotAStoreError(
                f"{self.io.devices[0].path}: no valid checkpoint in either slot (metadata "
                "corrupt); the cached KV cannot be trusted: reformat the store",
                self.io.devices[0].path, sb.checkpoint_offset)
        self.index = KeyIndex()
        journal = self._read_journal()
        # A damaged slot whose header names an older generation never held
        # a newer checkpoint: a newer epoch's journal begins only once its
        # checkpoint (header included) is durable there.
        newer_lost = any(s not in heads or heads[s].generation > cp.generation
                         for s in self.damaged_checkpoint_slots)
        ahead = self._newer_epoch(journal, cp.generation, newer_lost)
        self.stale_checkpoint = bool(ahead)
        if ahead:
            # The newest checkpoint is unreadable and its journal had begun:
            # the older one misses what was reclaimed and rewritten since, so
            # none of its runs can be trusted.  Start empty (a cache loses
            # only time), in a generation past every journal epoch seen.
            self.counters["stale_checkpoint_runs_dropped"] = len(cp.runs)
            logger.warning("kvblock: %s: the newest checkpoint is unreadable and the journal "
                           "moved on from the older one (generation %d); dropping its %d "
                           "runs", self.io.devices[0].path, cp.generation, len(cp.runs))
            self.regions.generation[:] = cp.regions["generation"]
            self._next_run_id = cp.next_run_id + (1 << 32)   # ids never met before
            self._generation = cp.generation + ahead
            self._seq, self._jhead = 0, 0
            self.counters["replayed_records"] = 0
            self.clean_at_open = False
            self._finish_layout()
            if not self.readonly:
                # Into both slots (the second one over the older, stale
                # checkpoint): this generation is past what _newer_epoch
                # looks for, so were the slot it went to unreadable again
                # before a later checkpoint, the older one would be trusted
                # (its runs' places rewritten since).  Two consecutive
                # generations leave no stale slot: either one with the
                # journal of the other's epoch is one generation behind.
                self._write_checkpoint()
                self._write_checkpoint()
                self._rewrite_unreadable_journal()
            return
        self._load_checkpoint(cp)
        records, end, next_seq, stop = jfmt.scan_to(journal, cp.journal_seq,
                                                    jfmt.epoch(sb.store_uuid, cp.generation))
        puts: list[Run] = []
        for rec in records:
            if isinstance(rec, jfmt.PutRun):
                run = self._replayed_run(rec)
                if run is not None:
                    puts.append(run)
                continue
            self._index_runs(puts)  # batches of PUTs are indexed in one call
            puts = []
            self._replay(rec)
        self._index_runs(puts)
        self.counters["replayed_records"] = len(records)
        if self.journal_foreign_puts:
            logger.warning("kvblock: %s: %d journal PUT record(s) this store cannot have "
                           "written were not replayed (run %d: %s)", self.io.devices[0].path,
                           len(self.journal_foreign_puts), *self.journal_foreign_puts[0])
        if self.journal_foreign_reclaims:
            logger.warning("kvblock: %s: %d journal RECLAIM record(s) naming a region the store "
                           "lacks (it has %d) were not replayed (region %d, generation %d)",
                           self.io.devices[0].path, len(self.journal_foreign_reclaims),
                           self.regions.count, *self.journal_foreign_reclaims[0])
        epoch = jfmt.epoch(sb.store_uuid, cp.generation)
        after = jfmt.records_after(journal, end, next_seq, epoch)
        if after is not None:
            # Replay stopped at a torn or damaged record with intact ones
            # after it: what they published is lost (the cache is smaller,
            # never wrong).  fsck reports it.
            pos, first, count = after
            self.journal_gap = {"offset": sb.journal_offset + pos, "first_seq": first,
                                "stopped_at_seq": next_seq, "records_not_replayed": count}
            logger.warning("kvblock: %s: the journal stops at record %d, but %d intact "
                           "record(s) from %d on (offset %d) follow; they are not replayed",
                           self.io.devices[0].path, next_seq, count, first,
                           sb.journal_offset + pos)
            self._removals_past_gap(journal, pos, first, epoch)
        # Lost to damage (bad bytes in one sector, or unreadable bytes before
        # intact records), not torn: no record shows what it removed
        # (records after it show only their own, _removals_past_gap)
        unreadable = after is not None and any(
            at < after[0] and stop < at + length for at, length, *_ in self.journal_unreadable)
        # ... or unreadable bytes that the commit replay stopped in went on
        # into (the last one: nothing after them says so, the block before
        # does); read as the log's end, its records were lost unreported
        unreadable = unreadable or self._commit_into_unreadable(journal, stop, next_seq, epoch)
        if unreadable or (jfmt.damaged_at(journal, stop, next_seq, epoch)
                          and not self._tears_anywhere()):
            self._drop_after_damage(sb.journal_offset + stop, next_seq)
        self._generation = cp.generation
        self._seq = next_seq
        self._jhead = end
        # a record of this epoch, replayed or not (damaged, past a gap):
        # written after the checkpoint, so not a clean close
        self.clean_at_open = not records and self.journal_gap is None \
            and self.journal_damaged is None
        self._finish_layout()
        if not self.readonly:
            self._write_checkpoint()  # new epoch: stale journal records are dead from here on
            self._rewrite_unreadable_journal()

    def _commit_into_unreadable(self, journal, stop: int, seq: int, epoch: int) -> bool:
        """Whether the record where replay stopped (``stop``, numbered
        ``seq``) reaches into a range the device cannot read: its header
        readable before the range, of ``epoch`` and numbered ``seq``, with
        its bytes going on into the range; or its header cut by the range,
        after an intact record's end in one sector (a commit that ends
        there writes zero padding, and a device writes a sector whole).  A
        crash leaves sectors old or new, not unreadable: the commit reached
        the range and its records there are lost to damage, not torn."""
        ahead = [at for at, _, *_ in self.journal_unreadable if at > stop]
        if not ahead:
            return False
        at = min(ahead)
        if stop + jfmt.HEADER_BYTES <= at:
            head = jfmt.header_at(journal, stop)
            return head is not None and head[:2] == (epoch, seq) and \
                stop + jfmt.HEADER_BYTES + head[2] > at
        return (stop % jfmt.SECTOR != 0 and not self._tears_anywhere()
                and any(journal[stop:at]))

    def _tears_anywhere(self) -> bool:
        """Whether the journal's device may have been written through a
        mapping (a fully allocated store file on tmpfs): a process killed
        inside that copy tears a record at any byte, so a record inside one
        sector is no proof of damage there (jfmt.damaged_at assumes a device
        that writes sectors whole).  Memory does not rot as media do."""
        from kvblock.io.mapped import mappable

        return mappable(self.io.devices[0]) is None

    def _drop_after_damage(self, offset: int, seq: int) -> None:
        """Replay stopped at a journal record written whole (acknowledged)
        and damaged since, the last one or with intact records after it
        (a gap): what it removed is unknown -- a
        region it reclaimed may hold other bytes now (trimmed, or written by
        puts a crash kept from committing) -- so no run is trusted (a cache
        loses only time)."""
        runs = list(self.index.runs.values())
        for run in runs:
            self._remove_run(run)
        # A damaged PUT's run id may have reached readers: never given again
        self._next_run_id += 1 << 32
        self.journal_damaged = {"offset": offset, "seq": seq, "runs_dropped": len(runs)}
        logger.warning("kvblock: %s: journal record %d at offset %d is damaged; what it "
                       "removed is unknown, so the store's %d runs are dropped",
                       self.io.devices[0].path, seq, offset, len(runs))

    def _removals_past_gap(self, journal, pos: int, first: int, epoch: int) -> None:
        """The intact records past a journal gap publish nothing, but what
        they show was removed is gone: a region reclaimed there (or in the
        lost records before them, which a PUT of a newer generation of the
        region shows) holds other bytes now than the runs indexed in it."""
        data = memoryview(journal)
        while True:
            records, end, seq = jfmt.scan(data[pos:], first, epoch)
            if not records:
                break
            for rec in records:
                if isinstance(rec, jfmt.PutRun):
                    if rec.run_id > MAX_RUN_ID:
                        continue    # foreign, its id not taken (see _replayed_run)
                    self._next_run_id = max(self._next_run_id, rec.run_id + 1)
                    rec = jfmt.Reclaim(rec.region, rec.generation)
                # (a generation only grows: an older one past the gap names
                # nothing newer than what is indexed, and must not go back)
                if isinstance(rec, jfmt.Reclaim) and not (
                        rec.region < self.regions.count and
                        rec.generation > int(self.regions.generation[rec.region])):
                    continue
                self._replay(rec)
            after = jfmt.records_after(journal, pos + end, seq, epoch)
            if after is None or after[0] <= pos:
                break
            pos, first, _ = after

    def _slot_checkpoint(self, slot: int, head: cpfmt.CheckpointHeader,
                         unreadable: list) -> cpfmt.Checkpoint | None:
        """The checkpoint in ``slot`` (its header ``head`` valid), or None
        when this store cannot load it (payload damaged or unreadable, or
        not of this store's shape)."""
        sb = self.sb
        if cpfmt.HEADER_BYTES + head.payload_bytes > sb.checkpoint_bytes:
            return None
        off = sb.checkpoint_offset + slot * sb.checkpoint_bytes + cpfmt.HEADER_BYTES
        payload = self._read_slot(off, head.payload_bytes, unreadable, array=True)
        cp = None if payload is None else cpfmt.decode_payload(head, payload)
        if cp is None or cp.ranges != self.geometry.run_checksums or \
                len(cp.regions) != self.regions.count:
            return None
        return cp

    def _read_slot(self, off: int, length: int, unreadable: list, array: bool = False):
        """Bytes of a checkpoint slot, or None when the device fails the read
        (the error is appended to ``unreadable``)."""
        try:
            if array:
                return self.io.read_array(0, off, length)
            return self.io.read_bytes(0, off, length)
        except IOFailedError as e:
            # the engine failed (no path, or a broken io_uring: device_fault
            # False), not the device: says nothing of the slot; taken for a
            # bad one, it could make a whole newest slot look lost (a stale
            # checkpoint: every run dropped)
            if not e.device_fault:
                raise
            unreadable.append(e)
            return None

    def _read_journal(self):
        """The journal's bytes.  A range the device cannot read (a bad
        sector) reads as zeros, which ends replay there as a torn record
        does; the ranges go to ``journal_unreadable`` (fsck reports them, a
        writable open rewrites them)."""
        sb = self.sb
        # [offset in the journal, bytes, the error, rewritten]
        self.journal_unreadable = []
        try:
            return self.io.read_array(0, sb.journal_offset, sb.journal_bytes)
        except IOFailedError as e:
            if not e.device_fault:  # the engine failed, not the device
                raise
        journal = np.zeros(sb.journal_bytes, np.uint8)
        unit = max(jfmt.BLOCK, self.io.devices[0].block_size)
        todo = [(0, sb.journal_bytes)]
        while todo:             # halve what fails, down to one block
            pos, length = todo.pop()
            try:
                journal[pos:pos + length] = self.io.read_array(0, sb.journal_offset + pos,
                                                               length)
                continue
            except IOFailedError as e:
                if not e.device_fault:
                    raise
                if length > unit:
                    half = -(-length // 2 // unit) * unit
                    todo += [(pos + half, length - half), (pos, half)]
                    continue
                bad = self.journal_unreadable
                if bad and bad[-1][0] + bad[-1][1] == pos:
                    bad[-1][1] += length
                else:
                    bad.append([pos, length, e, False])
        for pos, length, e, _ in self.journal_unreadable:
            logger.warning("kvblock: %s: %d journal bytes at offset %d are unreadable (%s); "
                           "replay stops there", self.io.devices[0].path, length,
                           sb.journal_offset + pos, e)
        return journal

    def _rewrite_unreadable_journal(self):
        """(a writable open, after its checkpoint started a new epoch: every
        record on the journal is dead) zeros over the unreadable ranges,
        which a drive remaps, so the next open reads them again."""
        for bad in self.journal_unreadable:
            self.io.write_bytes(0, self.sb.journal_offset + bad[0], bytes(bad[1]))
            bad[3] = True
        if self.journal_unreadable:
            self.io.flush([0])

    def _newer_epoch(self, journal, generation: int, newer_lost: bool = True) -> int:
        """k > 0 when the journal's first record belongs to checkpoint
        generation ``generation + k``: a newer checkpoint restarted the
        journal (the other slot's, now unreadable).  0 otherwise -- also
        when the newer checkpoint was torn before its journal began, which
        leaves the older one and its journal whole.  ``newer_lost``: a
        damaged slot may have held a checkpoint newer than ``generation``."""
        first = jfmt.record_at(journal)
        if first is None:
            # A first record that rotted (its checksum fails, or its header
            # elsewhere: its magic) still names its epoch in its header: no
            # rot forges a 64-bit epoch hash, so one of a newer generation
            # shows the journal moved on.
            named = jfmt.epoch_field_at(journal, 0)
            if named is not None and any(
                    named == jfmt.epoch(self.sb.store_uuid, generation + k)
                    for k in range(1, 4)):
                first = (named, None)
        if first is None:
            if self.journal_unreadable and self.journal_unreadable[0][0] == 0 and \
                    newer_lost:
                # The first record is unreadable and so is a checkpoint:
                # nothing tells whether the journal moved on; assume it did
                # (as far as is checked below), the older runs are not safe.
                return 3
            return 0
        for k in range(1, 4):
            if first[0] == jfmt.epoch(self.sb.store_uuid, generation + k):
                return k
        return 0

    def _load_checkpoint(self, cp: cpfmt.Checkpoint):
        rows = cp.runs
        if len(rows):    # checksums prove what was written, not that it was right
            # each run's bytes by a table of the lengths present (a bincount,
            # not np.unique's sort: 80 ms per million runs on the 2-core VM)
            nblocks = rows["nblocks"].astype(np.int64)
            longest = self.max_run_blocks
            table = np.zeros(longest + 1, np.uint64)
            counts = np.bincount(np.minimum(nblocks, longest), minlength=longest + 1)
            for n in np.flatnonzero(counts[1:]) + 1:
                table[n] = self.layout(int(n)).run_bytes
            sizes = table[np.minimum(nblocks, longest)]
            for i in np.flatnonzero(nblocks > longest):    # none unless corrupt
                sizes[i] = self.layout(int(nblocks[i])).run_bytes
            room = np.uint64(self.regions.size)
            bad = np.nonzero((rows["region"] >= self.regions.count) | (nblocks == 0)
                             | (sizes > room) | (rows["offset"] > room - sizes))[0]
            if bad.size:
                row = rows[int(bad[0])]
                off = self.sb.checkpoint_offset + self._cp_slot * self.sb.checkpoint_bytes
                raise NotAStoreError(
                    f"{self.io.devices[0].path}: the checkpoint at offset {off} places "
                    f"{bad.size} run(s) outside their region (run {int(row['run_id'])}: "
                    f"region {int(row['region'])} of {self.regions.count}, offset "
                    f"{int(row['offset'])}, {int(row['nblocks'])} blocks; regions are "
                    f"{self.regions.size} bytes): metadata corrupt, the cached KV cannot be "
                    "trusted: reformat the store", self.io.devices[0].path, off)
        self.regions.generation[:] = cp.regions["generation"]
        self.regions.seal_seq[:] = cp.regions["seal_seq"]
        self.regions.sealed_at[:] = cp.regions["sealed_at"]
        self.regions.next_seal = int(cp.regions["seal_seq"].max(initial=0)) + 1
        self._next_run_id = cp.next_run_id
        key_at = 0
        now = time.time()
        keys = cp.keys.tobytes()
        runs = []
        for i, row in enumerate(cp.runs.tolist()):
            run_id, region, gen, offset, n, _ = row
            runs.append(Run(run_id, region, gen, offset, keys[key_at * 16:(key_at + n) * 16],
                            cp.checksums[i], created=now))
            key_at += n
        self._index_runs(runs)

    def _replayed_run(self, rec: jfmt.PutRun) -> Run | None:
        foreign = None       # what no writer of this store puts in its journal
        if rec.run_id > MAX_RUN_ID:
            # Indexed, its keys' positions (run_id << POS_BITS | position)
            # would wrap past an int64, and every later put's id with it.
            # Its id is not taken either.
            foreign = f"run id {rec.run_id}, past the largest a store hands out ({MAX_RUN_ID})"
            self.journal_foreign_puts.append((rec.run_id, foreign))
            return None
        # Its id is used even when the run is not (a run id seeds its data
        # checksums: never hand one out twice).
        self._next_run_id = max(self._next_run_id, rec.run_id + 1)
        if rec.region >= self.regions.count:
            foreign = f"region {rec.region}, the store has {self.regions.count}"
        elif len(rec.checksums) != self.geometry.run_checksums:
            foreign = (f"{len(rec.checksums)} checksums, the store's runs have "
                       f"{self.geometry.run_checksums}")
        elif rec.offset + self.layout(rec.nblocks).run_bytes > self.regions.size:
            foreign = (f"{rec.nblocks} blocks at offset {rec.offset} of region {rec.region}, "
                       f"past its region's end ({self.regions.size} bytes)")
        if foreign is not None:
            self.journal_foreign_puts.append((rec.run_id, foreign))
            return None
        if rec.generation != int(self.regions.generation[rec.region]):
            return None  # stale: its space was reclaimed since
        return Run(rec.run_id, rec.region, rec.generation, rec.offset, rec.keys,
                   np.array(rec.checksums, dtype=np.uint64), created=time.time())

    def _replay(self, rec):
        """Apply a DROP or RECLAIM record (PUTs go through _replayed_run)."""
        if isinstance(rec, jfmt.DropRun):
            run = self.index.runs.get(rec.run_id)
            if run is not None:
                self._remove_run(run)
        elif isinstance(rec, jfmt.Reclaim):
            if rec.region < self.regions.count:
                for run in self.index.runs_in(rec.region):
                    self._remove_run(run)
                self.regions.generation[rec.region] = rec.generation
                self.regions.fill[rec.region] = 0   # the runs put after it count anew
                # Empty again, as release() leaves it: runs put in it after
                # this record were sealed later, not when the checkpoint's
                # seal time says (evict_older_than and fifo/lru would take
                # them first); _finish_layout seals it anew.
                self.regions.seal_seq[rec.region] = 0
                self.regions.sealed_at[rec.region] = 0
            else:       # no writer of this store names one (a bug, or damage)
                self.journal_foreign_reclaims.append((rec.region, rec.generation))

    def _finish_layout(self):
        """After recovery: regions holding runs are sealed, the rest are free."""
        regions = self.regions
        regions.free.clear()
        regions.open = None
        # Regions sealed after the last checkpoint are sealed in the order
        # they were written, which their runs' ids tell (run ids grow with
        # every put), not by region number: after a wrap the lowest-numbered
        # region may hold the newest runs, and fifo/lru would take it first.
        later = sorted((r for r in range(regions.count)
                        if regions.live[r] > 0 and regions.seal_seq[r] == 0),
                       key=lambda r: max(self.index.by_region.get(r, {0: None})))
        for r in later:
            regions.seal_seq[r] = regions.next_seal
            regions.sealed_at[r] = time.time()
            regions.next_seal += 1
        for r in range(regions.count):
            if regions.live[r] > 0:
                regions.state[r] = SEALED
            else:
                regions.state[r] = FREE
                regions.fill[r] = 0
                regions.free.append(r)
        # Freed at their old generation, though the checkpoint on the device
        # may still place runs there (dropped by replay, or all of them after
        # damage): safe to write only once the open's checkpoint, which no
        # longer lists them, is durable (_write_checkpoint clears this;
        # _allocate refuses a region before).
        self._freed_before_checkpoint = frozenset(regions.free)
