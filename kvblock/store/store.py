"""KVStore: runs of KV blocks on one or more devices, crash-consistent.

On-device map (device 0; other devices hold only the superblocks and data)::

    [superblock A][superblock B][checkpoint slot 0][checkpoint slot 1][journal][regions...]

Invariants (enforced where named):
- Data before metadata: a run's bytes are written and flushed before the
  journal record that publishes it (``_commit`` flushes every data device
  before writing the journal), and the run becomes visible in the index only
  after that record is durable (the PUT's apply callback runs after the flush).
- Removal may happen early, addition never: DROP/RECLAIM take runs out of the
  index before their record is durable, which after a crash can only make
  the cache smaller, never wrong.
- Reused space: a region is written again only after its RECLAIM record (with
  the region's new generation) is durable, and data checksums are seeded with
  the run id, so bytes of a reclaimed run never verify as another run's.
- Readers pin the regions they read; the eviction policy never picks a pinned
  region, so a block is never reclaimed under a reader.
- Every open replays the journal and then writes a new checkpoint, which starts
  a new journal epoch: records of an earlier epoch left on the medium are
  never replayed (see format/journal.py).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import xxhash

from kvblock.alloc.regions import FREE, SEALED, RegionTable
from kvblock.devices import Device, check_distinct
from kvblock.errors import (
    ConfigError,
    DeviceTooSmallError,
    FormatError,
    GeometryMismatchError,
    IOFailedError,
    KVBlockError,
    MissingDeviceError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreFullError,
    UnsupportedVersionError,
)
from kvblock.format import checkpoint as cpfmt
from kvblock.format import journal as jfmt
from kvblock.format import superblock as sbfmt
from kvblock.format import trailer as trailerfmt
from kvblock.format.checksum import data_seed
from kvblock.index import KeyIndex, Run, normalize_keys
from kvblock.index.index import POS_BITS
from kvblock.io import IOBatch, open_engine
from kvblock.io.engine import FEW_IOS
from kvblock.io import native
from kvblock.layout.geometry import Geometry, RunLayout, model_fingerprint, round_up
from kvblock.memory import HostBuffer
from kvblock.memory.spares import SpareBuffers
from kvblock.store.fence import fence_writers
from kvblock.store.policy import EVICTION_POLICIES, VERIFY_MODES, Admission
from kvblock.store.scatter import BlockList, as_array
from kvblock.store.storeio import StoreIO
from kvblock.tiers import HostTier

MIB = 1 << 20
# A default region is a round size plus 1/TRAILER_RESERVE for runs' trailers.
TRAILER_RESERVE = 64
# Counters every store reports (stats(), Prometheus), zero until something happens.
COUNTERS = (
    "put_runs", "put_blocks", "put_duplicate_runs", "admission_rejected_runs", "bytes_written",
    "lookups", "lookup_hit_blocks", "get_blocks", "get_bytes", "miss_gets", "bytes_read",
    "checksum_failures", "deleted_runs", "evicted_regions", "evicted_runs", "evicted_blocks",
    "discards", "commits", "journal_bytes", "checkpoints", "replayed_records", "recovery_us",
    "host_hit_blocks", "device_hit_blocks", "read_errors", "stale_checkpoint_runs_dropped",
    "lapsed_pin_gets", "cleared_puts", "superseded_runs", "partial_verified_reads",
)
RECLAIMING = 3  # region state while its RECLAIM record is being committed
CLEAR_DROP_BATCH = 4096  # DROP records per journal commit when clear() drops pinned runs
logger = logging.getLogger(__name__)


# Staging memory that layer-wise loads (kvblock.tensors.load_blocks) leave
# here for the next load: up to 3 unit buffers of ~8 MiB per load in flight.
LOAD_STAGING_KEEP = 128 << 20


def _span(blocks, start: int, stop: int):
    """Blocks start..stop of a (layers, groups, n, bytes) array or a BlockList."""
    return blocks.sub(start, stop) if isinstance(blocks, BlockList) else blocks[:, :, start:stop]


class PinHandle(list):
    """What :meth:`KVStore.pin` returns: the pinned stretches, released once."""

    released = False


def _one(blocks, k: int) -> np.ndarray:
    """Block k as (layers, groups, bytes)."""
    return blocks.block(k) if isinstance(blocks, BlockList) else blocks[:, :, k]


def _seed(run) -> np.uint64:
    """A run's checksum seed as read_hashed takes it (data_checksum's)."""
    return np.uint64(data_seed(run.run_id))


class Streams(NamedTuple):
    """_stage_run's answer when the write is to hash the run: each I/O's
    checksum index (its range, or ``ranges`` for the trailer)."""

    of_ios: np.ndarray


class Later(NamedTuple):
    """_stage_run's answer for a run whose checksums are computed while its
    data is written (:meth:`KVStore._write_run`): ``digest()`` fills the
    trailer and returns the range checksums; ``tail`` writes the trailer
    afterwards."""

    digest: Callable[[], np.ndarray]
    tail: IOBatch
    trailer: np.ndarray


# A run's hashing (range checksums where the write does not compute them,
# and the block digests of its trailer) runs on a helper thread while its data
# is written, for runs of at least OVERLAP_HASH_BYTES; smaller runs hash
# first and write data and trailer in one I/O (a thread handoff and a second
# write cost more than their hashing).  Both the hashing (xxhash, native) and
# the I/O release the GIL.  One writer, loop devices over /var/tmp and
# /dev/shm and a file in /var/tmp (perf/put_hashing.py --overlap-from 1,
# 2026-12-01): runs of 256 KiB to 1 MiB 0.85-1.00x hashed while written, 2
# and 4 MiB 0.96-1.10x, 8 MiB 1.10-1.20x, 32 MiB 1.25-1.44x.  A writer that
# finds every helper busy (many writer threads: their hashing overlaps the
# others' writes anyway) hashes on its own thread instead of queueing.
OVERLAP_HASH_BYTES = 4 << 20
_HASH_THREADS = max(1, min(os.cpu_count() or 1, 4))   # as the copy helpers (io/engine.py)
_hashers: ThreadPoolExecutor | None = None
_hash_slots = threading.BoundedSemaphore(_HASH_THREADS)
_hashers_lock = threading.Lock()


def _start_hashing(fn) -> Future | None:
    """``fn()`` on a free helper thread, or None when all are busy."""
    global _hashers
    slots = _hash_slots
    if not slots.acquire(blocking=False):
        return None

    def run():
        try:
            return fn()
        finally:
            slots.release()     # before the result is set: a waiter may go on to hash again
    try:
        with _hashers_lock:
            if _hashers is None:
                _hashers = ThreadPoolExecutor(max_workers=_HASH_THREADS,
                                              thread_name_prefix="kvblock-hash")
        return _hashers.submit(run)
    except BaseException:
        slots.release()
        raise


def _with_trailer_checksum(ranges, trailer: np.ndarray, run_id: int) -> np.ndarray:
    """A run's checksums as the index keeps them: per range, then the trailer's."""
    return np.append(np.asarray(ranges, np.uint64),
                     np.uint64(trailerfmt.checksum(trailer, run_id)))


def _first_difference(a: list, b: list) -> int:
    """The first index where two lists of equal length differ (they do)."""
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def _small_aligned(nbytes: int, alignment: int) -> np.ndarray:
    """An aligned scratch array for a small I/O (a trailer) from the heap: a
    fresh mapping per put costs more than the trailer's hashing."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    at = -raw.ctypes.data % alignment
    return raw[at:at + nbytes]


def _block_digests(batch: IOBatch, lay: RunLayout, dev_off: int, run_id: int) -> np.ndarray:
    """The (ranges, blocks) digests of a run's blocks (its trailer's), hashed
    from the memory ``batch`` writes the run's data from (at ``dev_off``)."""
    g = lay.geometry
    return block_digests_at(_block_addresses(batch, lay, dev_off), g.group_block_bytes,
                            run_id).reshape(g.ranges, lay.nblocks)


def _block_and_range_digests(batch: IOBatch, lay: RunLayout, dev_off: int,
                             run_id: int) -> tuple[np.ndarray, np.ndarray]:
    """_block_digests, and the range checksums (each range's blocks, then its
    zero padding up to range_bytes), in one pass over the blocks: 7.6-8.5
    GiB/s against 5.1-6.8 for a pass each, runs of 2 to 32 blocks of 256 KiB
    hashed out of memory on the 2-core VM."""
    g = lay.geometry
    return native.hash_blocks_ranges(_block_addresses(batch, lay, dev_off), g.ranges,
                                     lay.nblocks, g.group_block_bytes,
                                     lay.range_bytes - lay.prefix_bytes(lay.nblocks),
                                     data_seed(run_id))


def _block_addresses(batch: IOBatch, lay: RunLayout, dev_off: int) -> np.ndarray:
    """Where in memory each block of the run ``batch`` writes at ``dev_off``
    lies, range-major: block k of range r is the gbb bytes at r * range_bytes
    + k * gbb on the device."""
    g = lay.geometry
    gbb = np.uint64(g.group_block_bytes)
    r = np.repeat(np.arange(g.ranges, dtype=np.uint64), lay.nblocks)
    k = np.tile(np.arange(lay.nblocks, dtype=np.uint64), g.ranges)
    want = np.uint64(dev_off) + r * np.uint64(lay.range_bytes) + k * gbb
    order = np.argsort(batch.offsets, kind="stable")
    offs, addrs, lens = batch.offsets[order], batch.addrs[order], batch.lens[order]
    e = np.searchsorted(offs, want, side="right") - 1
    # Every writer's batch holds whole blocks per entry (staged runs, images,
    # BlockList pieces); a block across two entries would be a bug here.
    assert (e >= 0).all() and (want + gbb <= offs[e] + lens[e]).all(), \
        "a block's bytes span two write entries"
    return addrs[e] + (want - offs[e])


def block_digests_at(addrs, nbytes: int, run_id: int) -> np.ndarray:
    """data_checksum of the ``nbytes`` bytes at each address (blocks in
    memory; an array or list of addresses), in one native call."""
    n = len(addrs)
    digests = np.zeros(n, dtype=np.uint64)
    native.hash_pieces(np.asarray(addrs, dtype=np.uint64), np.full(n, nbytes, np.uint64),
                       np.arange(n, dtype=np.uint32), np.full(n, data_seed(run_id), np.uint64),
                       digests)
    return digests


def _epoch(store_uuid: bytes, generation: int) -> int:
    """Journal epoch: unique per (store, checkpoint generation)."""
    return xxhash.xxh64_intdigest(store_uuid + generation.to_bytes(8, "little"))


def _open_devices(devices, readonly=False) -> list[Device]:
    check_distinct([d.path if isinstance(d, Device) else d for d in devices])
    out = []
    try:
        for d in devices:
            out.append(d if isinstance(d, Device) else
                       Device(d, writable=not readonly, exclusive=not readonly))
    except BaseException:
        for d in out:
            d.close()
        raise
    return out


