"""In-memory index: key -> (run, position), and the runs themselves.

Keys live in a :class:`~kvblock.index.table.KeyTable` (numpy open addressing)
mapping to ``run_id << POS_BITS | position``; a run keeps its own keys as
one bytes object (what checkpoints and the journal store).

A key stored again by a newer run points there from then on: the older run's
position is superseded.  A run counts its positions still pointed at
(``live``); one left with none is of no use and is dropped, and a checkpoint
writes a superseded position's key as :data:`SUPERSEDED` (16 zero bytes, a
key no caller may use), so that deleting the newer run cannot bring the
older copy back after a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvblock.index.keys import _ZERO_STANDIN, KEY_BYTES, key_begins
from kvblock.index.table import FEW_KEYS, KeyTable, split_keys

POS_BITS = 24                      # up to 16M blocks per run
POS_MASK = (1 << POS_BITS) - 1
MAX_RUN_ID = (1 << (63 - POS_BITS)) - 1  # run ids are sequential: 2^39 puts
SUPERSEDED = bytes(KEY_BYTES)      # a superseded position's key in checkpoints
# the key 0's stand-in (keys.py) as the table holds it: (low, high) words
_STANDIN_WORDS = tuple(int.from_bytes(_ZERO_STANDIN[at:at + 8], "little") for at in (0, 8))


@dataclass(eq=False)
class Run:
    run_id: int
    region: int
    generation: int
    offset: int              # byte offset inside the region
    keys: bytes              # nblocks * 16
    checksums: np.ndarray    # uint64 per (layer, head group) range
    pins: int = 0
    hits: int = 0
    created: float = field(default=0.0)
    live: int = 0            # positions whose key points here (set by KeyIndex)
    # The store's publish count when this run was published (0: recovered
    # at open, older than any run published since): orders copies of a key
    # in the DRAM tier (KVStore._publish_puts, HostTier.drop_older).
    published: int = 0

    @property
    def nblocks(self) -> int:
        return len(self.keys) // KEY_BYTES

    def key(self, pos: int) -> bytes:
        return self.keys[pos * KEY_BYTES:(pos + 1) * KEY_BYTES]

    def packed(self) -> np.ndarray:
        return (np.int64(self.run_id) << np.int64(POS_BITS)) + np.arange(self.nblocks,
                                                                          dtype=np.int64)


class KeyIndex:
    def __init__(self):
        self.table = KeyTable()
        self.runs: dict[int, Run] = {}
        # Kept beside ``runs`` so that a reclaim and a checkpoint do not scan
        # every run under the store's lock (seconds at a million runs):
        self.by_region: dict[int, dict[int, Run]] = {}   # region -> its runs by id
        self.partly: set[int] = set()    # runs a newer run took some keys from

    def runs_in(self, region: int) -> list[Run]:
        """The indexed runs in ``region``."""
        return list(self.by_region.get(region, {}).values())

    def _set_live(self, run: Run, n: int) -> None:
        run.live = n
        if n < run.nblocks:
            self.partly.add(run.run_id)
        else:
            self.partly.discard(run.run_id)

    def __len__(self) -> int:
        return len(self.table)

    def add(self, run: Run) -> None:
        self.add_many([run])

    def add_many(self, runs: list[Run]) -> list[Run]:
        """Index runs; a key stored by several keeps the last run's position.
        Returns the runs (indexed before, or in ``runs``) left with no
        position pointed at: the caller drops them."""
        if not runs:
            return []
        for run in runs:
            self.runs[run.run_id] = run
            self.by_region.setdefault(run.region, {})[run.run_id] = run
        lo, hi = split_keys(b"".join(r.keys for r in runs))
        packed = np.concatenate([r.packed() for r in runs])
        kept = (lo != 0) | (hi != 0)              # SUPERSEDED positions stay out
        all_kept = bool(kept.all())
        if not all_kept:
            lo, hi, packed = lo[kept], hi[kept], packed[kept]
        before = len(self.table)
        overwritten = self.table.put(lo, hi, packed)
        hit = set()
        keyless = []                              # runs of SUPERSEDED positions only
        if len(self.table) - before + overwritten.size == lo.size:
            # No key twice in the batch: each run's kept positions point at it.
            if all_kept:
                for run in runs:
                    run.live = run.nblocks
            else:
                ends = np.cumsum([run.nblocks for run in runs])
                counts = np.diff(np.r_[0, np.cumsum(kept)[ends - 1]])
                for run, n in zip(runs, counts.tolist()):
                    self._set_live(run, n)
                keyless = [run for run in runs if run.live == 0]
            if not overwritten.size:
                return keyless                    # fresh keys only: the usual put
        else:
            hit.update(run.run_id for run in runs)
        hit.update(int(r) for r in np.unique(overwritten >> POS_BITS))
        hit_runs = [self.runs[i] for i in hit if i in self.runs]
        if hit_runs:                              # one probe for all of them
            live = self._live_positions(hit_runs)
            sizes = np.array([run.nblocks for run in hit_runs])
            counts = np.add.reduceat(live.astype(np.int64), np.cumsum(sizes) - sizes)
            for run, n in zip(hit_runs, counts.tolist()):
                self._set_live(run, n)
        return keyless + [run for run in hit_runs if run.live == 0]

    def _live_positions(self, runs: list[Run]) -> np.ndarray:
        """Per position of each of ``runs`` (concatenated): does its key
        still point there?"""
        lo, hi = split_keys(b"".join(run.keys for run in runs))
        return self.table.get(lo, hi) == np.concatenate([run.packed() for run in runs])

    def live_keys(self, runs: list[Run]) -> list[bytes]:
        """The keys of ``runs``' positions still pointed at (a newer run
        holds the others)."""
        out = [run.key(k) for run in runs if run.live == run.nblocks
               for k in range(run.nblocks)]
        partly = [run for run in runs if run.live < run.nblocks]
        if partly:
            live = self._live_positions(partly).tolist()
            out += [key for key, held in zip((run.key(k) for run in partly
                                              for k in range(run.nblocks)), live) if held]
        return out

    def superseded(self) -> dict[int, np.ndarray]:
        """(under the store's lock, with the runs snapshot) per run a newer
        run took keys from: is each of its positions' key still its own?"""
        partly = [self.runs[i] for i in self.partly]
        if not partly:
            return {}
        live = self._live_positions(partly)
        ends = np.cumsum([run.nblocks for run in partly])
        return {run.run_id: part for run, part in zip(partly, np.split(live, ends[:-1]))}

    @staticmethod
    def checkpoint_keys(runs: list[Run], superseded: dict[int, np.ndarray]) -> np.ndarray:
        """The runs' keys as a checkpoint stores them, (positions, 16) bytes:
        SUPERSEDED (zero) where ``superseded`` says a newer run holds the key.
        Reads only what never changes in a published run: no lock needed."""
        keys = np.frombuffer(b"".join([run.keys for run in runs]), dtype=np.uint8)
        keys = keys.reshape(-1, KEY_BYTES)
        if not superseded:
            return keys
        keys = keys.copy()
        at = 0
        for run in runs:
            live = superseded.get(run.run_id)
            if live is not None:
                keys[at:at + run.nblocks][~live] = 0
            at += run.nblocks
        return keys

    def remove(self, run: Run) -> None:
        """Drop a run; keys since re-stored by a newer run keep pointing there."""
        self.runs.pop(run.run_id, None)
        in_region = self.by_region.get(run.region)
        if in_region is not None:
            in_region.pop(run.run_id, None)
            if not in_region:
                del self.by_region[run.region]
        self.partly.discard(run.run_id)
        lo, hi = split_keys(run.keys)
        self.table.remove(lo, hi, expect=run.packed())
        run.live = 0

    def lookup(self, keys: list[bytes]) -> np.ndarray:
        """Packed (run id, position) per key; -1 where absent."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        if len(keys) <= FEW_KEYS:
            return np.array(self.table.get_few(keys), dtype=np.int64)
        lo, hi = split_keys(b"".join(keys))
        return self.table.get(lo, hi)

    def published_of(self, packed: np.ndarray) -> np.ndarray:
        """Run.published of the run each of ``packed`` (lookup()'s answer)
        names, -1 where absent: each run taken once, not once per key."""
        out = np.full(packed.size, -1, dtype=np.int64)
        present = packed >= 0
        if present.any():
            ids, which = np.unique(packed[present] >> POS_BITS, return_inverse=True)
            out[present] = np.array([self.runs[i].published for i in ids.tolist()],
                                    dtype=np.int64)[which]
        return out

    def locate(self, key: bytes) -> tuple[Run, int] | None:
        packed = self.table.get_few([key])[0]
        if packed < 0:
            return None
        return self.runs[packed >> POS_BITS], packed & POS_MASK

    def __contains__(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def runs_with_prefix(self, prefix: bytes) -> list[Run]:
        """The runs a key beginning with ``prefix`` (1 to 8 bytes) points
        into: one vectorised pass over the table (a key's first 8 bytes are
        its low word), not a loop over the runs."""
        if not 1 <= len(prefix) <= 8:
            raise ValueError(f"a key prefix is 1 to 8 bytes, got {len(prefix)}")
        t = self.table
        mask = np.uint64((1 << (8 * len(prefix))) - 1)
        want = np.uint64(int.from_bytes(prefix, "little"))
        hit = (t.val >= 0) & ((t.lo & mask) == want)
        # the key 0 is held under a stand-in: matched as the zeros given
        slot = t._slot_of(*_STANDIN_WORDS)
        if slot >= 0:
            hit[slot] = key_begins(_ZERO_STANDIN, prefix)
        ids = np.unique(t.val[hit] >> POS_BITS)
        return [self.runs[i] for i in ids.tolist()]

    def prefix_length(self, keys: list[bytes]) -> int:
        if len(keys) <= FEW_KEYS:
            n = 0
            for packed in self.table.get_few(keys):
                if packed < 0:
                    break
                n += 1
            return n
        found = self.lookup(keys) >= 0
        return int(found.size if found.all() else np.argmin(found))

    def segments(self, keys: list[bytes], windowed: bool = False
                 ) -> list[tuple[Run, int, int, int]]:
        """(run, first position, count, first key index) for each stretch of
        the stored prefix of ``keys`` that is consecutive within one run.
        ``windowed``: the keys are looked up a window at a time (FEW_KEYS,
        then four times as many each time) up to the first absent one, not
        all at once: for a caller that asks again and again with all the
        keys left whose stored prefixes are short (a layer-wise load
        alternating DRAM and device stretches), which cost work quadratic
        in the keys.  The answer is the same."""
        if len(keys) <= FEW_KEYS:
            return self._few_segments(self.table.get_few(keys))
        packed = self._stored_prefix_windowed(keys) if windowed else self.lookup(keys)
        n = int(packed.size if (packed >= 0).all() else np.argmin(packed >= 0))
        if n <= FEW_KEYS:        # (numpy's per-call cost is most of it)
            return self._few_segments(packed[:n].tolist())
        packed = packed[:n]
        # A stretch ends where the next position is not the next one of the
        # same run: a run of POS_MASK + 1 blocks packs its last position one
        # below the next run id's position 0.
        starts = np.nonzero(np.r_[True, (np.diff(packed) != 1)
                                  | (np.diff(packed >> POS_BITS) != 0)])[0]
        counts = np.diff(np.r_[starts, n])
        return [(self.runs[int(packed[s]) >> POS_BITS], int(packed[s]) & POS_MASK, int(c), int(s))
                for s, c in zip(starts, counts)]

    def _stored_prefix_windowed(self, keys: list[bytes]) -> np.ndarray:
        """lookup() of ``keys`` a window at a time up to the window holding
        the first absent key (those past it are not looked up): at most
        four times the stored prefix's keys, plus FEW_KEYS."""
        parts, at, size = [], 0, max(FEW_KEYS, 1)
        while at < len(keys):
            part = self.lookup(keys[at:at + size])
            parts.append(part)
            if (part < 0).any():
                break
            at += size
            size *= 4
        return np.concatenate(parts)

    def _few_segments(self, packed: list[int]) -> list[tuple[Run, int, int, int]]:
        """segments() of a few keys' packed values, in plain Python."""
        out, k, n = [], 0, len(packed)
        while k < n and packed[k] >= 0:
            first = k
            k += 1
            while k < n and packed[k] == packed[k - 1] + 1 and packed[k] & POS_MASK:
                k += 1
            p = packed[first]
            out.append((self.runs[p >> POS_BITS], p & POS_MASK, k - first, first))
        return out
