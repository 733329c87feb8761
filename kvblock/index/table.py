"""A compact hash table from 16-byte keys to int64 values, in numpy.

Open addressing with linear probing over three parallel arrays (key low
half, key high half, value), so an indexed block costs about 24 / load-factor
bytes instead of the ~150 bytes of a dict of bytes objects, and every
operation works on a whole batch of keys at once (a run's keys, a request's
prefix, a checkpoint's million keys) without a Python loop per key.
"""

from __future__ import annotations

import numpy as np

EMPTY, TOMBSTONE = -1, -2
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing spreads structured keys
_MIX_INT, _M64 = int(_MIX), (1 << 64) - 1
MAX_LOAD = 0.6
# A rebuild (growth, or tombstones cleared at the same size) leaves at least
# this share of the slots free below MAX_LOAD: one that freed only the
# keys removed since the last (live keys just under MAX_LOAD, a full store
# evicting and putting) was due again a few inserts later, a whole-table
# rebuild per put.  With it a rebuild's cost is at most 16 slots per key
# inserted since.
REBUILD_ROOM = 1 / 16
# Once removals leave fewer live keys than this share of the slots (a
# clear(), a large delete), the table is rebuilt at the size they need: kept
# at its peak, it held the peak's memory and its tombstones, which every
# probe of an absent key walks, until as many new keys rebuilt it (at the
# peak size again).  Far enough below a rebuild's load (MAX_LOAD -
# REBUILD_ROOM) that a shrink follows removals of a good share of the slots.
SHRINK_LOAD = MAX_LOAD / 8
# Up to this many keys are looked up one by one in Python (get_few): for a
# few keys numpy's per-call cost is most of a batch lookup's time (a 2-key
# lookup took 24 us through find(), 3 us through get_few()).
FEW_KEYS = 8
# A rebuild reinserts the live keys of this many slots of the old table at a
# time: the arrays it makes (copies of the keys, their probe positions,
# masks: ~100 bytes a key) are a chunk's, not the table's.  Reinserted all
# at once, a rebuild of a large table held the old table, copies of all its
# keys and that many bytes a key beside the new table (446 MB more at its
# peak for 2.5M keys growing to 224 MB, not 224 MB).
REBUILD_CHUNK = 1 << 16
# find() and an insert work on this many keys of a batch at a time, for the
# same reason: recovery puts a checkpoint's keys (millions) in one batch,
# and their probing held ~90 bytes a key at once (187 MB beside a 112 MB
# table for 2M keys).
BATCH_CHUNK = 1 << 16


