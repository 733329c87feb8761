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
  the cache smaller, never wrong.  A delete() or clear() that finds runs
  gone that way returns only once their records are durable
  (``_await_removals``): its promise is that they stay gone.
- Reused space: a region is written again only after its RECLAIM record (with
  the region's new generation) is durable, and data checksums are seeded with
  the run id, so bytes of a reclaimed run never verify as another run's.
- Readers pin the regions they read; the eviction policy never picks a pinned
  region, so a block is never reclaimed under a reader.
- Every open replays the journal and then writes a new checkpoint, which starts
  a new journal epoch: records of an earlier epoch left on the medium are
  never replayed (see format/journal.py).

The class is in four parts: this module (format and open, the journal and
checkpoints, allocation and reclaim, the index, pins, eviction, stats),
recovery.py (replay on open), and reads.py and writes.py, a run's I/O on
the devices, which a rank of a served store (client.py) runs too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
from typing import Sequence

import numpy as np

from kvblock.alloc.regions import SEALED, RegionTable
from kvblock.devices import Device, check_distinct, refuse_one_path
from kvblock.devices.device import said_size
from kvblock.errors import (
    ConfigError,
    DeviceTooSmallError,
    FormatError,
    GeometryMismatchError,
    InternalError,
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
from kvblock.index import Run, normalize_keys
from kvblock.index.index import POS_BITS, POS_MASK, KeyIndex
from kvblock.index.keys import KEY_BYTES
from kvblock.io import open_engine
from kvblock.layout.geometry import Geometry, RunLayout, model_fingerprint, round_up
from kvblock.memory.spares import SpareBuffers
from kvblock.store import writes
from kvblock.store.counters import Counters
from kvblock.store.fence import fence_writers
from kvblock.store.inflight import CLOSE_WAIT_S, InFlight, in_flight
from kvblock.store.policy import EVICTION_POLICIES, VERIFY_MODES, Admission
from kvblock.store.reads import RunReader
from kvblock.store.recovery import Recovery
from kvblock.store.removals import RemovalLog
from kvblock.store.runio import StagingBuffers
from kvblock.store.scatter import block_at
from kvblock.store.storeio import StoreIO, note_late_data_write, refuse_late_writes
from kvblock.store.writes import Later, RunWriter, Streams
from kvblock.tiers import HostTier
from kvblock.units import is_whole, size_setting

MIB = 1 << 20
# A default region is 1/DEFAULT_REGION_SHARE of the store's space in whole
# MiB (at most DEFAULT_REGION_MAX) plus 1/TRAILER_RESERVE for runs' trailers.
DEFAULT_REGION_SHARE = 16
DEFAULT_REGION_MAX = 256 * MIB
# The default journal: 1/JOURNAL_SHARE of the store's space, 1 MiB to JOURNAL_MAX.
JOURNAL_SHARE = 128
JOURNAL_MAX = 64 * MIB
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
# _finish_reclaim's tries of its steps after a failure (a KeyboardInterrupt
# each, or a step that fails every time) before it gives up and fails the store
FINISH_TRIES = 5
RECLAIM_WAIT_S = 0.1  # an allocation waiting for another thread's reclaim looks again
CLEAR_DROP_BATCH = 4096  # DROP records per journal commit when clear() drops pinned runs
logger = logging.getLogger(__name__)
_RELEASE_LOCK = threading.Lock()   # _release_devices: a store's devices are let go once


def _fresh_release_lock() -> None:
    """In a forked child: a thread of the parent closing some store at the
    fork held _RELEASE_LOCK, and held it stays there (that thread is not
    the child's); the child's close() of its copies would wait for good."""
    global _RELEASE_LOCK
    _RELEASE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_release_lock)


# Staging memory that layer-wise loads (kvblock.tensors.load_blocks) leave
# here for the next load: up to 3 unit buffers per load in flight, of ~8 MiB
# into a host cache and ~32 MiB (page-locked) into a CUDA one: two CUDA
# loads' worth (a second load's dropped, the next one mapped and page-locked
# them again).
LOAD_STAGING_KEEP = 192 << 20


class Segments(list):
    """``_segments``' answer: (run, position, count, first output block)
    tuples whose runs are pinned.  ``held``: the runs still pinned, made by
    the first ``_unpin`` and taken off one by one as their pins drop (a
    call cut half way, made again, releases only those left)."""

    held: list | None = None


class PinHandle(Segments):
    """What :meth:`KVStore.pin` returns: the pinned stretches, released once
    (``host_keys``: the blocks pinned in the DRAM tier, held only there,
    ``host_pins`` the tier's tokens for them, a list each leaves as its
    pin drops;
    ``store``: the open store whose regions it pins)."""

    released = False
    host_keys: tuple = ()
    host_pins: tuple = ()
    store = None

    def __bool__(self) -> bool:
        # a prefix held only in DRAM pins no stretch, but is pinned: a caller
        # taking an empty handle for a miss would never release it
        return bool(len(self) or self.host_keys)


# KVStore.open's and format's keyword options (besides geometry, model, readonly)
OPEN_OPTIONS = ("verify", "eviction", "admit_after", "engine", "queue_depth",
                "host_cache_bytes", "storeio_factory")


def _check_options(options: dict, geometry: Geometry | None = None) -> None:
    """The options of an open, refused before anything is opened or written
    (format checked them only when it opened the store it had made, after
    wiping the devices' old one): unknown names, and verify, eviction,
    admit_after and host_cache_bytes (its blocks with ``geometry``).  The
    engine and queue_depth are checked where the engine is made, before
    format writes."""
    if geometry is not None and not isinstance(geometry, Geometry):
        _not_a_geometry(geometry)
    unknown = sorted(k for k in options if k not in OPEN_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; a store takes "
                          f"{', '.join(OPEN_OPTIONS[:-1])}")
    verify, eviction = options.get("verify", "always"), options.get("eviction", "lru")
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if eviction not in EVICTION_POLICIES:
        raise ConfigError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
    Admission(options.get("admit_after", 1))
    host = options.get("host_cache_bytes")
    host = 0 if host is None else size_setting(host, "host cache", "host_cache_bytes", 0)
    if host and geometry is not None and host // geometry.block_bytes < 2:
        raise ConfigError(f"host cache of {host} bytes (host_cache_bytes) holds fewer than "
                          f"two {geometry.block_bytes}-byte blocks; give it more memory or none")


def _not_a_geometry(geometry) -> None:
    raise ConfigError(f"geometry must be a kvblock.Geometry, got {type(geometry).__name__} "
                      f"{geometry!r:.80}; e.g. Geometry(num_layers=32, num_kv_heads=8, "
                      "head_dim=128) (Geometry(**d) from a dict)")


def _device_list(devices, call: str) -> list:
    """open()'s and format()'s ``devices`` as a list (an iterator or a
    generator is taken once, not used up by the first look), each a path
    or a Device; else ConfigError naming what was given."""
    refuse_one_path(devices)          # one path: refused by name, not its characters
    if devices is None:
        devices = []
    try:
        devices = list(devices)
    except TypeError:
        raise ConfigError(f"{call} takes a list of devices (paths or Devices), got "
                          f"{devices!r}") from None
    for d in devices:
        if not isinstance(d, (str, bytes, os.PathLike, Device)):
            raise ConfigError(f"{call}: a device is a path or a Device, got {d!r} in "
                              f"{devices!r}")
    if not devices:
        raise ConfigError("format needs at least one device" if call == "format" else
                          "open needs the store's device(s)")
    return devices


def _open_devices(devices, readonly=False) -> list[Device]:
    refuse_one_path(devices)    # a single path (not a list): refused by name
    check_distinct([d.path if isinstance(d, Device) else d for d in devices])
    for d in devices:
        if isinstance(d, Device):
            _check_passed(d, readonly)
    out = []
    try:
        for d in devices:
            out.append(d if isinstance(d, Device) else
                       Device(d, writable=not readonly, exclusive=not readonly))
    except BaseException:
        # only what was opened here: a Device the caller passed stays the caller's
        _close_after_failure(None, [d for d in out if not _passed(d, devices)])
        raise
    return out


def _check_passed(dev: Device, readonly: bool) -> None:
    """A Device the caller opened, refused (ConfigError) before anything is
    read or written where it cannot serve the open: closed; or, to write
    (format, an open without readonly=True), opened read-only, or without
    exclusive access -- the claim that keeps a second writer off the store
    while this one holds it."""
    if dev.closed:
        raise ConfigError(f"{dev.path}: the Device passed is closed (a store closes the "
                          "Devices it was given); pass its path or an open Device")
    if readonly:
        return
    if not dev.writable:
        raise ConfigError(f"{dev.path}: the Device passed was opened read-only "
                          "(writable=False); open the store with readonly=True, or pass "
                          "its path or a writable Device")
    if not getattr(dev, "exclusive", True):
        raise ConfigError(f"{dev.path}: the Device passed was opened without exclusive "
                          "access (exclusive=False): another writer could open the store "
                          "beside this one; pass its path or a Device opened exclusively, "
                          "or open the store with readonly=True")


def _passed(dev, devices) -> bool:
    """Whether ``dev`` is a Device the caller passed in ``devices`` (it
    stays the caller's, open, when the open or format fails)."""
    return any(dev is x for x in devices)


def _close_after_failure(io, devs, host=None) -> None:
    """What a failed open or format had opened, closed: the engine first
    (its rings hold registered references to the devices, which would keep
    a raw device's O_EXCL claim alive), then every device, then the DRAM
    tier (its arena page-locked with CUDA), each past one whose close
    raises.  A close that raises is logged: the caller raises the open's
    own error (typed: provision formats on NotAStoreError), not this one."""
    try:
        with contextlib.ExitStack() as stack:      # closes in the reverse order
            if host is not None:
                stack.callback(host.close)
            for d in reversed(devs):
                stack.callback(d.close)
            if io is not None:
                stack.callback(io.engine.close)
    except Exception as e:
        logger.warning("kvblock: closing what a failed open had opened failed: %s", e)


class KVStore(Recovery, RunReader, RunWriter):
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
        interrupted format leaves no store that opens: on one device no valid
        superblock; on several, the devices done before the interruption
        name a store whose other devices are blank (an open refuses it, and
        formatting it again needs ``force``).
        """
        devices = _device_list(devices, "format")
        if not isinstance(geometry, Geometry):     # format needs one: the store's
            _not_a_geometry(geometry)
        if not isinstance(force, (bool, np.bool_)):
            # a setting read as text ("no", "false") would count as true and
            # wipe the store it was to keep (as evict's all: numpy's bools too)
            raise ConfigError(f"format: force must be True or False, got {force!r}")
        force = bool(force)
        _check_options(options, geometry)      # not after the old store is wiped
        if len(devices) > sbfmt.MAX_DEVICES:
            raise ConfigError(f"a store spans at most {sbfmt.MAX_DEVICES} devices")
        # The DRAM tier too, before the old store is wiped: one of more
        # memory than the machine maps is refused only when it is made.
        host_cache_bytes = options.pop("host_cache_bytes", 0)
        host = HostTier(host_cache_bytes, geometry.block_bytes) if host_cache_bytes else None
        try:
            devs = _open_devices(devices)
        except BaseException:
            _close_after_failure(None, [], host)
            raise
        io = None
        try:
            refuse_late_writes(devs, opening=True)   # (a write of this process may still land)
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
            fingerprint = model_fingerprint(model)     # refused before any write
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
                    fingerprint=fingerprint, created_ns=now,
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
            _close_after_failure(io, [d for d in devs if not _passed(d, devices)], host)
            raise
        # A fresh store maps a tmpfs file's pages in before it returns (kvblock/io/mapped.py)
        return cls._open_devs(devs, devices, geometry=geometry, model=model,
                              _prefault_now=True, _host=host, **options)

    @classmethod
    def open(cls, devices: Sequence, *, geometry: Geometry | None = None, model=None,
             readonly: bool = False, _stop: threading.Event | None = None,
             **options) -> "KVStore":
        """Open an existing store (devices in any order) and recover its state.

        ``geometry`` / ``model``, when given, must match what the store was
        formatted with (:class:`GeometryMismatchError` otherwise).
        ``readonly=True`` opens without exclusive access and never writes
        (for inspection while another process may own the store).
        """
        devices = _device_list(devices, "open")
        _check_options(options, geometry)
        # ``_stop`` (a store server's stop event): once set, the wait for a
        # dead server's ranks' writes in flight ends (DeviceBusyError)
        return cls._open_devs(_open_devices(devices, readonly), devices, geometry=geometry,
                              model=model, readonly=readonly, _stop=_stop, **options)

    @classmethod
    def _open_devs(cls, devs, passed=(), **kw) -> "KVStore":
        """The store on ``devs``, which it owns once open; an open that
        fails closes those it opened, not the Devices the caller passed
        (``passed``: the caller's list), which stay the caller's."""
        store = cls.__new__(cls)
        try:
            store._init(devs, **kw)
        except BaseException:
            _close_after_failure(getattr(store, "io", None),
                                 [d for d in devs if not _passed(d, passed)],
                                 getattr(store, "host", None))
            raise
        return store

    def _init(self, devs, *, geometry=None, model=None, verify="always", eviction="lru",
              admit_after=1, engine=None, queue_depth=32, storeio_factory=None,
              readonly=False, host_cache_bytes=0, _prefault_now=False, _host=None,
              _stop=None):
        # ``_host``: the DRAM tier format made before it wrote (this store's
        # from here on: a failed open closes it)
        self.host = _host
        if _host is not None:
            _host._gone = self._dram_gone
        _check_options({"verify": verify, "eviction": eviction})
        self.verify, self.eviction = verify, eviction
        self.readonly = readonly
        self.admission = Admission(admit_after)
        self._lock = threading.RLock()
        self._reclaimed = threading.Condition(self._lock)   # a region was freed
        # Removals from the index whose records are not yet durable, by
        # ticket (_next_removal_ticket); those whose commit failed stay lost.
        self._removal_tickets = 0
        self._removing: set[int] = set()
        self._removals_lost: set[int] = set()
        # Regions being reclaimed -> (their removal's ticket, None when no
        # run leaves the index; the generation their RECLAIM record gives).
        # One tuple per reclaim (_begin_reclaim): whoever finishes it knows
        # it by identity (_finish_steps).
        self._reclaims: dict[int, tuple[int | None, int]] = {}
        # Free regions trim_free holds off the free list while it discards
        # them: free all the same (evict counts them, an allocation waits
        # for them rather than evict a region of live runs).
        self._trimming: set[int] = set()
        # Regions being reclaimed that stay free once their RECLAIM record
        # is durable (evict, evict_older_than, a region emptied), not an
        # allocation's (it takes its region at once): evict(nbytes) counts
        # them, as room another call is making.
        self._freeing: set[int] = set()
        self._removals_durable = threading.Condition(self._lock)
        self._commit_lock = threading.Lock()
        self._failure: BaseException | None = None   # the metadata write that closed it
        # A forked child's copy is shut: its index goes stale as the parent
        # reclaims regions, and its journal position would overwrite the
        # parent's records.
        self._inflight = InFlight(
            "store is closed; reopen it with KVStore.open(devices)",
            forked_message=f"this process was forked from the one that opened the store (pid "
                           f"{os.getpid()}): its copy is shut (the parent goes on writing the "
                           "store); open it again in this process with KVStore.open(devices)")
        self._pid = os.getpid()   # a forked child's copy leaves the metadata to the parent
        self._clears = 0       # clear() calls: a put call that saw another count is refused
        self._publishes = 0    # publish commits (Run.published: their order)
        self._pending: list = []
        self._pending_lock = threading.Lock()
        # Regions a write left in flight may still land on: pinned for good
        # (_keep_pinned), each once.
        self._kept_pinned: dict[int, bool] = {}
        self._stagings = StagingBuffers()
        self.spares = SpareBuffers(LOAD_STAGING_KEEP)
        self.counters = Counters({name: 0 for name in COUNTERS})
        self.removals = RemovalLog()   # keys of runs evicted or dropped (removed_since)
        self.closed = True
        t0 = time.perf_counter()
        self._io_options = (engine, queue_depth, storeio_factory or StoreIO)
        if not readonly:        # (a metadata write of this process may still land there)
            refuse_late_writes(devs, opening=True)
        self.io = self._make_io(devs)
        self._read_superblocks(devs, geometry, model)
        # Before the recovery, which writes the open's checkpoint: the tier
        # refuses a size of fewer than two of the store's blocks (known from
        # the superblock) or more than the machine maps, and an option
        # refused is refused before anything is written.
        if _host is None:
            self.host = HostTier(host_cache_bytes, self.geometry.block_bytes,
                                 gone=self._dram_gone) if host_cache_bytes else None
        self._recover()
        if not readonly:        # a rank of a dead server may still be writing
            dev0 = self.io.devices[0]
            fence_writers([(dev0.fd, dev0.path)], stop=_stop)
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
        # What the store is (read from device 0's superblock from here on)
        # every device's superblock must say alike; one saying otherwise
        # (a bug, or crafted) would be read and written by device 0's values.
        ref_dev, ref = next(((d, sb) for d, sb in zip(devs, sbs) if sb.device_index == 0),
                            (devs[0], first))
        for d, sb in zip(devs, sbs):
            for name in ("geometry", "fingerprint", "alignment", "region_size",
                         "device_count"):
                mine, theirs = getattr(sb, name), getattr(ref, name)
                if mine != theirs:
                    show = (lambda v: v.hex()) if name == "fingerprint" else (
                        (lambda v: v.describe()) if name == "geometry" else str)
                    raise NotAStoreError(
                        f"{d.path}: superblock {name} {show(mine)} differs from device "
                        f"{ref.device_index}'s ({ref_dev.path}: {show(theirs)}); the devices' "
                        "superblocks disagree, the metadata is corrupt (the cached KV cannot be "
                        "trusted): reformat the store", d.path, 0)
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
            # (a store formatted before capacities were whole blocks
            # recorded a partial last block too)
            if d.capacity < sb.device_bytes // d.block_size * d.block_size:
                # a shrunk file or device: regions past its end would fail
                # every read (or land on someone else's space after a resize)
                raise DeviceTooSmallError(
                    f"{d.path}: {said_size(d)}, but the store was formatted on "
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
        # A run fits its region, its positions the index's packing, and its
        # PUT record a quarter of the journal (a larger one would only fail
        # at its commit, after its data was written).
        self.max_run_blocks = _max_run_blocks(self.geometry, self.alignment,
                                              self.sb.region_size, self.sb.journal_bytes)

    # ------------------------------------------------------------------ index bookkeeping
    # (recovery itself: kvblock/store/recovery.py)
    def _index_runs(self, runs: list[Run]) -> set[int]:
        """Index and account runs (under self._lock, or in recovery); drop
        the runs they leave with no key (see kvblock/index/index.py).
        Returns the regions of the runs dropped."""
        superseded = self.index.add_many(runs)
        for run in runs:
            self._account_run(run)
        for run in superseded:
            self._remove_run(run)
        self.counters.add("superseded_runs", len(superseded))
        return {run.region for run in superseded}

    def _account_run(self, run: Run):
        r = run.region
        self.regions.live[r] += 1
        end = run.offset + self.layout(run.nblocks).run_bytes
        self.regions.fill[r] = max(int(self.regions.fill[r]), end)

    def _remove_run(self, run: Run):
        self.index.remove(run)
        self.regions.live[run.region] -= 1

    def _forget_run(self, run: Run):
        """(under self._lock) a run evicted or dropped: out of the index, its
        keys in the removal log (a superseded run's keys stay in the store).
        Logged first: a run cut out of the index (a KeyboardInterrupt) is
        logged already, and _forget_cut logs those still indexed."""
        self.removals.add(run.keys)
        self._remove_run(run)

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
        interrupted = None
        while True:
            inside = False
            try:
                with self._commit_lock:
                    inside = True
                    self._lead_commit(entry)
                break
            except BaseException as e:
                if inside:
                    if interrupted is not None and e is not interrupted:
                        # the commit this caller led after the interrupt
                        # failed: the interrupt is still the caller's (a
                        # KVBlockError instead would be taken for a miss,
                        # the Ctrl-C swallowed)
                        raise interrupted from e
                    raise
                # Cut (a KeyboardInterrupt) while another writer's commit
                # held the lock: the records are queued all the same, and the
                # next leader would write and apply them with this caller
                # gone (a reclaim's region left RECLAIMING, which
                # allocations wait for without end).  See them through first
                # (one commit's wait), then raise; cut again, fail the
                # store, as a commit cut while it writes does, so that
                # nothing waits for them.
                if interrupted is not None:
                    self._fail(e)
                    raise
                interrupted = e
        if entry[3] is not None:
            error = StoreClosedError(f"metadata commit failed: {entry[3]}")
            error.__cause__ = entry[3]
            if interrupted is not None:
                raise interrupted from error    # (not swallowed as a store error)
            raise error
        if interrupted is not None:
            raise interrupted   # the records are durable and applied

    def _lead_commit(self, entry) -> None:
        """(under the commit lock) write every pending record, ``entry``'s
        among them unless an earlier leader did."""
        done = entry[2]
        if not done.is_set():
            with self._pending_lock:
                batch, self._pending = self._pending, []
            if self._failure is not None:
                # A commit failed before this writer led: nothing more
                # goes to the journal of a failed store.
                for item in batch:
                    item[3] = self._failure
                    item[2].set()
                batch = []
            try:
                for chunk in self._journal_chunks(batch):
                    written = [r for e in chunk for r in e[0]]
                    if written:    # none when a clear() refused every put here
                        self._write_journal(written)
                    for item in chunk:
                        if item[1] is not None:
                            with self._lock:
                                item[1]()
                        item[2].set()
                    if self._jhead > self.sb.journal_bytes // 2:
                        self._write_checkpoint()
            except BaseException as e:
                for item in batch:
                    if not item[2].is_set():
                        item[3] = e
                        item[2].set()
                self._fail(e)
                if entry[3] is not None or not isinstance(e, KVBlockError):
                    raise
                # The leader's own records went out in an earlier journal
                # write (or a checkpoint after them failed): its call
                # succeeded (the store is closed now).
                logger.warning("kvblock: a metadata commit failed, the store is "
                               "closed (reopen it to recover): %s", e)

    def _journal_chunks(self, batch: list) -> list[list]:
        """(the commit leader) the pending entries with their records
        decided, cut into journal writes of at most half the journal each
        (an entry's records stay together: a group of puts is published
        whole or not at all).  Writers queued behind one leader may hold
        more records than the journal; one commit of them all would fail."""
        budget = self.sb.journal_bytes // 2
        chunks, size = [[]], 0
        for entry in batch:
            if callable(entry[0]):
                entry[0] = list(entry[0]())
            need = sum(jfmt.record_bytes(r) for r in entry[0])
            if chunks[-1] and size + need > budget:
                chunks.append([])
                size = 0
            chunks[-1].append(entry)
            size += need
        return [chunk for chunk in chunks if chunk]

    def _write_journal(self, records):
        data = jfmt.encode_commit(records, self._seq, jfmt.epoch(self.sb.store_uuid,
                                                             self._generation))
        if self._jhead + len(data) > self.sb.journal_bytes:
            self._write_checkpoint()
            data = jfmt.encode_commit(records, self._seq,
                                      jfmt.epoch(self.sb.store_uuid, self._generation))
            if len(data) > self.sb.journal_bytes:
                raise StoreFullError(f"a commit of {len(data)} bytes exceeds the "
                                     f"{self.sb.journal_bytes}-byte journal")
        self.io.flush()  # data before the records that publish it
        self.io.write_bytes(0, self.sb.journal_offset + self._jhead, data)
        self.io.flush([0])
        self._jhead += len(data)
        self._seq += len(records)
        self.counters.add_each(commits=1, journal_bytes=len(data))

    def _write_checkpoint(self):
        """Snapshot the index into the other slot; the journal restarts empty."""
        with self._lock:       # the snapshot; lookups and puts wait for this lock
            runs = list(self.index.runs.values())
            superseded = self.index.superseded()
            regions = np.zeros(self.regions.count, dtype=cpfmt.REGION_DTYPE)
            regions["generation"] = self.regions.generation
            # Only a sealed region's seal counts: one being reclaimed keeps
            # its old seal until released, and runs put in it after this
            # checkpoint would get it back at a replay (evict_older_than
            # and fifo/lru would take them first).
            sealed = self.regions.state == SEALED
            regions["seal_seq"] = np.where(sealed, self.regions.seal_seq, 0)
            regions["sealed_at"] = np.where(sealed, np.ceil(self.regions.sealed_at), 0)
            header = (self._generation + 1, self._seq, self._next_run_id)
        # The rest reads only what a published run never changes (its id,
        # place, keys, checksums): outside the lock (a second at a million runs).
        run_rows = np.array([(r.run_id, r.region, r.generation, r.offset, r.nblocks, 0)
                             for r in runs], dtype=cpfmt.RUN_DTYPE)
        keys = KeyIndex.checkpoint_keys(runs, superseded)
        sums = (np.array([r.checksums for r in runs], dtype=np.uint64) if runs
                else np.zeros((0, self.geometry.run_checksums), np.uint64))
        cp = cpfmt.Checkpoint(*header, self.geometry.run_checksums, regions, run_rows,
                              keys, sums)
        data = cp.encode()
        if len(data) > self.sb.checkpoint_bytes:
            raise StoreFullError(f"checkpoint of {len(data)} bytes exceeds its "
                                 f"{self.sb.checkpoint_bytes}-byte slot")
        slot = 1 - getattr(self, "_cp_slot", 1)
        try:
            self.io.flush()
            self.io.write_bytes(0, self.sb.checkpoint_offset + slot * self.sb.checkpoint_bytes,
                                data)
            self.io.flush([0])
        except BaseException as e:
            # The slot may hold the new generation now (a write or flush
            # can fail after its bytes landed): journal records of the old
            # epoch written after it would never replay, so acknowledged
            # puts, deletes and clears would be undone by a crash.  Stop
            # serving, as a failed commit does; a reopen recovers.
            self._fail(e)
            raise
        self._cp_slot = slot
        self._generation = cp.generation
        self._jhead = 0
        self._freed_before_checkpoint = frozenset()   # (see _finish_layout)
        self.counters.add("checkpoints")

    @in_flight
    def checkpoint(self) -> None:
        """Write a checkpoint now (also done when the journal is half full, and on close)."""
        self._check_open(writing=True)
        with self._commit_lock:
            self._write_checkpoint()

    def _fail(self, exc):
        """A metadata write failed: the in-memory state may be ahead of the
        medium, so the store stops serving; reopen to recover."""
        if self._failure is None:
            self._failure = exc
        self.closed = True

    def _check_open(self, writing: bool = False):
        if self.closed:
            raise StoreClosedError("store is closed; reopen it with KVStore.open(devices)")
        if self._inflight.forked:
            # A forked child's copy refuses lookups, pins and stats too, not
            # only the calls that use the devices: its index goes stale as
            # the parent deletes and evicts (a lookup hit, then a refused get).
            raise StoreClosedError(self._inflight._forked_message)
        if writing and self.readonly:
            raise ReadOnlyStoreError(f"{self.io.devices[0].path}: store is open read-only; "
                                     "open it without readonly=True to change it")

    # ------------------------------------------------------------------ puts
    # (argument checks and a run's I/O: kvblock/store/writes.py; reads:
    # kvblock/store/reads.py)
    def _put(self, keys: list[bytes], blocks, began: int | None = None) -> int:
        """put_run/put_blocks after their argument checks; ``blocks`` is a
        (layers, groups, n, group_block_bytes) array or a BlockList."""
        return self._put_many([(keys, blocks)], began)[0]

    def _put_began(self) -> int:
        return self._clears

    def _stored_whole(self, keys: list[bytes]) -> bool:
        # the probe and the count of _put_many's duplicate (device copies
        # only: keys held in the DRAM tier alone are written)
        self._check_open(writing=True)
        if not keys:
            return False
        with self._lock:
            whole = bool((self.index.lookup(keys) >= 0).all())
        if whole:
            self.counters.add("put_duplicate_runs")
        return whole

    def _put_many(self, items: list, began: int | None = None) -> list[int]:
        """put_runs after its argument checks: (keys, blocks) pairs.  One run
        alone is published piece by piece (pieces of at most a region).
        ``began``: the clear count when the call began (_put_began)."""
        # a clear() from the call's start on refuses every piece of it
        clears = self._clears if began is None else began
        with self._lock:              # one index probe for every item's keys
            found = self.index.lookup([k for keys, _ in items for k in keys]) >= 0
        # every run checked before anything changes
        unchecked = self._check_runs_fit(items, found)

        def admit(keys, whole, offers):
            if whole:
                self.counters.add("put_duplicate_runs")
                return "duplicate"
            with self._lock:          # its offer counts: two puts at once lose none
                # noted in ``offers`` as it is counted: a KeyboardInterrupt
                # as the lock is let go finds it there to be given back
                admitted = self.admission.admit(keys[0], offers)
            return "ok" if admitted else "rejected"    # counted by _plan_puts
        out, pieces, repeats, admitted = self._plan_puts(items, found, admit, unchecked)
        # The regions this call's writes hold pinned (writer pins), each
        # listed as it is pinned (in _allocate); _put_one and _put_group
        # unpin what it lists.
        held: list[int] = []
        try:
            if len(items) == 1:
                for i, keys, blocks in pieces:
                    stored = self._put_one(keys, blocks, clears, held)
                    out[i] += stored
                    if not stored:    # a clear() overtook it: its earlier pieces went too
                        out[i] = 0
                        break
            else:
                out = self._put_grouped(out, pieces, repeats,
                                        lambda group: self._put_group(group, clears, held),
                                        self.sb.journal_bytes)
        finally:          # (an error: ``out`` holds what the pieces before it stored)
            try:
                self._give_back_unstored(items, out, admitted)
            except BaseException:     # cut as it began: ``admitted`` names them all
                self._give_back_unstored(items, out, admitted)
                raise
        return out

    def _give_back_offers(self, offers: list) -> None:
        # admission_rejected_runs is not taken off: a declined offer given
        # back was never counted (_plan_puts counts them once its plan
        # stands; the server's admit, told count=False, did not either)
        interrupted = None
        while offers:
            try:
                with self._lock:
                    while offers:
                        # off the list first: cut as give_back returns,
                        # the offer is not given back again
                        key, admitted = offers[0]
                        del offers[0]
                        self.admission.give_back(key, admitted)
            except BaseException as e:
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted

    def _count_rejected(self, runs: int, keys: list[bytes] = ()) -> None:
        self.counters.add("admission_rejected_runs", runs)

    def _put_group(self, pieces: list, clears: int, held: list) -> list[tuple[int, int]]:
        """Write each piece as a run, then publish them all with one commit.
        Pieces whose buffers already are their on-device image (no staging)
        are written together in one engine call after the others; a staged
        piece is written at once (the staging buffer is reused).  Returns
        (item, blocks) per piece, 0 blocks for one a clear() refused.
        ``held``: the call's writer pins (see _put_many), unpinned here."""
        written, deferred = [], []      # deferred: (run index, batch, sums, Streams or Later)
        images = [self._is_image(self.layout(len(keys)), blocks) for _, keys, blocks in pieces]
        # The images are written in one call: hashed while it runs when it is
        # large, however small each run is (LMCache puts 8 chunks at a time).
        together = sum(self.layout(len(keys)).data_bytes
                       for (_, keys, _), image in zip(pieces, images) if image)
        later = 0 if together >= writes.OVERLAP_HASH_BYTES else True
        try:
            for (i, keys, blocks), image in zip(pieces, images):
                if image:
                    run, batch, sums = self._write_piece(keys, blocks, held, defer=True,
                                                         later=later)
                    deferred.append((len(written), batch, sums))
                else:
                    run = self._write_piece(keys, blocks, held)
                written.append((i, keys, blocks, run))
            if deferred:
                for k, sums in self._write_runs_together(
                        [(batch, sums, written[k][3].run_id) for k, batch, sums in deferred]):
                    written[deferred[k][0]][3].checksums = sums
            discards = self._host_discards()
            published = self._publish_puts([run for _, _, _, run in written], clears)
        except IOFailedError as e:
            if e.in_flight:
                self._keep_pinned(held, e)
            raise
        finally:
            try:
                self._unpin_writers(held)
            except BaseException:      # cut as it began: the list names every pin still held
                self._unpin_writers(held)
                raise
        for _, keys, blocks, run in written:
            if run.run_id in published:
                self._count_put(keys, blocks, run, clears, discards)
        return [(i, len(keys) if run.run_id in published else 0)
                for i, keys, _, run in written]

    def _put_one(self, keys: list[bytes], blocks, clears: int, held: list | None = None) -> int:
        """One piece written and published; ``held``: the call's writer
        pins (see _put_many), unpinned here."""
        held = [] if held is None else held
        try:
            run = self._write_piece(keys, blocks, held)
            discards = self._host_discards()
            published = self._publish_put(run, clears)
        except IOFailedError as e:
            if e.in_flight:
                self._keep_pinned(held, e)
            raise
        finally:
            try:
                self._unpin_writers(held)
            except BaseException:      # cut as it began: the list names every pin still held
                self._unpin_writers(held)
                raise
        if not published:
            return 0
        self._count_put(keys, blocks, run, clears, discards)
        return len(keys)

    def _keep_pinned(self, regions: list, error: IOFailedError) -> None:
        """A put's write a broken io_uring could not wait for may still
        land (``error.in_flight``): the regions its call wrote (``regions``,
        its writer pins, which one of them it was the error does not say)
        keep one pin each while the store is open, never reclaimed: freed
        and written again, the late write landed on a later run there.
        Logged once per region."""
        kept = []
        with self._lock:
            for r in dict.fromkeys(regions):
                if r not in self._kept_pinned:
                    # (one line, no call in it: a Ctrl-C finds both or neither)
                    self.regions.pins[r], self._kept_pinned[r] = self.regions.pins[r] + 1, True
                    kept.append(r)
        for r in kept:
            dev, off = self.regions.address(r)
            # another open of the device in this process would not know it
            note_late_data_write(self.io.devices[dev],
                                 f"a data write in region {r} (offset {off})")
            logger.warning(
                "kvblock: %s: region %d (offset %d, %d bytes) is kept pinned, never reused "
                "while this process lives: a write to it may still be in flight (a broken "
                "io_uring could not wait for it: %s); this process opens the store no more "
                "once it is closed, the next process's open reclaims the region",
                self.io.devices[dev].path, r, off, self.regions.size, error)

    def _dram_gone(self, keys: list[bytes]) -> None:
        """HostTier's ``gone``: blocks that left the DRAM tier.  Those the
        device does not hold either left the store: logged for
        removed_since (their runs were logged when they left the device,
        while DRAM still served them, and a watcher's present() kept
        them).  Called under the tier's lock (the store never takes that
        lock while holding its own)."""
        with self._lock:
            held = self.index.lookup(keys) >= 0
        if not held.all():
            self.removals.add(b"".join(k for k, h in zip(keys, held.tolist()) if not h))

    def _host_discards(self) -> int | None:
        """The host tier's discard count before a run is published: a
        delete() from then on keeps its blocks out of the tier (it may have
        removed the run before they got there)."""
        return None if self.host is None else self.host.discards

    def _write_piece(self, keys: list[bytes], blocks, held: list, defer: bool = False,
                     later: int | bool = True):
        """Allocate a run's space and write its data: the Run, not yet
        published, its region still pinned, listed in ``held`` as it was
        pinned (the caller publishes, then unpins what ``held`` lists, also
        when this raises: a KeyboardInterrupt landing anywhere from the pin
        on leaves no pin that nothing drops).  ``defer``: leave the write
        to the caller, and return (Run without checksums when the write is
        to compute them, its IOBatch, its checksums, Streams or Later).
        ``later``: see _stage_run."""
        lay = self.layout(len(keys))
        region, offset, run_id, gen = self._begin_put(lay.run_bytes, held)
        dev, dev_off = self.regions.address(region, offset)
        batch, sums = self._stage_run(lay, blocks, run_id, dev, dev_off, later=later)
        if not defer:
            sums = self._write_run(batch, sums, run_id)
        run = Run(run_id, region, gen, offset, b"".join(keys),
                  None if isinstance(sums, (Streams, Later)) else sums, created=time.time())
        return (run, batch, sums) if defer else run

    def _count_put(self, keys: list[bytes], blocks, run: Run, clears: int,
                   discards: int | None) -> None:
        """A published run: its blocks enter the host tier (as the newest
        copies, unless a clear() came since the put began: the tier's epoch
        counts clear() calls as ``_clears`` does, clear() moving both; or a
        delete() since it was published, ``_host_discards``); the counters."""
        if self.host is not None:
            # Only the keys that still name this run: a newer copy published
            # (and put in the tier) since must not be replaced by this older
            # one.  Copied outside the store's lock (a long run's copies
            # would hold lookups up), so looked at again after: a key a
            # newer put took meanwhile leaves the tier (its reads go to the
            # device, which has the newest copy).
            packed = run.packed()
            with self._lock:
                named = self.index.lookup(keys)
            mine = np.flatnonzero(named == packed).tolist()
            # Keys no run names any more: this run left the device (evicted,
            # dropped) between its publish and here.  A copy of an older
            # put may still be in DRAM (its run evicted before, the tier
            # kept it): it must go, or reads get those older bytes.  Only
            # a copy older than this run: a newer put's (published after
            # this one, its run evicted since) is the key's newest copy,
            # held nowhere else.
            unnamed = np.flatnonzero(named < 0).tolist()
            for k in mine:
                # Asked again under the tier's lock: a newer put that
                # published since the look above (and returned, its copy
                # given to the tier) is not replaced by this older copy.
                self.host.put(keys[k], block_at(blocks, k), epoch=clears,
                              discards=discards, replace=True,
                              current=self._names(keys[k], packed[k]))
            if mine or unnamed:
                self._tier_keep_newest([keys[k] for k in mine + unnamed], packed[mine + unnamed],
                                       [run.published] * len(mine + unnamed))
        self.counters.add_each(put_runs=1, put_blocks=len(keys),
                               bytes_written=self.layout(len(keys)).run_bytes)

    def _names(self, key: bytes, packed):
        """For HostTier.put's ``current``: does the index still name
        ``packed`` (a run's position) for ``key``?  Then the run's
        ``published`` (the copy's age, for HostTier.drop_older), else None.
        ``packed`` -1 (a read that found the key nowhere when it looked, and
        on the device after: a put published meanwhile) is never current:
        its bytes are of a run the caller cannot date."""
        def check() -> int | None:
            with self._lock:
                if packed < 0 or self.index.lookup([key])[0] != packed:
                    return None
                return self.index.runs[int(packed) >> POS_BITS].published
        return check

    # The three steps of a put, also used apart by the store server
    # (kvblock/store/server.py), whose clients write the data themselves.
    def _begin_put(self, run_bytes: int, held: list | None = None) -> tuple[int, int, int, int]:
        """(region, offset, run id, region generation) for a new run; the
        region comes back pinned (a writer in flight: the caller unpins).
        ``held``: a list the region is added to as it is pinned, whose
        owner unpins what it lists, also when this raises; without one,
        an exception (a KeyboardInterrupt after _allocate returned) unpins
        it here."""
        pinned = [] if held is None else held
        try:
            region, offset = self._allocate(run_bytes, pinned)
            with self._lock:
                run_id = self._next_run_id
                self._next_run_id += 1
                gen = int(self.regions.generation[region])
            return region, offset, run_id, gen
        except BaseException:
            if held is None:
                try:
                    self._unpin_writers(pinned)
                except BaseException:  # cut as it began: the list names the pin still held
                    self._unpin_writers(pinned)
                    raise
            raise

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
            else:
                self.counters.add("cleared_puts", len(runs))
            return [jfmt.PutRun(run.run_id, run.region, run.generation, run.offset,
                                run.keys, tuple(int(s) for s in run.checksums))
                    for run in kept]

        emptied = set()

        def publish():
            now = time.time()
            self._publishes += 1
            for run in kept:
                run.published = self._publishes
            emptied.update(self._index_runs(kept))
            for run in kept:
                self.regions.last_access[run.region] = now

        try:
            self._commit(records, publish)
        finally:
            # The regions the runs emptied (superseded every run there,
            # none pinned) are freed also when a KeyboardInterrupt lands
            # after the commit applied (_commit raises it once the records
            # are durable) or as the release begins: left sealed with no
            # run, nothing frees them until eviction reaches them, and puts
            # evict live runs meanwhile.  (It frees each region once.)
            try:
                if emptied:
                    self._release_unpinned(emptied)
            except BaseException:
                self._release_unpinned(emptied)
                raise
        return {r.run_id for r in kept}

    def _allocate(self, nbytes: int, held: list) -> tuple[int, int]:
        """Space for a run, reclaiming regions by policy when none is free.
        The region comes back pinned (a writer in flight), added to ``held``
        as it is pinned: the caller unpins what ``held`` lists (when this
        raises too: a KeyboardInterrupt after the pin, here or in the
        caller before its own try, left the pin held for good, the region
        never evicted)."""
        while True:
            got, emptied, was_open = None, None, None

            def pick():
                nonlocal got, emptied, was_open
                self._check_freed_at_open(nbytes)
                was_open = self.regions.open
                taken = self.regions.allocate(nbytes, time.time())
                # The open region sealed here may hold no run (all deleted,
                # dropped or superseded while it was open): nothing else frees
                # a region emptied before its seal, so it would stay counted
                # as used, and allocations would evict live runs instead.
                if was_open is not None and self.regions.open != was_open \
                        and self.regions.live[was_open] == 0 \
                        and self.regions.pins[was_open] == 0:
                    emptied = was_open
                if taken is not None:
                    # pinned once ``held`` lists it (a cut between the two
                    # undoes the pin: nothing else changes it under the lock)
                    pins, listed = int(self.regions.pins[taken[0]]), len(held)
                    try:
                        self.regions.pins[taken[0]] = pins + 1
                        held.append(taken[0])
                    except BaseException:
                        if len(held) == listed:
                            self.regions.pins[taken[0]] = pins
                        raise
                    got = taken
                    return None      # an emptied region is freed below
                if emptied is not None:
                    return emptied, False        # freed, then taken
                if self._trimming or (self.regions.state == RECLAIMING).any():
                    # The free region trim_free is discarding comes back
                    # at once, or another thread is freeing a region (its
                    # RECLAIM record in flight): wait for it rather than
                    # evict a region of live runs too (two puts racing for
                    # the last region would empty two, where one holds both
                    # runs), or fail.  A failed reclaim closes the store,
                    # and the wait with it.
                    self._check_open()
                    self._reclaimed.wait(RECLAIM_WAIT_S)
                    return None
                victim = self.regions.victim(self.eviction)
                if victim is None:
                    raise StoreFullError(
                        f"store is full and every region holds pinned runs "
                        f"({self.regions.count} regions of {self.sb.region_size} bytes); "
                        "release pins or add capacity")
                return victim, True
            # The region is written again at once: no discard (see _finish_reclaim).
            try:
                self._reclaim(pick, discard=False)
                if got is not None:
                    if emptied is not None:
                        self._release_unpinned({emptied})
                    return got
            except BaseException:
                # Cut (a KeyboardInterrupt) from the pick on: the open region
                # it may have sealed empty is freed all the same (else it
                # stays sealed with no run; _release_unpinned frees it only
                # when so, once).
                if was_open is not None:
                    try:
                        self._release_unpinned({was_open})
                    except BaseException:
                        self._release_unpinned({was_open})
                raise

    def _check_freed_at_open(self, nbytes: int) -> None:
        """(before an allocation of ``nbytes``) refuse to write a region
        recovery freed while the checkpoint on the device may still place
        runs in it at its generation: its bytes rewritten, a journal cut or
        damaged where the records that emptied it lie would bring those
        runs back over them.  The open's checkpoint makes them safe, so
        this fires only where that checkpoint was skipped (a bug)."""
        freed, regions = self._freed_before_checkpoint, self.regions
        if not freed or not regions.free or regions.free[0] not in freed:
            return
        if regions.open is None or int(regions.fill[regions.open]) + nbytes > regions.size:
            r = regions.free[0]
            off = self.sb.checkpoint_offset + getattr(self, "_cp_slot", 0) \
                * self.sb.checkpoint_bytes
            raise InternalError(
                f"{self.io.devices[0].path}: region {r} was freed by recovery at its old "
                f"generation {int(self.regions.generation[r])}, but the open wrote no "
                f"checkpoint after it (the one at offset {off} may still place runs there): "
                "writing it now could bring them back over new bytes after a crash; a bug "
                "in kvblock: report it, and reopen the store (its open writes the checkpoint)")

    def _reclaim(self, pick, discard: bool = True) -> int | None:
        """Reclaim the region ``pick()`` names and return it; None (nothing
        done) when it names none.  ``pick`` runs under self._lock and
        returns (region, evict): with ``evict`` the region's runs leave the
        index (an eviction), else it holds none (emptied) and is only
        freed.  ``discard``: see _finish_reclaim; a reclaim that does not
        discard (an allocation's) takes its region at once, so it is not
        room another call is making (``_freeing``).

        From the moment pick() named a region its reclaim goes through: a
        KeyboardInterrupt landing at any line after (its runs leaving the
        index, the ticket, the RECLAIM record, the release) is raised once
        the record is durable and the region free.  Stopped half way, runs
        out of the index had no record (a crash brought them back), or the
        region stayed RECLAIMING with its ticket pending, which every
        allocation, evict, delete and clear then waited for.  Cut again
        while it completes: the store fails (as a commit cut twice), which
        ends those waits."""
        picked, begun, began = None, None, {}
        try:
            with self._lock:
                picked = pick()
                if picked is None:
                    return None
                self._begin_reclaim(*picked, freeing=discard, began=began)
                begun = self._reclaims[picked[0]]
            self._finish_reclaim(picked[0], discard)
        except BaseException:
            if picked is not None and self._failure is None:
                self._reclaim_cut(*picked, begun, discard, began)
            raise
        return picked[0]

    def _reclaim_cut(self, region: int, evict: bool, begun, freeing: bool,
                     began: dict) -> None:
        """_reclaim's reclaim of ``region`` after an exception: begun
        (``begun``, its _reclaims entry, None when _begin_reclaim was cut)
        and finished, unless it was (a KeyboardInterrupt after the region
        went free, a failed TRIM).  Cut again: the store fails."""
        try:
            if begun is None:
                with self._lock:
                    begun = self._begin_cut(region, evict, freeing, began)
            if self._reclaims.get(region) is begun:
                self._finish_reclaim(region, discard=False)
        except BaseException as again:
            with self._lock:
                self._fail(again)
                self._reclaimed.notify_all()
                self._removals_durable.notify_all()
            raise

    def _begin_reclaim(self, region: int, evict: bool = True, freeing: bool = True,
                       began: dict | None = None) -> None:
        """(under self._lock) the region RECLAIMING, its runs (``evict``)
        out of the index and counted, their removal's ticket held;
        ``freeing``: it counts as room being made (``_freeing``).
        ``began`` (for _begin_cut) gets the runs and their blocks before
        any leaves, and "counted" once the eviction counters have them."""
        began = {} if began is None else began
        runs = self.index.runs_in(region) if evict else []
        # the positions still theirs: a newer run's copy of a key stays stored
        # (Run.live: 0 once out of the index)
        blocks = sum(run.live for run in runs)
        began["runs"], began["blocks"] = runs, blocks
        if evict:
            # counted and noted together: _begin_cut counts a reclaim cut
            # (a KeyboardInterrupt) before it, once
            self._count_eviction(len(runs), blocks, began)
        ticket = self._next_removal_ticket() if evict else None
        self._reclaims[region] = (ticket, (int(self.regions.generation[region]) + 1)
                                  & 0xFFFFFFFF)
        if ticket is not None:
            self._removing.add(ticket)
        self.regions.state[region] = RECLAIMING
        if freeing:
            self._freeing.add(region)
        if self.regions.open == region:
            self.regions.open = None
        for run in runs:
            self._forget_run(run)

    def _count_eviction(self, runs: int, blocks: int, began: dict) -> None:
        """The eviction counters and ``began["counted"]`` together, under
        the counters' lock with no call between them: CPython raises a
        pending KeyboardInterrupt as a call returns, and one as add_each()
        returned left the counts added but not noted (_begin_cut added
        them again)."""
        c = self.counters
        with c._lock:
            c["evicted_regions"] += 1
            c["evicted_runs"] += runs
            c["evicted_blocks"] += blocks
            began["counted"] = True

    def _begin_cut(self, region: int, evict: bool, freeing: bool, began: dict):
        """(under self._lock) _begin_reclaim's work after a KeyboardInterrupt
        cut it (each step again is harmless; the count once); returns the
        reclaim's _reclaims entry.  ``began``: _begin_reclaim's notes."""
        if evict and not began.get("counted"):
            if "runs" in began:
                runs, blocks = began["runs"], began["blocks"]
            else:        # cut before it noted them: none has left the index
                runs = self.index.runs_in(region)
                blocks = sum(run.live for run in runs)
            self._count_eviction(len(runs), blocks, began)
        entry = self._reclaims.get(region)
        if entry is None:
            entry = self._reclaims[region] = (
                self._next_removal_ticket() if evict else None,
                (int(self.regions.generation[region]) + 1) & 0xFFFFFFFF)
        if entry[0] is not None:
            self._removing.add(entry[0])
        self.regions.state[region] = RECLAIMING
        if freeing:
            self._freeing.add(region)
        if self.regions.open == region:
            self.regions.open = None
        runs = {run.run_id: run for run in began.get("runs", []) + self.index.runs_in(region)}
        self._forget_cut(list(runs.values()))
        return entry

    def _finish_reclaim(self, region: int, discard: bool = True) -> None:
        """Commit the region's RECLAIM record, then free it.  ``discard``:
        TRIM it too (evict/delete: the space may stay free a while).  A region
        reclaimed by an allocation is rewritten at once, so it is not trimmed:
        the overwrite replaces the old data anyway, and on thin-provisioned
        targets (loop over tmpfs or a file) a TRIM punches a hole that the
        next writes must allocate again, which halved steady-state save
        throughput (perf/store_vs_fio.py).  `kvblock trim` discards free regions.

        A KeyboardInterrupt does not stop it half way: the steps left are
        taken again (without the TRIM), then it is raised.  Cut twice
        before the record is durable: the store fails, as _commit does when
        cut twice (a region freed with no RECLAIM record durable would be
        written under a generation the journal never gave it: a crash
        would drop those runs as stale and bring back the evicted ones on
        bytes overwritten since)."""
        entry, interrupted, failures = None, None, 0
        while True:
            try:
                if entry is None:
                    with self._lock:
                        entry = self._reclaims[region]
                self._finish_steps(region, entry, discard)
                break
            except BaseException as e:
                failures += 1
                # what is raised in the end: the first failure, but a
                # KeyboardInterrupt over an ordinary error (a Ctrl-C after
                # a failed step stays the caller's, not that error)
                first = e if interrupted is None or (
                    isinstance(interrupted, Exception) and not isinstance(e, Exception)) \
                    else interrupted
                if entry is None:
                    if interrupted is not None:
                        self._fail_reclaim(e, region, None)
                        if first is not e:
                            raise first from e
                        raise
                    interrupted = e
                    continue
                if self._failure is not None:
                    # a failed commit closed the store: the record may not
                    # be durable, the removal is lost
                    self._fail_reclaim(e, region, entry)
                    if first is not e:
                        raise first from e
                    raise
                if self._reclaims.get(region) is not entry:
                    raise first                  # free (a failed TRIM raises here)
                if interrupted is not None and \
                        int(self.regions.generation[region]) != entry[1]:
                    self._fail_reclaim(e, region, entry)     # cut twice before the record
                    if first is not e:
                        raise first from e
                    raise
                if failures >= FINISH_TRIES:
                    # A step after the record (the ticket's end, the
                    # release) that fails each time: retried without
                    # bound, the caller spun for good.  The store fails
                    # (the record is durable: a reopen frees the region).
                    error = StoreClosedError(
                        f"reclaim of region {region} could not finish after its RECLAIM "
                        f"record was durable ({failures} tries; last: {e!r}); reopen the "
                        "store (KVStore.open)")
                    error.__cause__ = e
                    try:
                        self._fail_reclaim(error, region, entry)
                    except BaseException:     # (the failing step itself, again)
                        pass
                    if not isinstance(first, Exception):
                        raise first from error   # a Ctrl-C stays the caller's
                    raise error
                interrupted, discard = first, False
        if interrupted is not None:
            raise interrupted

    def _fail_reclaim(self, e: BaseException, region: int, entry) -> None:
        """A reclaim whose record will not be written (or was, and the store
        failed after): the store fails, the removal ends (lost unless the
        record is durable), so that nothing waits for either for good.
        ``entry`` None (_finish_reclaim cut twice as it looked it up): the
        region's entry, when it still has one (left pending, its ticket
        kept a delete() or clear() waiting in _await_removals for good)."""
        with self._lock:
            self._fail(e)
            if entry is None:
                entry = self._reclaims.get(region)
            self._reclaimed.notify_all()
            self._removals_durable.notify_all()    # (a wait on a ticket sees the failure)
        if entry is not None:
            self._end_removal(entry[0], int(self.regions.generation[region]) == entry[1])

    def _finish_steps(self, region: int, entry, discard: bool) -> None:
        """_finish_reclaim's steps, each harmless when taken again: the
        record (unless durable: the generation is set as it becomes so),
        the ticket's end, the TRIM, the release (once: the region is free,
        or another reclaim's, when _reclaims no longer holds ``entry``)."""
        ticket, new_gen = entry

        def new_generation():
            # As the record becomes durable, before any checkpoint can follow
            # it (the commit that fills half the journal writes one at once):
            # a checkpoint with the old generation would make replay reject
            # every run put in the region since.
            self.regions.generation[region] = new_gen
        if int(self.regions.generation[region]) != new_gen:
            self._commit([jfmt.Reclaim(region, new_gen)], new_generation)
        self._end_removal(ticket, True)
        try:
            dev, off = self.regions.address(region)
            if discard and self.io.discard(dev, off, self.regions.size):
                self.counters.add("discards")
        finally:
            # Free even when the TRIM failed (its error is raised): the
            # RECLAIM record is durable, and a region left RECLAIMING would
            # be neither allocated nor reclaimed again until a reopen.
            with self._lock:
                if self._reclaims.get(region) is entry:
                    if self.regions.state[region] == RECLAIMING:
                        self._freeing.discard(region)
                        self.regions.release(region, generation=new_gen)
                    del self._reclaims[region]
                self._reclaimed.notify_all()

    def lookup(self, keys: Sequence) -> int:
        """Number of leading ``keys`` stored (longest stored prefix, in the
        host tier or on the device)."""
        self._check_open()
        keys = normalize_keys(keys)
        host = self.host      # once: a close() in another thread sets it to None
        if host is None:
            with self._lock:  # the index's arrays are swapped when it grows
                n = self.index.prefix_length(keys)
        else:
            with self._lock:
                on_device = self.index.lookup(keys) >= 0
            n = 0
            while n < len(keys) and (on_device[n] or keys[n] in host):
                n += 1
        self.counters.add_each(lookups=1, lookup_hit_blocks=n)
        return n

    def present(self, keys: Sequence) -> np.ndarray:
        """Per key: is it stored (on the device or in the host tier)?  One
        vectorised index probe; not counted as a lookup (writers use it to
        skip blocks already stored)."""
        self._check_open()
        keys = normalize_keys(keys)
        host = self.host      # once: a close() in another thread sets it to None
        with self._lock:
            found = self.index.lookup(keys) >= 0
        if host is not None:
            found = found | np.array([k in host for k in keys], dtype=bool)
        return found

    def pin(self, keys: Sequence) -> list:
        """Protect the stored prefix of ``keys`` from eviction until
        :meth:`unpin` (a lease held by an engine between lookup and load).
        Returns the pin handle (the pinned stretches; ``[]`` when nothing is
        stored)."""
        self._check_open()
        keys = normalize_keys(keys)
        host = self.host      # once: a close() in another thread sets it to None
        # A KeyboardInterrupt before the handle is returned: what it pinned
        # is released here (else nobody could: the caller has no handle).
        segs = handle = None
        try:
            if host is None:
                with self._lock:
                    segs = self._segments(keys)
                handle = PinHandle(segs)
            else:
                handle = self._pin_tiered(keys, host)
            handle.store = self
        except BaseException:
            if handle is not None:
                self._release_handle(handle, host)
            elif segs is not None:
                try:
                    self._unpin(segs)
                except BaseException:   # cut as it began: again (releases the rest)
                    self._unpin(segs)
                    raise
            raise
        return handle

    def _pin_tiered(self, keys: list[bytes], host: HostTier) -> PinHandle:
        """pin() with a DRAM tier (``host``, the store's): the prefix
        lookup() counts, its stretches on the device pinned there, its
        blocks held only in DRAM pinned in the tier (else the lease would
        end at the first of them)."""
        handle, host_keys, pos = PinHandle(), [], 0
        # the tier's tokens: entered by host.pin in the line it counts the
        # pin, taken off by host.unpin in the line it drops it (a call cut
        # partway, made again, releases only what is left)
        handle.host_pins = []
        pending = None       # a stretch pinned, not yet in the handle
        try:
            while pos < len(keys):
                # past the first block held only in DRAM, the keys left are
                # looked up a window at a time (KeyIndex.segments), not all
                # of them once per such block (quadratic, under the lock)
                with self._lock:
                    pending = self._segments(keys[pos:], windowed=pos > 0)
                shifted = [(run, p, c, out + pos) for run, p, c, out in pending]
                n = len(handle)
                # into the handle and off ``pending`` in one line with no
                # call in it: a KeyboardInterrupt finds them in one of the two
                handle[n:n], pending = shifted, None
                pos += sum(c for _, _, c, _ in shifted)
                if pos == len(keys):
                    break
                if host.pin(keys[pos], handle.host_pins) is None:
                    break
                host_keys.append(keys[pos])
                pos += 1
            handle.host_keys = tuple(host_keys)
        except BaseException:
            try:
                if pending is not None:
                    try:
                        self._unpin(pending)
                    except BaseException:   # cut as it began: again
                        self._unpin(pending)
                        raise
            finally:
                self._release_handle(handle, host)
            raise
        return handle

    def _release_handle(self, handle: PinHandle, host) -> None:
        """A pin handle's pins, device and DRAM, released (each once: a
        call cut as it began is made again)."""
        try:
            try:
                self._unpin(handle)
            except BaseException:   # cut as it began: again (releases the rest)
                self._unpin(handle)
                raise
        finally:
            # (the handle's list of tokens: each leaves it as its pin drops,
            # so a call made again does not release one twice)
            if handle.host_pins and host is not None:
                try:
                    host.unpin(handle.host_pins)
                except BaseException:   # cut as it began: again (the rest, once)
                    host.unpin(handle.host_pins)
                    raise

    def unpin(self, pins: list) -> None:
        """Release a handle returned by :meth:`pin` (once: a second release
        would take another lease's pin)."""
        if not isinstance(pins, PinHandle):
            raise ConfigError("unpin: pass the handle pin() returned")
        # Checked and marked under the lock: two threads releasing one
        # handle at once would both find it unreleased and count its
        # regions' pins down twice.
        host = self.host      # once: a close() in another thread sets it to None
        marked = False
        try:
            with self._lock:
                if pins.released:
                    raise ConfigError("unpin: this pin handle was released already")
                if pins.store is not self:
                    # Its runs and regions are another open's: counted down here,
                    # a region's pins would go below 0, and a region whose pins are
                    # not 0 is never evicted or freed again.
                    raise ConfigError("unpin: this pin handle is from another open of the "
                                      "store (or another store); release it on the store "
                                      "that pin() gave it, a reopen ends that open's pins")
                pins.released, marked = True, True     # one line: no call in it
            self._release_handle(pins, host)
        except BaseException:
            # Marked released, the caller can no longer release it: a
            # KeyboardInterrupt before the release (or as it began) must not
            # skip it.  Made again, it releases only what is left.
            if marked:
                self._release_handle(pins, host)
            raise

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

    def _host_hits_used(self, keys: list[bytes]) -> None:
        """Blocks a read took from the DRAM tier: the runs still holding
        them on the device count as just read (LRU), as a device read's runs
        do (_segments); else a run read only from DRAM looks never read,
        and LRU takes its region first."""
        if not keys:
            return
        with self._lock:
            packed = self.index.lookup(keys)
            now = time.time()
            for r in np.unique(packed[packed >= 0] >> POS_BITS).tolist():
                run = self.index.runs[int(r)]
                run.hits += 1
                self.regions.last_access[run.region] = now
                self.regions.hits[run.region] += 1

    def _segments(self, keys: list[bytes], windowed: bool = False
                  ) -> list[tuple[Run, int, int, int]]:
        """(run, first position, count, first output block) for the stored
        prefix of ``keys``; pins the runs' regions.  Under self._lock.
        ``windowed``: see KeyIndex.segments (a caller asking with all the
        keys left, once per stretch)."""
        segs = Segments(self.index.segments(keys, windowed))
        now = time.time()
        pins, taken = self.regions.pins, 0
        try:
            for run, _, _, _ in segs:
                # pinned and counted in one line with no call in it (see
                # _unpin_writers): a KeyboardInterrupt lands before or after
                run.pins, pins[run.region], taken = run.pins + 1, pins[run.region] + 1, taken + 1
                run.hits += 1
                self.regions.last_access[run.region] = now
                self.regions.hits[run.region] += 1
        except BaseException:
            # Cut between two runs (a KeyboardInterrupt at the loop's back
            # jump): the caller gets no segments to unpin, so the pins
            # taken drop here, or their regions stay pinned for good.
            for run, _, _, _ in segs[:taken]:
                run.pins, pins[run.region] = run.pins - 1, pins[run.region] - 1
            raise
        return segs

    def _unpin(self, segs) -> bool:
        """Release the pins of a ``_segments`` answer (or of a list of its
        Segments type made of them: a pin handle).  True: they were held
        all along (a store server's client says False when the server that
        pinned them went away: what was read may since have been rewritten).

        Each run's pins drop once, whatever a KeyboardInterrupt cuts: each
        run is taken off the answer's record (``held``) in the line its pins
        drop, with no call in it; cut between two runs (the loop's back
        jump, where the runs after it stayed pinned for good), the rest
        drop, then it is raised.  Cut as it began, nothing dropped: the
        caller calls it again with the same answer (a second call releases
        what is left, nothing twice).

        Only a Segments (a ``_segments`` answer, a copy made as Segments, a
        pin handle) is taken: it carries that record.  A plain list carries
        none, so a call cut as it returned, made again, dropped every pin a
        second time (another reader's pins taken): refused (TypeError)
        before any pin drops."""
        if not isinstance(segs, Segments):
            raise TypeError(
                f"_unpin takes the Segments that _segments answered (or a pin handle), "
                f"not a {type(segs).__name__}: it keeps the record of the pins still held "
                "that makes a call made again release nothing twice; pass that answer "
                "itself, not a copy or slice of it")
        interrupted = None
        while True:
            try:
                with self._lock:
                    held = segs.held
                    if held is None:
                        # (cut as the list is made: not set, made again)
                        held = segs.held = [seg[0] for seg in segs]
                    pins = self.regions.pins
                    while held:
                        run = held[-1]
                        # dropped and off the record in one line, no call in
                        # it (as _unpin_writers): cut before it or after it
                        run.pins, pins[run.region], held[-1:] = \
                            run.pins - 1, pins[run.region] - 1, ()
                break
            except Exception:
                raise
            except BaseException as e:    # a KeyboardInterrupt: the rest go
                interrupted = interrupted or e
        try:
            self._release_unpinned({seg[0].region for seg in segs})
        finally:
            if interrupted is not None:
                raise interrupted
        return True

    def _pins_hold(self, segs) -> bool:
        """Do the pins of a ``_segments`` answer still hold?  Always in
        one process (a store server's client: not once the server is gone)."""
        return True

    def _run_pin_held(self, run) -> bool:
        """Does the pin on ``run`` (from ``_segments``) still hold?  Always
        in one process; see RemoteStore."""
        return True

    def _unpin_writers(self, regions) -> None:
        """Writers done with their runs' regions (published, refused or
        failed).  A list is emptied as each pin drops: a KeyboardInterrupt
        landing in here does not stop it half way (the pins after the one
        it cut stayed held for good: their regions never evicted, the store
        full at last); the rest drop, then it is raised.  Cut as it
        began: the list still names every pin, for the caller to call it
        again."""
        held = regions if isinstance(regions, list) else list(regions)
        freed, interrupted = set(held), None
        while held:
            try:
                with self._lock:
                    pins = self.regions.pins
                    while held:
                        # Dropped and off the list in one line with no call
                        # in it: CPython raises a pending KeyboardInterrupt
                        # as a call returns, and ``pins[held.pop()] -= 1``
                        # was cut there, the region off the list and its
                        # pin held for good.
                        pins[held[-1]], held[-1:] = pins[held[-1]] - 1, ()
            except BaseException as e:
                interrupted = interrupted or e
        try:
            self._release_unpinned(freed)
        finally:
            if interrupted is not None:
                raise interrupted

    def _release_unpinned(self, regions) -> None:
        """Free the regions among ``regions`` that lost their last pin with no
        run left in them (deleted, cleared or dropped while being read, or a
        put refused by a clear): eviction would find them eventually, but
        their space counts as used until then."""
        if self.readonly or self.closed:
            return
        # A call in flight: unpin() is none, and a close() meanwhile would
        # free the engine under the reclaim.  Once closing, nothing is freed
        # (an empty region is free again at the next open).
        token = []
        try:
            try:   # inside the try whose finally leaves: a Ctrl-C as it returns
                self._inflight.enter(token)
            except StoreClosedError:
                return
            with self._lock:
                empty = [r for r in regions if self.regions.pins[r] == 0 and
                         self.regions.live[r] == 0 and self.regions.state[r] == SEALED]
            if empty:
                self._release_empty_regions(empty)
        except KVBlockError as e:    # the read or write itself went through
            logger.warning("kvblock: freeing emptied regions %s failed: %s", regions, e)
        finally:
            try:
                self._inflight.leave(token)
            except BaseException:    # cut as it left: again (it counts out once)
                self._inflight.leave(token)
                raise

    def _drop_runs(self, runs: list[Run], why: str | None = None,
                   count: str | None = None, keys: set | None = None) -> int:
        """Drop those of ``runs`` still indexed (journaled); returns the
        blocks removed: their positions no newer run took (those stay
        stored there).  ``why`` is for RemoteStore's server: the reads here
        count their failures themselves.  ``count``: a counter to add the
        runs this call took out to (not those another call dropped since
        the caller found them).  ``keys``: a set to add the removed
        positions' keys to (before anything can fail)."""
        # A quarter of the journal per commit: the DROP records of a large
        # delete (or clear, or fsck repair) could exceed a small journal, and
        # a commit that does fails and closes the store.  (Sized before any
        # run leaves the index: see below.)
        per_commit = max(1, self.sb.journal_bytes // 4 // jfmt.record_bytes(jfmt.DropRun(0)))
        # From the moment the runs leave the index their DROP records must
        # be written before this returns or raises (a crash would bring them
        # back, and the call returned for them, or a later delete() or
        # clear() that no longer finds them did), and the removal's ticket
        # must end (_await_removals waits for it): a KeyboardInterrupt landing
        # anywhere in between, not only in _commit's wait for its lock,
        # must not skip either.
        ticket, durable, interrupted, chosen = None, False, None, None
        try:
            try:
                with self._lock:
                    # once each: a run named twice (a read error's runs, one per
                    # segment; a client's list) taken out twice would count its
                    # region's live runs down twice, and an emptied-looking region
                    # is reclaimed under the runs still in it
                    chosen = list({r.run_id: r for r in runs
                                   if r.run_id in self.index.runs}.values())
                    removed = sum(run.live for run in chosen)
                    if count is not None:
                        self.counters.add(count, len(chosen))
                    if keys is not None:
                        keys.update(self.index.live_keys(chosen))
                    if chosen and not self.readonly:
                        # the ticket before any run leaves the index: held
                        # here (not inside a callee) from the moment it counts
                        ticket = self._next_removal_ticket()
                        self._removing.add(ticket)
                    for run in chosen:
                        self._forget_run(run)
            except BaseException as e:
                # Cut while the runs left the index (a KeyboardInterrupt):
                # they all leave (some are out already, one perhaps half
                # way), and their records are written below before the
                # interrupt is raised.  Cut before any was chosen: nothing
                # left the index.
                if chosen is None:
                    raise
                interrupted = e
                try:
                    with self._lock:
                        if ticket is None and chosen and not self.readonly:
                            ticket = self._next_removal_ticket()
                            self._removing.add(ticket)
                        self._forget_cut(chosen)
                except BaseException as again:
                    # cut again: the index is not what the journal will
                    # say; stop serving, as a commit cut twice does
                    self._fail(again)
                    raise
            if ticket is None:
                if interrupted is not None:
                    raise interrupted
                return removed
            cut = self._write_drops(chosen, per_commit)
            durable = True
            interrupted = interrupted or cut
        except BaseException as e:
            interrupted = interrupted or e
            if ticket is not None and not durable and self._failure is None:
                # Cut on the way to the records (or out of _write_drops
                # before its retries): all of them again (a DROP replayed
                # twice drops once).  Cut again: the store fails.
                try:
                    self._write_drops(chosen, per_commit)
                    durable = True
                except BaseException as again:
                    self._fail(again)
        finally:
            # The ticket ends even when an interrupt lands as _end_removal
            # begins (it is idempotent): left in ``_removing``, it would
            # make every later delete() and clear() wait for good.  Cut
            # there twice: the store fails, which ends those waits.
            try:
                self._end_removal(ticket, durable)
            except BaseException as e:
                interrupted = interrupted or e
                try:
                    self._end_removal(ticket, durable)
                except BaseException as again:
                    self._fail(again)
                    raise
        # The regions the runs left empty are freed also when a
        # KeyboardInterrupt cut the drop (or lands as this begins, or
        # between two regions: again, each is freed once): left sealed with
        # no run, their space counts used and puts evict live runs instead.
        try:
            if durable and not self.closed:
                self._release_empty_regions({r.region for r in chosen})
        except KVBlockError:
            if interrupted is None:
                raise
        except BaseException as e:
            interrupted = interrupted or e
            try:
                if durable and not self.closed:
                    self._release_empty_regions({r.region for r in chosen})
            except KVBlockError:
                pass           # (a failed TRIM: the region is free all the same)
        if interrupted is not None:
            raise interrupted
        return removed

    def _forget_cut(self, runs: list[Run]) -> None:
        """(under self._lock) every one of ``runs`` out of the index, after
        a KeyboardInterrupt cut their _forget_run loop: each step again is
        harmless (Index.remove of a run gone is a no-op), and their regions'
        live counts are counted again from the index (a run cut between its
        removal and its count would leave its region looking used, or,
        counted twice, empty under live runs)."""
        for run in runs:
            if run.run_id in self.index.runs:
                self.removals.add(run.keys)
            self.index.remove(run)
        for region in {run.region for run in runs}:
            self.regions.live[region] = len(self.index.runs_in(region))

    def _write_drops(self, runs: list[Run], per_commit: int) -> None:
        """Commit the DROP records of ``runs`` (out of the index already),
        ``per_commit`` a commit.  A KeyboardInterrupt does not stop it: the
        later batches' runs need theirs too; it is returned once every
        batch is durable (for the caller to raise).  A failed commit
        closed the store: nothing more is written."""
        at, interrupted, stalled = 0, None, False
        while True:
            before = at
            try:
                while at < len(runs):
                    end = min(at + per_commit, len(runs))

                    def written(end=end):    # applied once the batch's records are durable
                        nonlocal at
                        at = end
                    self._commit([jfmt.DropRun(r.run_id) for r in runs[at:end]], written)
                break
            except BaseException as e:
                # One that landed before a batch reached _commit (building
                # its records, entering _commit) wrote nothing: the batch
                # again (a DROP replayed twice drops once).  Cut twice with
                # nothing written between: the store fails, as _commit does
                # when cut twice, so that nothing relies on the records.
                if self._failure is not None:
                    raise
                interrupted = interrupted or e
                if at == before:
                    if stalled:
                        self._fail(e)
                        raise
                    stalled = True
                else:
                    stalled = False
        return interrupted

    def _next_removal_ticket(self) -> int:
        """(under self._lock) a number for a removal whose records are not
        yet durable; the caller adds it to ``_removing`` once it holds it
        (an interrupt between the two then leaves no ticket that nothing
        ends), and _end_removal ends it."""
        ticket = self._removal_tickets
        self._removal_tickets += 1
        return ticket

    def _end_removal(self, ticket: int | None, durable: bool) -> None:
        """A removal's records were committed (``durable``), or its commit
        raised: its ticket ends, lost when the store failed."""
        if ticket is not None:
            with self._lock:
                self._removing.discard(ticket)
                # An interrupt (KeyboardInterrupt) raised by a commit
                # that saw its records through leaves the store open:
                # only a failed commit loses them.
                if not durable and self._failure is not None:
                    self._removals_lost.add(ticket)
                self._removals_durable.notify_all()

    def _await_removals(self) -> None:
        """Return once every removal begun before now is durable.  A
        delete() or clear() that found runs already out of the index (another
        call's DROP or RECLAIM record in flight) must not return before that
        record is: a crash would bring back what it returned for."""
        with self._lock:
            mark = self._removal_tickets
            # A failed store commits nothing more: removals still pending
            # (another thread's regions after a failed RECLAIM) are lost.
            self._removals_durable.wait_for(lambda: self._failure is not None or
                                            all(t >= mark for t in self._removing))
            lost = any(t < mark for t in self._removing | self._removals_lost)
        if lost:
            raise StoreClosedError(f"metadata commit failed: {self._failure}; a removal this "
                                   "call relied on may not be durable; reopen the store "
                                   "(KVStore.open) and repeat the call")

    def _release_empty_regions(self, candidates) -> None:
        failed = None
        for region in candidates:
            def pick(region=region):
                if self.regions.live[region] == 0 and self.regions.pins[region] == 0 \
                        and self.regions.state[region] == SEALED:
                    return region, False
                return None
            try:
                self._reclaim(pick)
            except KVBlockError as e:
                # A failed TRIM (the region is free all the same) does not
                # stop the others: left sealed and empty, their space would
                # count used and puts would evict live runs instead.
                if self.closed:
                    raise
                failed = failed or e
        if failed is not None:
            raise failed

    @in_flight
    def delete(self, keys: Sequence) -> int:
        """Remove the runs holding any of ``keys`` (and their blocks from the
        DRAM tier, with any of ``keys`` found only there); returns the number
        of blocks removed."""
        self._check_open(writing=True)
        keys = normalize_keys(keys)
        with self._lock:
            # one vectorised lookup, not a Python call per key under the lock
            # (100k keys: 0.5 s against 12 ms); runs in the order first named
            packed = self.index.lookup(keys)
            ids, first = np.unique(packed[packed >= 0] >> POS_BITS, return_index=True)
            runs = [self.index.runs[i] for i in ids[np.argsort(first)].tolist()]
        return self._delete_runs(runs,
                                 lambda tier: {k for k in keys if tier.discard(k)})

    @in_flight
    def delete_prefix(self, prefix: bytes, keep: Sequence = ()) -> int:
        """Remove the runs holding a key that begins with ``prefix`` (1 to 8
        bytes), and the DRAM tier's blocks whose keys do; returns the blocks
        removed.  For callers that give each tenant or worker a key prefix
        of its own: one of them clears its blocks of a shared store, not the
        others' (kvblock.integrations.lmcache).  The runs holding any of
        ``keep`` stay (a caller's pinned keys, as an unforced remove)."""
        self._check_open(writing=True)
        prefix = check_key_prefix(prefix)
        keep = set(normalize_keys(keep))
        with self._lock:
            runs = self.index.runs_with_prefix(prefix)
            if keep:
                kept = {hit[0].run_id: hit[0] for k in keep
                        if (hit := self.index.locate(k)) is not None}
                runs = [r for r in runs if r.run_id not in kept]
                # The keys a kept run still names stay stored: their DRAM
                # copies too (not those a newer run took: not kept here).
                for r in kept.values():
                    names = self.index.lookup([r.key(p) for p in range(r.nblocks)]) == r.packed()
                    keep |= {r.key(p) for p in np.flatnonzero(names).tolist()}
        return self._delete_runs(runs, lambda tier: tier.discard_prefix(prefix, keep))

    def _delete_runs(self, runs: list[Run], discard_asked) -> int:
        """delete()'s work once its runs are found: drop them, then their
        blocks from the DRAM tier, and what ``discard_asked(tier)`` drops
        there (the keys asked for: a copy may outlive its run); returns the
        blocks removed."""
        failed, removed, on_device, host_only = None, 0, set(), 0
        try:
            try:
                removed = self._drop_runs(runs, count="deleted_runs",
                                          keys=None if self.host is None else on_device)
            except KVBlockError as e:
                # The runs are out of the index and their DROP records durable;
                # only freeing a region emptied failed (its TRIM): the DRAM
                # tier's copies must go all the same.
                if self.closed:
                    raise
                failed = e
            self._await_removals()
        finally:
            # Also when cut (a KeyboardInterrupt raised out of the drop,
            # its runs out of the index, or out of the wait): the DRAM
            # tier's copies would answer reads of the deleted keys.
            if self.host is not None:
                # Only the keys the runs still held: a newer run's copy of one
                # (perhaps only in DRAM now) is another put's, not deleted here.
                # Cut in the loop (a KeyboardInterrupt), the keys after it
                # stayed readable: the rest go (a discard made again drops
                # nothing), then it is raised.
                todo, cut = list(on_device), None
                while todo:
                    try:
                        while todo:
                            self.host.discard(todo[-1])
                            del todo[-1]
                    except Exception:
                        raise
                    except BaseException as e:
                        cut = cut or e
                host_only = len(discard_asked(self.host) - on_device)
                if cut is not None:
                    raise cut
        if failed is not None:
            raise failed
        return removed + host_only

    def removed_since(self, cursor: str | None = None) -> tuple[str, list[bytes] | None]:
        """Keys of the runs evicted, deleted, cleared or dropped since
        ``cursor`` (None: from now on), and the cursor for the next call;
        the keys are None when the log lost some of them (check the keys
        you watch with :meth:`present`).  See kvblock/store/removals.py."""
        self._check_open()
        return self.removals.since(cursor)

    @in_flight
    def evict(self, nbytes: int | None = None, *, all: bool = False) -> int:
        """Reclaim sealed regions by policy until ``nbytes`` are free (or all
        unpinned ones with ``all=True``).  Returns regions reclaimed.  Only
        the regions sealed when it began (the open one with them): those
        that puts in other threads fill meanwhile are theirs (taking them
        too, it went on as long as such puts did)."""
        self._check_open(writing=True)
        check_evict(nbytes, all)
        reclaimed, failed, sealed_before, done = 0, None, None, False

        def pick():
            nonlocal sealed_before, done
            free_bytes = self._free_regions() * self.regions.size
            if not all and (nbytes is None or free_bytes >= nbytes):
                done = True
                return None
            if not all and free_bytes + len(self._freeing) * self.regions.size >= nbytes:
                # Another call (a delete, an eviction) is freeing the
                # rest: wait for it rather than evict live runs too.
                # A failed reclaim closes the store, and the wait with it.
                self._check_open()
                self._reclaimed.wait(RECLAIM_WAIT_S)
                return None
            emptied = None
            if sealed_before is None and self.regions.open is not None:
                opened = self.regions.open
                self.regions.seal(opened)
                # Emptied while open (nothing frees it once sealed): its
                # space goes first, before any region of live runs.
                # Freed, not evicted (no run leaves the store): not in
                # evicted_regions, as when a put seals it or a delete
                # empties a sealed region (_release_empty_regions).
                if self.regions.live[opened] == 0 and self.regions.pins[opened] == 0:
                    emptied = opened
            if sealed_before is None:
                sealed_before = self.regions.next_seal
            if emptied is not None:
                return emptied, False
            victim = self.regions.victim(self.eviction, sealed_before)
            if victim is None:
                done = True
                return None
            return victim, True
        while not done:
            try:
                if self._reclaim(pick) is None:
                    continue
            except KVBlockError as e:
                # A failed TRIM (the region is free all the same) does not
                # stop the others: clear() would leave their runs served.
                if self.closed:
                    raise
                failed = failed or e
            reclaimed += 1
        if failed is not None:
            raise failed
        return reclaimed

    @in_flight
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
                # (one line: a KeyboardInterrupt finds both or neither)
                self._clears, mine = self._clears + 1, self._clears + 1
        failed = None
        try:
            try:
                reclaimed = self.evict(all=True)
            except KVBlockError as e:    # a TRIM failed: every run is forgotten still
                if self.closed:
                    raise
                failed, reclaimed = e, 0
            with self._lock:
                left = [r for r in self.index.runs.values() if r.run_id < mark]
            for at in range(0, len(left), CLEAR_DROP_BATCH):
                try:
                    self._drop_runs(left[at:at + CLEAR_DROP_BATCH])
                except KVBlockError as e:  # a TRIM of a region emptied: the rest go all the same
                    if self.closed:
                        raise
                    failed = failed or e
        finally:
            if self.host is not None:
                # Last: a read that began before the runs left the index put
                # their blocks here; reads and puts in flight see the new
                # epoch.  Also when cut above (a KeyboardInterrupt, an
                # error): the clear count moved, and the tier's epoch must
                # follow it (else no put reached DRAM again), nor may the
                # tier serve blocks whose runs have left the device.
                self.host.clear(epoch=mine)
        self._await_removals()
        if failed is not None:
            raise failed
        return reclaimed

    def clear_ticket(self) -> str:
        """A name for the clear() calls so far: a caller writing a batch in
        several puts compares it before each and stops once it changed (the
        batch holds KV from before the clear; a put overtaken by a clear
        while it is written is refused by the store itself)."""
        self._check_open()
        return f"{id(self):x}:{self._clears}"

    @in_flight
    def evict_older_than(self, cutoff: float) -> int:
        """Reclaim unpinned regions sealed before ``cutoff`` (seconds since the
        epoch).  Returns regions reclaimed."""
        self._check_open(writing=True)
        cutoff = time_cutoff(cutoff)

        def old(r):
            return (self.regions.state[r] == SEALED and self.regions.pins[r] == 0
                    and self.regions.sealed_at[r] < cutoff)
        with self._lock:
            candidates = [int(r) for r in np.nonzero(
                (self.regions.state == SEALED) & (self.regions.pins == 0)
                & (self.regions.sealed_at < cutoff))[0]]
        failed, reclaimed = None, 0
        for region in candidates:
            # One region at a time leaves the index and is freed, as evict()
            # takes them: taking them all first left those not yet reached
            # RECLAIMING for good when an exception no handler here catches
            # (KeyboardInterrupt) cut the loop, and allocations wait while
            # any region is RECLAIMING.  One taken meanwhile (an allocation's
            # victim, a read's pin) is left to that call.
            def pick(region=region):
                return (region, True) if old(region) else None
            try:
                if self._reclaim(pick) is None:
                    continue
            except KVBlockError as e:
                # A failed TRIM (the region is free all the same) does not
                # stop the others; a failed RECLAIM commit closed the store.
                if self.closed:
                    raise
                failed = failed or e
            reclaimed += 1
        if failed is not None:
            raise failed
        return reclaimed

    @in_flight
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
                self._trimming.add(region)
            try:
                dev, off = self.regions.address(region)
                if self.io.discard(dev, off, self.regions.size):
                    done += 1
            finally:
                with self._lock:
                    self._trimming.discard(region)
                    self.regions.free.append(region)
                    self._reclaimed.notify_all()
            seen.add(region)
        self.counters.add("discards", done)
        return done, len(seen)

    def _free_regions(self) -> int:
        """(under self._lock) free regions, those trim_free is discarding too."""
        return len(self.regions.free) + len(self._trimming)

    @property
    def uuid(self) -> str:
        """The store's uuid (as RemoteStore.uuid: the same store, the same text)."""
        return str(uuid.UUID(bytes=self.sb.store_uuid))

    def stats(self) -> dict:
        """Counters and gauges (bytes, blocks, regions, hits, checksum failures...)."""
        self._check_open()
        # Read once each: a close() in another thread sets them to None
        # (stats is no call close() waits for); then it is closed, and says so.
        tier, io = self.host, self.io
        if io is None:
            self._check_open()
        # The DRAM tier's first: its lock is never taken under the store's
        # (HostTier.put asks the store's lock under its own).
        host = tier.stats() if tier is not None else {}
        with self._lock:
            r = self.regions
            return {
                "uuid": self.uuid,
                "devices": [d.path for d in io.devices],
                "geometry": self.geometry.as_dict(),
                "engine": io.engine.name,
                # devices read (and written) through shared mappings (store files on tmpfs)
                "mapped_reads": [d.path for i, d in enumerate(io.devices)
                                 if io.engine.mapped(i)],
                "mapped_writes": [d.path for i, d in enumerate(io.devices)
                                  if io.engine.mapped_for_writes(i)],
                "capacity_bytes": r.count * r.size,
                "used_bytes": r.used_bytes,
                "regions": r.count,
                "regions_free": self._free_regions(),
                "regions_sealed": int((r.state == SEALED).sum()),
                "runs": len(self.index.runs),
                "blocks": len(self.index),
                "checkpoint_generation": self._generation,
                **self.counters.snapshot(),
                **host,
                **({"gpu_path": self._gpu_path, "gpu_path_reason": self._gpu_path_reason}
                   if getattr(self, "_gpu_path", None) else {}),
            }

    def close(self) -> None:
        """Clean shutdown: write a checkpoint (fast next open) and close
        devices.  Calls in flight in other threads (reads, puts, loads) are
        waited for (up to CLOSE_WAIT_S); later ones raise StoreClosedError."""
        if getattr(self, "_inflight", None) is None:     # __init__ failed before it
            self.closed = True
            return
        self._inflight.shut()
        drained = self._inflight.drained(CLOSE_WAIT_S, repr(self),
                                         "the last of them, released when it is done")
        if self.closed:
            if drained:     # (or waits while another close() releases them)
                self._release_devices()
            else:           # (closed by a failed commit: as below)
                self._inflight.after_drained(self._release_devices)
            return
        try:
            # Not in a forked child: the parent still writes the journal (a
            # checkpoint here would hide its later records from recovery),
            # and its threads may hold the locks a checkpoint takes.
            if not self.readonly and os.getpid() == self._pid:
                with self._commit_lock:
                    # Another close() in another thread may have written
                    # its checkpoint while this one waited here, and
                    # released the engine after it: nothing more to write.
                    # (Closed under the lock: one waiting here sees it.)
                    if not self.closed:
                        try:
                            # The open region is sealed now, not at the
                            # next open (no run is appended to it after a
                            # reopen either): its seal time, which
                            # evict_older_than goes by, is then when its
                            # runs were last written at the latest, not
                            # whenever the store is opened again.
                            with self._lock:
                                if self.regions.open is not None:
                                    self.regions.seal(self.regions.open)
                            self._write_checkpoint()
                        finally:
                            self.closed = True
        finally:
            self.closed = True
            if drained:
                self._release_devices()
            else:
                # Not left to the garbage collector: a Device's descriptor
                # (its flock, its O_EXCL claim) is never closed by it, and
                # the store could not be opened again in this process.
                self._inflight.after_drained(self._release_devices)

    def _release_devices(self):
        # Each is released past one whose close raises (a kvikio close error
        # left the devices open, their locks held: no store could open them
        # while this process lived); the error is raised after.
        # Once, whichever of two close() calls comes here first (a device
        # closed twice would close a descriptor number reused meanwhile).
        # Not the store's lock: a forked child's close comes here, and a
        # thread of the parent may have held that lock at the fork.  (One
        # for every store, RemoteStore's too: held for a moment, at close, and made
        # afresh in a forked child: _fresh_release_lock.)
        # A call that finds the release another call's (two close() at once)
        # returns once that one is done: the caller may reopen the devices
        # next (refused as busy while they are open).  Not in a forked
        # child, whose copy a parent's thread was releasing at the fork:
        # that thread is not there to finish, so the child lets go of its
        # copies of what that release had taken (kept on the mark for
        # this; closing a copy the parent had closed before the fork does
        # nothing).  Else the child kept its copies of the device
        # descriptors (a block device's O_EXCL claim: the store could not
        # be opened again while the child lived) and of the buffers.
        with _RELEASE_LOCK:
            other = getattr(self, "_releasing", None)
            if other is not None and other[0] != os.getpid() and not other[1].is_set():
                kvikio, host, io = other[2]       # a parent's release, cut off by the fork
                other = None
            elif other is None:
                kvikio, host, io = (getattr(self, "_kvikio", None), getattr(self, "host", None),
                                    self.io)
            if other is None:
                self._releasing = mine = (os.getpid(), threading.Event(), (kvikio, host, io))
                self._kvikio = self.host = self.io = None
        if other is not None:
            pid, done, _ = other
            if pid == os.getpid():
                done.wait()
            return
        try:
            with contextlib.ExitStack() as stack:      # closes in the reverse order of these
                if io is not None:
                    stack.callback(io.close)
                stack.callback(self._stagings.close)
                stack.callback(self.spares.close)
                if host is not None:
                    stack.callback(host.close)
                if kvikio is not None:
                    stack.callback(kvikio.close)
        finally:
            mine[1].set()
            self._releasing = mine[:2] + (None,)     # released: no need to keep them

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


SUPERBLOCKS_END = max(sbfmt.COPY_OFFSETS) + sbfmt.SIZE


def check_key_prefix(prefix) -> bytes:
    """delete_prefix()'s argument: 1 to 8 bytes, else ConfigError."""
    if not isinstance(prefix, (bytes, bytearray, memoryview)) or not 1 <= len(prefix) <= 8:
        raise ConfigError(f"delete_prefix: a key prefix is 1 to 8 bytes, got {prefix!r}")
    return bytes(prefix)


def _store_on(io: StoreIO, dev: int) -> str | None:
    """store_in() of a device of ``io``."""
    if io.devices[dev].capacity < SUPERBLOCKS_END:
        return None                      # too small to hold even the superblocks
    copies = [io.read_bytes(dev, off, sbfmt.SIZE) for off in sbfmt.COPY_OFFSETS]
    return store_in(copies, io.devices[dev].path)


def _try_superblock(io: StoreIO, dev: int, raise_errors=False):
    path = io.devices[dev].path
    if io.devices[dev].capacity < SUPERBLOCKS_END:
        if not raise_errors:
            return None
        raise DeviceTooSmallError(
            f"{path}: {said_size(io.devices[dev])} cannot hold a kvblock store (its "
            f"superblocks alone take {SUPERBLOCKS_END}): not a store; a store needs a few MiB "
            "at least", path)
    copies, unreadable = [], []
    for off in sbfmt.COPY_OFFSETS:
        try:
            copies.append(io.read_bytes(dev, off, sbfmt.SIZE))
        except IOFailedError as e:
            # a bad sector under one copy: the other is there for this
            if not e.device_fault or len(unreadable) + 1 == len(sbfmt.COPY_OFFSETS):
                raise
            unreadable.append(e)
            copies.append(b"")
    try:
        sb = sbfmt.pick(copies, path)
        problem = sb.layout_problem()
        if problem:     # checksummed, but written so by a bug (or crafted): never used
            raise NotAStoreError(
                f"{path}: superblock describes an impossible layout: {problem}; the metadata "
                "is corrupt (the cached KV cannot be trusted): reformat the store", path, 0)
        return sb
    except KVBlockError:
        if not raise_errors:
            return None
        if unreadable:  # what the unread copy holds is unknown: no proof of corruption
            raise unreadable[0] from None
        raise


def check_evict(nbytes, all) -> None:
    """evict()'s arguments: a byte count or all=True, else ConfigError
    (a truthy all="no" would evict the whole store; neither argument
    reclaimed nothing and said 0; with both, nbytes was ignored)."""
    if nbytes is not None and (not is_whole(nbytes) or nbytes < 0):
        raise ConfigError(f"evict: nbytes must be a byte count >= 0, got {nbytes!r}")
    if not isinstance(all, (bool, np.bool_)):
        raise ConfigError(f"evict: all must be True or False, got {all!r}")
    if (nbytes is None) == (not all):
        raise ConfigError("evict: give nbytes or all=True" +
                          (", not both" if all else
                           " (evict(0) reclaims nothing; evict_older_than(cutoff) takes "
                           "regions by age)"))


def time_cutoff(value) -> float:
    """evict_older_than's cutoff: seconds since the epoch, as a float."""
    # NaN compares false with every sealing time: it would evict nothing, silently
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or value != value:
        raise ConfigError(f"evict_older_than: the cutoff must be seconds since the epoch "
                          f"(e.g. time.time() - 3600), got {value!r}")
    try:
        return float(value)
    except OverflowError:    # an int past any float (10 ** 400)
        raise ConfigError(f"evict_older_than: the cutoff must be seconds since the epoch "
                          f"(e.g. time.time() - 3600), got an integer of "
                          f"{int(value).bit_length()} bits") from None


def _max_run_blocks(geometry: Geometry, alignment: int, region_size: int,
                    journal_bytes: int) -> int:
    """The most blocks one run (one piece of a longer put) holds in a store
    of these sizes."""
    record_keys = (journal_bytes // 4 - jfmt.PUT_RECORD_OVERHEAD
                   - 8 * geometry.run_checksums) // KEY_BYTES
    return max(1, min(RunLayout.max_blocks(geometry, alignment, region_size),
                      POS_MASK + 1, record_keys))


def _blocks_too_small(devs, geometry: Geometry) -> ConfigError | None:
    """A ConfigError when the model's blocks are too small for a store over
    devices of ``devs``'s block sizes, however large (a checkpoint slot keeps
    16 bytes per block the store's space could hold, and there are two, all
    on the first device): it names the block size, the least a store over
    them takes and the fix.  None when a large enough device holds one."""
    # (planning imports this module: its names are taken here, when called)
    from kvblock.store.planning import MAX_SIZE, StandIn

    # devices of the largest size planned: any device is smaller
    probes = [StandIn(d.path, d.block_size, MAX_SIZE // d.block_size * d.block_size)
              for d in devs]

    def least(probes) -> int | None:
        def fits(block_bytes: int) -> bool:
            try:
                _plan(probes, geometry, None, None, block_bytes=block_bytes, probe=True)
            except (DeviceTooSmallError, ConfigError):
                return False
            return True

        low = geometry.block_bytes
        if fits(low):
            return None
        high = 2 * low
        while not fits(high):
            low, high = high, 2 * high
            if high > MAX_SIZE:
                return None                 # not the blocks: no size of them plans one
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid, high)
        return high

    need = least(probes)
    if need is None:
        return None
    over = f" over {len(devs)} devices" if len(devs) > 1 else ""
    alone = least(probes[:1]) if len(devs) > 1 else None
    return ConfigError(
        f"blocks of {geometry.block_bytes} bytes ({geometry.describe()}) are too small for "
        f"any store{over}: its checkpoint keeps 16 bytes per block its space could hold, in "
        f"each of two slots on the first device, so the metadata outgrows any device; a store"
        f"{over} takes blocks of at least {need} bytes"
        + ("" if len(devs) == 1 else
           f" (a store on one device, at least {alone})" if alone is not None else
           " (a store on one device takes these)")
        + ": use more tokens per block or larger heads"
        + (", or fewer devices" if len(devs) > 1 else ""))


def _plan(devs: list[Device], geometry: Geometry, region_size, journal_bytes, *,
          block_bytes: int | None = None, probe: bool = False, short: bool = False) -> dict:
    """Where everything goes on each device.  (``block_bytes``: the model's
    blocks taken as that many bytes; ``probe``: a plan _blocks_too_small
    makes, whose refusals are not explained; ``short``: the plan of devices
    too small for their regions, returned rather than refused, for
    planning's search of the least size.)"""
    for name, value in (("region_size", region_size), ("journal_bytes", journal_bytes)):
        if value is not None and (not is_whole(value) or value <= 0):
            raise ConfigError(f"{name} must be a positive whole number of bytes, got {value!r} "
                              "(e.g. 256 << 20; the CLI takes sizes like 256M)")
    alignment = max(4096, max(d.block_size for d in devs))
    sb_end = round_up(2 * sbfmt.SIZE, alignment)
    # The space the store can use: regions stripe across the devices, each
    # holding as many as the smallest can (see per_dev below), so a larger
    # device's surplus is never used.  Defaults and the checkpoint slots are
    # sized for this (an index of the sum of the capacities made a small
    # device 0 too small for its metadata, of a store that fits it).
    total = min(d.capacity for d in devs) * len(devs)
    min_run = RunLayout(geometry, 1, alignment).run_bytes
    if region_size is None:
        region_size = min(DEFAULT_REGION_MAX,
                          max(MIB, total // DEFAULT_REGION_SHARE // MIB * MIB))
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
        journal_bytes = min(JOURNAL_MAX, max(MIB, total // JOURNAL_SHARE))
    journal_bytes = round_up(int(journal_bytes), alignment)
    # a run's PUT record may fill a quarter of the journal: one of one block, at least
    min_journal = round_up(4 * (jfmt.PUT_RECORD_OVERHEAD + 8 * geometry.run_checksums
                                + KEY_BYTES), alignment)
    if journal_bytes < min_journal:
        raise ConfigError(f"journal_bytes {journal_bytes} is too small for {geometry.describe()}: "
                          f"it must hold at least {min_journal} bytes (the default is 1/128 "
                          "of the store's space, 1-64 MiB)")
    # Checkpoint slots must hold the largest possible index: every run at least
    # one aligned range per (layer, group) and a trailer, every block at least
    # block_bytes.
    max_runs = total // min_run + 1
    max_keys = total // (block_bytes or geometry.block_bytes) + 1
    max_regions = total // region_size + 1
    cp_bytes = round_up(cpfmt.HEADER_BYTES + max_regions * cpfmt.REGION_DTYPE.itemsize
                        + max_runs * (cpfmt.RUN_DTYPE.itemsize + 8 * geometry.run_checksums)
                        + max_keys * 16, alignment)
    cp_off = sb_end
    j_off = cp_off + 2 * cp_bytes
    data0 = round_up(j_off + journal_bytes, MIB if alignment <= MIB else alignment)
    data_offsets = [data0] + [round_up(sb_end, MIB if alignment <= MIB else alignment)] * (len(devs) - 1)
    per_dev = [max(0, (d.capacity - off) // region_size) for d, off in zip(devs, data_offsets)]
    # A store needs two regions; striped, each device one (the one short is named).
    least = 2 if len(devs) == 1 else 1
    for i, (d, off, n) in enumerate(zip(devs, data_offsets, per_dev)):
        if n < least and not short:
            if i == 0 and not probe:
                # no device of any size: the model's blocks (not the device) are too small
                too_small = _blocks_too_small(devs, geometry)
                if too_small is not None:
                    raise too_small
            raise DeviceTooSmallError(
                f"{d.path}: {said_size(d)} cannot hold "
                f"{'metadata' if i == 0 else 'its superblocks'} ({off} bytes) and "
                f"{'two' if least == 2 else 'one'} {region_size}-byte "
                f"region{'s' if least == 2 else ''} (need about {off + least * region_size}); "
                "use a larger device or a smaller region_size", d.path)
    return {"alignment": alignment, "region_size": region_size, "journal_offset": j_off,
            "journal_bytes": journal_bytes, "checkpoint_offset": cp_off,
            "checkpoint_bytes": cp_bytes, "data_offsets": data_offsets,
            "regions_per_device": per_dev, "region_count": min(per_dev) * len(devs)}


__all__ = ["KVStore"]