class KVStore:
    """A KV block store.  Create with :meth:`format`, reopen with :meth:`open`.

    Parameters (both constructors)
    ------------------------------
    verify : "always" (check data checksums on every read) or "never".
    eviction : "lru" (least recently used region, fewer hits first) or "fifo".
    admit_after : write a run to flash only at its N-th offer (1 = always).
    engine : I/O engine name ("uring", "threads"); default: best available.
    queue_depth : I/Os in flight per batch.
    """

    # ------------------------------------------------------------------ construction
    @classmethod
    def format(cls, devices: Sequence, geometry: Geometry, *, model=None,
               region_size: int | None = None, journal_bytes: int | None = None,
               force: bool = False, **options) -> "KVStore":
        """Write a new, empty store over ``devices`` and open it.

        Refuses a device that already holds a kvblock store unless ``force``.
        The superblocks are written last, after the old ones are wiped, so an
        interrupted format leaves no valid superblock.
        """
        if not devices:
            raise ConfigError("format needs at least one device")
        if len(devices) > sbfmt.MAX_DEVICES:
            raise ConfigError(f"a store spans at most {sbfmt.MAX_DEVICES} devices")
        devs = _open_devices(devices)
        io = None
        try:
            io = options.get("storeio_factory", StoreIO)(   # writes only: nothing to map
                devs, open_engine(devs, options.get("engine"), mapped_reads=False,
                                  queue_depth=options.get("queue_depth", 32)))
            if not force:
                for i, d in enumerate(devs):
                    existing = _store_on(io, i)
                    if existing is not None:
                        raise FormatError(f"{d.path} already holds {existing}; pass "
                                          "force=True to overwrite", d.path, 0)
            plan = _plan(devs, geometry, region_size, journal_bytes)
            store_uuid = uuid.uuid4().bytes
            dev_uuids = tuple(uuid.uuid4().bytes for _ in devs)
            zeros = bytes(2 * sbfmt.SIZE)
            for i in range(len(devs)):
                io.write_bytes(i, 0, zeros)         # wipe old superblocks first
            io.flush()
            first = cpfmt.Checkpoint(
                generation=1, journal_seq=1, next_run_id=1, ranges=geometry.run_checksums,
                regions=np.zeros(plan["region_count"], dtype=cpfmt.REGION_DTYPE),
                runs=np.zeros(0, dtype=cpfmt.RUN_DTYPE), keys=np.zeros((0, 16), np.uint8),
                checksums=np.zeros((0, geometry.run_checksums), np.uint64))
            io.write_bytes(0, plan["checkpoint_offset"], first.encode())
            io.write_bytes(0, plan["checkpoint_offset"] + plan["checkpoint_bytes"],
                           bytes(cpfmt.HEADER_BYTES))
            io.write_bytes(0, plan["journal_offset"], bytes(jfmt.BLOCK))
            io.flush()
            now = time.time_ns()
            for i, d in enumerate(devs):
                sb = sbfmt.Superblock(
                    store_uuid=store_uuid, device_uuid=dev_uuids[i], device_index=i,
                    device_count=len(devs), alignment=plan["alignment"],
                    device_bytes=d.capacity, region_size=plan["region_size"],
                    region_count=plan["regions_per_device"][i],
                    data_offset=plan["data_offsets"][i], geometry=geometry,
                    fingerprint=model_fingerprint(model), created_ns=now,
                    device_uuids=dev_uuids,
                    **({"journal_offset": plan["journal_offset"],
                        "journal_bytes": plan["journal_bytes"],
                        "checkpoint_offset": plan["checkpoint_offset"],
                        "checkpoint_bytes": plan["checkpoint_bytes"]} if i == 0 else {}))
                data = sb.encode()
                io.write_bytes(i, sbfmt.COPY_OFFSETS[0], data)
                io.flush([i])
                io.write_bytes(i, sbfmt.COPY_OFFSETS[1], data)
                io.flush([i])
            io.engine.close()
        except BaseException:
            if io is not None:
                io.engine.close()
            for d in devs:
                if not any(d is x for x in devices):
                    d.close()
            raise
        # A fresh store maps a tmpfs file's pages in before it returns (kvblock/io/mapped.py)
        return cls._open_devs(devs, geometry=geometry, model=model, _prefault_now=True,
                              **options)

    @classmethod
    def open(cls, devices: Sequence, *, geometry: Geometry | None = None, model=None,
             readonly: bool = False, **options) -> "KVStore":
        """Open an existing store (devices in any order) and recover its state.

        ``geometry`` / ``model``, when given, must match what the store was
        formatted with (:class:`GeometryMismatchError` otherwise).
        ``readonly=True`` opens without exclusive access and never writes
        (for inspection while another process may own the store).
        """
        if not devices:
            raise ConfigError("open needs the store's device(s)")
        return cls._open_devs(_open_devices(devices, readonly), geometry=geometry, model=model,
                              readonly=readonly, **options)

    @classmethod
    def _open_devs(cls, devs, **kw) -> "KVStore":
        store = cls.__new__(cls)
        try:
            store._init(devs, **kw)
        except BaseException:
            # The engine first: its rings hold registered references to the
            # devices, which would keep a raw device's O_EXCL claim alive.
            io = getattr(store, "io", None)
            if io is not None:
                io.engine.close()
            for d in devs:
                d.close()
            raise
        return store

    def _init(self, devs, *, geometry=None, model=None, verify="always", eviction="lru",
              admit_after=1, engine=None, queue_depth=32, storeio_factory=None,
              readonly=False, host_cache_bytes=0, _prefault_now=False):
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        self.verify, self.eviction = verify, eviction
        self.readonly = readonly
        self.host = None
        self.admission = Admission(admit_after)
        self._lock = threading.RLock()
        self._commit_lock = threading.Lock()
        self._clears = 0       # clear() calls: a put call that saw another count is refused
        self._pending: list = []
        self._pending_lock = threading.Lock()
        self._local = threading.local()
        self.spares = SpareBuffers(LOAD_STAGING_KEEP)
        self.counters: Counter = Counter({name: 0 for name in COUNTERS})
        self.closed = True
        t0 = time.perf_counter()
        self._io_options = (engine, queue_depth, storeio_factory or StoreIO)
        self.io = self._make_io(devs)
        self._read_superblocks(devs, geometry, model)
        self._recover()
        if not readonly:        # a rank of a dead server may still be writing
            dev0 = self.io.devices[0]
            fence_writers([(dev0.fd, dev0.path)])
        self.host = HostTier(host_cache_bytes, self.geometry.block_bytes) \
            if host_cache_bytes else None
        self.closed = False
        self.counters["recovery_us"] = int((time.perf_counter() - t0) * 1e6)
        # Only now: mapping a tmpfs store's pages in beside the recovery slowed
        # it.  A reopened store maps them in the background (recovery time is
        # what a restart waits for); a fresh one at once (format provisions).
        self.io.engine.start_mapped_reads(background=False if _prefault_now else None)

    def _make_io(self, devs) -> StoreIO:
        engine, queue_depth, factory = self._io_options
        return factory(devs, open_engine(devs, engine, queue_depth=queue_depth,
                                         defer_mapped_reads=True))

    def _read_superblocks(self, devs, geometry, model):
        sbs = []
        for i, d in enumerate(devs):
            sb = _try_superblock(self.io, i, raise_errors=True)
            sbs.append(sb)
        first = sbs[0]
        for d, sb in zip(devs, sbs):
            if sb.store_uuid != first.store_uuid:
                raise MissingDeviceError(
                    f"{d.path} belongs to store {uuid.UUID(bytes=sb.store_uuid)}, not "
                    f"{uuid.UUID(bytes=first.store_uuid)} (from {devs[0].path}); pass the "
                    "devices of one store", d.path, 0)
        by_index = {}
        for d, sb in zip(devs, sbs):
            if sb.device_index in by_index:
                raise MissingDeviceError(f"{d.path} and {by_index[sb.device_index][0].path} are "
                                         f"both device {sb.device_index} of the store", d.path, 0)
            if sb.device_uuids[sb.device_index] != sb.device_uuid:
                raise MissingDeviceError(f"{d.path}: device uuid does not match the store's "
                                         "device table (superblock from another format?)",
                                         d.path, 0)
            by_index[sb.device_index] = (d, sb)
        missing = [i for i in range(first.device_count) if i not in by_index]
        if missing:
            names = ", ".join(f"#{i} (uuid {uuid.UUID(bytes=first.device_uuids[i])})"
                              for i in missing)
            raise MissingDeviceError(
                f"store {uuid.UUID(bytes=first.store_uuid)} has {first.device_count} devices; "
                f"missing {names}; pass every device of the store", devs[0].path, 0)
        ordered = [by_index[i] for i in range(first.device_count)]
        for d, sb in ordered:
            if d.capacity < sb.device_bytes:
                # a shrunk file or device: regions past its end would fail
                # every read (or land on someone else's space after a resize)
                raise DeviceTooSmallError(
                    f"{d.path}: {d.capacity} bytes, but the store was formatted on "
                    f"{sb.device_bytes}; the device shrank (a truncated file?). Restore its "
                    "size (truncate -s / fallocate -l), or reformat", d.path, errno.ENOSPC)
        # Put the engine's device table in store order (device index i == engine index i).
        if [d for d, _ in ordered] != list(devs):
            self.io.engine.close()
            devs = [d for d, _ in ordered]
            self.io = self._make_io(devs)
        self.sb = ordered[0][1]
        self.superblocks = [sb for _, sb in ordered]
        self.geometry = self.sb.geometry
        if geometry is not None and geometry != self.geometry:
            raise GeometryMismatchError(
                f"{devs[0].path}: store was formatted for {self.geometry.describe()}, "
                f"asked for {geometry.describe()}; open with the store's geometry or "
                "format a new store", devs[0].path, 0)
        if model is not None and model_fingerprint(model) != self.sb.fingerprint:
            raise GeometryMismatchError(
                f"{devs[0].path}: store was formatted for another model fingerprint than "
                f"{model!r}; its KV cannot serve this model", devs[0].path, 0)
        self.alignment = self.sb.alignment
        self._layouts: dict[int, RunLayout] = {}   # layout()'s, by run length
        counts = [sb.region_count for sb in self.superblocks]
        ndev = len(self.superblocks)
        per_dev = min(counts)  # striping uses the same number of regions per device
        self.regions = RegionTable(per_dev * ndev, self.sb.region_size, ndev,
                                   [sb.data_offset for sb in self.superblocks])
        self.max_run_blocks = RunLayout.max_blocks(self.geometry, self.alignment,
                                                   self.sb.region_size)

    # ------------------------------------------------------------------ recovery
    def _recover(self):
        sb = self.sb
        self.journal_gap = None
        # Slots that were written once but no longer decode (fsck reports
        # them; the next checkpoint goes to one of them).
        self.damaged_checkpoint_slots = []
        slots = []
        for slot in (0, 1):
            off = sb.checkpoint_offset + slot * sb.checkpoint_bytes
            raw = self.io.read_bytes(0, off, cpfmt.HEADER_BYTES)
            head = cpfmt.decode_header(raw)
            if head is not None:
                slots.append((head.generation, slot, head))
            elif bytes(raw[:len(cpfmt.MAGIC)]) == cpfmt.MAGIC:
                self.damaged_checkpoint_slots.append(slot)
        cp = None
        for _, slot, head in sorted(slots, reverse=True):
            off = sb.checkpoint_offset + slot * sb.checkpoint_bytes
            if cpfmt.HEADER_BYTES + head.payload_bytes <= sb.checkpoint_bytes:
                payload = self.io.read_array(0, off + cpfmt.HEADER_BYTES, head.payload_bytes)
                cp = cpfmt.decode_payload(head, payload)
                if cp is not None and cp.ranges == self.geometry.run_checksums and \
                        len(cp.regions) == self.regions.count:
                    self._cp_slot = slot
                    break
            self.damaged_checkpoint_slots.append(slot)
            cp = None
        if cp is None:
            raise NotAStoreError(
                f"{self.io.devices[0].path}: no valid checkpoint in either slot (metadata "
                "corrupt); the cached KV cannot be trusted: reformat the store",
                self.io.devices[0].path, sb.checkpoint_offset)
        self.index = KeyIndex()
        journal = self.io.read_array(0, sb.journal_offset, sb.journal_bytes)
        ahead = self._newer_epoch(journal, cp.generation)
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
                self._write_checkpoint()
            return
        self._load_checkpoint(cp)
        records, end, next_seq = jfmt.scan(journal, cp.journal_seq,
                                           _epoch(sb.store_uuid, cp.generation))
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
        epoch = _epoch(sb.store_uuid, cp.generation)
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
        self._generation = cp.generation
        self._seq = next_seq
        self._jhead = end
        self.clean_at_open = not records
        self._finish_layout()
        if not self.readonly:
            self._write_checkpoint()  # new epoch: stale journal records are dead from here on

    def _newer_epoch(self, journal, generation: int) -> int:
        """k > 0 when the journal's first record belongs to checkpoint
        generation ``generation + k``: a newer checkpoint restarted the
        journal (the other slot's, now unreadable).  0 otherwise -- also
        when the newer checkpoint was torn before its journal began, which
        leaves the older one and its journal whole."""
        first = jfmt.record_at(journal)
        if first is None:
            return 0
        for k in range(1, 4):
            if first[0] == _epoch(self.sb.store_uuid, generation + k):
                return k
        return 0

    def _load_checkpoint(self, cp: cpfmt.Checkpoint):
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

    def _index_runs(self, runs: list[Run]) -> set[int]:
        """Index and account runs (under self._lock, or in recovery); drop
        the runs they leave with no key (see kvblock/index/index.py).
        Returns the regions of the runs dropped."""
        superseded = self.index.add_many(runs)
        for run in runs:
            self._account_run(run)
        for run in superseded:
            self._remove_run(run)
        self.counters["superseded_runs"] += len(superseded)
        return {run.region for run in superseded}

    def _replayed_run(self, rec: jfmt.PutRun) -> Run | None:
        # Its id is used even when the run is not (a run id seeds its data
        # checksums: never hand one out twice).
        self._next_run_id = max(self._next_run_id, rec.run_id + 1)
        if rec.region >= self.regions.count or \
                rec.generation != int(self.regions.generation[rec.region]) or \
                len(rec.checksums) != self.geometry.run_checksums:
            return None  # stale or foreign: its space was reclaimed since
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
                for run in [r for r in self.index.runs.values() if r.region == rec.region]:
                    self._remove_run(run)
                self.regions.generation[rec.region] = rec.generation

    def _account_run(self, run: Run):
        r = run.region
        self.regions.live[r] += 1
        end = run.offset + self.layout(run.nblocks).run_bytes
        self.regions.fill[r] = max(int(self.regions.fill[r]), end)

    def _remove_run(self, run: Run):
        self.index.remove(run)
        self.regions.live[run.region] -= 1

    def _finish_layout(self):
        """After recovery: regions holding runs are sealed, the rest are free."""
        regions = self.regions
        regions.free.clear()
        regions.open = None
        for r in range(regions.count):
            if regions.live[r] > 0:
                regions.state[r] = SEALED
                if regions.seal_seq[r] == 0:  # sealed after the last checkpoint
                    regions.seal_seq[r] = regions.next_seal
                    regions.sealed_at[r] = int(time.time())
                    regions.next_seal += 1
            else:
                regions.state[r] = FREE
                regions.fill[r] = 0
                regions.free.append(r)

    # ------------------------------------------------------------------ metadata writes
    def _commit(self, records: list, apply=None) -> None:
        """Make ``records`` durable (group commit), then run ``apply``.

        Whoever takes the commit lock writes every pending record in one
        journal write: flush data devices, write the journal, flush device 0.
        ``records`` may be a function returning them, called by that leader
        under the commit lock (what is decided there cannot race a clear()).
        Never call with ``self._lock`` held (the leader needs it to apply).
        """
        done = threading.Event()
        entry = [records, apply, done, None]
        with self._pending_lock:
            self._pending.append(entry)
        with self._commit_lock:
            if not done.is_set():
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                try:
                    written = [r for e in batch
                               for r in (e[0]() if callable(e[0]) else e[0])]
                    if written:    # none when a clear() refused every put here
                        self._write_journal(written)
                except BaseException as e:
                    for item in batch:
                        item[3] = e
                        item[2].set()
                    self._fail(e)
                    raise
                for item in batch:
                    if item[1] is not None:
                        with self._lock:
                            item[1]()
                    item[2].set()
                if self._jhead > self.sb.journal_bytes // 2:
                    try:
                        self._write_checkpoint()
                    except BaseException as e:
                        self._fail(e)
                        raise
        if entry[3] is not None:
            raise StoreClosedError(f"metadata commit failed: {entry[3]}") from entry[3]

    def _write_journal(self, records):
        data = jfmt.encode_commit(records, self._seq, _epoch(self.sb.store_uuid,
                                                             self._generation))
        if self._jhead + len(data) > self.sb.journal_bytes:
            self._write_checkpoint()
            data = jfmt.encode_commit(records, self._seq,
                                      _epoch(self.sb.store_uuid, self._generation))
            if len(data) > self.sb.journal_bytes:
                raise StoreFullError(f"a commit of {len(data)} bytes exceeds the "
                                     f"{self.sb.journal_bytes}-byte journal")
        self.io.flush()  # data before the records that publish it
        self.io.write_bytes(0, self.sb.journal_offset + self._jhead, data)
        self.io.flush([0])
        self._jhead += len(data)
        self._seq += len(records)
        self.counters["commits"] += 1
        self.counters["journal_bytes"] += len(data)

    def _write_checkpoint(self):
        """Snapshot the index into the other slot; the journal restarts empty."""
        with self._lock:
            runs = list(self.index.runs.values())
            run_rows = np.zeros(len(runs), dtype=cpfmt.RUN_DTYPE)
            for i, run in enumerate(runs):
                run_rows[i] = (run.run_id, run.region, run.generation, run.offset,
                               run.nblocks, 0)
            keys = self.index.checkpoint_keys(runs)
            sums = (np.stack([r.checksums for r in runs]) if runs
                    else np.zeros((0, self.geometry.run_checksums), np.uint64))
            regions = np.zeros(self.regions.count, dtype=cpfmt.REGION_DTYPE)
            regions["generation"] = self.regions.generation
            regions["seal_seq"] = self.regions.seal_seq
            regions["sealed_at"] = self.regions.sealed_at
            cp = cpfmt.Checkpoint(self._generation + 1, self._seq, self._next_run_id,
                                  self.geometry.run_checksums, regions, run_rows, keys, sums)
        data = cp.encode()
        if len(data) > self.sb.checkpoint_bytes:
            raise StoreFullError(f"checkpoint of {len(data)} bytes exceeds its "
                                 f"{self.sb.checkpoint_bytes}-byte slot")
        slot = 1 - getattr(self, "_cp_slot", 1)
        self.io.flush()
        self.io.write_bytes(0, self.sb.checkpoint_offset + slot * self.sb.checkpoint_bytes, data)
        self.io.flush([0])
        self._cp_slot = slot
        self._generation = cp.generation
        self._jhead = 0
        self.counters["checkpoints"] += 1

    def checkpoint(self) -> None:
        """Write a checkpoint now (also done when the journal is half full, and on close)."""
        self._check_open(writing=True)
        with self._commit_lock:
            self._write_checkpoint()

    def _fail(self, exc):
        """A metadata write failed: the in-memory state may be ahead of the
        medium, so the store stops serving; reopen to recover."""
        self.closed = True

    # ------------------------------------------------------------------ layout helpers
    def layout(self, nblocks: int) -> RunLayout:
        lay = self._layouts.get(nblocks)
        if lay is None:
            if len(self._layouts) >= 4096:     # runs of many lengths: keep it small
                self._layouts.clear()
            lay = self._layouts[nblocks] = RunLayout(self.geometry, nblocks, self.alignment)
        return lay

    def _check_open(self, writing: bool = False):
        if self.closed:
            raise StoreClosedError("store is closed; reopen it with KVStore.open(devices)")
        if writing and self.readonly:
            raise ReadOnlyStoreError(f"{self.io.devices[0].path}: store is open read-only; "
                                     "open it without readonly=True to change it")

    def _staging(self, nbytes: int, purpose: str = "staging") -> HostBuffer:
        """This thread's aligned buffer for ``purpose`` (grown, never shrunk):
        kept between calls because touching fresh memory is slow (and on VMs
        that hand freed memory back, very slow).  Purposes do not share memory:
        "staging" is put_run's, "gather" is save_blocks' source buffer, "pages"
        the SGLang backend's read buffer."""
        buf = getattr(self._local, purpose, None)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.close()
            buf = HostBuffer(round_up(nbytes, 1 << 20))
            setattr(self._local, purpose, buf)
        return buf

    # ------------------------------------------------------------------ public API
    def put_run(self, keys: Sequence, data) -> int:
        """Store a run of consecutive blocks.

        ``data`` holds the blocks' bytes in the store's layout order: an array
        (any dtype) of ``len(keys) * geometry.block_bytes`` bytes shaped or
        viewable as ``(num_layers, head_groups, len(keys), group_block_bytes)``.
        Returns the number of blocks written (0 when admission declined the
        run).  Runs longer than a region are split into several runs.
        """
        self._check_open(writing=True)
        keys = normalize_keys(keys)
        return self._put(keys, self._blocks_view(keys, data))

    def put_blocks(self, keys: Sequence, blocks: Sequence) -> int:
        """Store a run whose blocks lie in separate buffers: ``blocks[k]`` is
        an array of ``geometry.block_bytes`` bytes, block k of the run in the
        store's layout order (``(num_layers, head_groups, group_block_bytes)``).

        Aligned blocks whose per-range pieces are multiples of the store's
        alignment are written from where they are (no copy); others are
        gathered through staging memory.  Otherwise as :meth:`put_run`.
        """
        self._check_open(writing=True)
        keys = normalize_keys(keys)
        return self._put(keys, BlockList.of(blocks, self.geometry, len(keys), "put_blocks",
                                            writable=False))

    def put_runs(self, runs: Sequence) -> list[int]:
        """Store several runs: ``runs`` holds ``(keys, data)`` pairs, each as
        :meth:`put_run` takes it.  The runs' data are written one run after
        another and published together, with one journal commit (one flush
        of the data devices and one of the journal) for up to a quarter of
        the journal or of the store's regions at a time, instead of one per
        run.  The commit's records go in run order, each checksummed: a crash
        while it is written may keep a leading part of the group's runs, each
        whole, never a run whose data did not land.  An error raised while a
        group is written publishes none of it (the groups before it stay).
        Returns the blocks written for each run, as put_run would.  Every
        argument is checked before anything is written."""
        self._check_open(writing=True)
        items = []
        for k, run in enumerate(runs):
            if not isinstance(run, (tuple, list)) or len(run) != 2:
                raise ConfigError(f"put_runs: run {k} must be a (keys, data) pair")
            keys, data = run
            keys = normalize_keys(keys)
            items.append((keys, self._blocks_view(keys, data)))
        return self._put_many(items)

    def _put(self, keys: list[bytes], blocks) -> int:
        """put_run/put_blocks after their argument checks; ``blocks`` is a
        (layers, groups, n, group_block_bytes) array or a BlockList."""
        return self._put_many([(keys, blocks)])[0]

    def _put_many(self, items: list) -> list[int]:
        """put_runs after its argument checks: (keys, blocks) pairs.  One run
        alone is published piece by piece (pieces of at most a region)."""
        g = self.geometry
        clears = self._clears         # a clear() from here on refuses every piece of the call
        out = [0] * len(items)
        pieces = []                   # (item, keys, blocks) of at most a region each
        with self._lock:              # one index probe for every item's keys
            found = self.index.lookup([k for keys, _ in items for k in keys]) >= 0
        at = 0
        for i, (keys, blocks) in enumerate(items):
            n = len(keys)
            at += n
            if n == 0:
                continue
            if found[at - n:at].all():
                self.counters["put_duplicate_runs"] += 1
                out[i] = n
                continue
            self._check_fits(n)
            if not self.admission.admit(keys[0]):
                self.counters["admission_rejected_runs"] += 1
                continue
            step = self.max_run_blocks
            for start in range(0, n, step):
                stop = min(n, start + step)
                pieces.append((i, keys[start:stop], _span(blocks, start, stop)))
        if len(items) == 1:
            for i, keys, blocks in pieces:
                stored = self._put_one(keys, blocks, clears)
                out[i] += stored
                if not stored:        # a clear() overtook it: its earlier pieces went too
                    out[i] = 0
                    break
            return out
        # Group the pieces: each group's regions stay pinned until its commit,
        # so a group may fill at most a quarter of the regions (the rest can
        # be reclaimed for it; one more for a partly filled open region), and
        # its commit record at most a quarter of the journal.
        max_bytes = max(1, self.regions.count // 4 - 1) * self.sb.region_size
        max_record = self.sb.journal_bytes // 4
        groups, nbytes, record = [[]], 0, 0
        for piece in pieces:
            size = self.layout(len(piece[1])).run_bytes
            entry = len(piece[1]) * 16 + g.run_checksums * 8 + 64
            if groups[-1] and (nbytes + size > max_bytes or record + entry > max_record):
                groups.append([])
                nbytes, record = 0, 0
            groups[-1].append(piece)
            nbytes += size
            record += entry
        cleared = set()
        for group in groups:
            if group:
                for i, n in self._put_group(group, clears):
                    out[i] += n
                    if not n:
                        cleared.add(i)
        for i in cleared:             # a clear() overtook a piece: the item's others went too
            out[i] = 0
        return out

    def _put_group(self, pieces: list, clears: int) -> list[tuple[int, int]]:
        """Write each piece as a run, then publish them all with one commit.
        Pieces whose buffers already are their on-device image (no staging)
        are written together in one engine call after the others; a staged
        piece is written at once (the staging buffer is reused).  Returns
        (item, blocks) per piece, 0 blocks for one a clear() refused."""
        written, deferred = [], []      # deferred: (run index, batch, sums, Streams or Later)
        images = [self._is_image(self.layout(len(keys)), blocks) for _, keys, blocks in pieces]
        # The images are written in one call: hashed while it runs when it is
        # large, however small each run is (LMCache puts 8 chunks at a time).
        together = sum(self.layout(len(keys)).data_bytes
                       for (_, keys, _), image in zip(pieces, images) if image)
        later = 0 if together >= OVERLAP_HASH_BYTES else True
        try:
            for (i, keys, blocks), image in zip(pieces, images):
                if image:
                    run, batch, sums = self._write_piece(keys, blocks, defer=True, later=later)
                    deferred.append((len(written), batch, sums))
                else:
                    run = self._write_piece(keys, blocks)
                written.append((i, keys, blocks, run))
            if deferred:
                for k, sums in self._write_runs_together(
                        [(batch, sums, written[k][3].run_id) for k, batch, sums in deferred]):
                    written[deferred[k][0]][3].checksums = sums
            published = self._publish_puts([run for _, _, _, run in written], clears)
        finally:
            self._unpin_writers([run.region for _, _, _, run in written])
        for _, keys, blocks, run in written:
            if run.run_id in published:
                self._count_put(keys, blocks, run, clears)
        return [(i, len(keys) if run.run_id in published else 0)
                for i, keys, _, run in written]

    def _write_runs_together(self, staged: list) -> list[tuple[int, np.ndarray]]:
        """Write (batch, sums, Streams or Later, run id) triples in one engine
        call each for the runs whose checksums are known or hashed on helper
        threads meanwhile (Later: their trailers in one more call after; a
        Later that finds the helpers busy is hashed first, its trailer
        written with its data) and for those the write hashes (a mapped
        device).  Returns (index, checksums) of the runs whose checksums
        were not known."""
        later = [(k, sums, run_id, _start_hashing(sums.digest))
                 for k, (_, sums, run_id) in enumerate(staged) if isinstance(sums, Later)]
        first, out = {}, []
        try:
            first = {k: sums.digest() for k, sums, _, h in later if h is None}
            known = [b for b, sums, _ in staged if not isinstance(sums, Streams)]
            known += [sums.tail for k, sums, _, _ in later if k in first]
            if known:
                self.io.write(known[0] if len(known) == 1 else IOBatch.concat(known))
            hashed = [(k, b, sums, run_id) for k, (b, sums, run_id) in enumerate(staged)
                      if isinstance(sums, Streams)]
            if hashed:
                nr = self.geometry.run_checksums
                batch = IOBatch.concat([b for _, b, _, _ in hashed])
                streams = np.concatenate([np.asarray(sums.of_ios, np.int64) + j * nr
                                          for j, (_, _, sums, _) in enumerate(hashed)])
                seeds = np.repeat(np.array([run_id for *_, run_id in hashed], dtype=np.uint64),
                                  nr)
                digests = self.io.write_hashed(batch, streams, seeds)
                out = [(k, digests[j * nr:(j + 1) * nr]) for j, (k, *_) in enumerate(hashed)]
        finally:
            wait([h for *_, h in later if h is not None])   # they read the runs' memory
        tails = [sums.tail for k, sums, _, _ in later if k not in first]
        for k, sums, run_id, h in later:
            ranges = first[k] if h is None else h.result()
            out.append((k, _with_trailer_checksum(ranges, sums.trailer, run_id)))
        if tails:
            self.io.write(tails[0] if len(tails) == 1 else IOBatch.concat(tails))
        return out

    def _blocks_view(self, keys: list[bytes], data) -> np.ndarray:
        """put_run's data as (layers, groups, blocks, group_block_bytes) bytes."""
        g, n = self.geometry, len(keys)
        arr = as_array(data, "put_run")
        if arr.nbytes != n * g.block_bytes:
            raise ConfigError(f"put_run: {n} keys need {n * g.block_bytes} bytes of KV "
                              f"({g.describe()}), got {arr.nbytes}")
        return np.ascontiguousarray(arr).view(np.uint8).reshape(
            g.num_layers, g.head_groups, n, g.group_block_bytes)

    def _check_fits(self, nblocks: int) -> None:
        """Refuse a run the store cannot hold at once: its pieces would evict
        one another (the tail pushing out the head), leaving nothing to find."""
        g, regions = self.geometry, self.regions
        step = self.max_run_blocks
        if step < 1:
            raise StoreFullError(f"one block ({g.block_bytes} bytes) does not fit a "
                                 f"{regions.size}-byte region")
        full, rest = divmod(nblocks, step)
        need = full * self.layout(step).run_bytes + (self.layout(rest).run_bytes if rest else 0)
        # Its first piece may go to the partly filled region: count one less.
        room = max(1, regions.count - 1) * regions.size
        if need > room:
            raise StoreFullError(
                f"a run of {nblocks} blocks ({need} bytes on the device) does not fit this "
                f"store, which holds at most {room} bytes of one run ({regions.count} regions "
                f"of {regions.size} bytes, less one); store a shorter prefix or give the "
                "store more capacity")

    def _put_one(self, keys: list[bytes], blocks, clears: int) -> int:
        run = self._write_piece(keys, blocks)
        try:
            published = self._publish_put(run, clears)
        finally:
            self._unpin_writers([run.region])
        if not published:
            return 0
        self._count_put(keys, blocks, run, clears)
        return len(keys)

    def _write_piece(self, keys: list[bytes], blocks, defer: bool = False,
                     later: int | bool = True):
        """Allocate a run's space and write its data: the Run, not yet
        published, its region still pinned (the caller publishes, then
        unpins).  ``defer``: leave the write to the caller, and return (Run
        without checksums when the write is to compute them, its IOBatch,
        its checksums, Streams or Later).  ``later``: see _stage_run."""
        lay = self.layout(len(keys))
        region, offset, run_id, gen = self._begin_put(lay.run_bytes)
        try:
            dev, dev_off = self.regions.address(region, offset)
            batch, sums = self._stage_run(lay, blocks, run_id, dev, dev_off, later=later)
            if not defer:
                sums = self._write_run(batch, sums, run_id)
        except BaseException:
            self._unpin_writers([region])
            raise
        run = Run(run_id, region, gen, offset, b"".join(keys),
                  None if isinstance(sums, (Streams, Later)) else sums, created=time.time())
        return (run, batch, sums) if defer else run

    def _count_put(self, keys: list[bytes], blocks, run: Run, clears: int) -> None:
        """A published run: its blocks enter the host tier (as the newest
        copies, unless a clear() came since the put began: the tier's epoch
        counts clear() calls as ``_clears`` does, clear() moving both); the
        counters."""
        if self.host is not None:
            for k in range(len(keys)):
                self.host.put(keys[k], _one(blocks, k), epoch=clears, replace=True)
        self.counters["put_runs"] += 1
        self.counters["put_blocks"] += len(keys)
        self.counters["bytes_written"] += self.layout(len(keys)).run_bytes

    # The three steps of a put, also used apart by the store server
    # (kvblock/store/server.py), whose clients write the data themselves.
    def _begin_put(self, run_bytes: int) -> tuple[int, int, int, int]:
        """(region, offset, run id, region generation) for a new run; the
        region comes back pinned (a writer in flight: the caller unpins)."""
        region, offset = self._allocate(run_bytes)
        with self._lock:
            run_id = self._next_run_id
            self._next_run_id += 1
            gen = int(self.regions.generation[region])
        return region, offset, run_id, gen

    def _is_image(self, lay: RunLayout, blocks, any_address: bool = False) -> bool:
        """Are ``blocks`` already the run's on-device image (or aligned,
        unpadded pieces of it), so that writing them needs no staging copy?
        ``any_address``: an array for a copy into a mapped device, which
        needs no aligned memory."""
        if lay.prefix_bytes(lay.nblocks) != lay.range_bytes:
            return False
        if isinstance(blocks, BlockList):
            return blocks.direct(self.alignment)
        return blocks.flags.c_contiguous and (any_address
                                              or blocks.ctypes.data % self.alignment == 0)

    def _stage_run(self, lay: RunLayout, blocks, run_id: int, dev: int, dev_off: int,
                   later: int | bool = False):
        """(the IOBatch that writes the run's on-device image at ``dev_off``,
        data and block digest trailer, its checksums (per range, then the
        trailer's), or instead the checksum index of each I/O when
        :meth:`_write_run` is to hash the ranges and the trailer as it writes
        them).  ``blocks`` is (layers, groups, n, group_block_bytes) or a
        BlockList; copied into the thread's staging buffer unless it already
        is the image (or aligned, unpadded pieces of it).  ``later``: a run
        of at least OVERLAP_HASH_BYTES (or of at least ``later`` bytes, an
        int) is hashed by :meth:`_write_run` while its data is written (the
        batch is then the data only, with a :class:`Later`)."""
        g = lay.geometry
        payload = lay.prefix_bytes(lay.nblocks)
        # Copied into a mapping, each range is hashed right after it is
        # copied (in cache) instead of in a pass of its own.  Such a write is
        # a copy on this process's cores (shared with helper threads when
        # large): hashing beside it measured 0.87-1.05x (perf/put_hashing.py),
        # so it hashes first.
        as_written = self.io.engine.mapped_for_writes(dev)
        if later is True:
            later = OVERLAP_HASH_BYTES
        later = later is not False and lay.data_bytes >= later and not as_written
        # (a copy into a mapping takes the caller's memory wherever it lies)
        if self._is_image(lay, blocks, any_address=as_written):
            trailer = _small_aligned(lay.trailer_bytes, self.alignment)
            if isinstance(blocks, BlockList):
                if as_written:
                    batch, streams = blocks.hashed_batch(dev, dev_off, lay.range_bytes)
                    return self._with_trailer(lay, batch, Streams(streams), trailer, run_id,
                                              dev, dev_off, later)
                return self._with_trailer(lay, blocks.batch(dev, dev_off, lay.range_bytes),
                                          None, trailer, run_id, dev, dev_off, later)
            # The caller's array already is the on-device image: no copy.
            address = blocks.ctypes.data
            if as_written:
                at = np.arange(g.ranges, dtype=np.uint64) * np.uint64(payload)
                return self._with_trailer(
                    lay, IOBatch(at + np.uint64(address), dev, at + np.uint64(dev_off),
                                 np.full(g.ranges, payload, np.uint64)),
                    Streams(np.arange(g.ranges)), trailer, run_id, dev, dev_off, later)
            return self._with_trailer(lay, IOBatch.single(address, dev, dev_off, lay.data_bytes),
                                      None, trailer, run_id, dev, dev_off, later)
        buf = self._staging(lay.run_bytes)
        ranges = buf.array[:lay.data_bytes].reshape(g.ranges, lay.range_bytes)
        if isinstance(blocks, BlockList):
            blocks.gather_into(ranges)
        else:
            ranges[:, :payload] = blocks.reshape(g.ranges, payload)
        ranges[:, payload:] = 0
        # The trailer follows the ranges in the staging buffer: one write,
        # unless the run is hashed while its data is written.
        trailer = buf.array[lay.data_bytes:lay.run_bytes]
        data = IOBatch.single(buf.address, dev, dev_off, lay.data_bytes)
        staged = self._with_trailer(lay, data, None, trailer, run_id, dev, dev_off, later)
        if later:
            return staged
        return IOBatch.single(buf.address, dev, dev_off, lay.run_bytes), staged[1]

    def _with_trailer(self, lay: RunLayout, batch: IOBatch, sums, trailer: np.ndarray,
                      run_id: int, dev: int, dev_off: int, later: bool = False):
        """The data write ``batch`` of a run and its checksums (``sums``:
        Streams, or None: hashed from the blocks with their digests), with
        the run's block digest trailer filled in ``trailer`` and its write
        appended (the batch keeps the buffer alive); with ``later`` (not
        for Streams), the data write and a :class:`Later` that does the
        hashing and the trailer."""
        def digest():
            if isinstance(sums, Streams):
                blocks, ranges = _block_digests(batch, lay, dev_off, run_id), None
            else:
                blocks, ranges = _block_and_range_digests(batch, lay, dev_off, run_id)
            trailer[:] = trailerfmt.encode(blocks, lay.trailer_bytes)
            return ranges

        tail = IOBatch.single(trailer.ctypes.data, dev, dev_off + lay.data_bytes,
                              lay.trailer_bytes)
        tail.keep = trailer
        if later:
            assert not isinstance(sums, Streams), "a hashed (mapped) write hashes first"
            return batch, Later(digest, tail, trailer)
        ranges = digest()
        out = IOBatch.concat([batch, tail])
        out.keep = trailer
        if isinstance(sums, Streams):
            return out, Streams(np.append(np.asarray(sums.of_ios, np.int64), lay.geometry.ranges))
        return out, _with_trailer_checksum(ranges, trailer, run_id)

    def _write_run(self, batch: IOBatch, sums, run_id: int) -> np.ndarray:
        """Write a staged run; its checksums (``sums``, or, when _stage_run
        left them to the write, those the write computed: Streams; or, for
        a Later, those a helper thread computes while the data is written,
        the trailer written after)."""
        if isinstance(sums, Later):
            return self._write_runs_together([(batch, sums, run_id)])[0][1]
        if not isinstance(sums, Streams):
            self.io.write(batch)
            return sums
        return self.io.write_hashed(batch, sums.of_ios, [run_id] * self.geometry.run_checksums)

    def _publish_put(self, run: Run, clears: int) -> bool:
        """Journal the run's PUT record durably (after flushing the data), then
        index it.  The run's region must still be pinned by its writer.
        False when a clear() came after the put call began (``clears``: the
        clear count then, taken before its space was allocated): the run
        holds what was stored before the clear (or the tail of a prefix the
        clear took away), so it is not published."""
        return bool(self._publish_puts([run], clears))

    def _publish_puts(self, runs: list[Run], clears: int) -> set[int]:
        """:meth:`_publish_put` for several runs, in one commit; returns the
        ids of the runs published."""
        kept = []

        def records():   # under the commit lock, where clear() counts
            if clears == self._clears:
                kept.extend(runs)
            return [jfmt.PutRun(run.run_id, run.region, run.generation, run.offset,
                                run.keys, tuple(int(s) for s in run.checksums))
                    for run in kept]

        emptied = set()

        def publish():
            now = time.time()
            emptied.update(self._index_runs(kept))
            for run in kept:
                self.regions.last_access[run.region] = now

        self._commit(records, publish)
        self.counters["cleared_puts"] += len(runs) - len(kept)
        self._release_unpinned(emptied)
        return {r.run_id for r in kept}

    def _allocate(self, nbytes: int) -> tuple[int, int]:
        """Space for a run, reclaiming regions by policy when none is free.
        The region comes back pinned (a writer in flight)."""
        while True:
            with self._lock:
                got = self.regions.allocate(nbytes, time.time())
                if got is not None:
                    self.regions.pins[got[0]] += 1
                    return got
                victim = self.regions.victim(self.eviction)
                if victim is None:
                    raise StoreFullError(
                        f"store is full and every region holds pinned runs "
                        f"({self.regions.count} regions of {self.sb.region_size} bytes); "
                        "release pins or add capacity")
                self._begin_reclaim(victim)
            # The region is written again at once: no discard (see _finish_reclaim).
            self._finish_reclaim(victim, discard=False)

    def _begin_reclaim(self, region: int) -> None:
        """(under self._lock) take the region's runs out of the index."""
        dropped = [r for r in self.index.runs.values() if r.region == region]
        for run in dropped:
            self._remove_run(run)
        self.regions.state[region] = RECLAIMING
        if self.regions.open == region:
            self.regions.open = None
        self.counters["evicted_regions"] += 1
        self.counters["evicted_runs"] += len(dropped)
        self.counters["evicted_blocks"] += sum(r.nblocks for r in dropped)

    def _finish_reclaim(self, region: int, discard: bool = True) -> None:
        """Commit the region's RECLAIM record, then free it.  ``discard``:
        TRIM it too (evict/delete: the space may stay free a while).  A region
        reclaimed by an allocation is rewritten at once, so it is not trimmed:
        the overwrite replaces the old data anyway, and on thin-provisioned
        targets (loop over tmpfs or a file) a TRIM punches a hole that the
        next writes must allocate again, which halved steady-state save
        throughput (perf/store_vs_fio.py).  `kvblock trim` discards free regions."""
        new_gen = (int(self.regions.generation[region]) + 1) & 0xFFFFFFFF

        def new_generation():
            # As the record becomes durable, before any checkpoint can follow
            # it (the commit that fills half the journal writes one at once):
            # a checkpoint with the old generation would make replay reject
            # every run put in the region since.
            self.regions.generation[region] = new_gen
        self._commit([jfmt.Reclaim(region, new_gen)], new_generation)
        dev, off = self.regions.address(region)
        if discard and self.io.discard(dev, off, self.regions.size):
            self.counters["discards"] += 1
        with self._lock:
            self.regions.release(region, generation=new_gen)

    def lookup(self, keys: Sequence) -> int:
        """Number of leading ``keys`` stored (longest stored prefix, in the
        host tier or on the device)."""
        self._check_open()
        keys = normalize_keys(keys)
        if self.host is None:
            with self._lock:  # the index's arrays are swapped when it grows
                n = self.index.prefix_length(keys)
        else:
            with self._lock:
                on_device = self.index.lookup(keys) >= 0
            n = 0
            while n < len(keys) and (on_device[n] or keys[n] in self.host):
                n += 1
        self.counters["lookups"] += 1
        self.counters["lookup_hit_blocks"] += n
        return n

    def present(self, keys: Sequence) -> np.ndarray:
        """Per key: is it stored (on the device or in the host tier)?  One
        vectorised index probe; not counted as a lookup (writers use it to
        skip blocks already stored)."""
        self._check_open()
        keys = normalize_keys(keys)
        with self._lock:
            found = self.index.lookup(keys) >= 0
        if self.host is not None:
            found = found | np.array([k in self.host for k in keys], dtype=bool)
        return found

    def pin(self, keys: Sequence) -> list:
        """Protect the stored prefix of ``keys`` from eviction until
        :meth:`unpin` (a lease held by an engine between lookup and load).
        Returns the pin handle (the pinned stretches; ``[]`` when nothing is
        stored)."""
        self._check_open()
        with self._lock:
            return PinHandle(self._segments(normalize_keys(keys)))

    def unpin(self, pins: list) -> None:
        """Release a handle returned by :meth:`pin` (once: a second release
        would take another lease's pin)."""
        if not isinstance(pins, PinHandle):
            raise ConfigError("unpin: pass the handle pin() returned")
        if pins.released:
            raise ConfigError("unpin: this pin handle was released already")
        pins.released = True
        self._unpin(pins)

    def contains(self, key) -> bool:
        return self.lookup([key]) == 1

    def touch(self, keys: Sequence) -> int:
        """Mark the regions of the runs holding ``keys`` as just used, as a
        read would, so that LRU eviction keeps them longer; nothing is read
        (an engine's hint that it is about to use them).  Returns how many
        of ``keys`` are stored (on the device)."""
        self._check_open()
        keys = normalize_keys(keys)
        with self._lock:
            packed = self.index.lookup(keys)
            found = packed[packed >= 0]
            runs = np.unique(found >> POS_BITS)
            regions = [self.index.runs[int(r)].region for r in runs.tolist()]
            if regions:
                self.regions.last_access[regions] = time.time()
        return int(found.size)

    def _segments(self, keys: list[bytes]) -> list[tuple[Run, int, int, int]]:
        """(run, first position, count, first output block) for the stored
        prefix of ``keys``; pins the runs' regions.  Under self._lock."""
        segs = self.index.segments(keys)
        now = time.time()
        for run, _, _, _ in segs:
            run.pins += 1
            run.hits += 1
            self.regions.pins[run.region] += 1
            self.regions.last_access[run.region] = now
            self.regions.hits[run.region] += 1
        return segs

    def _unpin(self, segs) -> bool:
        """Release the pins of a ``_segments`` answer.  True: they were held
        all along (a store server's client says False when the server that
        pinned them went away: what was read may since have been rewritten)."""
        with self._lock:
            for run, _, _, _ in segs:
                run.pins -= 1
                self.regions.pins[run.region] -= 1
        self._release_unpinned({run.region for run, _, _, _ in segs})
        return True

    def _unpin_writers(self, regions) -> None:
        """Writers done with their runs' regions (published, refused or failed)."""
        with self._lock:
            for region in regions:
                self.regions.pins[region] -= 1
        self._release_unpinned(set(regions))

    def _release_unpinned(self, regions) -> None:
        """Free the regions among ``regions`` that lost their last pin with no
        run left in them (deleted, cleared or dropped while being read, or a
        put refused by a clear): eviction would find them eventually, but
        their space counts as used until then."""
        if self.readonly or self.closed:
            return
        with self._lock:
            empty = [r for r in regions if self.regions.pins[r] == 0 and
                     self.regions.live[r] == 0 and self.regions.state[r] == SEALED]
        if not empty:
            return
        try:
            self._release_empty_regions(empty)
        except KVBlockError as e:    # the read or write itself went through
            logger.warning("kvblock: freeing emptied regions %s failed: %s", empty, e)

    def get_run(self, keys: Sequence, out) -> int:
        """Read the stored prefix of ``keys`` into ``out``.

        ``out`` is a writable array of ``len(keys) * geometry.block_bytes``
        bytes, laid out like ``put_run``'s data.  Returns the number of leading
        blocks read and verified; the contents of ``out`` past them are
        unspecified (a miss, or a checksum failure, which drops the bad run).
        """
        self._check_open()
        keys = normalize_keys(keys)
        dst = self._run_out(len(keys), out, "get_run")
        if self.host is None:
            return self._read(keys, dst, None)
        return self._read_tiered(keys, dst)

    def get_runs(self, requests: Sequence[tuple[Sequence, Any]]) -> list[int]:
        """:meth:`get_run` for several ``(keys, out)`` requests in one call;
        returns each request's count of leading blocks read and verified.

        Requests for a few blocks out of a stored run (an engine promoting
        part of what it stored as one run) are read in one engine batch and
        checked against their runs' trailers together: one native call and
        one pass of bookkeeping for all of them instead of one per request;
        requests for one whole run each go in one batch as well.  Other
        requests are read as get_run reads them.  With a host tier, every
        request is read as get_run reads it.  A checksum failure
        or a device error (EIO...) fails the request that met it (its count
        is 0) and drops the run it hit, as get_run does (which raises the
        device error); errors that reached no device (a closed engine) raise.
        """
        self._check_open()
        targets = []
        for keys, out in requests:
            keys = normalize_keys(keys)
            targets.append((keys, self._run_out(len(keys), out, "get_runs")))
        if self.host is not None:
            return [self._read_tiered(keys, dst) for keys, dst in targets]
        pinned: list = []
        counts = [0] * len(targets)
        try:
            with self._lock:
                for keys, _ in targets:
                    pinned.append(self._segments(keys))
            together = []       # (request, the read's (run, lay, pos, count, dst, ranges))
            whole = []          # (request, run, destination): one whole run each
            for i, ((_, dst), segs) in enumerate(zip(targets, pinned)):
                read = self._readable_together(segs, dst)
                if read is not None:
                    together.append((i, read))
                    continue
                if len(segs) == 1:
                    run, pos, count, at = segs[0]
                    part = _span(dst, at, at + count)
                    if self._straight_into(run, pos, count, part, None):
                        whole.append((i, run, part))
                        continue
                if segs:
                    try:
                        counts[i] = self._read_segs(segs, dst, None)
                    except IOFailedError as e:
                        if e.path is None:
                            raise
                        counts[i] = 0        # (the run it hit is dropped)
            if together:
                reads = [read for _, read in together]
                try:
                    oks = self._read_blocks_together(reads)
                except IOFailedError as e:
                    if e.path is None:
                        raise
                    oks = [self._read_alone(read) for read in reads]   # which run was it?
                for (i, read), ok in zip(together, oks):
                    counts[i] = read[3] if ok else 0
            if whole:
                self._read_whole_requests(whole, counts)
        except BaseException:
            for segs in pinned:
                if segs:
                    self._unpin(segs)
            raise
        for i, segs in enumerate(pinned):
            if segs:
                counts[i] = self._read_done(segs, counts[i], None)
            else:
                self.counters["miss_gets"] += 1
        return counts

    def _read_whole_requests(self, whole: list, counts: list) -> None:
        """get_runs' requests that are one whole run each, ``whole`` holding
        (request, run, destination): in one engine call (their I/O in flight
        together), again past a run that fails its checksums (count 0), and
        one by one after a device error, so that it fails only the request
        whose run it hit (that run is dropped)."""
        while whole:
            try:
                got = self._read_whole_runs([(run, part) for _, run, part in whole])
            except IOFailedError as e:
                if e.path is None:
                    raise
                for i, run, part in whole:
                    try:
                        counts[i] = run.nblocks if self._read_whole_runs([(run, part)]) else 0
                    except IOFailedError as e1:
                        if e1.path is None:
                            raise
                        self._read_failed(e1, [run])
                return
            for i, run, _ in whole[:got]:
                counts[i] = run.nblocks
            whole = whole[got + 1:]       # whole[got] failed its checksums: dropped, count 0

    def _read_alone(self, read) -> bool:
        """One :meth:`_read_blocks_together` item on its own; False when it
        meets a device error (the run it hit is dropped)."""
        try:
            return self._read_blocks_together([read])[0]
        except IOFailedError as e:
            if e.path is None:
                raise
            self._read_failed(e, [read[0]])
            return False

    def _run_out(self, n: int, out, what: str) -> np.ndarray:
        """``out`` of get_run (``n`` blocks) as a (layers, groups, n, bytes) view."""
        g = self.geometry
        out_arr = as_array(out, what, writable=True)
        if out_arr.nbytes != n * g.block_bytes or not out_arr.flags.writeable \
                or not out_arr.flags.c_contiguous:
            raise ConfigError(f"{what}: out must be a writable, C-contiguous array of "
                              f"{n * g.block_bytes} bytes for {n} blocks, got {out_arr.nbytes} "
                              f"bytes (writable: {out_arr.flags.writeable}, C-contiguous: "
                              f"{out_arr.flags.c_contiguous})")
        return out_arr.reshape(-1).view(np.uint8).reshape(g.num_layers, g.head_groups, n,
                                                          g.group_block_bytes)

    def get_blocks(self, keys: Sequence, outs: Sequence) -> int:
        """:meth:`get_run` into blocks that lie in separate buffers:
        ``outs[k]`` is a writable, C-contiguous array of
        ``geometry.block_bytes`` bytes that receives block k in the store's
        layout order.  A whole run read into aligned blocks goes straight into
        them (no copy).  Returns the number of leading blocks read and
        verified; the blocks past them are unspecified."""
        self._check_open()
        keys = normalize_keys(keys)
        dst = BlockList.of(outs, self.geometry, len(keys), "get_blocks", writable=True)
        if self.host is None:
            return self._read(keys, dst, None)
        return self._read_tiered(keys, dst)

    def _read_tiered(self, keys, dst) -> int:
        """Blocks in the host tier are copied from DRAM, stretches of the others
        read from the device; blocks read from the device then enter the tier
        (after the copies, so they cannot push out blocks about to be read)."""
        n = len(keys)
        epoch = self.host.epoch       # a clear() during the read keeps its blocks out
        in_host = [k in self.host for k in keys]
        done, fetched = 0, []
        while done < n:
            if in_host[done] and self.host.read_into(keys[done], _one(dst, done)):
                self.counters["host_hit_blocks"] += 1
                done += 1
                continue
            end = done + 1
            while end < n and not in_host[end]:
                end += 1
            got = self._read(keys[done:end], _span(dst, done, end), None)
            fetched.extend(range(done, done + got))
            self.counters["device_hit_blocks"] += got
            done += got
            if done < end:
                break
        for k in fetched:
            self.host.put(keys[k], _one(dst, k), epoch=epoch)
        return done

    def read_range(self, keys: Sequence, layer: int, group: int, out) -> int:
        """Read one (layer, head group) of the stored prefix of ``keys``:
        ``out`` holds ``len(keys) * group_block_bytes`` bytes (blocks in order).
        One read per run; returns the number of leading blocks read."""
        self._check_open()
        g = self.geometry
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                   for x in (layer, group)) or \
                not (0 <= layer < g.num_layers and 0 <= group < g.head_groups):
            raise ConfigError(f"read_range: layer {layer} / group {group} outside "
                              f"{g.num_layers} layers x {g.head_groups} groups")
        keys = normalize_keys(keys)
        out_arr = as_array(out, "read_range", writable=True)
        if out_arr.nbytes != len(keys) * g.group_block_bytes or not out_arr.flags.writeable \
                or not out_arr.flags.c_contiguous:
            raise ConfigError(f"read_range: out must be a writable, C-contiguous array of "
                              f"{len(keys) * g.group_block_bytes} bytes")
        dst = out_arr.reshape(-1).view(np.uint8).reshape(1, 1, len(keys), g.group_block_bytes)
        return self._read(keys, dst, (layer, group))

    def _read(self, keys, dst, only) -> int:
        with self._lock:
            segs = self._segments(keys)
        if not segs:
            self.counters["miss_gets"] += 1
            return 0
        try:
            done = self._read_segs(segs, dst, only)
        except BaseException:
            self._unpin(segs)
            raise
        return self._read_done(segs, done, only)

    def _read_done(self, segs, done: int, only) -> int:
        """Unpin a read's segments and count it: ``done`` blocks, or 0 when
        the pins lapsed meanwhile."""
        if not self._unpin(segs):
            # The pins lapsed while the bytes were read: their space may have
            # been reused meanwhile, and unverified reads would not notice.
            self.counters["lapsed_pin_gets"] += 1
            return 0
        g = self.geometry
        self.counters["get_blocks"] += done
        self.counters["get_bytes"] += done * (g.group_block_bytes if only else g.block_bytes)
        return done

    def _read_segs(self, segs, dst, only) -> int:
        """The pinned segments ``segs`` into ``dst``; how many leading blocks
        were read and verified (raises on a device error, after dropping the
        run it hit)."""
        if isinstance(dst, BlockList):
            dst.addresses()          # once: the per-run views below slice it
        done, i = 0, 0
        while i < len(segs):
            # Consecutive whole runs that go straight into place are read
            # in one engine call: their I/O is in flight together, and the
            # per-run cost is a few numpy ops instead of a call each.
            whole = []
            while i + len(whole) < len(segs):
                run, pos, count, out_at = segs[i + len(whole)]
                part = _span(dst, out_at, out_at + count)
                if not self._straight_into(run, pos, count, part, only):
                    break
                whole.append((run, part))
            if whole:
                try:
                    got = self._read_whole_runs(whole)
                except IOFailedError as e:
                    self._read_failed(e, [run for run, _ in whole])
                    raise
                done += sum(run.nblocks for run, _ in whole[:got])
                if got < len(whole):
                    break
                i += len(whole)
                continue
            run, pos, count, out_at = segs[i]
            try:
                if not self._read_segment(run, pos, count,
                                          _span(dst, out_at, out_at + count), only):
                    break
            except IOFailedError as e:
                self._read_failed(e, [run])
                raise
            done += count
            i += 1
        return done

    def _straight_into(self, run: Run, pos: int, count: int, part, only) -> bool:
        """Can blocks pos..pos+count of ``run`` be read straight into ``part``
        (no staging)?  When they are the whole, unpadded run and ``part`` is
        an aligned contiguous array (then it is the run's on-device image) or
        aligned blocks in separate buffers."""
        if only is not None or pos != 0 or count != run.nblocks:
            return False
        return self._is_image(self.layout(run.nblocks), part)

    def _read_segment(self, run: Run, pos: int, count: int, dst, only) -> bool:
        """Blocks pos..pos+count of ``run`` into ``dst`` ((layers, groups,
        count, bytes) array, or a BlockList when ``only`` is None)."""
        if self._straight_into(run, pos, count, dst, only):
            return self._read_whole_runs([(run, dst)]) == 1
        g = self.geometry
        lay = self.layout(run.nblocks)
        verify = self.verify == "always"
        idx = [lay.range_index(*only)] if only else list(range(g.ranges))
        if verify:
            window = self._verified_window(lay, pos, count, len(idx))
            if window is not None:
                return self._read_blocks_verified(run, lay, pos, count, dst, idx, *window)
            lo, span = 0, lay.range_bytes         # range checksums need whole ranges
        else:
            lo, span = self._window(lay, pos, count)
        buf = self._staging(span * len(idx))
        dev, base = self.regions.address(run.region, run.offset)
        offsets = (np.array(idx, dtype=np.uint64) * np.uint64(lay.range_bytes)
                   + np.uint64(base + lo))
        addrs = np.arange(len(idx), dtype=np.uint64) * np.uint64(span) + np.uint64(buf.address)
        batch = IOBatch(addrs, dev, offsets, span)
        if verify:
            sums = self.io.read_hashed(batch, np.arange(len(idx)), np.full(len(idx), _seed(run)))
            if not self._verified(run, sums, np.asarray(run.checksums, np.uint64)[idx], idx):
                return False
        else:
            self.io.read(batch)
        self._scatter_window(buf.array, len(idx), lo, span, pos, count, dst)
        self.counters["bytes_read"] += span * len(idx)
        return True

    def _scatter_window(self, buf: np.ndarray, nranges: int, lo: int, span: int, pos: int,
                        count: int, dst) -> None:
        """Blocks pos..pos+count into ``dst`` out of ``buf``, which holds
        ``nranges`` windows of ``span`` bytes, each from byte ``lo`` of its
        range."""
        gbb = self.geometry.group_block_bytes
        rows = buf[:span * nranges].reshape(nranges, span)[:, pos * gbb - lo:]
        if isinstance(dst, BlockList):
            dst.scatter_from(rows, 0)
        else:
            dst[...] = rows[:, :count * gbb].reshape(dst.shape)

    def _window(self, lay: RunLayout, pos: int, count: int) -> tuple[int, int]:
        """(offset, bytes) of the aligned part of each range of ``lay`` that
        holds blocks pos..pos+count."""
        gbb = self.geometry.group_block_bytes
        lo = pos * gbb // self.alignment * self.alignment
        return lo, min(round_up((pos + count) * gbb, self.alignment), lay.range_bytes) - lo

    def _verified_window(self, lay: RunLayout, pos: int, count: int, nranges: int):
        """For a verified read of blocks pos..pos+count of ranges of ``lay``:
        :meth:`_window`, to read with the trailer instead of whole ranges, or
        None when whole ranges cost about as little (the windows would be
        most of them)."""
        lo, span = self._window(lay, pos, count)
        if span * nranges + lay.trailer_bytes > lay.range_bytes * nranges * 3 // 4:
            return None
        return lo, span

    def _read_blocks_verified(self, run: Run, lay: RunLayout, pos: int, count: int, dst,
                              idx: list, lo: int, span: int) -> bool:
        """Blocks pos..pos+count of ``run`` (ranges ``idx``) into ``dst``,
        verified without reading whole ranges: each range's aligned window
        [lo, lo + span) and the run's block digest trailer in one batch; the
        trailer against the index's checksum, each block handed out against
        the trailer (kvblock/format/trailer.py)."""
        g = self.geometry
        gbb = g.group_block_bytes
        nidx = len(idx)
        # Windows that are exactly the blocks, into an aligned contiguous
        # destination (its rows are the ranges' blocks): read straight there.
        straight = (lo == pos * gbb and span == count * gbb and not isinstance(dst, BlockList)
                    and dst.flags.c_contiguous)
        if straight:
            data_at = dst.ctypes.data
            straight = data_at % self.alignment == 0
        dev, base = self.regions.address(run.region, run.offset)
        if straight and gbb % self.alignment == 0 and self.io.engine.mapped(dev):
            return self._read_blocks_together([(run, lay, pos, count, dst, idx)])[0]
        buf = self._staging((0 if straight else span * nidx) + lay.trailer_bytes)
        if not straight:
            data_at = buf.address
        tail = 0 if straight else span * nidx
        # Python ints, not numpy: a promotion reads a few blocks, and numpy's
        # per-call cost was most of this method's time.
        rb = lay.range_bytes
        offsets = [base + lo + r * rb for r in idx]
        offsets.append(base + lay.data_bytes)
        addrs = [data_at + i * span for i in range(nidx)]
        addrs.append(buf.address + tail)
        self.io.read(IOBatch.listed(addrs, dev, offsets, [span] * nidx + [lay.trailer_bytes]))
        trailer = buf.array[tail:tail + lay.trailer_bytes]
        # Block j of the i-th range read starts at i * span + (pos + j) * gbb - lo.
        first = data_at + pos * gbb - lo
        at = [first + i * span + j * gbb for i in range(nidx) for j in range(count)]
        if not self._blocks_match_trailer(run, trailer, trailerfmt.checksum(trailer, run.run_id),
                                          idx, pos, count,
                                          block_digests_at(at, gbb, run.run_id).tolist()):
            return False
        if not straight:
            self._scatter_window(buf.array, nidx, lo, span, pos, count, dst)
        self.counters["bytes_read"] += span * nidx + lay.trailer_bytes
        self.counters["partial_verified_reads"] += 1
        return True

    def _readable_together(self, segs, dst):
        """For get_runs: when a request's stored part is one segment that
        :meth:`_read_blocks_together` can read, that read's item, else None.
        That is part of a run (a whole run is read as one image, checked by
        range checksums), verified with the trailer, straight into an aligned
        contiguous ``dst``, each block its own I/O (so blocks must be whole
        sectors: the engine checks alignment on mapped devices too, and
        their reads take the engine's path until the mapping is ready)."""
        if len(segs) != 1 or self.verify != "always" or isinstance(dst, BlockList):
            return None
        run, pos, count, out_at = segs[0]
        if pos == 0 and count == run.nblocks:
            return None
        g = self.geometry
        lay = self.layout(run.nblocks)
        window = self._verified_window(lay, pos, count, g.ranges)
        gbb = g.group_block_bytes
        if window is None or window != (pos * gbb, count * gbb):
            return None
        part = _span(dst, out_at, out_at + count)
        if not part.flags.c_contiguous or part.ctypes.data % self.alignment:
            return None
        if gbb % self.alignment:
            return None
        return run, lay, pos, count, part, list(range(g.ranges))

    def _read_blocks_together(self, reads: list) -> list[bool]:
        """Blocks of one or more runs straight into place, in one engine
        batch; ``reads`` holds (run, layout, pos, count, dst, ranges) items,
        ``dst`` a contiguous (ranges, count) array of blocks.  Each block and
        each run's trailer (into this thread's staging buffer) is an entry
        hashed on its own: out of a mapping as it is copied, while its bytes
        are in cache, else as it lands.  Then each run's blocks are checked
        against its trailer (:meth:`_blocks_match_trailer`).  Returns, per
        item, whether its blocks are good."""
        gbb = self.geometry.group_block_bytes
        buf = self._staging(sum(lay.trailer_bytes for _, lay, *_ in reads))
        addrs, devs, offsets, lens, seeds = [], [], [], [], []
        trailer_at = buf.address
        for run, lay, pos, count, dst, idx in reads:
            dev, base = self.regions.address(run.region, run.offset)
            rb, at, nb = lay.range_bytes, dst.ctypes.data, len(idx) * count
            addrs += [at + k * gbb for k in range(nb)]
            addrs.append(trailer_at)
            offsets += [base + r * rb + (pos + j) * gbb for r in idx for j in range(count)]
            offsets.append(base + lay.data_bytes)
            lens += [gbb] * nb
            lens.append(lay.trailer_bytes)
            devs += [dev] * (nb + 1)
            seeds += [data_seed(run.run_id)] * (nb + 1)
            trailer_at += lay.trailer_bytes
        n = len(addrs)
        sums = self.io.read_hashed(IOBatch.listed(addrs, devs, offsets, lens),
                                   np.arange(n, dtype=np.uint32),
                                   np.array(seeds, np.uint64)).tolist()
        oks, k, t = [], 0, 0
        for run, lay, pos, count, dst, idx in reads:
            nb, tb = len(idx) * count, lay.trailer_bytes
            ok = self._blocks_match_trailer(run, buf.array[t:t + tb], sums[k + nb], idx, pos,
                                            count, sums[k:k + nb])
            if ok:
                self.counters["bytes_read"] += nb * gbb + tb
                self.counters["partial_verified_reads"] += 1
            oks.append(ok)
            k, t = k + nb + 1, t + tb
        return oks

    def _blocks_match_trailer(self, run: Run, trailer, trailer_sum: int, idx: list, pos: int,
                              count: int, digests: list[int]) -> bool:
        """A partial read's check: the trailer (its bytes, and ``trailer_sum``
        their hash) against the index's checksum, then ``digests`` (blocks
        pos..pos+count of ranges ``idx``, range-major) against the trailer's.
        On a mismatch, record the failure (the first bad range) and say False."""
        g = self.geometry
        if trailer_sum != int(run.checksums[g.ranges]):
            self._checksum_failure(run, g.ranges)
            return False
        table = trailerfmt.decode(trailer, g.ranges, run.nblocks)
        want = (table[:, pos:pos + count] if len(idx) == g.ranges
                else table[idx, pos:pos + count]).reshape(-1).tolist()
        if digests != want:
            self._checksum_failure(run, idx[_first_difference(digests, want) // count])
            return False
        return True

    def _read_whole_runs(self, parts: list) -> int:
        """Whole runs straight into place (``parts``: (run, destination) pairs
        that passed :meth:`_straight_into`, all BlockLists or all arrays), in
        one engine call; with verification each range is its own checksum
        stream.  Returns how many leading runs were read and verified (a bad
        run is dropped).  Built with numpy over all the runs at once."""
        verify = self.verify == "always"
        nr = self.geometry.ranges
        runs = [run for run, _ in parts]
        where = [self.regions.address(run.region, run.offset) for run in runs]
        if len(parts) * nr <= FEW_IOS and not isinstance(parts[0][1], BlockList):
            return self._read_few_images(parts, where, verify)
        devs = np.array([d for d, _ in where], dtype=np.uint32)
        bases = np.array([b for _, b in where], dtype=np.uint64)
        lays = [self.layout(run.nblocks) for run in runs]
        range_bytes = np.array([lay.range_bytes for lay in lays], dtype=np.uint64)
        if isinstance(parts[0][1], BlockList):   # an I/O per (range, block), merged if they touch
            blocks = parts[0][1] if len(parts) == 1 else BlockList.joined([p for _, p in parts])
            batch, streams = blocks.runs_batch([run.nblocks for run in runs], devs, bases,
                                               range_bytes, by_range=verify)
        else:                                    # each part is its run's image
            addrs = np.array([part.ctypes.data for _, part in parts], dtype=np.uint64)
            if verify:                           # one I/O per range
                j = np.repeat(np.arange(len(parts)), nr)
                r = np.tile(np.arange(nr, dtype=np.uint64), len(parts))
                batch = IOBatch(addrs[j] + r * range_bytes[j], devs[j],
                                bases[j] + r * range_bytes[j], range_bytes[j])
                streams = np.arange(len(parts) * nr)
            else:
                batch = IOBatch(addrs, devs, bases, [lay.data_bytes for lay in lays])
        if not verify:
            self.io.read(batch)
            good = len(parts)
        else:
            seeds = np.repeat(np.array([_seed(run) for run in runs], dtype=np.uint64), nr)
            sums = self.io.read_hashed(batch, streams, seeds)
            want = np.concatenate([np.asarray(run.checksums[:nr], np.uint64) for run in runs])
            bad = np.nonzero(sums != want)[0]
            good = int(bad[0]) // nr if bad.size else len(parts)
            if bad.size:
                self._checksum_failure(runs[good], int(bad[0]) % nr)
        self.counters["bytes_read"] += sum(lay.data_bytes for lay in lays[:good])
        return good

    def _read_few_images(self, parts: list, where: list, verify: bool) -> int:
        """_read_whole_runs of a few runs' images (at most FEW_IOS ranges in
        all: an LMCache chunk, a run of a few layers) with Python ints
        instead of numpy, whose per-call cost was ~70 us of a 2 MiB get."""
        nr = self.geometry.ranges
        addrs, devs, offsets, lens, seeds, want = [], [], [], [], [], []
        for (run, part), (dev, base) in zip(parts, where):
            lay = self.layout(run.nblocks)
            at = part.ctypes.data
            if verify:                           # one I/O (and checksum stream) per range
                rb = lay.range_bytes
                addrs += [at + r * rb for r in range(nr)]
                offsets += [base + r * rb for r in range(nr)]
                lens += [rb] * nr
                devs += [dev] * nr
                seeds += [data_seed(run.run_id)] * nr
                want += np.asarray(run.checksums[:nr], dtype=np.uint64).tolist()
            else:
                addrs.append(at)
                offsets.append(base)
                lens.append(lay.data_bytes)
                devs.append(dev)
        batch = IOBatch.listed(addrs, devs, offsets, lens)
        good = len(parts)
        if not verify:
            self.io.read(batch)
        else:
            sums = self.io.read_hashed(batch, np.arange(len(addrs)),
                                       np.array(seeds, dtype=np.uint64)).tolist()
            if sums != want:
                bad = _first_difference(sums, want)
                good = bad // nr
                self._checksum_failure(parts[good][0], bad % nr)
        self.counters["bytes_read"] += sum(self.layout(run.nblocks).data_bytes
                                           for run, _ in parts[:good])
        return good

    def _verified(self, run: Run, sums: np.ndarray, want: np.ndarray, idx=None) -> bool:
        """Compare a read's checksums with the run's; on a mismatch record the
        failure (the first bad range) and say False."""
        bad = np.nonzero(sums != want)[0]
        if bad.size:
            self._checksum_failure(run, int(bad[0]) if idx is None else idx[int(bad[0])])
            return False
        return True

    def _checksum_failure(self, run: Run, range_index: int) -> None:
        self.counters["checksum_failures"] += 1
        dev, off = self.regions.address(run.region, run.offset)
        self.last_checksum_failure = (self.io.devices[dev].path, off, run.run_id, range_index)
        self._drop_runs([run])

    def _read_failed(self, error: IOFailedError, runs: list[Run]) -> None:
        """A device read for ``runs`` failed (EIO, a short read...): drop the
        run the failed I/O was in (every one of ``runs`` when several I/Os
        failed or the error gives no offset), as a checksum failure does.
        Kept, it would stay a hit that no read can return, and engines retry
        hits (vLLM's tiering manager would promote it every step).  The
        caller still raises ``error``.  An engine failure that reached no
        device (no path) drops nothing."""
        self.counters["read_errors"] += 1
        if error.path is None:
            return
        hit = runs
        if error.offset is not None and error.failed <= 1:
            end = error.offset + max(int(error.length or 0), 1)
            hit = []
            for run in runs:
                dev, base = self.regions.address(run.region, run.offset)
                if (self.io.devices[dev].path == error.path
                        and base < end and error.offset < base + self.layout(run.nblocks).run_bytes):
                    hit.append(run)
            hit = hit or runs
        self.last_read_error = (error.path, error.offset, [r.run_id for r in hit])
        logger.warning("kvblock: %s; dropping %d run(s) that read it (%d blocks)", error,
                       len(hit), sum(r.nblocks for r in hit))
        try:
            self._drop_runs(hit)
        except KVBlockError as e:    # the read error is what the caller hears
            logger.warning("kvblock: dropping runs after a read error failed: %s", e)

    def _drop_runs(self, runs: list[Run]) -> None:
        with self._lock:
            runs = [r for r in runs if r.run_id in self.index.runs]
            for run in runs:
                self._remove_run(run)
        if runs and not self.readonly:
            self._commit([jfmt.DropRun(r.run_id) for r in runs])
            self._release_empty_regions({r.region for r in runs})

    def _release_empty_regions(self, candidates) -> None:
        for region in candidates:
            with self._lock:
                if not (self.regions.live[region] == 0 and self.regions.pins[region] == 0
                        and self.regions.state[region] == SEALED):
                    continue
                self.regions.state[region] = RECLAIMING
            self._finish_reclaim(region)

    def delete(self, keys: Sequence) -> int:
        """Remove the runs holding any of ``keys`` (and their blocks from the
        DRAM tier, with any of ``keys`` found only there); returns the number
        of blocks removed."""
        self._check_open(writing=True)
        keys = normalize_keys(keys)
        with self._lock:
            runs = {}
            for k in keys:
                hit = self.index.locate(k)
                if hit is not None:
                    runs[hit[0].run_id] = hit[0]
        self._drop_runs(list(runs.values()))
        host_only = 0
        if self.host is not None:     # the keys asked for too: a copy may outlive its run
            on_device = {run.key(k) for run in runs.values() for k in range(run.nblocks)}
            for key in on_device:
                self.host.discard(key)
            host_only = sum(self.host.discard(key) for key in set(keys) - on_device)
        self.counters["deleted_runs"] += len(runs)
        return sum(r.nblocks for r in runs.values()) + host_only

    def evict(self, nbytes: int | None = None, *, all: bool = False) -> int:
        """Reclaim sealed regions by policy until ``nbytes`` are free (or all
        unpinned ones with ``all=True``).  Returns regions reclaimed."""
        self._check_open(writing=True)
        if nbytes is not None and (isinstance(nbytes, bool) or
                                   not isinstance(nbytes, (int, np.integer)) or nbytes < 0):
            raise ConfigError(f"evict: nbytes must be a byte count >= 0, got {nbytes!r}")
        reclaimed = 0
        while True:
            with self._lock:
                free_bytes = len(self.regions.free) * self.regions.size
                if not all and (nbytes is None or free_bytes >= nbytes):
                    break
                if self.regions.open is not None:
                    self.regions.seal(self.regions.open)
                victim = self.regions.victim(self.eviction)
                if victim is None:
                    break
                self._begin_reclaim(victim)
            self._finish_reclaim(victim)
            reclaimed += 1
        return reclaimed

    def clear(self) -> int:
        """Forget every stored block: what engines mean by clearing a cache
        (after a weight update, the same keys would name different KV).
        Unpinned regions are reclaimed; runs in regions that reads in flight
        pin are dropped from the index at once (their space is freed when
        the last pin goes); a put call that began before the clear and is
        not yet published publishes nothing, none of its pieces (it returns
        0; pieces it published before are dropped with the rest once this
        returns); the DRAM tier is emptied too (evict keeps it: a block
        there outlives its run on flash), and reads and puts in flight do
        not refill it.  Returns the regions reclaimed now."""
        self._check_open(writing=True)
        with self._commit_lock:          # no publish decides meanwhile (_publish_puts)
            with self._lock:
                mark = self._next_run_id       # runs before it are dropped below
                self._clears += 1
        if self.host is not None:        # first: reads and puts in flight see the new epoch
            self.host.clear()
        reclaimed = self.evict(all=True)
        with self._lock:
            left = [r for r in self.index.runs.values() if r.run_id < mark]
        for at in range(0, len(left), CLEAR_DROP_BATCH):
            self._drop_runs(left[at:at + CLEAR_DROP_BATCH])
        return reclaimed

    def evict_older_than(self, cutoff: float) -> int:
        """Reclaim unpinned regions sealed before ``cutoff`` (seconds since the
        epoch).  Returns regions reclaimed."""
        self._check_open(writing=True)
        with self._lock:
            old = [int(r) for r in np.nonzero((self.regions.state == SEALED)
                                              & (self.regions.pins == 0)
                                              & (self.regions.sealed_at < cutoff))[0]]
            for region in old:
                self._begin_reclaim(region)
        for region in old:
            self._finish_reclaim(region)
        return len(old)

    def trim_free(self) -> tuple[int, int]:
        """Discard every free region.  Returns (regions discarded, free regions);
        0 discarded when the device does not support discard."""
        self._check_open(writing=True)
        done, seen = 0, set()
        while True:
            # One region at a time leaves the free list while it is discarded:
            # a writer given it meanwhile would have its data punched away.
            # It goes back at the end; meeting one already done ends the pass.
            with self._lock:
                if not self.regions.free or self.regions.free[0] in seen:
                    break
                region = self.regions.free.popleft()
            try:
                dev, off = self.regions.address(region)
                if self.io.discard(dev, off, self.regions.size):
                    done += 1
            finally:
                with self._lock:
                    self.regions.free.append(region)
            seen.add(region)
        self.counters["discards"] += done
        return done, len(seen)

    def _kvikio_reader(self):
        """The store's kvikio file handles (created on first GPU load)."""
        reader = getattr(self, "_kvikio", None)
        if reader is None:
            from kvblock.io.gpu import KvikioReader

            reader = self._kvikio = KvikioReader([d.path for d in self.io.devices])
        return reader

    def stats(self) -> dict:
        """Counters and gauges (bytes, blocks, regions, hits, checksum failures...)."""
        self._check_open()
        with self._lock:
            r = self.regions
            return {
                "uuid": str(uuid.UUID(bytes=self.sb.store_uuid)),
                "devices": [d.path for d in self.io.devices],
                "geometry": self.geometry.as_dict(),
                "engine": self.io.engine.name,
                # devices read (and written) through shared mappings (store files on tmpfs)
                "mapped_reads": [d.path for i, d in enumerate(self.io.devices)
                                 if self.io.engine.mapped(i)],
                "mapped_writes": [d.path for i, d in enumerate(self.io.devices)
                                  if self.io.engine.mapped_for_writes(i)],
                "capacity_bytes": r.count * r.size,
                "used_bytes": r.used_bytes,
                "regions": r.count,
                "regions_free": len(r.free),
                "regions_sealed": int((r.state == SEALED).sum()),
                "runs": len(self.index.runs),
                "blocks": len(self.index),
                "checkpoint_generation": self._generation,
                **{k: int(v) for k, v in sorted(self.counters.items())},
                **(self.host.stats() if self.host is not None else {}),
                **({"gpu_path": self._gpu_path, "gpu_path_reason": self._gpu_path_reason}
                   if getattr(self, "_gpu_path", None) else {}),
            }

    def close(self) -> None:
        """Clean shutdown: write a checkpoint (fast next open) and close devices."""
        if self.closed:
            if getattr(self, "io", None) is not None:
                self._release_devices()
            return
        try:
            if not self.readonly:
                with self._commit_lock:
                    self._write_checkpoint()
        finally:
            self.closed = True
            self._release_devices()

    def _release_devices(self):
        if getattr(self, "_kvikio", None) is not None:
            self._kvikio.close()
            self._kvikio = None
        if getattr(self, "host", None) is not None:
            self.host.close()
            self.host = None
        self.spares.close()
        for purpose in ("staging", "gather", "pages"):
            buf = getattr(self._local, purpose, None)
            if buf is not None:
                buf.close()
                setattr(self._local, purpose, None)
        if self.io is not None:
            self.io.close()
            self.io = None

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.index)} blocks"
        return f"KVStore({self.sb.geometry.describe()}, {state})"


