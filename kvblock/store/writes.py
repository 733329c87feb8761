"""Writing runs to the devices: staging, hashing, the data and trailer I/O.

A put's publication (allocation, the journal record, the index) is the
store's own: :class:`~kvblock.store.store.KVStore` commits it to its journal,
a :class:`~kvblock.store.client.RemoteStore` asks its server.  What happens
on the devices in between is the same for both, and lives here.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, NamedTuple, Sequence

import numpy as np

from kvblock.errors import ConfigError, StoreFullError
from kvblock.format import trailer as trailerfmt
from kvblock.index import normalize_keys
from kvblock.io import IOBatch
from kvblock.layout.geometry import RunLayout
from kvblock.store.digests import block_and_range_digests, block_digests, with_trailer_checksum
from kvblock.store.inflight import in_flight
from kvblock.store.runio import RunIO
from kvblock.store.scatter import BlockList, as_array, span


class Streams(NamedTuple):
    """_stage_run's answer when the write is to hash the run: each I/O's
    checksum index (its range, or ``ranges`` for the trailer)."""

    of_ios: np.ndarray


class Later(NamedTuple):
    """_stage_run's answer for a run whose checksums are computed while its
    data is written (:meth:`RunWriter._write_run`): ``digest()`` fills the
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


def _fresh_hashers() -> None:
    """In a forked child: the helper pool's threads are the parent's (the
    child has none of them, yet the pool counts them as started and idle, so
    a run handed to it would never be hashed and its put would wait for
    good), and so are the slots the parent's busy helpers held, and the
    lock a thread of the parent may have held.  The child starts its own."""
    global _hashers, _hash_slots, _hashers_lock
    _hashers = None
    _hash_slots = threading.BoundedSemaphore(_HASH_THREADS)
    _hashers_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_hashers)


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


