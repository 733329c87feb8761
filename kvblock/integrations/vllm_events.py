"""The vLLM tier's KV cache events: what its store jobs put in the store, and
that it went once the store no longer holds it.

With KV cache events on (``--kv-events-config``) vLLM drains every tier's
``take_events()`` each scheduler step and publishes ``BlockStored`` and
``BlockRemoved`` for offloaded chunks (its ``OffloadingEventsTracker`` fans
a chunk's key out to the chunk's block hashes).  A router that sends each
request where its prefix is cached must hear of removals as well as stores,
or it keeps sending requests to a replica for KV that is gone.

The store holds hashes of vLLM's keys (the tier's namespace mixed in), not
the keys, so the tier remembers the vLLM key of every kvblock key it
announced (a dict entry per stored slot while events are on).  A thread
polls the store's removal log (``removed_since``) every
``EVENTS_INTERVAL_S`` and announces the removal of announced keys the store
no longer holds, checked with ``present()``: a key in the log may be back
already, put again by this replica or another sharing the store.  Keys
announced since the last poll are checked too, whatever the log says: a job
is announced when its last piece is done, and an earlier piece's key may
have been removed (and the log passed) before.  When the
log lost keys (a long pause, a restarted server), every announced key is
checked.  A key is announced stored once until its removal is announced
(vLLM asks consumers to count repeated announcements): a store job that
finds it stored, or puts it back before the watch saw it go, announces
nothing for it.  Stored events carry ``removal_expected`` and, as ``ownership``, the tier
type and the store's uuid (``"kvblock:<uuid>"``: vLLM's tracker keys a
chunk's residencies by medium and ownership, so two kvblock tiers in one
vLLM must not share one), so vLLM's tracker keeps a chunk's payload until
the removal, which then names the block hashes its store named.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvblock.errors import KVBlockError
from kvblock.integrations.periodic import Periodic

logger = logging.getLogger("kvblock")

EVENTS_INTERVAL_S = 0.5
PRESENT_BATCH = 8192           # keys per present() call (one request to a server)


class TierEvents:
    """A tier's event queue, and the watch that turns removals into events."""

    def __init__(self, store, medium: Medium, locality: Locality | None, ownership: str,
                 interval: float = EVENTS_INTERVAL_S):
        self._store = store
        self._medium, self._locality, self._ownership = medium, locality, ownership
        self._queue: deque[OffloadingEvent] = deque()
        self._lock = threading.Lock()          # _announced, _stamp, appends to _queue
        # kvblock key -> (vLLM key, stamp of the BlockStored that announced it)
        self._announced: dict[bytes, tuple[OffloadKey, int]] = {}
        self._stamp = 0
        # Announced since the last poll: checked once whatever the log says.
        # A job announces its keys when its last piece is done; an earlier
        # piece's key may have been evicted, and its removal passed by the
        # watch (not yet announced then), before that.
        self._fresh: set[bytes] = set()
        self._poll_lock = threading.Lock()
        self._cursor = self._first_cursor()
        self._ticker = Periodic(self.poll, interval, "kvblock-tier-events")

    def _first_cursor(self) -> str | None:
        """Where the removal log stands now (None: unknown, the first poll
        checks every announced key)."""
        try:
            return self._store.removed_since(None)[0]
        except KVBlockError as e:
            logger.debug("kvblock tier: removal log: %s", e)
            return None

    def _event(self, keys: list, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=self._medium, removed=removed,
                               locality=self._locality, ownership=self._ownership,
                               removal_expected=True)

    def stored(self, pairs: list[tuple[bytes, OffloadKey]]) -> None:
        """A store job put these (kvblock key, vLLM key) pairs in the store
        (or found them there).  Announces only those not announced already:
        vLLM asks consumers to count repeated announcements of a key, and its
        removal is announced once.  An announced key still gets a new stamp,
        so a removal the watch is about to announce (the key evicted, then
        stored again) is not."""
        new = []
        with self._lock:
            for kb, key in pairs:
                self._stamp += 1
                if kb not in self._announced:
                    new.append(key)
                self._announced[kb] = (key, self._stamp)
                self._fresh.add(kb)
            if new:
                self._queue.append(self._event(new, removed=False))

    def take(self) -> list[OffloadingEvent]:
        """The events so far, oldest first.  Starts the removal watch on the
        first call (vLLM drains events only when its KV events are on)."""
        self._ticker.start()
        out = []
        with self._lock:
            while self._queue:
                out.append(self._queue.popleft())
        return out

    def announced(self) -> int:
        """How many keys this tier announced that it has not announced gone."""
        with self._lock:
            return len(self._announced)

    def poll(self) -> None:
        """One step of the watch (the thread's; tests call it): announce the
        removal of announced keys the store dropped since the last step."""
        with self._poll_lock:
            try:
                cursor, keys = self._store.removed_since(self._cursor)
            except KVBlockError as e:     # a closed store, a server away: next time
                logger.debug("kvblock tier: removal log: %s", e)
                return
            if self._cursor is None:
                keys = None
            with self._lock:
                fresh, self._fresh = self._fresh, set()
                if keys is None:             # the log lost some: check every key
                    watched = {kb: stamp for kb, (_, stamp) in self._announced.items()}
                else:
                    watched = {kb: self._announced[kb][1] for kb in (*keys, *fresh)
                               if kb in self._announced}
            checked = False
            try:
                checked = not watched or self._announce_gone(watched)
            finally:
                if not checked:              # (an unforeseen error too: the thread goes on)
                    with self._lock:
                        self._fresh |= fresh
            if checked:                      # else the cursor stays: checked again next step
                self._cursor = cursor

    def _announce_gone(self, watched: dict[bytes, int]) -> bool:
        """Announce the removal of the ``watched`` keys the store does not
        hold, unless a store job announced one again meanwhile (its stamp
        moved).  False when the store could not be asked."""
        kbs = list(watched)
        gone = []
        try:
            for at in range(0, len(kbs), PRESENT_BATCH):
                batch = kbs[at:at + PRESENT_BATCH]
                gone += [kb for kb, held in zip(batch, self._store.present(batch)) if not held]
        except KVBlockError as e:
            logger.debug("kvblock tier: removal check: %s", e)
            return False
        with self._lock:
            keys = []
            for kb in gone:
                entry = self._announced.get(kb)
                if entry is not None and entry[1] == watched[kb]:
                    del self._announced[kb]
                    keys.append(entry[0])
            if keys:
                self._queue.append(self._event(keys, removed=True))
        return True

    def close(self) -> None:
        """Stop the watch (a bounded wait: periodic.py)."""
        self._ticker.stop()