def split_keys(keys: bytes | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) uint64 halves of concatenated 16-byte keys."""
    words = np.frombuffer(keys, dtype="<u8") if isinstance(keys, (bytes, bytearray)) \
        else np.ascontiguousarray(keys).view("<u8").reshape(-1)
    words = words.reshape(-1, 2)
    return words[:, 0], words[:, 1]


class KeyTable:
    def __init__(self, capacity: int = 1024):
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self._min_cap = cap      # a shrink goes no lower
        self._alloc(cap)
        self.live = 0

    def _alloc(self, cap: int):
        self.cap = cap
        self.mask = np.uint64(cap - 1)
        self.shift = np.uint64(64 - (cap.bit_length() - 1))
        self.lo = np.zeros(cap, dtype=np.uint64)
        self.hi = np.zeros(cap, dtype=np.uint64)
        self.val = np.full(cap, EMPTY, dtype=np.int64)
        self.used = 0  # live + tombstones
        self._claim = np.full(cap, -1, dtype=np.int32)  # scratch for _insert_new

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self.lo.nbytes + self.hi.nbytes + self.val.nbytes + self._claim.nbytes

    def _home(self, lo, hi):
        with np.errstate(over="ignore"):
            return ((lo ^ (hi * _MIX)) * _MIX) >> self.shift

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Slot of each key, or -1 where absent."""
        n, step = lo.size, BATCH_CHUNK
        slots = np.full(n, -1, dtype=np.int64)
        for at in range(0, n, step):
            clo, chi, out = lo[at:at + step], hi[at:at + step], slots[at:at + step]   # views
            idx = self._home(clo, chi)
            todo = np.arange(clo.size)
            while todo.size:
                v = self.val[idx]
                hit = (v >= 0) & (self.lo[idx] == clo[todo]) & (self.hi[idx] == chi[todo])
                out[todo[hit]] = idx[hit].astype(np.int64)
                go_on = ~hit & (v != EMPTY)
                todo, idx = todo[go_on], (idx[go_on] + np.uint64(1)) & self.mask
        return slots

    def _slot_of(self, lo: int, hi: int) -> int:
        """find() of one key given as Python ints: its slot, or -1."""
        val, klo, khi = self.val, self.lo, self.hi
        mask = self.cap - 1
        i = _home_of(lo, hi, int(self.shift))
        while True:
            v = val.item(i)
            if v == EMPTY:
                return -1
            if v >= 0 and klo.item(i) == lo and khi.item(i) == hi:
                return i
            i = (i + 1) & mask

    def get_few(self, keys: list[bytes]) -> list[int]:
        """get() for a few 16-byte keys, probed one by one with Python ints:
        the same answers as get(), without numpy's per-call cost."""
        val, out = self.val, []
        for key in keys:
            slot = self._slot_of(int.from_bytes(key[:8], "little"),
                                 int.from_bytes(key[8:16], "little"))
            out.append(-1 if slot < 0 else val.item(slot))
        return out

    def get(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Value of each key, or -1 where absent."""
        slots = self.find(lo, hi)
        out = np.full(lo.size, -1, dtype=np.int64)
        present = slots >= 0
        out[present] = self.val[slots[present]]
        return out

    def put(self, lo: np.ndarray, hi: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Insert or overwrite; a key repeated in the batch keeps its last value.
        Returns the values overwritten (one per key that was present)."""
        if lo.size == 0:
            return np.zeros(0, dtype=np.int64)
        if lo.size <= FEW_KEYS:
            return self._put_few(lo.tolist(), hi.tolist(), np.asarray(values).tolist())
        values = np.asarray(values, dtype=np.int64)
        if lo.size > 1 and _has_equal_neighbours(np.sort(lo)):
            # a key repeated in the batch: its last occurrence wins
            order = np.lexsort((np.arange(lo.size), hi, lo))
            slo, shi = lo[order], hi[order]
            last = np.ones(lo.size, dtype=bool)
            last[:-1] = (slo[1:] != slo[:-1]) | (shi[1:] != shi[:-1])
            if not last.all():
                keep = np.sort(order[last])
                lo, hi, values = lo[keep], hi[keep], values[keep]
        slots = self.find(lo, hi)
        present = slots >= 0
        if present.any():
            at = slots[present]
            overwritten = self.val[at]
            self.val[at] = values[present]
            new = ~present
            if not new.any():
                return overwritten
            lo, hi, values = lo[new], hi[new], values[new]
        else:        # all new (recovery's batch of every key): no copy of them
            overwritten = np.zeros(0, dtype=np.int64)
        del slots, present       # not held through a grow
        try:
            if (self.used + lo.size) > MAX_LOAD * self.cap:
                self._grow(self.live + lo.size)
            self._insert_new(lo, hi, values)
        except BaseException:
            self._recount()
            raise
        return overwritten

    def _recount(self):
        """The live and used counts from the slots: after an insert cut
        short (a KeyboardInterrupt between a round's keys placed and their
        count), else len() stays short of the keys held for good (a remove
        of them takes it below zero) and the next grow is sized by it."""
        self.live = int((self.val >= 0).sum())
        self.used = int((self.val != EMPTY).sum())

    def _put_few(self, los: list[int], his: list[int], vals: list[int]) -> np.ndarray:
        """put() of a few keys given as Python ints, one by one (a put of a
        short run); the same answers and table contents as put()."""
        last = {key: i for i, key in enumerate(zip(los, his))}   # repeated: the last wins
        overwritten, new = [], []
        for i in sorted(last.values()):
            slot = self._slot_of(los[i], his[i])
            if slot >= 0:
                overwritten.append(self.val.item(slot))
                self.val[slot] = vals[i]
            else:
                new.append(i)
        if new:
            try:
                self._insert_few(los, his, vals, new)
            except BaseException:
                self._recount()      # (see put())
                raise
        return np.array(overwritten, dtype=np.int64)

    def _insert_few(self, los: list[int], his: list[int], vals: list[int], new: list[int]):
        """_put_few's insert of the keys ``new`` indexes (absent ones)."""
        if self.used + len(new) > MAX_LOAD * self.cap:
            self._grow(self.live + len(new))
        # Placed as _insert_new places them (the same slots, so the same
        # tombstones reused): in rounds, each key at a free slot claims
        # it, the last claimant of a slot takes it, the others step on.
        val, mask, shift = self.val, self.cap - 1, int(self.shift)
        pending = [(i, _home_of(los[i], his[i], shift)) for i in new]
        while pending:
            claims = {slot: i for i, slot in pending if val.item(slot) < 0}
            later = []
            for i, slot in pending:
                if claims.get(slot) != i:
                    later.append((i, (slot + 1) & mask))
                    continue
                if val.item(slot) == EMPTY:
                    self.used += 1       # a tombstone reused was counted already
                self.lo[slot], self.hi[slot], val[slot] = los[i], his[i], vals[i]
            pending = later
        self.live += len(new)

    def _insert_new(self, lo, hi, values):
        step = BATCH_CHUNK
        for at in range(0, lo.size, step):
            clo, chi, cval = lo[at:at + step], hi[at:at + step], values[at:at + step]
            idx = self._home(clo, chi)
            todo = np.arange(clo.size)
            while todo.size:
                free = self.val[idx] < 0
                # Among keys aiming at the same free slot one takes it
                # (scatter: the last write to a slot of the scratch array
                # wins), the rest probe on.
                cand = np.nonzero(free)[0]
                target = idx[cand].astype(np.int64)
                cand = cand.astype(np.int32)
                self._claim[target] = cand
                win = cand[self._claim[target] == cand]
                self._claim[target] = -1
                slots, who = idx[win].astype(np.int64), todo[win]
                self.used += int((self.val[slots] == EMPTY).sum())
                self.lo[slots], self.hi[slots], self.val[slots] = clo[who], chi[who], cval[who]
                self.live += win.size
                rest = np.ones(todo.size, dtype=bool)
                rest[win] = False
                todo, idx = todo[rest], (idx[rest] + np.uint64(1)) & self.mask

    def remove(self, lo: np.ndarray, hi: np.ndarray, expect: np.ndarray | None = None) -> int:
        """Delete keys (only where the value equals ``expect``, when given)."""
        slots = self.find(lo, hi)
        ok = slots >= 0
        if expect is not None:
            ok &= self.val[np.where(ok, slots, 0)] == np.asarray(expect, dtype=np.int64)
        gone = np.unique(slots[ok])
        try:
            self.val[gone] = TOMBSTONE
            self.live -= gone.size
        except BaseException:
            # Cut between the two (a KeyboardInterrupt): counted from the
            # slots, else the count stays off for good (a remove again
            # finds the keys gone) and len() and the shrink go by it.
            self.live = int((self.val >= 0).sum())
            raise
        if self.cap > self._min_cap and self.live < SHRINK_LOAD * self.cap:
            self._rebuild(self._min_cap, self.live)
        return int(gone.size)

    def _grow(self, need: int):
        self._rebuild(self.cap, need)

    def _rebuild(self, cap: int, need: int):
        """Reinsert the live keys into the smallest table of ``cap`` slots
        times a power of two that holds ``need`` keys with room to spare."""
        while need > (MAX_LOAD - REBUILD_ROOM) * cap:
            cap *= 2
        # Built aside and swapped in at once: cut half way (a
        # KeyboardInterrupt), the table is the old one, not an empty or
        # half-filled one (every key not yet reinserted lost from the index).
        new = KeyTable.__new__(KeyTable)
        new._min_cap = self._min_cap
        new._alloc(cap)
        new.live = 0
        # A chunk of the old table at a time (in slot order): no copy of
        # every live key beside the two tables.
        step = REBUILD_CHUNK
        for at in range(0, self.cap, step):
            val = self.val[at:at + step]
            live = np.flatnonzero(val >= 0)
            if live.size:
                new._insert_new(self.lo[at:at + step][live], self.hi[at:at + step][live],
                                val[live])
        self.__dict__.update(new.__dict__)


def _home_of(lo: int, hi: int, shift: int) -> int:
    """KeyTable._home of one key given as Python ints (uint64 arithmetic)."""
    return (((lo ^ ((hi * _MIX_INT) & _M64)) * _MIX_INT) & _M64) >> shift


def _has_equal_neighbours(sorted_values: np.ndarray) -> bool:
    return bool((sorted_values[1:] == sorted_values[:-1]).any())