# ---------------------------------------------------------------------- format planning
def store_in(copies: list[bytes], path: str, allow_model=False) -> str | None:
    """The kvblock store that superblock ``copies`` (read at sbfmt.COPY_OFFSETS)
    show, in words (None: none).  A store of another format version or a
    damaged one counts too: only force overwrites them.  ``allow_model``: a
    store formatted for this model is not counted (a tool's own scratch)."""
    try:
        sb = sbfmt.pick(copies, path)
    except UnsupportedVersionError as e:
        return f"a kvblock store of another kvblock release ({e})"
    except KVBlockError:
        if any(c[:len(sbfmt.MAGIC)] == sbfmt.MAGIC for c in copies):
            return "a damaged kvblock store (its superblocks do not check out; kvblock fsck)"
        return None
    if allow_model is not False and sb.fingerprint == model_fingerprint(allow_model):
        return None
    return f"kvblock store {uuid.UUID(bytes=sb.store_uuid)} ({sb.geometry.describe()})"


def _store_on(io: StoreIO, dev: int) -> str | None:
    """store_in() of a device of ``io``."""
    copies = [io.read_bytes(dev, off, sbfmt.SIZE) for off in sbfmt.COPY_OFFSETS]
    return store_in(copies, io.devices[dev].path)


def _try_superblock(io: StoreIO, dev: int, raise_errors=False):
    path = io.devices[dev].path
    copies = [io.read_bytes(dev, off, sbfmt.SIZE) for off in sbfmt.COPY_OFFSETS]
    try:
        return sbfmt.pick(copies, path)
    except KVBlockError:
        if raise_errors:
            raise
        return None


