"""A scripted store workload with known data, and the checks run after a crash.

Data of a run is derived from its keys, so a checker can tell exactly which
bytes each stored key must read back as.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvblock import Geometry, KVStore, aligned_empty, create_file
from kvblock.index import normalize_keys

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16,
                head_groups=2)   # 2 KiB per (layer, group) block, 8 KiB per block
REGION = 256 << 10


def small_store(path, size: int = 4 << 20) -> str:
    """A store file of ``size`` bytes formatted at ``path`` with GEOM, regions
    of REGION and a small journal: a few puts fill it."""
    create_file(path, size)
    KVStore.format([str(path)], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    return str(path)


def run_keys(i: int, n: int) -> list[bytes]:
    return [f"run{i}-blk{j}".encode() for j in range(n)]


def run_data(keys: list[bytes], geom: Geometry = GEOM) -> np.ndarray:
    seed = xxhash.xxh64_intdigest(b"".join(keys))
    return np.random.default_rng(seed).integers(0, 256, len(keys) * geom.block_bytes,
                                                dtype=np.uint8)


@dataclass
class Journal:
    """What the workload did, as seen by its caller."""

    attempted: dict = field(default_factory=dict)     # first key -> keys of the run
    acked: set = field(default_factory=set)            # first keys of puts that returned
    deleting: set = field(default_factory=set)         # first keys whose delete was called
    deleted: set = field(default_factory=set)          # ... and returned


def workload(store: KVStore, log: Journal, runs: int = 12, evicting: bool = False,
             batched: bool = False) -> None:
    """Puts of runs of 1-4 blocks, with deletes, checks and a checkpoint
    between them; ``batched``: the runs go three at a time through put_runs."""
    group = 3 if batched else 1
    for first in range(0, runs, group):
        todo = [run_keys(i, 1 + i % 4) for i in range(first, min(runs, first + group))]
        for keys in todo:
            log.attempted[keys[0]] = keys
        if batched:       # from aligned buffers: runs of 2 and 4 blocks are written in place
            store.put_runs([(keys, _aligned(run_data(keys))) for keys in todo])
        else:
            store.put_run(todo[0], run_data(todo[0]))
        for keys in todo:
            log.acked.add(keys[0])
        for i in range(first, first + len(todo)):
            _between_puts(store, log, i, evicting)


def _aligned(data: np.ndarray) -> np.ndarray:
    out = aligned_empty(data.nbytes)
    out[:] = data
    return out


def _between_puts(store: KVStore, log: Journal, i: int, evicting: bool) -> None:
    if i % 5 == 4:
        victim = run_keys(i - 2, 1 + (i - 2) % 4)
        log.deleting.add(victim[0])
        store.delete(victim[:1])
        log.deleted.add(victim[0])
    if i % 6 == 5:
        check_store(store, log, evicting=evicting, live=True)
    if i == 7:
        store.checkpoint()


def check_store(store: KVStore, log: Journal, *, evicting: bool = False,
                live: bool = False, corrupted: bool = False) -> int:
    """No phantom, no wrong byte, nothing acknowledged lost.  Returns blocks found.

    ``corrupted``: the medium was damaged on purpose, so a delete may be
    forgotten and a read may stop at a checksum failure; bytes read must
    still be right."""
    found = 0
    known = {k for keys in log.attempted.values() for k in normalize_keys(keys)}
    for run in list(store.index.runs.values()):
        for j in range(run.nblocks):
            assert run.key(j) in known, f"phantom key {run.key(j)!r} in the index"
    for first, keys in log.attempted.items():
        n = store.lookup(keys)
        if first in log.deleted and not corrupted:
            assert n == 0, f"run {first!r} was deleted (acknowledged) but {n} blocks remain"
        elif first in log.acked and first not in log.deleting and not evicting:
            assert n == len(keys), f"acknowledged run {first!r}: only {n}/{len(keys)} blocks"
        if n:
            out = np.zeros(len(keys) * GEOM.block_bytes, np.uint8)
            got = store.get_run(keys, out)
            assert got == n or (corrupted and got < n), \
                f"{first!r}: lookup said {n} blocks, get_run read {got}"
            n = got
            shape = (GEOM.num_layers, GEOM.head_groups, len(keys), GEOM.group_block_bytes)
            want = run_data(keys).reshape(shape)[:, :, :n]
            assert np.array_equal(out.reshape(shape)[:, :, :n], want), f"{first!r}: wrong bytes"
            found += n
    if not live:
        assert store.counters["checksum_failures"] == 0
    return found
