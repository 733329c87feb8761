"""In-memory index: key -> (run, position), and the runs themselves.

Keys map to ``run_id << POS_BITS | position`` (one int per key) to keep the
per-block cost small; a run keeps its keys in one bytes object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvblock.index.keys import KEY_BYTES

POS_BITS = 24


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


class KeyIndex:
    def __init__(self):
        self._keys: dict[bytes, int] = {}
        self.runs: dict[int, Run] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, run: Run) -> None:
        self.runs[run.run_id] = run
        base = run.run_id << POS_BITS
        keys = run.keys
        for pos in range(run.nblocks):
            self._keys[keys[pos * KEY_BYTES:(pos + 1) * KEY_BYTES]] = base | pos

    def remove(self, run: Run) -> None:
        """Drop a run; keys since re-stored by a newer run keep pointing there."""
        self.runs.pop(run.run_id, None)
        base = run.run_id << POS_BITS
        for pos in range(run.nblocks):
            k = run.key(pos)
            if self._keys.get(k) == base | pos:
                del self._keys[k]

    def locate(self, key: bytes) -> tuple[Run, int] | None:
        packed = self._keys.get(key)
        if packed is None:
            return None
        return self.runs[packed >> POS_BITS], packed & ((1 << POS_BITS) - 1)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def prefix_length(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n