def _plan(devs: list[Device], geometry: Geometry, region_size, journal_bytes) -> dict:
    """Where everything goes on each device."""
    alignment = max(4096, max(d.block_size for d in devs))
    sb_end = round_up(2 * sbfmt.SIZE, alignment)
    total = sum(d.capacity for d in devs)
    min_run = RunLayout(geometry, 1, alignment).run_bytes
    if region_size is None:
        region_size = min(256 * MIB, max(MIB, total // 16 // MIB * MIB), )
        region_size = max(region_size, round_up(min_run, MIB))
        # Room for the runs' trailers: engines cut runs at round sizes (16 or
        # 64 MiB), which would tile a 256 MiB region exactly but for their
        # trailers; 1/64 more lets them (1/64 of a region is also a 4 KiB
        # trailer per 256 KiB run).
        region_size += round_up(region_size // TRAILER_RESERVE, alignment)
    if region_size % alignment or region_size < min_run:
        raise ConfigError(f"region_size {region_size} must be a multiple of {alignment} and "
                          f"hold at least one block ({min_run} bytes for {geometry.describe()})")
    if journal_bytes is None:
        journal_bytes = min(64 * MIB, max(MIB, total // 128))
    journal_bytes = round_up(journal_bytes, alignment)
    # Checkpoint slots must hold the largest possible index: every run at least
    # one aligned range per (layer, group) and a trailer, every block at least
    # block_bytes.
    max_runs = total // min_run + 1
    max_keys = total // geometry.block_bytes + 1
    max_regions = total // region_size + 1
    cp_bytes = round_up(cpfmt.HEADER_BYTES + max_regions * cpfmt.REGION_DTYPE.itemsize
                        + max_runs * (cpfmt.RUN_DTYPE.itemsize + 8 * geometry.run_checksums)
                        + max_keys * 16, alignment)
    cp_off = sb_end
    j_off = cp_off + 2 * cp_bytes
    data0 = round_up(j_off + journal_bytes, MIB if alignment <= MIB else alignment)
    data_offsets = [data0] + [round_up(sb_end, MIB if alignment <= MIB else alignment)] * (len(devs) - 1)
    per_dev = [max(0, (d.capacity - off) // region_size) for d, off in zip(devs, data_offsets)]
    if min(per_dev) < 1 or sum(per_dev) < 2:
        need = data0 + 2 * region_size
        raise DeviceTooSmallError(
            f"{devs[0].path}: {devs[0].capacity} bytes cannot hold metadata "
            f"({data0} bytes) and two {region_size}-byte regions (need about {need}); "
            "use a larger device or a smaller region_size", devs[0].path)
    return {"alignment": alignment, "region_size": region_size, "journal_offset": j_off,
            "journal_bytes": journal_bytes, "checkpoint_offset": cp_off,
            "checkpoint_bytes": cp_bytes, "data_offsets": data_offsets,
            "regions_per_device": per_dev, "region_count": min(per_dev) * len(devs)}


__all__ = ["KVStore"]
