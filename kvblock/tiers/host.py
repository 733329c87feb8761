"""Host-memory (DRAM) tier: hot blocks stay in memory, cold ones only on flash.

Blocks live in fixed slots of one page-aligned, pre-faulted arena (pinned with
CUDA when a GPU is present, so host-to-device copies can be asynchronous).
Replacement is segmented LRU, which is frequency-aware: a new block enters
the *probation* segment; a hit promotes it to the *protected* segment (80% of
the slots); eviction takes probation's least recent block first, so blocks
seen once never push out blocks that are read again and again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from kvblock.errors import ConfigError
from kvblock.index.keys import key_begins
from kvblock.memory import HostBuffer
from kvblock.units import size_setting

PROTECTED_SHARE = 0.8


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int, gone=None):
        """``gone``: called with the keys of blocks that leave the tier
        (evicted, discarded, cleared), under the tier's lock: the store
        logs those it no longer holds on the device either (its removal
        log, ``removed_since``, logged their runs while this tier still
        held them)."""
        capacity_bytes = size_setting(capacity_bytes, "host cache", "host_cache_bytes", 0)
        self.slots = capacity_bytes // block_bytes
        if self.slots < 2:
            raise ConfigError(f"host cache of {capacity_bytes} bytes (host_cache_bytes) holds "
                              f"fewer than two {block_bytes}-byte blocks; give it more memory "
                              "or none")
        self.block_bytes = block_bytes
        try:
            self.arena = HostBuffer(self.slots * block_bytes)
        except ConfigError as e:   # more than the machine will map
            raise ConfigError(f"host cache of {capacity_bytes} bytes (host_cache_bytes): {e}, "
                              "or none") from None
        # (its close() unlocks it before the unmap; collected unclosed, with
        # a store dropped without close(), its finalizer does)
        self.pinned = self.arena.pin_for_cuda()
        self.blocks = self.arena.array.reshape(self.slots, block_bytes)
        self.free = list(range(self.slots - 1, -1, -1))
        self.probation: OrderedDict[bytes, int] = OrderedDict()
        self.protected: OrderedDict[bytes, int] = OrderedDict()
        self.protected_max = int(self.slots * PROTECTED_SHARE)
        self.lock = threading.Lock()
        self.hits = self.misses = self.inserts = self.evictions = 0
        self.epoch = 0   # clear() calls: an insert that began before one is dropped
        self.discards = 0   # discard() calls: likewise (a delete during a read or put)
        # A store pin() holds the copy it pinned, not the key: (key, the
        # copy's insert number) -> pins; a copy some pin holds is never
        # evicted.  A copy delete() or clear() removed is no one's: a
        # re-put of its key is not held by the old lease.
        self.pins: dict[tuple[bytes, int], int] = {}
        self.born: dict[bytes, int] = {}   # key -> its copy's insert number
        # key -> ``current()``'s answer for its copy: the store's publish
        # count of the run it came from (-1: put without ``current``)
        self.published: dict[bytes, int] = {}
        self._births = 0
        self._gone = gone

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, key: bytes) -> bool:
        # Under the lock: a hit moves a block from one segment to the other
        # (pop, then insert), and a look at both between the two steps
        # finds it in neither.
        with self.lock:
            return key in self.probation or key in self.protected

    def get(self, key: bytes, since: int = -1) -> np.ndarray | None:
        """A copy of the block's bytes (counts a hit), or None.  ``since``:
        the publish count of the run the store names for the key (see
        :meth:`_stale_locked`)."""
        with self.lock:
            self._stale_locked(key, since)
            block = self._lookup_locked(key)
            return None if block is None else block.copy()

    def read_into(self, key: bytes, out: np.ndarray, offset: int = 0,
                  since: int = -1) -> bool:
        """The block's bytes from ``offset`` on (``out.nbytes`` of them:
        the whole block, or one layer and head group of it) into ``out``;
        ``since`` as for :meth:`get`."""
        with self.lock:
            self._stale_locked(key, since)
            block = self._lookup_locked(key)
            if block is None:
                return False
            out[...] = block[offset:offset + out.nbytes].reshape(out.shape)
            return True

    def copy_out(self, key: bytes, copy, since: int = -1) -> bool:
        """Call ``copy`` with the block's bytes in the arena (a view, good
        only during the call: it runs under the tier's lock, and a slot
        freed by a delete or clear is reused at once) and count a hit;
        False, nothing called, when the block is not here.  For copies
        that need no host copy of their own: a synchronous copy to a GPU
        goes straight from the (page-locked) arena.  ``since`` as for
        :meth:`get`."""
        with self.lock:
            self._stale_locked(key, since)
            block = self._lookup_locked(key)
            if block is None:
                return False
            copy(block)
            return True

    def _stale_locked(self, key: bytes, since: int) -> None:
        """A copy of ``key`` from a run published before ``since`` (the run
        the store names now is newer: its put's step here never came, the
        put cut after its publish) is stale: it leaves, and the read misses
        here (the device has the newest copy).  A copy put without
        ``current`` has no age (-1): its caller's to keep right."""
        if since >= 0 and key in self.born and 0 <= self.published[key] < since:
            self._drop_locked(key)

    def missed(self, n: int) -> None:
        """Count ``n`` misses: blocks a read took from the device (or found
        nowhere) after looking for them here without get/read_into."""
        with self.lock:
            self.misses += n

    def _lookup_locked(self, key):
        slot = self.protected.get(key)
        if slot is not None:
            self.protected.move_to_end(key)
        else:
            slot = self.probation.get(key)
            if slot is None:
                self.misses += 1
                return None
            self._protect(key, slot)
        self.hits += 1
        return self.blocks[slot]

    def _protect(self, key, slot):
        """(under the lock) ``key`` (in probation, at ``slot``) moves to
        protected, demoting protected's coldest beyond its share.  Each
        move enters the block in its new segment, then takes it out of
        the old one: a KeyboardInterrupt between the two (as a call
        returns) finds it in both, and the moves left are made (made
        again, a move done is skipped), then it is raised; popped first,
        a block cut there was in neither (its slot lost for good)."""
        interrupted = None
        while True:
            try:
                if key in self.probation:
                    self.protected[key] = slot
                    del self.probation[key]
                while len(self.protected) > self.protected_max:  # demote the coldest
                    old = next(iter(self.protected))
                    self.probation[old] = self.protected[old]
                    del self.protected[old]
                break
            except Exception:
                raise
            except BaseException as e:
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted

    def put(self, key: bytes, block: np.ndarray, *, epoch: int | None = None,
            discards: int | None = None, replace: bool = False, current=None) -> None:
        """Insert a block; evicts by policy when full.  ``epoch``: the tier's
        epoch when the caller read or wrote the block (a clear() since, or
        one under way: not inserted; with ``replace`` the older copy here
        goes too); ``discards``: likewise its ``discards`` (a discard() since,
        of any key: not inserted, the block may be one a delete() removed
        meanwhile; with ``replace`` the older copy here goes too).
        ``replace``: a newer copy of a key already here replaces it (a put),
        else the one here stays.  ``current``: a callable saying whether
        the block is still the key's newest copy (the store's index still
        names the run it came from): None when not, else when that run was
        published (kept with the copy, for :meth:`drop_older`); asked
        under this tier's lock: a newer
        put that published after the caller last looked puts its own copy
        here after this one (it waits for the lock), never before, so an
        older copy cannot replace it, not even for a moment."""
        if block.nbytes != self.block_bytes:   # before a victim goes or a slot is taken
            raise ConfigError(f"host tier: block of {block.nbytes} bytes for key "
                              f"{key.hex()}; the tier holds {self.block_bytes}-byte blocks "
                              "(the store's block_bytes)")
        data = block.reshape(-1).view(np.uint8)   # (calls: before anything changes)
        with self.lock:
            if epoch is not None and epoch != self.epoch:
                # A put during a clear() (its clear count moved, this epoch
                # not yet): not inserted, but its key's older copy here goes,
                # or reads serve that until the clear ends.
                if replace:
                    self._drop_locked(key)
                return
            if discards is not None and discards != self.discards:
                if replace:
                    self._drop_locked(key)
                return
            # (takes the store's lock inside this one: the store never
            # takes this lock while holding its own)
            published = -1
            if current is not None:
                published = current()
                if published is None:
                    return
            slot = self.probation.get(key)
            if slot is None:
                slot = self.protected.get(key)
            if slot is not None:
                if replace:
                    # the bytes and their age in one line with no call in it
                    self.blocks[slot], self.published[key] = data, published
                return
            victim = None
            if not self.free:
                victim = self._victim_locked()
                if victim is None:      # every block is pinned: this one stays out
                    return
            self._insert_locked(key, data, published, victim)

    def _insert_locked(self, key: bytes, data: np.ndarray, published: int, victim) -> None:
        """(under the lock) ``key``'s new copy (not here) into the last free
        slot, or (``victim``: (segment, key), evicted) into the victim's.

        A KeyboardInterrupt landing between two steps (as a call returns)
        cut put there: the slot taken left the free list and went to no
        block (the tier one block smaller for good), or a victim's slot went
        free with its insert number left (every later eviction looking at
        it raised KeyError).  Each step is a line with no call in it, done
        once (made again, a step done is skipped): cut, the steps left are
        done, then the interrupt is raised."""
        if victim is None:
            seg = old = None
            n = len(self.free)
            slot = self.free[n - 1]
        else:
            seg, old = victim
            slot = seg[old]
        births = self._births + 1
        counts = (births, self.inserts + 1, self.evictions + (victim is not None))
        taken, interrupted = False, None
        while True:
            try:
                if victim is None:
                    if not taken:
                        self.free[n - 1:], taken = (), True
                elif old in seg:
                    del seg[old], self.born[old], self.published[old]
                self.blocks[slot] = data
                self.probation[key], self.born[key], self.published[key] = \
                    slot, births, published
                self._births, self.inserts, self.evictions = counts
                break
            except Exception:
                raise
            except BaseException as e:    # a KeyboardInterrupt: the rest is done
                interrupted = interrupted or e
        try:
            if victim is not None:
                self._report([old])
        finally:
            if interrupted is not None:
                raise interrupted

    def _victim_locked(self):
        """(segment, key) of the block to evict: probation's least recent
        unpinned one, else protected's; None when every block is pinned."""
        for seg in (self.probation, self.protected):
            for key in seg:
                if (key, self.born[key]) not in self.pins:
                    return seg, key
        return None

    def pin(self, key: bytes, held: list | None = None) -> tuple[bytes, int] | None:
        """Keep ``key``'s block from eviction until :meth:`unpin` of the
        token returned (a store pin() lease); None, and nothing pinned,
        when it is not here.  delete() and clear() still remove it, and
        the pin ends with the copy it held: a later copy of the key (a
        re-put) is not pinned by it.

        ``held``: a list the token is appended to in the line its pin is
        counted (no call in it): a KeyboardInterrupt landing as this call
        returns (the lock's release) finds it there, for :meth:`unpin`,
        where a token only returned would be lost with its pin."""
        with self.lock:
            born = self.born.get(key)
            if born is None:
                return None
            token = (key, born)
            count = self.pins.get(token, 0) + 1
            if held is None:
                self.pins[token] = count
            else:
                at = len(held)
                self.pins[token], held[at:at] = count, (token,)
            return token

    def unpin(self, tokens) -> None:
        """Release each of ``tokens`` (:meth:`pin`'s, once per pin).

        A list is the record of the pins still held: each token leaves it
        in the line its pin drops (no call in it), so a KeyboardInterrupt
        landing partway (the loop's back jump) releases the rest, then is
        raised, and a call cut as it began, made again with the same list,
        releases only what is left (nothing twice: another lease's pin of
        the same copy stays).  Any other iterable is copied first."""
        held = tokens if isinstance(tokens, list) else list(tokens)
        interrupted = None
        while held:
            try:
                with self.lock:
                    pins = self.pins
                    while held:
                        token = held[-1]
                        left = pins.get(token, 0) - 1
                        if left > 0:
                            pins[token], held[-1:] = left, ()
                        elif left == 0:
                            del pins[token], held[-1]
                        else:          # not pinned (released already): nothing drops
                            del held[-1]
            except Exception:
                raise
            except BaseException as e:     # a KeyboardInterrupt: the rest go
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted

    def clear(self, epoch: int | None = None) -> int:
        """Drop every block; how many there were.  ``epoch``: the store's
        clear count this clear() made (its puts pass theirs to :meth:`put`):
        the tier's epoch becomes it unless already past it (a later clear
        done first), not one more, so a store clear() cut short before it
        came here leaves the two apart until the next one only; None: one
        more."""
        with self.lock:
            free = list(range(self.slots - 1, -1, -1))
            n, keys = len(self.probation) + len(self.protected), list(self.born)
            epoch = self.epoch + 1 if epoch is None else max(self.epoch, epoch)
            new, t = (epoch, OrderedDict(), OrderedDict(), {}, {}, free), self
            # one line with no call in it: a KeyboardInterrupt lands before
            # it (nothing cleared) or after it (all of it)
            t.epoch, t.probation, t.protected, t.born, t.published, t.free = new
            self._report(keys)
            return n

    def discard(self, key: bytes) -> bool:
        """Drop a block; whether it was here."""
        with self.lock:
            self.discards += 1
            return self._drop_locked(key)

    def discard_prefix(self, prefix: bytes, keep=frozenset()) -> set[bytes]:
        """Drop the blocks whose keys begin with ``prefix``, except those of
        ``keep``; their keys."""
        with self.lock:
            self.discards += 1
            keys = {k for seg in (self.probation, self.protected) for k in seg
                    if key_begins(k, prefix) and k not in keep}
            # cut between two keys (the loop's back jump), the rest drop too
            # (a drop made again is a drop of nothing), then it is raised
            todo, interrupted = list(keys), None
            while todo:
                try:
                    while todo:
                        self._drop_locked(todo[-1], report=False)
                        del todo[-1]
                except Exception:
                    raise
                except BaseException as e:
                    interrupted = interrupted or e
            try:
                self._report(list(keys))
            finally:
                if interrupted is not None:
                    raise interrupted
            return keys

    def drop_older(self, keys: list[bytes], published: list[int]) -> None:
        """Drop each of ``keys`` whose copy here came from a run published
        before ``published[k]`` (the answers of put's ``current``), by the
        rule a read applies (:meth:`_stale_locked`): a newer copy stays."""
        with self.lock:
            for key, newer in zip(keys, published):
                self._stale_locked(key, newer)

    def _drop_locked(self, key: bytes, report: bool = True) -> bool:
        """(under the lock) ``key``'s block out, its slot free.  Cut between
        the two steps (a KeyboardInterrupt), the slot went to no one: both
        are done (each once), then it is raised."""
        seg = self.probation if key in self.probation else \
            self.protected if key in self.protected else None
        if seg is None:
            return False
        slot, n, freed, interrupted = seg[key], len(self.free), False, None
        while True:
            try:
                if key in seg:
                    del seg[key], self.born[key], self.published[key]
                if not freed:
                    self.free[n:n], freed = (slot,), True
                break
            except Exception:
                raise
            except BaseException as e:
                interrupted = interrupted or e
        try:
            if report:
                self._report([key])
        finally:
            if interrupted is not None:
                raise interrupted
        return True

    def _report(self, keys: list[bytes]) -> None:
        if keys and self._gone is not None:
            self._gone(keys)

    def stats(self) -> dict:
        with self.lock:
            return {"host_blocks": len(self), "host_capacity_blocks": self.slots,
                    "host_tier_hits": self.hits, "host_tier_misses": self.misses,
                    "host_inserts": self.inserts, "host_evictions": self.evictions,
                    "host_pinned": self.pinned}

    def close(self) -> None:
        # Unmapping does not unlock: the arena's close() unregisters it from
        # CUDA first (else the driver kept the pages, the whole tier, locked,
        # and an arena mapped there later could not be pinned).
        self.pinned = False
        self.arena.close()
