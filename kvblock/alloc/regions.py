"""Log-structured region allocator.

The data area of every device is cut into equal regions; region ``r`` lives
on device ``r % ndev`` (striping region by region, so consecutive regions use
different devices).  Runs are appended to one open region at a time; a full
region is sealed; space comes back only by reclaiming a whole region (one
TRIM), chosen by the eviction policy.  Allocation is O(1): a bump pointer in
the open region and a FIFO of free regions.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

FREE, OPEN, SEALED = 0, 1, 2


class RegionTable:
    def __init__(self, region_count: int, region_size: int, device_count: int,
                 data_offsets: list[int]):
        self.count = region_count
        self.size = region_size
        self.device_count = device_count
        self.data_offsets = list(data_offsets)
        self.generation = np.zeros(region_count, dtype=np.uint32)
        self.seal_seq = np.zeros(region_count, dtype=np.uint64)
        # seconds since the epoch; exact here, rounded up in a checkpoint
        # (evict_older_than never takes a region sealed after its cutoff)
        self.sealed_at = np.zeros(region_count, dtype=np.float64)
        self.state = np.zeros(region_count, dtype=np.uint8)
        self.fill = np.zeros(region_count, dtype=np.uint64)     # bytes appended
        self.live = np.zeros(region_count, dtype=np.int64)      # live runs
        self.pins = np.zeros(region_count, dtype=np.int64)      # readers + writers in flight
        self.last_access = np.zeros(region_count, dtype=np.float64)
        self.hits = np.zeros(region_count, dtype=np.int64)
        self.free: deque[int] = deque(range(region_count))
        self.open: int | None = None
        self.next_seal = 1

    # --- addressing -----------------------------------------------------------------
    def device_of(self, region: int) -> int:
        return region % self.device_count

    def address(self, region: int, offset: int = 0) -> tuple[int, int]:
        """(device index, byte offset on that device) of a region-relative offset."""
        dev = region % self.device_count
        return dev, self.data_offsets[dev] + (region // self.device_count) * self.size + offset

    # --- allocation -----------------------------------------------------------------
    def allocate(self, nbytes: int, now: float) -> tuple[int, int] | None:
        """(region, offset) for ``nbytes`` appended in the open region, opening
        a free region when needed; None when no free region is left."""
        if nbytes > self.size:
            raise ValueError(f"{nbytes} bytes do not fit a {self.size}-byte region")
        if self.open is not None and int(self.fill[self.open]) + nbytes > self.size:
            self.seal(self.open)
        if self.open is None:
            if not self.free:
                return None
            r = self.free.popleft()
            self.state[r] = OPEN
            self.fill[r] = 0
            self.last_access[r] = now
            self.hits[r] = 0
            self.open = r
        r = self.open
        offset = int(self.fill[r])
        self.fill[r] = offset + nbytes
        return r, offset

    def seal(self, region: int, now: float | None = None) -> None:
        if self.open == region:
            self.open = None
        self.state[region] = SEALED
        self.seal_seq[region] = self.next_seal
        self.sealed_at[region] = time.time() if now is None else now
        self.next_seal += 1

    def release(self, region: int, generation: int | None = None) -> None:
        """A region is empty again (after reclaim): its generation becomes
        ``generation`` (the one its RECLAIM record made durable), or the next."""
        if self.state[region] == FREE:
            raise ValueError(f"region {region} released twice")
        if self.open == region:
            self.open = None
        self.state[region] = FREE
        self.fill[region] = 0
        self.live[region] = 0
        self.seal_seq[region] = 0
        self.sealed_at[region] = 0
        if generation is None:
            self.generation[region] += 1
        else:
            self.generation[region] = generation
        self.free.append(region)

    # --- eviction -------------------------------------------------------------------
    def victim(self, policy: str, sealed_before: int | None = None) -> int | None:
        """The region to reclaim next: sealed, holding no pinned runs (and
        with ``sealed_before``, a seal number: sealed before it).

        fifo: oldest sealed; lru: least recently read or written, ties broken
        by fewer hits (frequency-aware), then by the oldest sealed (after a
        reopen no access is known: the seal order is the write order).  A
        vectorised scan over the region table, run once per region reclaimed.
        """
        eligible = (self.state == SEALED) & (self.pins == 0)
        if sealed_before is not None:
            eligible &= self.seal_seq < sealed_before
        candidates = np.nonzero(eligible)[0]
        if candidates.size == 0:
            return None
        if policy == "fifo":
            return int(candidates[np.argmin(self.seal_seq[candidates])])
        order = np.lexsort((self.seal_seq[candidates], self.hits[candidates],
                            self.last_access[candidates]))
        return int(candidates[order[0]])

    @property
    def used_bytes(self) -> int:
        """Bytes appended to regions not free: dead space (runs deleted,
        superseded or refused, space a failed put took) counts until its
        region is reclaimed.  A region's fill is not in a checkpoint (the
        on-device format has no field for it): an open reconstructs it as
        the end of the region's last live run, so after a reopen the dead
        space past that run no longer counts and the gauge can drop,
        though the space is not usable before the region is reclaimed."""
        return int(self.fill[self.state != FREE].sum())
