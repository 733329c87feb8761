"""Reading runs from the devices into the caller's memory, verified.

The store's index says where a prefix of keys lies (``_segments``, which pins
it, and ``_unpin``); reading it is the same code for a
:class:`~kvblock.store.store.KVStore` and for a rank of a served store
(:class:`~kvblock.store.client.RemoteStore`): whole runs in as few I/Os as
the engine takes, parts of runs by their windows and the run's block digest
trailer, every byte checked against the run's checksums unless
``verify="never"``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Sequence

import numpy as np

from kvblock.errors import ConfigError, IOFailedError, KVBlockError
from kvblock.format import trailer as trailerfmt
from kvblock.format.checksum import data_seed
from kvblock.index import Run, normalize_keys
from kvblock.index.index import POS_BITS
from kvblock.io import IOBatch
from kvblock.io.engine import FEW_IOS
from kvblock.layout.geometry import RunLayout, round_up
from kvblock.memory import HostBuffer
from kvblock.store.digests import block_digests_at, run_seed
from kvblock.store.inflight import in_flight
from kvblock.store.runio import RunIO
from kvblock.store.scatter import BlockList, as_array, block_at, span
from kvblock.units import is_whole

logger = logging.getLogger(__name__)
DAMAGED_RUNS_KEPT = 1024
# A read meeting an unreadable run another read is dropping waits this long
# at most for that drop (a journal commit) before it raises
READ_ERROR_DROP_WAIT_S = 30.0
# After a read of several runs that failed in more than one I/O, each run is
# read again alone (to drop only the unreadable ones) in pieces of this size.
PROBE_BYTES = 4 << 20


def _first_difference(a: list, b: list) -> int:
    """The first index where two lists of equal length differ (they do)."""
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class RunReader(RunIO):
    """get_run, get_runs, get_blocks and read_range.  The class using it
    provides ``_check_open``, ``_segments``, ``_unpin``, ``_run_pin_held``,
    ``_host_hits_used`` (with a host tier) and
    ``_drop_runs(runs, why=...)`` (why: "checksum" or "read_error", for a
    store server's counters)."""

    # Where the last failure was (README: "store.last_read_error says
    # where"): None until one happens, so monitoring can read them any time.
    last_read_error: tuple | None = None          # (path, offset, run ids dropped)
    last_checksum_failure: tuple | None = None    # (path, offset, run id, range)
    # (why, run id) of runs found damaged lately, why "checksum" or
    # "read_error" (run ids are never reused): requests of one get_runs
    # call, or racing reads, that meet one damaged run count and drop it once.
    _damaged_runs: OrderedDict | None = None
    _damaged_lock = threading.Lock()
    # run id -> set once the read-error drop of that run a read began is
    # done (dropped, or failed to): the other reads that met it raise then
    _read_error_drops: dict | None = None

    @in_flight
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

    @in_flight
    def get_runs(self, requests: Sequence[tuple[Sequence, Any]]) -> list[int]:
        """:meth:`get_run` for several ``(keys, out)`` requests in one call;
        returns each request's count of leading blocks read and verified.

        Requests for a few blocks out of a stored run (an engine promoting
        part of what it stored as one run) are read in one engine batch and
        checked against their runs' trailers together: one native call and
        one pass of bookkeeping for all of them instead of one per request;
        requests for one whole run each go in one batch as well.  Other
        requests are read as get_run reads them.  With a host tier, every
        request is read as get_run reads it.  A checksum failure ends the
        count of the request that met it before the run it hit (0 when that
        is the request's first run), a device error (EIO...) fails that
        request (its count is 0); either drops the run it hit, as get_run
        does (which raises the device error); errors that reached no device
        (a closed engine, a broken io_uring: ``device_fault`` False) raise.
        """
        self._check_open()
        if not isinstance(requests, Iterable) or isinstance(requests, (str, bytes)):
            raise ConfigError(f"get_runs: requests must be a sequence of (keys, out) pairs, "
                              f"got {type(requests).__name__}")
        targets = []
        for k, request in enumerate(requests):
            if not isinstance(request, (tuple, list)) or len(request) != 2:
                raise ConfigError(f"get_runs: request {k} must be a (keys, out) pair, got "
                                  f"{type(request).__name__}")
            keys, out = request
            keys = normalize_keys(keys)
            targets.append((keys, self._run_out(len(keys), out, "get_runs")))
        if self.host is not None:
            return [self._read_tiered_request(keys, dst) for keys, dst in targets]
        pinned: list = []
        counts = [0] * len(targets)
        nbytes = [0] * len(targets)     # each request's bytes read (see _read_done)
        partial = [0] * len(targets)    # and its partial verified reads (the same)
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
                    part = span(dst, at, at + count)
                    if self._straight_into(run, pos, count, part, None):
                        whole.append((i, run, part))
                        continue
                if segs:
                    tally = [0, 0]
                    try:
                        counts[i] = self._read_segs(segs, dst, None, tally)
                        nbytes[i], partial[i] = tally
                    except IOFailedError as e:
                        if not e.device_fault:
                            raise
                        counts[i] = 0        # (the run it hit is dropped)
            if together:
                reads = [read for _, read in together]
                got = [0] * len(reads)
                try:
                    oks = self._read_blocks_together(reads, got)
                except IOFailedError as e:
                    if not e.device_fault:
                        raise
                    unreadable: set = set()    # run ids: requests sharing one drop it once
                    got = [0] * len(reads)
                    oks = [self._read_alone(read, unreadable, got, j)   # which run was it?
                           for j, read in enumerate(reads)]
                for (i, read), ok, b in zip(together, oks, got):
                    counts[i] = read[3] if ok else 0
                    nbytes[i], partial[i] = b, int(ok)
            if whole:
                self._read_whole_requests(whole, counts, nbytes)
            for i, segs in enumerate(pinned):
                if segs:
                    counts[i] = self._read_done(segs, counts[i], None, nbytes[i], None,
                                                partial[i])
                else:
                    self.counters.add("miss_gets")
        except BaseException:
            # (a KeyboardInterrupt in the loop above, between two requests'
            # unpins, too: the requests after it stayed pinned for good)
            # Each request's pins go once: _unpin releases only what is left
            # of an answer (nothing of one _read_done released).
            # A second Ctrl-C in one of these unpins: the requests after it
            # are released all the same, then it is raised.
            cut = None
            for segs in pinned:
                if segs:
                    try:
                        self._unpin(segs)
                    except BaseException as e:    # cut as it began: again
                        cut = cut or e
                        self._unpin(segs)
            if cut is not None:
                raise cut
            raise
        return counts

    def _read_tiered_request(self, keys, dst) -> int:
        """get_runs' request with a host tier: :meth:`_read_tiered`, 0 when
        a device error fails it (the run it hit is dropped already)."""
        try:
            return self._read_tiered(keys, dst)
        except IOFailedError as e:
            if not e.device_fault:
                raise
            return 0

    def _read_whole_requests(self, whole: list, counts: list, nbytes: list) -> None:
        """get_runs' requests that are one whole run each, ``whole`` holding
        (request, run, destination): in one engine call (their I/O in flight
        together), again past a run that fails its checksums (count 0), and
        one by one after a device error, so that it fails only the request
        whose run it hit (that run is dropped).  Each request's count goes
        in ``counts``, the bytes it read in ``nbytes``."""
        while whole:
            read = [0] * len(whole)
            try:
                got = self._read_whole_runs([(run, part) for _, run, part in whole], read)
            except IOFailedError as e:
                if not e.device_fault:
                    raise
                unreadable = set()   # run ids: requests sharing a run count and drop it once
                for i, run, part in whole:
                    if run.run_id in unreadable:
                        counts[i] = 0        # met its device error already: dropped
                        continue
                    one = [0]
                    try:
                        counts[i] = run.nblocks if self._read_whole_runs([(run, part)], one) else 0
                        nbytes[i] = one[0]
                    except IOFailedError as e1:
                        if not e1.device_fault:
                            raise
                        unreadable.add(run.run_id)
                        self._read_failed(e1, [run])
                return
            for (i, run, _), b in zip(whole[:got], read):
                counts[i], nbytes[i] = run.nblocks, b
            whole = whole[got + 1:]       # whole[got] failed its checksums: dropped, count 0

    def _read_alone(self, read, unreadable: set, tally: list, j: int) -> bool:
        """One :meth:`_read_blocks_together` item on its own (the bytes it
        read added to ``tally[j]``); False when it
        meets a device error (the run it hit is dropped) or its run met one
        already (``unreadable``, run ids: counted and dropped once)."""
        if read[0].run_id in unreadable:
            return False
        try:
            one = [0]
            ok = self._read_blocks_together([read], one)[0]
            tally[j] += one[0]
            return ok
        except IOFailedError as e:
            if not e.device_fault:
                raise
            unreadable.add(read[0].run_id)
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

    @in_flight
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

    def _read_tiered(self, keys, dst, only=None) -> int:
        """Blocks in the host tier are copied from DRAM, stretches of the others
        read from the device; blocks read from the device then enter the tier
        (after the copies, so they cannot push out blocks about to be read),
        unless ``only`` (read_range's (layer, group)) read a part of each."""
        n = len(keys)
        g = self.geometry
        at = 0 if only is None else (only[0] * g.head_groups + only[1]) * g.group_block_bytes
        # a clear() or delete() during the read keeps its blocks out
        epoch, discards = self.host.epoch, self.host.discards
        # the run each key names before the read (see the inserts below),
        # and when it was published (-1: none)
        with self._lock:
            named = self.index.lookup(keys)
            published = self.index.published_of(named)
        published = published.tolist()      # (ints for the tier; past the lock)
        in_host = [k in self.host for k in keys]
        done, fetched, hits, raced, from_host, device = 0, [], 0, 0, [], 0
        # bytes read from the devices and partial verified reads, by
        # stretches whose pins held
        read = [0, 0]
        try:
            while done < n:
                if in_host[done]:
                    if self.host.read_into(keys[done], block_at(dst, done), at,
                                           since=published[done]):
                        hits += 1
                        from_host.append(keys[done])
                        done += 1
                        continue
                    raced += 1      # gone meanwhile: read_into counted its miss
                end = done + 1
                while end < n and not in_host[end]:
                    end += 1
                # A stretch stored nowhere after blocks already read ends the
                # prefix; only a read that returns nothing at all is a miss.
                # (counted below, with the DRAM blocks, once the whole read
                # returns: a device error in a later stretch returns none)
                got = self._read(keys[done:end], span(dst, done, end), only, done == 0, read)
                device += got
                if only is None:
                    fetched.extend(range(done, done + got))
                done += got
                if done < end:
                    break
        finally:
            # the tier's misses: the blocks not taken from it, and the key that
            # ended the prefix (the tier's hits read_into counted), also when a
            # device error fails the read (at the key whose stretch it hit):
            # the tier's counters count its lookups, as read_into its hits
            self.host.missed(min(done + 1, n) - hits - raced)
        # DRAM hits count as blocks read, as the device's do
        self._host_hits_used(from_host)
        self.counters.add_each(host_hit_blocks=hits, device_hit_blocks=device,
                               get_blocks=hits + device, bytes_read=read[0],
                               partial_verified_reads=read[1],
                               get_bytes=(hits + device) * (g.group_block_bytes if only
                                                            else g.block_bytes))
        for k in fetched:
            # only while the key names the run read (under the tier's lock:
            # a newer put's copy is never replaced by this one, see HostTier.put)
            self.host.put(keys[k], block_at(dst, k), epoch=epoch, discards=discards,
                          current=self._names(keys[k], named[k]))
        if fetched:
            # A put published a newer run of a key since the read began:
            # the bytes read may be the older run's, and the newer copy the
            # put gave the tier may have been pushed out before the insert.
            self._tier_keep_newest([keys[k] for k in fetched], named[fetched],
                                   [published[k] for k in fetched])
        return done

    def _tier_keep_newest(self, keys: list[bytes], named, published: list[int]) -> None:
        """After copies of ``keys`` went into the DRAM tier, taken from the
        runs ``named`` (packed run per key, ``published`` their
        Run.published): the keys that name another run by now (or none)
        leave the tier if their copy there is older than that run (or, one
        named now, than the run named now): their reads go to the device,
        which has the newest copy.  Looked at after
        the insert (a key's run only ever changes to a newer one).  A copy
        as new or newer stays: this run's own (a newer put replaces or drops
        it itself; with the run evicted it is the key's newest copy), or a
        newer put's (its run perhaps evicted since: the only copy left)."""
        with self._lock:
            now = self.index.lookup(keys)
            moved = np.flatnonzero(now != named).tolist()
            # the age a copy must reach to stay: the run named now (a newer
            # put's, whose own DRAM step may not have come: a copy older than
            # it is stale), else, the run gone, the one the caller looked at
            runs = self.index.runs
            newer = [max(published[j], runs[int(now[j]) >> POS_BITS].published)
                     if now[j] >= 0 else published[j] for j in moved]
        if moved:
            self.host.drop_older([keys[j] for j in moved], newer)

    @in_flight
    def read_range(self, keys: Sequence, layer: int, group: int, out) -> int:
        """Read one (layer, head group) of the stored prefix of ``keys``:
        ``out`` holds ``len(keys) * group_block_bytes`` bytes (blocks in order).
        One read per run; blocks in the host tier are copied from DRAM, as
        get_run does; returns the number of leading blocks read."""
        self._check_open()
        g = self.geometry
        for name, value in (("layer", layer), ("group", group)):
            if not is_whole(value):     # "0" printed as 0 read as in range
                raise ConfigError(f"read_range: {name} must be an int, got {value!r} "
                                  f"({type(value).__name__})")
        if not (0 <= layer < g.num_layers and 0 <= group < g.head_groups):
            raise ConfigError(f"read_range: layer {layer} / group {group} outside "
                              f"{g.num_layers} layers x {g.head_groups} groups")
        keys = normalize_keys(keys)
        out_arr = as_array(out, "read_range", writable=True)
        if out_arr.nbytes != len(keys) * g.group_block_bytes or not out_arr.flags.writeable \
                or not out_arr.flags.c_contiguous:
            raise ConfigError(f"read_range: out must be a writable, C-contiguous array of "
                              f"{len(keys) * g.group_block_bytes} bytes")
        dst = out_arr.reshape(-1).view(np.uint8).reshape(1, 1, len(keys), g.group_block_bytes)
        if self.host is None:
            return self._read(keys, dst, (layer, group))
        return self._read_tiered(keys, dst, (layer, group))

    def _read(self, keys, dst, only, count_miss: bool = True, tally: list | None = None) -> int:
        """``count_miss``: count a read that finds nothing stored as a
        miss (False: the caller's read returned blocks from elsewhere).
        ``tally``: None, count the blocks and bytes read; else the caller
        counts them, once its whole read returns (the bytes read, under
        pins that held, are added to ``tally[0]``, the partial verified
        reads to ``tally[1]``)."""
        segs = None
        try:
            with self._lock:
                segs = self._segments(keys)
            if not segs:
                if count_miss:
                    self.counters.add("miss_gets")
                return 0
            read = [0, 0]
            done = self._read_segs(segs, dst, only, read)
            return self._read_done(segs, done, only, read[0], tally, read[1])
        except BaseException:
            # (a KeyboardInterrupt as the lock was let go, before the read's
            # try, too: nothing released the pins).  _unpin releases what is
            # left of them: nothing twice when _read_done's unpin ran.
            if segs:
                try:
                    self._unpin(segs)
                except BaseException:    # cut as it began: again
                    self._unpin(segs)
                    raise
            raise

    def _read_done(self, segs, done: int, only, nbytes: int, tally: list | None = None,
                   partial: int = 0) -> int:
        """Unpin a read's segments and count it: ``done`` blocks, ``nbytes``
        read from the devices and ``partial`` partial verified reads (into
        ``tally`` for the caller to count, when it is given), or 0 when the
        pins lapsed meanwhile (the read counts nothing but the lapse: what
        it read is not returned)."""
        try:
            held = self._unpin(segs)
        except BaseException:
            self._unpin(segs)      # cut as it began: again (the rest, once)
            raise
        if not held:
            # The pins lapsed while the bytes were read: their space may have
            # been reused meanwhile, and unverified reads would not notice.
            self.counters.add("lapsed_pin_gets")
            return 0
        if tally is not None:
            tally[0] += nbytes
            tally[1] += partial
            return done
        g = self.geometry
        self.counters.add_each(get_blocks=done, bytes_read=nbytes,
                               partial_verified_reads=partial,
                               device_hit_blocks=done,     # with a DRAM tier or not
                               get_bytes=done * (g.group_block_bytes if only else g.block_bytes))
        return done

    def _read_segs(self, segs, dst, only, tally: list) -> int:
        """The pinned segments ``segs`` into ``dst``; how many leading blocks
        were read and verified (raises on a device error, after dropping the
        run it hit).  The bytes read for them are added to ``tally[0]``, the
        partial verified reads among them to ``tally[1]`` (counted by the
        caller once the pins are known to have held)."""
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
                part = span(dst, out_at, out_at + count)
                if not self._straight_into(run, pos, count, part, only):
                    break
                whole.append((run, part))
            if whole:
                read = [0] * len(whole)
                try:
                    got = self._read_whole_runs(whole, read)
                except IOFailedError as e:
                    self._read_failed(e, [run for run, _ in whole])
                    raise
                tally[0] += sum(read)
                done += sum(run.nblocks for run, _ in whole[:got])
                if got < len(whole):
                    break
                i += len(whole)
                continue
            run, pos, count, out_at = segs[i]
            try:
                if not self._read_segment(run, pos, count,
                                          span(dst, out_at, out_at + count), only, tally):
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

    def _read_segment(self, run: Run, pos: int, count: int, dst, only, tally: list) -> bool:
        """Blocks pos..pos+count of ``run`` into ``dst`` ((layers, groups,
        count, bytes) array, or a BlockList when ``only`` is None); the
        bytes read are added to ``tally[0]`` (a partial verified read
        counted in ``tally[1]``)."""
        if self._straight_into(run, pos, count, dst, only):
            return self._read_whole_runs([(run, dst)], tally) == 1
        g = self.geometry
        lay = self.layout(run.nblocks)
        verify = self.verify == "always"
        idx = [lay.range_index(*only)] if only else list(range(g.ranges))
        if verify:
            window = self._verified_window(lay, pos, count, len(idx))
            if window is not None:
                return self._read_blocks_verified(run, lay, pos, count, dst, idx, *window,
                                                  tally=tally)
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
            sums = self.io.read_hashed(batch, np.arange(len(idx)), np.full(len(idx), run_seed(run)))
            if not self._verified(run, sums, np.asarray(run.checksums, np.uint64)[idx], idx):
                return False
        else:
            self.io.read(batch)
        self._scatter_window(buf.array, len(idx), lo, span, pos, count, dst)
        tally[0] += span * len(idx)
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
                              idx: list, lo: int, span: int, tally: list) -> bool:
        """Blocks pos..pos+count of ``run`` (ranges ``idx``) into ``dst``,
        verified without reading whole ranges: each range's aligned window
        [lo, lo + span) and the run's block digest trailer in one batch; the
        trailer against the index's checksum, each block handed out against
        the trailer (kvblock/format/trailer.py).  The bytes read are added
        to ``tally[0]``, and the read (when good) to ``tally[1]``."""
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
            ok = self._read_blocks_together([(run, lay, pos, count, dst, idx)], tally)[0]
            tally[1] += ok
            return ok
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
        tally[0] += span * nidx + lay.trailer_bytes
        tally[1] += 1
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
        part = span(dst, out_at, out_at + count)
        if not part.flags.c_contiguous or part.ctypes.data % self.alignment:
            return None
        if gbb % self.alignment:
            return None
        return run, lay, pos, count, part, list(range(g.ranges))

    def _read_blocks_together(self, reads: list, tally: list) -> list[bool]:
        """Blocks of one or more runs straight into place, in one engine
        batch; ``reads`` holds (run, layout, pos, count, dst, ranges) items,
        ``dst`` a contiguous (ranges, count) array of blocks.  Each block and
        each run's trailer (into this thread's staging buffer) is an entry
        hashed on its own: out of a mapping as it is copied, while its bytes
        are in cache, else as it lands.  Then each run's blocks are checked
        against its trailer (:meth:`_blocks_match_trailer`).  Returns, per
        item, whether its blocks are good (each good one a partial verified
        read, which its caller counts once its pins held); the bytes read
        for item j (when good) are added to ``tally[j]``."""
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
        for j, (run, lay, pos, count, dst, idx) in enumerate(reads):
            nb, tb = len(idx) * count, lay.trailer_bytes
            ok = self._blocks_match_trailer(run, buf.array[t:t + tb], sums[k + nb], idx, pos,
                                            count, sums[k:k + nb])
            if ok:
                tally[j] += nb * gbb + tb
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

    def _read_whole_runs(self, parts: list, tally: list) -> int:
        """Whole runs straight into place (``parts``: (run, destination) pairs
        that passed :meth:`_straight_into`, all BlockLists or all arrays), in
        one engine call; with verification each range is its own checksum
        stream.  Returns how many leading runs were read and verified (a bad
        run is dropped); the bytes read for part j (when good) are added to
        ``tally[j]``.  Built with numpy over all the runs at once."""
        verify = self.verify == "always"
        nr = self.geometry.ranges
        runs = [run for run, _ in parts]
        where = [self.regions.address(run.region, run.offset) for run in runs]
        if len(parts) * nr <= FEW_IOS and not isinstance(parts[0][1], BlockList):
            return self._read_few_images(parts, where, verify, tally)
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
            seeds = np.repeat(np.array([run_seed(run) for run in runs], dtype=np.uint64), nr)
            sums = self.io.read_hashed(batch, streams, seeds)
            want = np.concatenate([np.asarray(run.checksums[:nr], np.uint64) for run in runs])
            bad = np.nonzero(sums != want)[0]
            good = int(bad[0]) // nr if bad.size else len(parts)
            if bad.size:
                self._checksum_failure(runs[good], int(bad[0]) % nr)
        for j, lay in enumerate(lays[:good]):
            tally[j] += lay.data_bytes
        return good

    def _read_few_images(self, parts: list, where: list, verify: bool, tally: list) -> int:
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
        for j, (run, _) in enumerate(parts[:good]):
            tally[j] += self.layout(run.nblocks).data_bytes
        return good

    def _verified(self, run: Run, sums: np.ndarray, want: np.ndarray, idx=None) -> bool:
        """Compare a read's checksums with the run's; on a mismatch record the
        failure (the first bad range) and say False."""
        bad = np.nonzero(sums != want)[0]
        if bad.size:
            self._checksum_failure(run, int(bad[0]) if idx is None else idx[int(bad[0])])
            return False
        return True

    def _damage_found(self, run: Run, why: str = "checksum") -> tuple[bool, bool]:
        """Record ``run`` as found damaged (``why``: "checksum", or
        "read_error" for a device error): (count it, drop it).  A read (or
        a layer-wise load) that found it so already counted it and dropped it,
        or is dropping it: (False, False); where that drop failed
        (:meth:`_damage_not_dropped`), this one drops it: (False, True)."""
        key = (why, run.run_id)
        with self._damaged_lock:
            if self._damaged_runs is None:
                self._damaged_runs = OrderedDict()
            dropping = self._damaged_runs.get(key)
            if dropping is not None:
                self._damaged_runs[key] = True
                if not dropping and why == "read_error":    # this one drops it now
                    if self._read_error_drops is None:
                        self._read_error_drops = {}
                    self._read_error_drops[run.run_id] = threading.Event()
                return False, not dropping
            self._damaged_runs[key] = True
            if len(self._damaged_runs) > DAMAGED_RUNS_KEPT:
                self._damaged_runs.popitem(last=False)
            if why == "read_error":       # (_read_failed sets it once its drop is done)
                if self._read_error_drops is None:
                    self._read_error_drops = {}
                self._read_error_drops[run.run_id] = threading.Event()
        return True, True

    def _damage_not_dropped(self, run: Run, why: str = "checksum") -> None:
        """The drop of a damaged run failed: the next read that meets it
        drops it (without counting it again)."""
        key = (why, run.run_id)
        with self._damaged_lock:
            if self._damaged_runs is not None and key in self._damaged_runs:
                self._damaged_runs[key] = False

    def _checksum_failure(self, run: Run, range_index: int) -> None:
        if not self._run_pin_held(run):
            return       # its space may hold other runs now; the read is a miss
        count, drop = self._damage_found(run)
        if count:        # else counted by the read that met it first
            self.counters.add("checksum_failures")
            dev, off = self.regions.address(run.region, run.offset)
            self.last_checksum_failure = (self.io.devices[dev].path, off, run.run_id,
                                          range_index)
        if not drop:
            return       # dropped (or being dropped) by the read that met it first
        try:
            self._drop_runs([run], why="checksum")
        except KVBlockError as e:    # the read is a miss whatever became of the drop
            self._damage_not_dropped(run)
            logger.warning("kvblock: dropping run %d after a checksum failure failed: %s",
                           run.run_id, e)

    def _unreadable(self, runs: list[Run]) -> list[Run] | None:
        """Of ``runs``, those whose bytes a read meets a device error in,
        each run read alone (in pieces of at most PROBE_BYTES); None when
        the engine failed instead (nothing can be told)."""
        runs = list({run.run_id: run for run in runs}.values())   # (one per segment)
        lays = [self.layout(run.nblocks) for run in runs]
        size = min(PROBE_BYTES, max(lay.run_bytes for lay in lays))
        hit = []
        with HostBuffer(size, register=False) as buf:
            for run, lay in zip(runs, lays):
                dev, base = self.regions.address(run.region, run.offset)
                for at in range(0, lay.run_bytes, size):
                    try:
                        self.io.read(IOBatch.single(buf.address, dev, base + at,
                                                    min(size, lay.run_bytes - at)))
                    except IOFailedError as e:
                        if not e.device_fault:
                            return None
                        hit.append(run)
                        break
        return hit

    def _read_failed(self, error: IOFailedError, runs: list[Run]) -> None:
        """A device read for ``runs`` failed (EIO, a short read...): drop the
        run the failed I/O was in, as a checksum failure does; when several
        I/Os failed (the error names the first) or it gives no offset, each
        of ``runs`` is read again on its own and those that fail go (every
        one of them when that cannot tell).  Kept, it would stay a hit that
        no read can return, and engines retry hits (vLLM's tiering manager
        would promote it every step).  The caller still raises ``error``.
        An engine failure that reached no device (no path, or a broken
        ring: ``device_fault`` False) drops nothing."""
        if not error.device_fault:
            self.counters.add("read_errors")
            return      # the engine failed (a broken ring): the data is as it was
        hit = runs
        if len(runs) > 1 and (error.offset is None or error.failed > 1):
            # Runs read together (a get_blocks over a striped store: runs of
            # every device) were all dropped, those read fine too.
            try:
                hit = self._unreadable(runs)
            except KVBlockError as e:
                # The probe itself failed (its buffer could not be mapped):
                # nothing can be told, as when the engine fails, and the
                # caller still raises the device's error, not this one.
                logger.warning("kvblock: reading the runs of a failed read again "
                               "failed: %s", e)
                hit = None
            if hit is None:
                hit = runs
        elif error.offset is not None and error.failed <= 1:
            end = error.offset + max(int(error.length or 0), 1)
            hit = []
            for run in runs:
                dev, base = self.regions.address(run.region, run.offset)
                if (self.io.devices[dev].path == error.path
                        and base < end and error.offset < base + self.layout(run.nblocks).run_bytes):
                    hit.append(run)
            hit = hit or runs
        # Reads in other threads that met the same unreadable run (run ids
        # are never reused) count it and drop it once, as a checksum failure.
        found = [(run, *self._damage_found(run, "read_error")) for run in hit]
        drop = [run for run, _, dropping in found if dropping]
        # the events _damage_found made for this read's drops (set below):
        # once a drop failed, another read may put its own in their place
        with self._damaged_lock:
            mine = [(run.run_id, self._read_error_drops.get(run.run_id)) for run in drop] \
                if self._read_error_drops else []
        if not found or any(count for _, count, _ in found):   # (none: read fine again)
            self.counters.add("read_errors")
            self.last_read_error = (error.path, error.offset, [r.run_id for r in hit])
            logger.warning("kvblock: %s; dropping %d run(s) that read it (%d blocks)", error,
                           len(hit), sum(r.nblocks for r in hit))
        try:
            if drop:
                try:
                    self._drop_runs(drop, why="read_error")
                except KVBlockError as e:    # the read error is what the caller hears
                    for run in drop:
                        self._damage_not_dropped(run, "read_error")
                    logger.warning("kvblock: dropping runs after a read error failed: %s", e)
        finally:
            with self._damaged_lock:
                for run_id, event in mine:
                    if event is not None and self._read_error_drops.get(run_id) is event:
                        del self._read_error_drops[run_id]
            for _, event in mine:
                if event is not None:
                    event.set()
        # Runs another read met first and is dropping: raised before that
        # drop is done, this read's caller would read the run again (a
        # caller skipping the key that failed) and meet the same EIO.
        with self._damaged_lock:
            others = [self._read_error_drops.get(run.run_id) for run, _, dropping in found
                      if not dropping] if self._read_error_drops else []
        deadline = time.monotonic() + READ_ERROR_DROP_WAIT_S
        for event in others:
            if event is not None:
                event.wait(max(0.0, deadline - time.monotonic()))


def _fresh_damaged_lock() -> None:
    """In a forked child: a thread of the parent recording a damaged run at
    the fork held RunReader._damaged_lock (one for every store), and held
    it stays there (that thread is not the child's): the child's first
    damaged run would wait for good."""
    RunReader._damaged_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_damaged_lock)
