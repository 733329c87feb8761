"""In-memory index: key -> (run, position), and the runs themselves.

Keys live in a :class:`~kvblock.index.table.KeyTable` (numpy open addressing)
mapping to ``run_id << POS_BITS | position``; a run keeps its own keys as
one bytes object (what checkpoints and the journal store).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvblock.index.keys import KEY_BYTES
from kvblock.index.table import KeyTable, split_keys

POS_BITS = 24                      # up to 16M blocks per run
POS_MASK = (1 << POS_BITS) - 1
MAX_RUN_ID = (1 << (63 - POS_BITS)) - 1  # run ids are sequential: 2^39 puts


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

    def __len__(self) -> int:
        return len(self.table)

    def add(self, run: Run) -> None:
        self.add_many([run])

    def add_many(self, runs: list[Run]) -> None:
        """Index runs; a key stored by several keeps the last run's position."""
        if not runs:
            return
        for run in runs:
            self.runs[run.run_id] = run
        lo, hi = split_keys(b"".join(r.keys for r in runs))
        self.table.put(lo, hi, np.concatenate([r.packed() for r in runs]))

    def remove(self, run: Run) -> None:
        """Drop a run; keys since re-stored by a newer run keep pointing there."""
        self.runs.pop(run.run_id, None)
        lo, hi = split_keys(run.keys)
        self.table.remove(lo, hi, expect=run.packed())

    def lookup(self, keys: list[bytes]) -> np.ndarray:
        """Packed (run id, position) per key; -1 where absent."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        lo, hi = split_keys(b"".join(keys))
        return self.table.get(lo, hi)

    def locate(self, key: bytes) -> tuple[Run, int] | None:
        packed = int(self.lookup([key])[0])
        if packed < 0:
            return None
        return self.runs[packed >> POS_BITS], packed & POS_MASK

    def __contains__(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def prefix_length(self, keys: list[bytes]) -> int:
        found = self.lookup(keys) >= 0
        return int(found.size if found.all() else np.argmin(found))

    def segments(self, keys: list[bytes]) -> list[tuple[Run, int, int, int]]:
        """(run, first position, count, first key index) for each stretch of
        the stored prefix of ``keys`` that is consecutive within one run."""
        packed = self.lookup(keys)
        n = int(packed.size if (packed >= 0).all() else np.argmin(packed >= 0))
        if n == 0:
            return []
        packed = packed[:n]
        starts = np.nonzero(np.r_[True, np.diff(packed) != 1])[0]
        counts = np.diff(np.r_[starts, n])
        return [(self.runs[int(packed[s]) >> POS_BITS], int(packed[s]) & POS_MASK, int(c), int(s))
                for s, c in zip(starts, counts)]