def _small_aligned(nbytes: int, alignment: int) -> np.ndarray:
    """An aligned scratch array for a small I/O (a trailer) from the heap: a
    fresh mapping per put costs more than the trailer's hashing."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    at = -raw.ctypes.data % alignment
    return raw[at:at + nbytes]


class RunWriter(RunIO):
    """put_run, put_blocks and put_runs (their argument checks), and a run's
    I/O: ``_stage_run`` builds it, ``_write_run`` writes it.  The class using
    it provides ``_put`` and ``_put_many``, which allocate and publish."""

    @in_flight
    def put_run(self, keys: Sequence, data) -> int:
        """Store a run of consecutive blocks.

        ``data`` holds the blocks' bytes in the store's layout order: an array
        (any numeric dtype), CPU tensor or bytes-like object (bytes,
        bytearray, memoryview; a str or a list is refused) of
        ``len(keys) * geometry.block_bytes`` bytes shaped or
        viewable as ``(num_layers, head_groups, len(keys), group_block_bytes)``.
        Returns the number of blocks written (0 when admission declined the
        run).  Runs longer than a region are split into several runs
        (pieces), each published once written: a put that fails part way (a
        device error; for a RemoteStore, its server gone) raises with the
        pieces before it stored, a leading part of ``keys`` that ``lookup``
        finds (putting the run again stores it whole).
        """
        self._check_open(writing=True)
        began = self._put_began()
        keys = normalize_keys(keys)
        return self._put(keys, self._blocks_view(keys, data), began)

    @in_flight
    def put_blocks(self, keys: Sequence, blocks: Sequence) -> int:
        """Store a run whose blocks lie in separate buffers: ``blocks[k]`` is
        an array of ``geometry.block_bytes`` bytes, block k of the run in the
        store's layout order (``(num_layers, head_groups, group_block_bytes)``).

        Aligned blocks whose per-range pieces are multiples of the store's
        alignment are written from where they are (no copy); others are
        gathered through staging memory.  Otherwise as :meth:`put_run`.
        """
        self._check_open(writing=True)
        began = self._put_began()
        keys = normalize_keys(keys)
        return self._put(keys, BlockList.of(blocks, self.geometry, len(keys), "put_blocks",
                                            writable=False), began)

    @in_flight
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
        began = self._put_began()
        try:
            runs = iter(runs)
        except TypeError:
            raise ConfigError(f"put_runs: runs must be a sequence of (keys, data) pairs, got "
                              f"{type(runs).__name__}") from None
        items = []
        for k, run in enumerate(runs):
            if not isinstance(run, (tuple, list)) or len(run) != 2:
                raise ConfigError(f"put_runs: run {k} must be a (keys, data) pair")
            keys, data = run
            keys = normalize_keys(keys)
            items.append((keys, self._blocks_view(keys, data, "put_runs")))
        return self._put_many(items, began)

    def _stored_whole(self, keys: list[bytes]) -> bool:
        """Would put_run(keys, ...) be a duplicate (the store holds every
        key)?  Then counted as put_run counts one (put_duplicate_runs):
        save_blocks asks first, and gathers no pages for a run that is not
        written.  False where the store cannot tell without a put (the
        caller then puts, which decides)."""
        return False

    def _put_began(self):
        """What a put notes as it begins, before its argument checks (a
        clear() from then on refuses it): passed to _put/_put_many."""
        return None

    def _check_runs_fit(self, items: list, found: np.ndarray) -> set[int]:
        """put_runs' runs checked to fit the store (_check_fits) before any
        offer is counted or anything written; not those whose every key the
        store (``found``) or the call's earlier runs hold: put one call
        after another, such a run is a duplicate (_plan_puts), however long.
        Returns those: _plan_puts checks one when it writes it after all
        (an earlier run holding some of its keys was declined), still
        before anything is written (the offers admit counted stay)."""
        later, earlier, at = set(), set(), 0
        for i, (keys, _) in enumerate(items):
            held = found[at:at + len(keys)]
            at += len(keys)
            if keys and not held.all():
                if earlier and all(h or k in earlier for k, h in zip(keys, held.tolist())):
                    later.add(i)
                else:
                    self._check_fits(len(keys))
            earlier.update(keys)
        return later

    def _plan_puts(self, items: list, found: np.ndarray, admit: Callable,
                   unchecked: set = frozenset()) -> tuple:
        """put_runs' runs (keys, blocks) as pieces to write, as if put one
        call after another: a run that the store (``found``: per key of every
        item, in order) and the call's earlier runs hold whole is a
        duplicate, written by none.  ``admit(keys, whole, offers)`` answers for
        the others ("ok", "duplicate" or "rejected"; a duplicate counted there,
        an offer it counts added to ``offers`` as (first key, or the
        server's offer id, admitted) in the step that counts it,
        a declined run counted here once the plan stands (_count_rejected):
        a counter a refused call had counted and taken off again fell, which
        Prometheus reads as a reset; ``whole``: the store holds every key).
        ``unchecked``: the items _check_runs_fit left to be checked here if
        written.  Returns (blocks per item, pieces (item, keys, blocks) of
        at most ``max_run_blocks``, and per duplicate found in earlier runs
        the items it depends on, and the admitted items with the offer
        admit noted for each: see _give_back_unstored).  A call refused here (a late _check_fits, an
        admit that fails) counts no offer: those admit counted are given
        back, and its declined runs are counted by no counter."""
        out, pieces = [0] * len(items), []
        taken: dict[bytes, int] = {}  # keys an earlier run of this call writes: that run
        repeats = {}                  # a run found whole in earlier runs: those runs
        offers = []                   # (first key, admitted) of the offers admit counted
        admitted = []                 # the items admitted (to be written)
        start = 0
        try:
            for i, (keys, blocks) in enumerate(items):
                n = len(keys)
                held, start = found[start:start + n], start + n
                if n == 0:
                    continue
                whole = bool(held.all())
                if not whole and taken and all(h or k in taken for k, h in zip(keys, held)):
                    self.counters.add("put_duplicate_runs")
                    out[i] = n
                    repeats[i] = {taken[k] for k, h in zip(keys, held) if not h}
                    continue
                # (the offer goes into ``offers`` as admit counts it: a
                # KeyboardInterrupt as admit returned, noted here after it,
                # left a counted offer never given back)
                noted = len(offers)
                verdict = admit(keys, whole, offers)
                if verdict == "duplicate":
                    out[i] = n
                    continue
                if verdict == "rejected":
                    continue
                # none of it written yet: refused whole.  ``whole`` too: one
                # _check_runs_fit left to admit, a duplicate, that a served
                # store's admit found removed since (present, then admit)
                if i in unchecked or whole:
                    self._check_fits(n)
                # with the offer admit noted for it (none: nothing to give back)
                admitted.append((i, offers[-1][0] if len(offers) > noted else None))
                taken.update(dict.fromkeys(keys, i))
                for first in range(0, n, self.max_run_blocks):
                    last = min(n, first + self.max_run_blocks)
                    pieces.append((i, keys[first:last], span(blocks, first, last)))
            rejected = [k for k, a in offers if not a]
            if rejected:
                self._count_rejected(len(rejected), rejected)
        except BaseException:
            offers.reverse()          # latest first: one key offered twice
            try:
                self._give_back_offers(offers)
            except BaseException:     # cut as it began: the list names every offer left
                self._give_back_offers(offers)
                raise
            raise
        return out, pieces, repeats, admitted

    def _give_back_unstored(self, items: list, out: list[int], admitted: list) -> None:
        """The offers of ``admitted`` items ((item, the offer admit noted),
        _plan_puts) that a put did not store whole
        (``out``: blocks stored per item; a clear() overtook it, or an error
        stopped it): given back, so that the next offer admits them, not
        the admit_after-th one after it.  ``admitted`` is emptied as
        their offers are handed to _give_back_offers: cut (a
        KeyboardInterrupt) before that, it names them all, for the caller
        to call this again; after, each is given back once."""
        back = [(offer, True) for i, offer in reversed(admitted)
                if offer is not None and out[i] < len(items[i][0])]
        del admitted[:]     # (no call between: nothing is raised in between)
        try:
            self._give_back_offers(back)
        except BaseException:       # cut as it began: ``back`` names every offer left
            self._give_back_offers(back)
            raise

    def _give_back_offers(self, offers: list) -> None:
        """Undo offers admission counted for puts that stored nothing:
        (offer, admitted) each as admit noted it (the first key; a
        RemoteStore's: the server's offer id), latest first.  No counter changes: a
        declined offer given back was never counted (_count_rejected).
        ``offers`` is emptied, each offer taken off it before it is given
        back (Admission.give_back is not idempotent: a declined offer
        given back twice counts two less): a KeyboardInterrupt landing in
        here gives back the rest, then is raised; cut as it began, the
        list names every offer left, for the caller to call it again."""
        raise NotImplementedError

    def _count_rejected(self, runs: int, keys: list[bytes] = ()) -> None:
        """Count ``runs`` declined runs of a put_runs whose plan stands, in
        admission_rejected_runs (only ever up: an exported counter).
        ``keys``: their offers as admit noted them (first keys; a
        RemoteStore's: the server's offer ids, which it settles, not
        another call's)."""
        raise NotImplementedError

    def _put_grouped(self, out: list[int], pieces: list, repeats: dict,
                     put_group: Callable, journal_bytes: int) -> list[int]:
        """Write and publish _plan_puts' pieces in groups (``put_group``: one
        commit each); ``out`` completed: an item a clear() overtook stored
        nothing, nor did a duplicate of it."""
        cleared = set()
        for group in self._groups(pieces, journal_bytes):
            for i, n in put_group(group):
                out[i] += n
                if not n:
                    cleared.add(i)
        for i in cleared:             # a clear() overtook a piece: the item's others went too
            out[i] = 0
        for i, holders in repeats.items():   # stored only as the runs holding it were
            if holders & cleared:
                out[i] = 0
        return out

    def _groups(self, pieces: list, journal_bytes: int) -> list[list]:
        """put_runs' pieces (item, keys, blocks; at most a region each) in
        groups of one commit each: a group's regions stay pinned until its
        commit, so it may fill at most a quarter of the regions (the rest can
        be reclaimed for it; one more for a partly filled open region), and
        its commit record at most a quarter of the journal."""
        max_bytes = max(1, self.regions.count // 4 - 1) * self.regions.size
        max_record = journal_bytes // 4
        groups, nbytes, record = [[]], 0, 0
        for piece in pieces:
            size = self.layout(len(piece[1])).run_bytes
            entry = len(piece[1]) * 16 + self.geometry.run_checksums * 8 + 64
            if groups[-1] and (nbytes + size > max_bytes or record + entry > max_record):
                groups.append([])
                nbytes, record = 0, 0
            groups[-1].append(piece)
            nbytes += size
            record += entry
        return [group for group in groups if group]

    def _blocks_view(self, keys: list[bytes], data, what: str = "put_run") -> np.ndarray:
        """put_run's data as (layers, groups, blocks, group_block_bytes) bytes."""
        g, n = self.geometry, len(keys)
        arr = as_array(data, what)
        if arr.nbytes != n * g.block_bytes:
            raise ConfigError(f"{what}: {n} keys need {n * g.block_bytes} bytes of KV "
                              f"({g.describe()}), got {arr.nbytes}")
        return np.ascontiguousarray(arr).view(np.uint8).reshape(
            g.num_layers, g.head_groups, n, g.group_block_bytes)

    def _check_fits(self, nblocks: int) -> None:
        """Refuse a run the store cannot hold at once: its pieces would evict
        one another (the tail pushing out the head), leaving nothing to find."""
        check_run_fits(nblocks, self.geometry, self.max_run_blocks, self.regions.count,
                       self.regions.size, self.layout)

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
                blocks, ranges = block_digests(batch, lay, dev_off, run_id), None
            else:
                blocks, ranges = block_and_range_digests(batch, lay, dev_off, run_id)
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
        return out, with_trailer_checksum(ranges, trailer, run_id)

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
            helpers = [h for *_, h in later if h is not None]   # they read the runs' memory
            try:
                wait(helpers)
            except BaseException:
                # Interrupted (KeyboardInterrupt) while they hash: raise once
                # they are done, not with them still reading the staging
                # buffer (which close() unmaps) or the caller's array.
                wait(helpers)
                raise
        tails = [sums.tail for k, sums, _, _ in later if k not in first]
        for k, sums, run_id, h in later:
            ranges = first[k] if h is None else h.result()
            out.append((k, with_trailer_checksum(ranges, sums.trailer, run_id)))
        if tails:
            self.io.write(tails[0] if len(tails) == 1 else IOBatch.concat(tails))
        return out


def check_run_fits(nblocks: int, geometry, max_run_blocks: int, region_count: int,
                   region_size: int, layout: Callable[[int], RunLayout]) -> None:
    """Refuse (StoreFullError) a run of ``nblocks`` that a store of
    ``region_count`` regions of ``region_size`` bytes, cutting runs into
    pieces of at most ``max_run_blocks`` blocks laid out by ``layout(n)``,
    cannot hold at once: its pieces would evict one another (the tail
    pushing out the head), leaving nothing to find.  The arithmetic of
    RunWriter._check_fits, for a store open or only planned
    (kvblock/store/planning.py)."""
    g = geometry
    step = max_run_blocks
    if step < 1:
        raise StoreFullError(f"one block ({g.block_bytes} bytes) does not fit a "
                             f"{region_size}-byte region")
    full, rest = divmod(nblocks, step)
    piece = layout(step).run_bytes
    rest_bytes = layout(rest).run_bytes if rest else 0
    need = full * piece + rest_bytes
    # Pieces never straddle regions: count the regions they fill (a
    # region's slack past its last whole piece adds up over many).
    per_region = region_size // piece
    used = -(-full // per_region)
    if rest and (not used or (full - (used - 1) * per_region) * piece + rest_bytes
                 > region_size):
        used += 1
    # Its first piece may go to the partly filled region: count one less.
    room = max(1, region_count - 1)
    if used > room:
        raise StoreFullError(
            f"a run of {nblocks} blocks ({need} bytes on the device, in {used} regions) "
            f"does not fit this store, which holds at most {room} regions of one run "
            f"({region_count} regions of {region_size} bytes, less one); store a "
            "shorter prefix or give the store more capacity")
