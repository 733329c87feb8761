"""RemoteStore: a store shared by several processes through one store server.

Engines that run one process per tensor-parallel rank (SGLang, LMCache) need
one store on one device for all of them.  One process, the store server
(``kvblock serve DEV... --socket PATH`` or
:func:`kvblock.store.server.serve_in_background`), owns the store's metadata:
index, allocation, journal, checkpoints, eviction, and the exclusive claim on
the devices.  Each rank opens a :class:`RemoteStore` on the server's Unix
socket and does its own direct I/O on the devices (opened without the
exclusive claim) at the offsets the server hands out, so bytes never travel
through the socket.  The requests (a put is admit, allocate, write here,
commit; a read is segments, read here, unpin) are described in protocol.py;
one connection and its pins is a :class:`~kvblock.store.session.Session`;
starting a server where none answers is launch.py's.

When the server is gone (killed, crashed, stopped), every call raises
:class:`ServerGoneError`.  The store on the device stays exactly as crash-safe
as a KVStore killed at the same moment: reopen it (restart the server, or
``KVStore.open``) to recover.  With ``reconnect=True`` a thread here
connects again (and starts a server, see :func:`connect`) meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import traceback
import uuid
import weakref
from typing import Sequence

import numpy as np

from kvblock import errors
from kvblock.devices import Device, check_distinct, medium_key, refuse_one_path
from kvblock.errors import (ConfigError, ConnectionAbandonedError, KVBlockError, ServerError,
                            ServerGoneError, StoreClosedError, StoreFullError)
from kvblock.index import normalize_keys
from kvblock.io import open_engine
from kvblock.layout.geometry import Geometry, RunLayout, model_fingerprint
from kvblock.memory.spares import SpareBuffers
from kvblock.store.counters import Counters
from kvblock.store.fence import WriteFence
from kvblock.store.inflight import CLOSE_WAIT_S, InFlight, in_flight
from kvblock.store.launch import (ensure_server, socket_path_str, wait_for_server,
                                  wait_for_starting_server)
from kvblock.store.policy import VERIFY_MODES
from kvblock.store.protocol import (
    PROTOCOL,
    decode_keys,
    encode_keys,
    encode_msg,
    raise_remote,
    recv_msg,
)
from kvblock.store.reads import RunReader
from kvblock.store.runio import StagingBuffers
from kvblock.store.scatter import span
from kvblock.store.session import Session, fence_files, open_socket, recv_fence_files
from kvblock.store.store import (
    COUNTERS,
    LOAD_STAGING_KEEP,
    KVStore,
    _not_a_geometry,
    _try_superblock,
    check_evict,
    check_key_prefix,
    time_cutoff,
)
from kvblock.store.storeio import StoreIO
from kvblock.store.writes import RunWriter
from kvblock.units import timeout_setting

logger = logging.getLogger("kvblock")
HEARTBEAT_TICK_S = 1.0      # the heartbeat thread looks at least this often


# ---------------------------------------------------------------------- client
class RemoteRun:
    """What a reader needs of a run: where it is and its checksums (the
    server keeps the rest)."""

    __slots__ = ("run_id", "region", "generation", "offset", "nblocks", "checksums",
                 "session")

    def __init__(self, run_id, region, generation, offset, nblocks, checksums, session=None):
        self.run_id, self.region, self.generation = run_id, region, generation
        self.offset, self.nblocks = offset, nblocks
        self.checksums = np.array(checksums, dtype=np.uint64)
        self.session = session     # the connection whose pin covers the run

    def __repr__(self) -> str:
        return (f"RemoteRun(id={self.run_id}, region={self.region}, offset={self.offset}, "
                f"blocks={self.nblocks})")


class PinnedSegments(list):
    """``_segments``' answer: (run, position, count, first key index) tuples,
    pinned on the server under ``pin`` until ``_unpin``."""

    pin: int | None = None
    released = False       # unpin() took it (a handle pin() returned is released once)


class RemoteRegions:
    """Region addressing (the part of the region table a reader needs)."""

    def __init__(self, size: int, device_count: int, data_offsets: list[int], count: int):
        self.size, self.device_count, self.count = size, device_count, count
        self.data_offsets = list(data_offsets)

    def device_of(self, region: int) -> int:
        return region % self.device_count

    def address(self, region: int, offset: int = 0) -> tuple[int, int]:
        dev = region % self.device_count
        return dev, self.data_offsets[dev] + (region // self.device_count) * self.size + offset


# A lost session is replaced by a thread that tries to connect every
# RECONNECT_INTERVAL_S, doubling up to RECONNECT_MAX_INTERVAL_S while nobody
# answers; calls meanwhile fail at once (ServerGoneError), so an engine
# thread never waits for a server to come back.
# Counters of the reads a rank does on the devices itself: a store server
# sees none of them (they are in each RemoteStore's stats()["client"]).
READ_COUNTERS = ("get_blocks", "get_bytes", "bytes_read", "miss_gets", "read_errors",
                 "partial_verified_reads", "lapsed_pin_gets", "device_hit_blocks",
                 "host_hit_blocks")
RECONNECT_INTERVAL_S = 0.5
RECONNECT_MAX_INTERVAL_S = 10.0
# A server that serves another store (or speaks another protocol) is not
# retried by the thread; a call this long after the refusal tries once more
# (the operator may have restarted the right server meanwhile).
REFUSED_RETRY_S = 10.0


def _reconnect_loop(ref, stop: threading.Event) -> None:
    """(thread) Replace the lost session of ``ref()``; holds the store only
    while trying, so a store dropped without close() is still collected."""
    delay, warned = RECONNECT_INTERVAL_S, None
    while not stop.wait(delay):
        store = ref()
        if store is None or store.closed:
            return
        done, warned = _reconnect_once(store, warned)
        del store
        if done:
            return
        delay = min(delay * 2, RECONNECT_MAX_INTERVAL_S)


def _heartbeat_loop(ref, stop: threading.Event) -> None:
    """(thread) While ``ref()`` holds pins, ping its server every quarter of
    the server's pin lease, so they are not taken for a stopped process's.
    It looks every eighth of the lease (at most every HEARTBEAT_TICK_S), so
    a lease a reconnect brought counts at once.  Until ``stop``: close()
    sets it once the calls in flight are done (it waits for puts in flight,
    whose allocations a lapsed lease would give away, and for reads under
    the pins of connections abandoned after a timeout).

    It must live as long as the store (else its pins lapse on a server
    that lives): a beat that fails unexpectedly (a bug, a MemoryError) is
    logged, once per distinct error, and the next tick tries again."""
    last, failures = 0.0, set()
    while True:
        store = ref()
        if store is None:
            return
        tick = HEARTBEAT_TICK_S
        try:
            lease = store._pin_lease
            if lease:
                tick = min(HEARTBEAT_TICK_S, lease / 8)
            if lease and store._heartbeat and time.monotonic() - last >= lease / 4:
                if store._ping():
                    last = time.monotonic()
        except Exception as e:  # noqa: BLE001  (said; the next tick tries again)
            _note_heartbeat_failure(failures, store.socket_path, e)
        del store
        if stop.wait(tick):
            return


def _note_heartbeat_failure(failures: set, socket_path: str, e: BaseException) -> None:
    """A heartbeat's unexpected error: logged with its traceback as text (a
    record must not keep the frames, and the store with them), once per
    distinct error (its type and where it was raised), not every tick."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    key = (type(e), (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else None)
    if key in failures:
        logger.debug("kvblock: the heartbeat to %s failed again: %s: %s", socket_path,
                     type(e).__name__, e)
        return
    if len(failures) < 256:
        failures.add(key)
    logger.error("kvblock: the heartbeat to %s failed (%s: %s); it goes on (this error is "
                 "logged once)\n%s", socket_path, type(e).__name__, e,
                 "".join(traceback.format_exception(e)).rstrip())


def _reconnect_once(store: "RemoteStore", warned: str | None) -> tuple[bool, str | None]:
    """One attempt: (finished, the last warning logged)."""
    try:
        try:
            s = store._new_session()
        except ServerGoneError:
            if store._restart is None or store.closed:    # (closed: start none)
                raise
            store._restart()           # nobody there: start a server (one rank does)
            s = store._new_session()
    except (errors.GeometryMismatchError, errors.ProtocolMismatchError) as e:
        # another store, or another release's server: retrying at once cannot
        # help; a call after REFUSED_RETRY_S tries again (_start_reconnect).
        # Said first: whoever sees the session gone finds the reason logged.
        if str(e) != store._refused:
            logger.error("%s", str(e))     # text only: a record must not keep the traceback
        store._refused, store._refused_at = str(e), time.monotonic()
        store._session.gone = (f"{e} (a call tried again after {REFUSED_RETRY_S:g} s "
                               "reconnects once the right server answers)")
        return True, warned
    except Exception as e:  # noqa: BLE001  (a malformed hello too: an attempt that failed)
        if store.closed:               # closed meanwhile: nothing to say
            return True, warned
        # Anything else escaping would end the thread, and with it every
        # attempt until some call happens to start a new one.
        why = str(e) if isinstance(e, (KVBlockError, OSError)) else \
            f"its answer to hello was not understood ({type(e).__name__}: {e})"
        if why != warned:
            logger.warning("kvblock: reconnecting to %s: %s (retrying)", store.socket_path, why)
        return False, why
    if store._adopt(s):
        store._refused = None
        logger.warning("kvblock: reconnected to the store server at %s (pid %d)",
                       store.socket_path, store.server_pid)
    return True, warned


def _parting_answer(sock: socket.socket) -> dict | None:
    """An answer the server left before it closed the connection, if any."""
    try:
        return recv_msg(sock)
    except (OSError, ValueError):
        return None


class RemoteStore(RunReader, RunWriter):
    """A store served by a store server, with KVStore's byte API (put_run,
    get_run, read_range, lookup, contains, delete, evict, stats, close) and
    the internals kvblock.tensors uses, so ``save_blocks(remote, ...)`` and
    ``load_blocks(remote, ...)`` work unchanged.

    Parameters
    ----------
    socket_path : the server's Unix socket.
    verify : "always" / "never" for this process's reads (default: the server's).
    engine, queue_depth : this process's I/O engine.
    devices : device paths in store order, when this process sees them under
        other names than the server (default: the server's paths).
    geometry, model : when given, the served store must have this geometry
        and have been formatted for this model (GeometryMismatchError
        otherwise), as KVStore.open checks them.
    timeout : seconds to wait for one answer (default: no limit); past it
        the connection is abandoned.
    reconnect : when the connection is lost (the server died, or an answer
        timed out), connect again in the background, and with
        :func:`connect`'s ``devices`` start a new server when none answers.
        Calls fail with ServerGoneError until then; pins and allocations of
        the lost connection are gone with it.  Default False: the store
        stays gone.

    Raises :class:`ServerGoneError` when no server answers on ``socket_path``.

    Reads and the writes of a put's data run here, on this process's devices,
    with KVStore's own code (:class:`RunReader`, :class:`RunWriter`).
    """

    def __init__(self, socket_path, *, verify: str | None = None, engine=None,
                 queue_depth: int = 32, devices: Sequence | None = None,
                 timeout: float | None = None, reconnect: bool = False,
                 geometry: Geometry | None = None, model=None):
        refuse_one_path(devices)     # one path, not its characters: refused by name
        if geometry is not None and not isinstance(geometry, Geometry):
            # as KVStore.open: compared once connected, a dict failed as an
            # AttributeError ('describe') after the devices were opened
            _not_a_geometry(geometry)
        # text failed in the connect as a TypeError, -1 as socket's bare
        # ValueError; 0 made the socket non-blocking (calls failed as gone)
        timeout = timeout_setting(timeout, "RemoteStore", least="> 0")
        self.socket_path = socket_path_str(socket_path)
        self.closed = True
        self.io = None
        self.host = None           # no DRAM tier in a rank: its memory belongs to the engine
        self.readonly = False
        self.timeout = timeout
        self._lock = threading.RLock()      # local: kvblock.tensors holds it around _segments
        # A pin handle's release is checked and marked under this (no I/O
        # under it): two threads releasing one handle at once release it once.
        self._release_lock = threading.Lock()
        self._inflight = InFlight(self._closed_message())
        self._stagings = StagingBuffers()
        self.spares = SpareBuffers(LOAD_STAGING_KEEP)
        # fenced_writes: writes refused, their server gone
        self.counters = Counters({name: 0 for name in COUNTERS + ("reconnects", "fenced_writes")})
        self._fence: WriteFence | None = None
        self._pin_lease: float | None = None  # the server's (hello)
        self._heartbeat = True                # ping while holding pins (tests turn it off)
        # Reconnecting (see _reconnect_loop): a thread started when the
        # session is lost; ``_restart`` (set by connect) starts a server.
        self._reconnect = bool(reconnect)
        self._restart = None
        self._stop = threading.Event()
        self._reconnect_lock = threading.Lock()
        self._reconnector: threading.Thread | None = None
        # the session the reconnect thread is making (hello): close() ends it
        self._connecting: Session | None = None
        self._forked = False
        # a put_runs' session, per thread: every call it makes goes there (_put_many)
        self._bound = threading.local()
        # puts between their allocation and their commit's answer: close() waits for them
        self._publishing: set = set()    # (a token per put: _put_under_way)
        self._writes_cut = False     # close() stopped waiting for them: none may write now
        self._pid = os.getpid()    # a forked child's copy: see close()
        self._refused: str | None = None   # the server serves another store: no reconnect
        self._refused_at = 0.0             # ... until REFUSED_RETRY_S after this
        self._session = Session(open_socket(self.socket_path, timeout))
        self._sessions = weakref.WeakSet([self._session])   # for a forked child to close
        try:
            hello = self._call("hello", protocol=PROTOCOL, pid=os.getpid())
            served = recv_fence_files(self._session.sock, self.socket_path,
                                      len(hello.get("devices") or ()))
            try:
                self._setup(hello, verify, engine, queue_depth, devices)
                self._check_medium(served)
            except BaseException:
                for fd in served:
                    os.close(fd)
                raise
            for fd in served[2:]:            # devices 1..: checked, not fenced on
                os.close(fd)
            self._fence.served(served[:2])
            self._check_identity(geometry, model)
        except BaseException:
            self._session.close()
            if self.io is not None:
                self.io.close()
                self.io = None
            if self._fence is not None:
                self._fence.close()
            raise
        self.closed = False
        _LIVE.add(self)
        # Dropped without close(): its devices and fence files go with it.
        self._finalizer = weakref.finalize(self, _close_dropped, self.io, self._fence,
                                           self._sessions)
        # (its own stop: it goes on while close() waits for puts in flight)
        self._beat_stop = threading.Event()
        threading.Thread(target=_heartbeat_loop, args=(weakref.ref(self), self._beat_stop),
                         name="kvblock-heartbeat", daemon=True).start()

    def _check_identity(self, geometry, model) -> None:
        where = f"the store served on {self.socket_path}"
        # A server outlives the ranks that started it: one left from an
        # engine's last run keeps serving the store it was started for.
        fix = (f" (store server pid {self.server_pid}): stop that server (kill -TERM "
               f"{self.server_pid}) to format the devices anew, or give this process its own "
               "socket and devices")
        if geometry is not None and geometry != self.geometry:
            raise errors.GeometryMismatchError(
                f"{where} holds {self.geometry.describe()}, this process needs "
                f"{geometry.describe()}{fix}", self.socket_path, 0)
        if model is not None and self.fingerprint and \
                self.fingerprint != model_fingerprint(model):
            raise errors.GeometryMismatchError(
                f"{where} was formatted for another model than {model!r}; its KV cannot "
                f"serve this model{fix}", self.socket_path, 0)

    def _setup(self, hello, verify, engine, queue_depth, devices):
        if hello.get("protocol") != PROTOCOL:
            raise errors.ProtocolMismatchError(
                f"store server at {self.socket_path} speaks protocol {hello.get('protocol')}, "
                f"this kvblock speaks {PROTOCOL}: run one kvblock release on both sides")
        self.server_pid = int(hello["pid"])
        self._pin_lease = hello.get("pin_lease")
        self.uuid = hello["uuid"]
        self.geometry = Geometry(**hello["geometry"])
        self.fingerprint = bytes.fromhex(hello.get("fingerprint", ""))   # the model's
        self.alignment = int(hello["alignment"])
        self._layouts: dict[int, RunLayout] = {}   # layout()'s, by run length
        self.max_run_blocks = int(hello["max_run_blocks"])
        self.journal_bytes = int(hello["journal_bytes"])   # bounds a put_runs commit
        # the server's policies (they apply to every rank; None: not said)
        self.server_eviction = hello.get("eviction")
        self.server_admit_after = hello.get("admit_after")
        self._verify_given = verify     # None: the server's, read again at a reconnect
        self.verify = verify or hello["verify"]
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        self.regions = RemoteRegions(int(hello["region_size"]), len(hello["devices"]),
                                     hello["data_offsets"], int(hello["region_count"]))
        paths = list(devices) if devices is not None else hello["devices"]
        if len(paths) != len(hello["devices"]):
            raise errors.GeometryMismatchError(
                f"the store server at {self.socket_path} serves store {hello['uuid']} on "
                f"{len(hello['devices'])} device(s) ({', '.join(hello['devices'])}), not on "
                f"{', '.join(map(str, paths))}: give each store its own socket (e.g. a "
                "{dp_rank} in it too)", str(paths[0]) if paths else self.socket_path, 0)
        check_distinct(paths)     # one device twice would read as one out of place
        devs = []
        try:
            for p in paths:  # the server holds the exclusive claim
                devs.append(Device(p, writable=True, exclusive=False))
        except BaseException:
            for d in devs:
                d.close()
            raise
        self._open_io(devs, engine, queue_depth)
        want = uuid.UUID(hello["uuid"]).bytes
        if devices is not None:
            # This process's own names of the store's devices (an engine's
            # config: any order, as KVStore.open takes them): in store order.
            sbs = [_try_superblock(self.io, i) for i in range(len(devs))]
            if any(sb is None or sb.store_uuid != want for sb in sbs):
                raise errors.GeometryMismatchError(
                    f"the store server at {self.socket_path} serves store {hello['uuid']} on "
                    f"{', '.join(hello['devices'])}, not on {', '.join(map(str, paths))}: "
                    "give each store its own socket (e.g. a {dp_rank} in it too)",
                    str(paths[0]), 0)
            order = sorted(range(len(devs)), key=lambda i: sbs[i].device_index)
            if order != list(range(len(devs))):
                devs = [devs[i] for i in order]
                self.io.engine.close()
                self.io = None
                self._open_io(devs, engine, queue_depth)
        sbs = []
        for i, d in enumerate(devs):  # the same store, each device in its place
            sb = _try_superblock(self.io, i, raise_errors=True)
            if sb.store_uuid != want or sb.device_index != i:
                raise errors.MissingDeviceError(
                    f"{d.path} is not device #{i} of store {hello['uuid']} served at "
                    f"{self.socket_path}; give each device of the store once (in any "
                    "order)", d.path, 0)
            sbs.append(sb)
        # The data area every place the server answers is checked against
        # (and this rank's I/O is aligned to) is hello's: it must be the
        # one the superblocks lay out, as KVStore.open takes it from them.
        mine = (sbs[0].region_size, min(sb.region_count for sb in sbs) * len(sbs),
                [sb.data_offset for sb in sbs], sbs[0].alignment, sbs[0].geometry)
        said = (self.regions.size, self.regions.count, self.regions.data_offsets,
                self.alignment, self.geometry)
        if said != mine:
            raise errors.GeometryMismatchError(
                f"the store server at {self.socket_path} answered hello with the layout "
                f"region_size {said[0]}, region_count {said[1]}, data_offsets {said[2]}, "
                f"alignment {said[3]}, but the superblocks of {', '.join(d.path for d in devs)} "
                f"say {mine[0]}, {mine[1]}, {mine[2]}, {mine[3]}"
                + ("" if said[4] == mine[4] else " (and another geometry)") +
                ": a server of another kvblock release? run one release on both sides",
                devs[0].path, 0)
        self._fence = WriteFence(fence_files(devs[0], self.socket_path))

    def _open_io(self, devs, engine, queue_depth) -> None:
        """This rank's I/O path on ``devs`` (closed if it cannot be made).
        Writes go through the kernel: the server may have punched holes (a
        server with mapped reads off trims), and a write into a hole through
        a mapping of a full tmpfs would be a SIGBUS, not ENOSPC."""
        try:
            self.io = StoreIO(devs, open_engine(devs, engine, queue_depth=queue_depth,
                                                mapped_writes=False))
        except BaseException:
            for d in devs:
                d.close()
            raise

    def _check_medium(self, served: list[int]) -> None:
        """Each of the server's devices (the descriptors it sent after hello:
        device 0, its fence file, then devices 1..) is the very medium this
        rank does its I/O on: a copy of a device of the store (same uuid,
        another file) served at the socket, or given to this rank, would
        take this rank's commits for runs whose bytes it wrote elsewhere."""
        theirs = [served[0], *served[2:]]
        for i, dev in enumerate(self.io.devices):
            if i >= len(theirs) or not same_medium(theirs[i], dev.fd):
                raise errors.GeometryMismatchError(
                    f"the store server at {self.socket_path} serves store {self.uuid} from "
                    f"another medium than {dev.path} (its device #{i}; a copy of the "
                    "store?): reconnect to the server of this medium, or reopen",
                    dev.path, 0)

    # ------------------------------------------------------------------ transport
    def _current(self) -> "Session":
        """The session calls go to; ServerGoneError while it is lost (and,
        with ``reconnect``, a new one is being sought)."""
        s = self._session
        if s.gone is not None:
            self._start_reconnect()
            raise self._gone_error(s)
        return s

    def _gone_error(self, s: "Session") -> StoreClosedError:
        """The error of a call that meets session ``s`` given up: where this
        rank was closed (a close() in another thread overtook the call after
        its open check), StoreClosedError as every later call's, not
        ServerGoneError, on which a caller waits for a reconnect that a
        closed rank never makes."""
        stop = getattr(self, "_stop", None)    # (closed by close(): not a rank still opening)
        if self.closed and stop is not None and stop.is_set():
            lost = "" if s.gone == "remote store is closed" else f" (its connection: {s.gone})"
            return StoreClosedError(self._closed_message() + lost)
        if s.abandoned is not None:     # given up on here: the server may live on
            return ConnectionAbandonedError(s.gone)
        return ServerGoneError(s.gone)

    def _abandoned_put_error(self, s: "Session", what: str, op: str = "commit",
                             allocated: bool = True) -> ConnectionAbandonedError:
        """The error of a put whose connection ``s`` (the one its space is
        allocated on, where its requests must go) another call gave up on
        before the put's ``op`` request (its commit, or an allocate) went
        out: ``what`` was not stored.  ``allocated``: space was allocated
        for the put on ``s`` before (an allocate's: the runs before it in
        its group), given back; else nothing was."""
        again = ("a new connection is being made in the background (reconnect=True)"
                 if self._reconnect else "connect again (reconnect=True makes a new "
                 "connection by itself)")
        if op == "allocate":
            request = "the allocation of its space" if not allocated else \
                "the allocation of its next run's space"
            space = ("nothing was allocated for it" if not allocated else
                     "the space allocated for its runs before is given back (the server "
                     "gets it back once the put lets go of the connection)")
        else:
            request = "the put's commit"
            space = ("the space allocated for it is given back (the server gets it back "
                     "once the put lets go of the connection)")
        return ConnectionAbandonedError(
            f"{what} was not stored: the connection to the store server at "
            f"{self.socket_path} that the put was using was given up before {request} "
            f"could go out on it, because another call on this store ({s.abandoned}); "
            f"{space}, and the server may well live on.  Retry the put once connected "
            f"again: {again}")

    @property
    def _rpc_lock(self) -> threading.Lock:
        return self._session.lock

    def _call(self, op: str, **args):
        s = getattr(self._bound, "session", None)    # this thread's put_runs' server
        return self._call_on(s if s is not None else self._current(), op, **args)

    def _call_on(self, s: "Session", op: str, record: list | None = None, **args):
        """One request on session ``s`` (a pin or an allocation is released
        on the session that took it).  ``record``: see _call_locked."""
        with s.lock:
            return self._call_locked(s, op, args, record=record)

    def contains_nowait(self, key, wait: float, timeout: float | None = None) -> bool | None:
        """contains(), or None when another thread's call keeps the
        connection busy for ``wait`` seconds (a scheduler thread must not
        queue behind a worker's commit).  ``timeout`` bounds the answer's
        wait (a hung server): past it the session is abandoned and this
        raises ServerGoneError; and while another call has been waiting for
        its answer longer than ``timeout``, this answers False at once."""
        n = self._call_nowait("lookup", [key], wait, timeout)
        if n is None or n is False:
            return n
        self.counters.add_each(lookups=1, lookup_hit_blocks=n)
        return n == 1

    def touch_nowait(self, keys: Sequence, wait: float,
                     timeout: float | None = None) -> int | None:
        """touch() with contains_nowait's bounds: None when the connection
        stays busy for ``wait`` seconds, 0 (nothing touched) at once while
        another call has waited for its answer longer than ``timeout``."""
        n = self._call_nowait("touch", keys, wait, timeout)
        return None if n is None else int(n)

    def answer_overdue(self, timeout: float) -> bool:
        """Whether a call on the connection has waited for its answer longer
        than ``timeout``: the ``_nowait`` calls given that timeout answer
        False (0) at once, not their answer, until it is answered or abandoned."""
        return self._session.overdue(timeout)

    def _call_nowait(self, op: str, keys: Sequence, wait: float, timeout: float | None):
        """``op`` on ``keys``' answer, as an int; None when the connection
        stays busy for ``wait`` s; False while a call is stuck past ``timeout``."""
        self._check_open()
        s = self._current()

        def stuck() -> bool:     # a call stuck past the caller's limit: the server is hung
            return timeout is not None and s.overdue(timeout)
        if stuck():              # no wait for the connection it holds
            return False
        if not s.lock.acquire(timeout=wait):
            return False if stuck() else None
        try:
            keys = normalize_keys(keys)
            answer = self._call_locked(s, op, {"keys": encode_keys(keys)}, timeout=timeout)
        finally:
            s.lock.release()
        return self._count_answer(op, answer, len(keys))

    def _count_answer(self, op: str, answer, most: int | None = None) -> int:
        """``op``'s answer, a count: a whole number from 0 (to ``most``, the
        keys asked).  Taken as it came, a lookup past the keys asked made an
        engine claim blocks that do not exist, and int() took True or "2"
        (or failed bare on None): refused with ServerError."""
        if type(answer) is int and answer >= 0 and (most is None or answer <= most):
            return answer
        bound = "" if most is None else f" up to the {most} keys asked"
        raise ServerError(
            f"the store server at {self.socket_path} answered {op} with {str(answer)[:200]}, "
            f"not a count from 0{bound}; a server of another kvblock release?")

    def _call_locked(self, s: "Session", op: str, args: dict, timeout: float | None = None,
                     record: list | None = None):
        """One request and its answer (under ``s.lock``).  ``record``: a
        list the answer (an ok one's result) is added to as it is read, for
        a caller that must act on it though a Ctrl-C lands as this returns
        (an allocation's id, to abort it; an admit's offer, to give it
        back: an _OfferRecord, which keeps only the offer)."""
        if s.gone is not None:
            e = self._gone_error(s)
            e.not_sent = True       # (a put says what it did not store: _put_call_on)
            raise e
        data = encode_msg({"op": op, **args})   # a ConfigError here sends nothing
        limit = self.timeout if timeout is None else (
            timeout if self.timeout is None else min(timeout, self.timeout))
        s.call_started = time.monotonic()
        sent = False
        try:
            s.sock.settimeout(limit)
            try:
                s.sock.sendall(data)
                sent = True
            except (BrokenPipeError, ConnectionResetError):
                # a server that refused this connection (ServerBusyError)
                # answered and closed before the request went out
                s.sock.settimeout(0)
                reply = _parting_answer(s.sock)
                if reply is None or reply.get("ok"):
                    raise
                s.gone = str(reply.get("message", "the server closed the connection"))
                s.close_when_released()
            else:
                reply = recv_msg(s.sock)
            if reply is None:
                raise ConnectionError("the server closed the connection")
            if record is not None and reply.get("ok"):
                # in the try: cut before this line, the connection is given up
                record.append(reply.get("result"))
        except BaseException as e:
            s.call_started = None
            # The request may be half sent or its answer unread: the stream
            # cannot be trusted any more, so the connection is abandoned
            # (closed once this process's pins on it are released; until
            # then the heartbeat keeps it alive, which a request cut off in
            # the middle of its frame rules out).
            s.torn = s.torn or not sent
            lost = isinstance(e, (OSError, ValueError))
            again = ("a new connection is being made" if self._reconnect else
                     "connect again")
            if isinstance(e, TimeoutError):
                s.abandoned = s.abandoned or (f"{op} got no answer within timeout= "
                                              f"({limit:g} s)" if limit is not None else
                                              f"{op} got no answer in time")
                s.gone = (f"the store server at {self.socket_path} did not answer "
                          f"{op} in time ({e}); this connection is abandoned: {again}")
            elif lost:
                s.gone = (f"store server at {self.socket_path} is gone ({op}: {e}); " +
                          ("reconnecting (a rank restarts the server)" if self._reconnect
                           else "restart it (kvblock serve) and reconnect"))
                if self._pin_lease and s.held > 0:
                    s.gone += (f" (if it still runs, it dropped this connection: it held pins "
                               f"and was quiet past the server's pin lease of "
                               f"{self._pin_lease:g} s)")
            else:
                s.abandoned = s.abandoned or f"{op} was cut off ({type(e).__name__})"
                s.gone = (f"connection to the store server at {self.socket_path} "
                          f"was abandoned in the middle of {op} ({type(e).__name__})")
            s.close_when_released()
            if s is self._session:
                self._start_reconnect()
            if lost:      # (StoreClosedError where close() ended it under the call)
                raise self._gone_error(s) from None
            raise
        s.call_started = None
        if not reply.get("ok"):
            raise_remote(reply.get("error", "ServerError"), reply.get("message", ""))
        return reply.get("result")

    def _ping(self) -> bool:
        """Tell the server this process is alive, when it holds pins and no
        call is in flight (an answer in progress is as good); whether it did.
        The connections abandoned after a timeout that still hold pins a
        caller holds (kept open for them, their server perhaps alive) are
        pinged too: their pins must not lapse under a read."""
        s = self._session
        self._ping_abandoned()
        if s.gone is not None or s.held <= 0 or not s.lock.acquire(blocking=False):
            return False
        try:
            self._call_locked(s, "ping", {})
        except (KVBlockError, OSError) as e:   # the session is given up: calls say so
            logger.debug("kvblock: ping to %s: %s", self.socket_path, e)
        finally:
            s.lock.release()
        return True

    def _ping_abandoned(self) -> None:
        """Ping each connection given up on while pins are held on it (see
        Session.keep_alive): its answers are never read, only discarded."""
        for _ in range(3):     # (a WeakSet changed by a reconnect meanwhile: again)
            try:
                sessions = list(self._sessions)
                break
            except RuntimeError:
                continue
        else:
            return
        frame = None
        for old in sessions:
            if old.gone is None or old.held <= 0:
                continue
            if frame is None:
                frame = encode_msg({"op": "ping"})
            if not old.keep_alive(frame):
                logger.debug("kvblock: could not ping an abandoned connection to %s",
                             self.socket_path)

    def _check_open(self, writing: bool = False):
        if self.closed:
            raise StoreClosedError(self._closed_message())
        self._current()

    def _closed_message(self) -> str:
        """A closed rank's StoreClosedError: which server (a process may
        hold ranks of several), and the fix."""
        return (f"remote store is closed (server socket {self.socket_path}); connect "
                f"again: RemoteStore({self.socket_path!r})")

    @property
    def server_alive(self) -> bool:
        return self._session.gone is None and not self.closed

    # ------------------------------------------------------------------ reconnecting
    def _start_reconnect(self) -> None:
        if not self._reconnect or self.closed or self._forked:
            return
        if self._refused and time.monotonic() - self._refused_at < REFUSED_RETRY_S:
            return
        with self._reconnect_lock:
            if self._session.gone is None:      # replaced meanwhile: nothing to do
                return
            if self._reconnector is not None and self._reconnector.is_alive():
                return
            self._reconnector = threading.Thread(
                target=_reconnect_loop, args=(weakref.ref(self), self._stop),
                name="kvblock-reconnect", daemon=True)
            self._reconnector.start()

    def _new_session(self) -> "Session":
        """A session on the server now at the socket, which must serve this
        store (same uuid and geometry) with this protocol."""
        s = Session(open_socket(self.socket_path, self.timeout))
        self._sessions.add(s)          # a fork from here on closes it in the child
        with self._reconnect_lock:     # close() from here on ends it (see close)
            closed = self.closed
            if not closed:
                self._connecting = s
        if closed:
            s.close()
            raise StoreClosedError("remote store was closed while it reconnected")
        try:
            hello = self._call_locked(s, "hello", {"protocol": PROTOCOL, "pid": os.getpid()})
            if hello.get("protocol") != PROTOCOL:
                raise errors.ProtocolMismatchError(
                    f"the store server at {self.socket_path} now speaks protocol "
                    f"{hello.get('protocol')}, this kvblock {PROTOCOL}: run one kvblock "
                    "release on both sides")
            if hello.get("uuid") != self.uuid or \
                    Geometry(**hello["geometry"]) != self.geometry or \
                    int(hello["region_size"]) != self.regions.size or \
                    list(hello["data_offsets"]) != list(self.regions.data_offsets):
                raise errors.GeometryMismatchError(
                    f"the store server at {self.socket_path} now serves another store "
                    f"(uuid {hello.get('uuid')}, not {self.uuid}): reopen it", self.socket_path, 0)
            # The layout every place it answers is checked against (and this
            # rank's I/O aligned to, on these devices) is the first hello's,
            # which the superblocks confirmed: this server must serve it.
            said = (int(hello["region_count"]), int(hello["alignment"]), len(hello["devices"]))
            mine = (self.regions.count, self.alignment, self.regions.device_count)
            if said != mine:
                raise errors.GeometryMismatchError(
                    f"the store server at {self.socket_path} now answers hello with the layout "
                    f"region_count {said[0]}, alignment {said[1]}, {said[2]} device(s), not "
                    f"{mine[0]}, {mine[1]}, {mine[2]} as this process opened store "
                    f"{self.uuid}: a server of another kvblock release? reopen it",
                    self.socket_path, 0)
            # read here: a malformed hello closes the connection (below)
            server_pid, max_run_blocks = int(hello["pid"]), int(hello["max_run_blocks"])
            # verify=None follows the server's default: this server's, which
            # a restart may have changed (--verify)
            verify = self._verify_given or hello["verify"]
            if verify not in VERIFY_MODES:
                raise ConfigError(f"the store server at {self.socket_path} answered verify "
                                  f"{str(verify)[:40]!r}, not one of {VERIFY_MODES}")
            served = recv_fence_files(s.sock, self.socket_path, self.regions.device_count)
            # Under the lock close() sets ``closed`` by: a close() that came
            # during the hello (or a server's start) came first (refused: its
            # devices may be gone), or closes the fence files handed over here.
            with self._reconnect_lock:
                try:
                    if self.closed:
                        raise StoreClosedError("remote store was closed while it "
                                               "reconnected")
                    self._check_medium(served)
                except BaseException:
                    for fd in served:
                        os.close(fd)
                    raise
                for fd in served[2:]:        # devices 1..: checked, not fenced on
                    os.close(fd)
                self._fence.served(served[:2])   # this server's (a write in flight keeps the last's)
                self._connecting = None
        except BaseException:
            with self._reconnect_lock:   # let go of before the socket is closed
                self._connecting = None
            s.close()
            raise
        self.server_pid, self.max_run_blocks = server_pid, max_run_blocks
        self.verify = verify
        self._pin_lease = hello.get("pin_lease")
        self.server_eviction = hello.get("eviction")
        self.server_admit_after = hello.get("admit_after")
        return s

    def _adopt(self, s: "Session") -> bool:
        """Make ``s`` the session calls go to (False when closed meanwhile)."""
        with self._reconnect_lock:
            if self.closed or self._forked:
                s.close()
                return False
            self._session = s
            self._sessions.add(s)
        self.counters.add("reconnects")
        return True

    # ------------------------------------------------------------------ byte API
    def _put_many(self, items: list, began=None) -> list[int]:
        """put_runs here: every run checked to fit and admitted before any is
        written; then, as in one process, the pieces are written and
        published in groups, each with one commit_runs (one journal commit:
        an error while a group is written publishes none of it).  (``began``:
        unused; the server's admit names the clear count.)"""
        if len(items) == 1:
            return [self._put(*items[0])]
        # Every call of a put_runs goes to one server: its admits (told
        # count=False) and the count_rejected of the runs they declined, the
        # offers given back, its commits.  A count sent after a restart (and
        # reconnect) was counted by the new server, which decided none of
        # them; the old server gone, the call raises ServerGoneError, as a
        # put whose server dies between its pieces.
        self._bound.session = self._current()
        try:
            return self._put_many_on(items, self._bound.session)
        finally:
            self._bound.session = None

    def _put_many_on(self, items: list, s: "Session") -> list[int]:
        """put_runs of several items, every call on session ``s``."""
        # The clear ticket before the present below, not the first admit's:
        # the plan is made from present's answer, and a clear() between it
        # and the first admit published runs planned on the keys the clear
        # removed (a run counted stored as a duplicate of them, not stored).
        # A clear() from here on refuses every run, as KVStore's.
        clears = self.clear_ticket()
        # Which keys the store holds, asked once: the server's admit sees
        # none of this call's runs (they are published together, after
        # every admit), so a run held whole by the store and the call's
        # earlier runs together is found here, as KVStore finds it.
        found = self.present([k for keys, _ in items for k in keys])
        # every run checked to fit before anything changes, as KVStore's
        unchecked = self._check_runs_fit(items, found)

        def admit(keys, whole, offers):
            # a declined run is counted (here and on the server) once the
            # plan stands: _count_rejected.  The offer the server counted
            # goes into ``offers`` (its id) as its answer comes: given back
            # if nothing is stored.
            verdict, _ = self._admit(keys, count=False, record=offers)
            if verdict == "duplicate":
                self.counters.add("put_duplicate_runs")
            return verdict
        out, pieces, repeats, admitted = self._plan_puts(items, found, admit, unchecked)
        # The groups go to the admits' server (see _put: a reconnect between
        # two groups would refuse the later ones as cleared while a run's
        # pieces in the earlier ones stay published).
        on = [s]
        try:
            if repeats:     # duplicates no admit saw: the server's stats count them too
                self._call("count_duplicates", runs=len(repeats))
            with self._put_under_way():   # close() lets every group through (see there)
                out = self._put_grouped(out, pieces, repeats,
                                        lambda group: self._put_group(group, clears, on),
                                        self.journal_bytes)
        finally:          # (an error: ``out`` holds what the groups before it stored)
            try:
                self._give_back_unstored(items, out, admitted)
            except BaseException:     # cut as it began: ``admitted`` names them all
                self._give_back_unstored(items, out, admitted)
                raise
        return out

    def _put_group(self, pieces: list, clears: str,
                   on: list | None = None) -> list[tuple[int, int]]:
        """Allocate and write each piece, then publish them all with one
        commit_runs.  Returns (item, blocks) per piece, 0 blocks for one a
        clear() refused.  ``on``: as _put_one's."""
        s = self._session_for(on)   # the allocations, their commit or abort: one session
        with self._put_under_way():       # close() waits for it (see there)
            allocs, puts, sent, held = [], [], False, 0
            what = (f"this put's commit of {len(pieces)} runs "
                    f"({sum(len(keys) for _, keys, _ in pieces)} blocks)")
            try:
                for k, (_, keys, blocks) in enumerate(pieces):
                    # counted before the request goes out, as _segments' pin:
                    # a connection another thread gives up on (a call past
                    # timeout=) as the answer comes would be closed at once
                    # under the allocation (the put then met it "gone")
                    # (the count first: cut between the two, the session
                    # keeps one too many, never closed under another's pin)
                    s.hold(1)
                    held += 1
                    # each answer into ``allocs`` as it is read: a Ctrl-C as
                    # the call returns still leaves its id for the abort
                    a = self._put_call_on(s, "allocate", {"nblocks": len(keys)}, what,
                                          allocated=bool(allocs), record=allocs)
                    self._check_allocated(a, len(keys))
                    # the last write flushes every device the group wrote
                    last = k == len(pieces) - 1
                    sums = self._write_allocated(s, a, keys, blocks, {
                        self.regions.device_of(x["region"]) for x in allocs} if last else None,
                        what)
                    puts.append([a["wid"], encode_keys(keys), [int(c) for c in sums]])
                sent = True          # from here the server releases the pins (once it goes out)
                stored = self._put_call_on(s, "commit_runs", {"puts": puts, "clears": clears},
                                           what)
            except BaseException as e:
                if not sent or self._cut_before_sent(s, e):
                    self._abort(s, [_wid(a) for a in allocs])
                raise
            finally:
                s.hold(-held)
        if not isinstance(stored, list) or len(stored) != len(pieces) or not all(
                _is_int(n) and n in (0, len(keys)) for n, (_, keys, _) in zip(stored, pieces)):
            # zip would cut a short answer to it: its runs left out counted
            # as cleared, whether the server published them or not
            raise ServerError(
                f"the store server at {self.socket_path} answered commit_runs for "
                f"{len(pieces)} runs with {str(stored)[:200]}, not the blocks published for "
                "each (all or none of each run); a server of another kvblock release?")
        return [(i, self._count_committed(n)) for (i, _, _), n in zip(pieces, stored)]

    def _put(self, keys: list[bytes], blocks, began=None) -> int:
        if not keys:
            return 0
        # Every call of the put goes to one server, as put_runs' (see
        # _put_many): its admit, its pieces and the offer it gives back.  A
        # restart (and reconnect) between the admit and the first piece sent
        # the piece to the new server with the old one's clear ticket: the
        # commit was refused as "cleared" (the put answered 0 and counted a
        # clear that never came), and the offer given back reached a server
        # that never counted it (its admission then admitted the key's next
        # offer at once).  The old server gone, the put raises
        # ServerGoneError, as a put whose server dies midway.
        if getattr(self._bound, "session", None) is not None:
            return self._put_on(keys, blocks, self._bound.session)
        self._bound.session = self._current()
        try:
            return self._put_on(keys, blocks, self._bound.session)
        finally:
            self._bound.session = None

    def _put_on(self, keys: list[bytes], blocks, s: "Session") -> int:
        """put_run of one run, every call on session ``s``."""
        n = len(keys)
        too_long = None
        try:
            self._check_fits(n)
        except StoreFullError as e:
            # As KVStore: a run the store holds whole (as shorter runs) is a
            # duplicate, which admit answers; one that is not is refused
            # before admit counts its offer.
            if not self.present(keys).all():
                raise
            too_long = e
        # a declined run is counted at once (by the server's admit), but for
        # one refused whatever admit says (its offer given back, below).
        # The offer the server counted (its id) goes into ``offers`` as the
        # answer comes: given back (finally, below) unless stored whole.
        offers: list = []
        written = 0
        try:
            verdict, clears = self._admit(keys, count=too_long is None, record=offers)
            if verdict == "duplicate":
                self.counters.add("put_duplicate_runs")
                written = n
                return n
            if too_long is not None:     # removed meanwhile: it would have to be written
                # refused: the offer admit counted is given back (a declined
                # one counted by no counter)
                raise too_long
            if verdict == "rejected":    # (counted by the server's admit: no offer open)
                self.counters.add("admission_rejected_runs")
                return 0
            step = self.max_run_blocks
            # Once a piece is committed, the later ones go to the same server:
            # a server a reconnect brought between two pieces refuses them (the
            # admit's clear ticket is another server run's), and the put would
            # answer 0 while its earlier pieces stay published.  That server
            # gone, the put raises ServerGoneError, as when no reconnect came yet.
            on = [s]
            with self._put_under_way():   # close() lets every piece through (see there)
                for start in range(0, n, step):
                    stop = min(n, start + step)
                    what = None if n <= step else (
                        f"blocks {start} to {stop - 1} of this put's run of {n} blocks" +
                        (f" (its first {start}, committed before, stay stored)"
                         if start else ""))
                    stored = self._put_one(keys[start:stop], span(blocks, start, stop),
                                           clears, on, what)
                    written += stored
                    if not stored:    # a clear() overtook it: its earlier pieces went too
                        written = 0
                        return 0
        finally:          # not stored whole: the next offer admits it (see KVStore)
            if written < n:
                try:
                    self._give_back_offers(offers)
                except BaseException:   # cut before it was sent: ``offers`` names it still
                    self._give_back_offers(offers)
                    raise
        return written

    def _admit(self, keys: list[bytes], count: bool = True,
               record: list | None = None) -> tuple[str, str]:
        """admit's answer for a run of ``keys``: (verdict, clear ticket).
        Another verdict than the three admit gives (a server of another
        release) would be taken for "ok", and the run written: refused with
        ServerError, as a malformed answer is, before anything is allocated.
        ``count=False``: the server does not count a declined run (a call
        that may still be refused counts it later: _count_rejected).
        ``record``: a list the offer the server counted and keeps open on
        the connection is added to, (its id, admitted), as the answer comes
        (for _give_back_offers and _count_rejected to name)."""
        # The offer goes into ``record`` as the answer is read (inside
        # _call_locked's try): a Ctrl-C as the call returns, before the
        # answer got here, left it open on a live connection until it ended
        # (the key's next offer then taken for a repeat).
        noted = None if record is None else _OfferRecord(record)
        if count:
            answer = self._call("admit", keys=encode_keys(keys), record=noted)
        else:
            answer = self._call("admit", keys=encode_keys(keys), count=False, record=noted)
        verdict = answer.get("verdict") if isinstance(answer, dict) else None
        clears = answer.get("clears") if isinstance(answer, dict) else None
        if verdict not in ("ok", "duplicate", "rejected") or not isinstance(clears, str):
            raise ServerError(
                f"the store server at {self.socket_path} answered admit with "
                f"{str(answer)[:200]}, not a verdict (ok, duplicate or rejected) and a clear "
                "ticket; nothing was written (a server of another kvblock release?)")
        return verdict, clears

    def _give_back_offers(self, offers: list) -> None:
        """Give offers back to the server's admission, which counted them
        (best effort: a server gone took its offer counts with it), on the
        connection their put's admits went to (``self._bound.session``)
        or not at all.  ``offers`` is emptied before they are sent, as
        KVStore's (see RunWriter._give_back_offers): a caller that calls
        again after a KeyboardInterrupt sends none twice.

        Never sent again, on that connection or another: the server tracks
        the offers counted on each connection and gives back itself those
        open when it ends.  One this could not send (the connection
        abandoned after a timeout or a cut call) is given back there, and
        one whose answer was lost was given back already; sent again on a
        later connection, it was given back twice (a declined one counted
        one offer less: another rank's offer of the key cancelled)."""
        if not offers:
            return
        s = getattr(self._bound, "session", None)
        ids = [offer for offer, _ in offers]    # (the server knows which it admitted)
        pending, sending = list(offers), False
        try:
            del offers[:]       # (no call between the encoding and this)
            if s is None:       # (no put's connection: the server gives them back at its end)
                return
            with s.lock:        # (a Ctrl-C waiting here, another call in flight: not sent)
                sending = True  # cut from here, the connection is abandoned (_call_locked)
                self._call_locked(s, "give_back", {"offers": ids})
        except KVBlockError as e:
            logger.debug("kvblock: give_back to %s: %s", self.socket_path, e)
        except BaseException:
            # cut before the request could go out (its lock awaited): the
            # offers are put back, for the caller's call again to send
            if not sending and not offers:
                offers[:] = pending
            raise

    def _count_rejected(self, runs: int, keys: list = ()) -> None:
        """put_runs' declined runs, counted on the server (its admits were
        told count=False) and here, once the call's plan stands.  ``keys``
        (their offer ids, admit's answers) name the offers the server
        settles: another thread's put_runs on the connection has its own
        open."""
        self._call("count_rejected", runs=runs, offers=list(keys))
        self.counters.add("admission_rejected_runs", runs)

    def _abort(self, s: "Session", wids: list[int]) -> None:
        """Give back allocations on ``s`` that will not be committed."""
        for wid in wids:
            if wid is None:         # an answer without one: nothing to name
                continue
            try:
                self._call_on(s, "abort", wid=wid)
            except KVBlockError:
                pass  # a dead connection releases the pins anyway

    def _check_allocated(self, a, nblocks: int) -> None:
        """``a``, allocate's answer for a run of ``nblocks``, names space
        inside one region of the store's data area, aligned: this rank
        writes there itself, so a place a server answered wrongly (a bug,
        another release, a stray process on the socket) would be written
        over the superblocks, checkpoints, journal or another region's runs.
        ServerError, before a byte is written (the caller gives it back)."""
        regions, need = self.regions, self.layout(nblocks).run_bytes
        if isinstance(a, dict) and all(_is_int(a.get(k)) for k in
                                       ("wid", "region", "offset", "run_id")):
            region, offset = a["region"], a["offset"]
            if 0 <= region < regions.count and 0 <= offset and \
                    offset % self.alignment == 0 and offset + need <= regions.size:
                return
        raise ServerError(
            f"the store server at {self.socket_path} answered allocate for {nblocks} blocks "
            f"({need} bytes) with {str(a)[:200]}, not an aligned place inside one of its "
            f"{regions.count} regions of {regions.size} bytes; nothing was written (a "
            "server of another kvblock release?)")

    @contextlib.contextmanager
    def _put_under_way(self):
        """A put's allocations, writes and commit: close() waits for them
        until the commit is answered, so that what was written is published,
        not cut off by the connection's end (a local store's close lets a
        put in flight finish too).  StoreClosedError once close() began.
        Nested (a put's pieces, or put_runs' groups, inside the whole
        put's): the put began before close() did, and goes on to its end;
        refused between two pieces, it raised StoreClosedError with its
        first pieces published, where a local store's close lets it finish."""
        depth = getattr(self._bound, "put_depth", 0)
        # Counted as a token in a set, added inside the try and discarded
        # (again, if cut) in its finally: a KeyboardInterrupt at any line
        # leaves it counted out once.  A count raised before the try, or
        # lowered after the finally's first line, stayed up for good where
        # one landed there, and every later close() waited CLOSE_WAIT_S.
        me = object()
        try:
            self._publishing.add(me)
            self._bound.put_depth = depth + 1
            # (after the count: a close from here waits for it)
            if self.closed and not depth:
                raise StoreClosedError("remote store was closed during the put")
            yield
        finally:
            try:
                self._put_over(me, depth)
            except BaseException:      # cut as it left: again (it counts out once)
                self._put_over(me, depth)
                raise

    def _put_over(self, me: object, depth: int) -> None:
        """A put (or a piece of it) counted by _put_under_way as ``me`` is
        over: counted out, its thread's depth back to ``depth`` (both
        idempotent: called again where a KeyboardInterrupt cut it)."""
        self._bound.put_depth = depth
        self._publishing.discard(me)

    def _write_allocated(self, s: "Session", a: dict, keys: list[bytes], blocks,
                         flush: frozenset | set | None = frozenset(),
                         what: str | None = None) -> np.ndarray:
        """Write a run into the space ``a`` (allocate's answer on ``s``)
        holds; its checksums.  ``flush``: devices to flush after it (data
        before the record that publishes it), its own added; None: none.
        ``what``: the put's words for what it stores (its error's)."""
        lay = self.layout(len(keys))
        dev, dev_off = self.regions.address(a["region"], a["offset"])
        batch, sums = self._stage_run(lay, blocks, a["run_id"], dev, dev_off, later=True)
        with self._fence.writing():          # see kvblock/store/fence.py
            if self._writes_cut:             # close() gave up waiting for the puts under way
                raise StoreClosedError("remote store was closed during the put")
            if s.hung_up():                  # the space may be someone else's by now
                self.counters.add("fenced_writes")
                raise ServerGoneError(
                    f"the store server at {self.socket_path} that allocated this run's "
                    f"space ({self.io.devices[dev].path} at {dev_off}) is gone; the run "
                    "was not written")
            if s.gone is not None and s.abandoned is not None:   # its commit cannot go out
                raise self._abandoned_put_error(s, what or f"this put's run of {len(keys)} "
                                                "blocks")
            try:
                sums = self._write_run(batch, sums, a["run_id"])
            except errors.IOFailedError as e:
                if e.in_flight:
                    self._left_in_flight(s)
                raise
            if flush is not None:
                self.io.flush(sorted(flush | {dev}))
            return sums

    def _left_in_flight(self, s: "Session") -> None:
        """(under the write fence) A write the engine could not wait for (a
        broken io_uring's) may still land on space ``s`` allocated: this
        process stays in the fence until it ends, so an owner's fence waits
        for it, and ``s`` is given up, not asked to abort (an abort gives
        the space back at once; a connection's end, after the fence)."""
        self._fence.keep()
        s.abandoned = s.abandoned or "a write of a put was left in flight by a broken io_uring"
        if s.gone is None:
            s.gone = (f"connection to the store server at {self.socket_path} was given up: "
                      "a write under its allocation may still land (a broken io_uring could "
                      "not wait for it); the server gives that space back once this "
                      "process ends")
        if s is self._session:
            self._start_reconnect()

    def _session_for(self, on: list | None) -> "Session":
        """The session a put's piece goes to: ``on[0]`` (the earlier
        pieces'), or, None there, the current one (then kept in ``on``)."""
        if on is not None and on[0] is not None:
            return on[0]
        s = self._current()
        if on is not None:
            on[0] = s
        return s

    def _put_one(self, keys: list[bytes], blocks, clears: str, on: list | None = None,
                 what: str | None = None) -> int:
        """One piece of a put.  ``on[0]``: the session to put it on (the
        earlier pieces'), or None: the current one, then set there.
        ``what``: the piece in words, for an error (default: a run of its
        blocks)."""
        n = len(keys)
        s = self._session_for(on)   # the allocation, its commit or abort: one session
        with self._put_under_way():       # close() waits for it (see there)
            # counted before the request goes out (see _put_group)
            s.hold(1)
            sent, a, got = False, None, []
            what = what or f"this put's run of {n} blocks"
            try:
                # the server pins the region for us; its answer goes into
                # ``got`` as it is read (a Ctrl-C as the call returns kept it
                # from ``a``, and nothing aborted it: see _put_group)
                a = self._put_call_on(s, "allocate", {"nblocks": n}, what, allocated=False,
                                      record=got)
                self._check_allocated(a, n)
                sums = self._write_allocated(s, a, keys, blocks, what=what)
                sent = True          # from here the server releases the pin (once it goes out)
                stored = self._put_call_on(s, "commit", {
                    "wid": a["wid"], "keys": encode_keys(keys),
                    "checksums": [int(c) for c in sums], "clears": clears}, what)
            except BaseException as e:
                if not sent or self._cut_before_sent(s, e):
                    self._abort(s, [_wid(x) for x in got])
                raise
            finally:
                s.hold(-1)
        if not _is_int(stored) or stored not in (0, n):
            # as commit_runs' (see _put_group): any truthy answer (a part of
            # the run, True, "0") was counted as the whole run published
            raise ServerError(
                f"the store server at {self.socket_path} answered commit for a run of {n} "
                f"blocks with {str(stored)[:200]}, not the blocks published ({n}, or 0 when "
                "a clear() overtook it); a server of another kvblock release?")
        return self._count_committed(stored)

    @staticmethod
    def _cut_before_sent(s: "Session", e: BaseException) -> bool:
        """Was a request on ``s`` (a commit, an unpin) that raised ``e`` cut
        before it went out (a Ctrl-C as it waited for the connection's
        lock)?  One cut in the middle gives the connection up (``s.gone``:
        its allocations and pins go as it closes), an answered error is a
        KVBlockError.  Else the server holds them on a live connection
        until they are aborted or unpinned (an abort after a commit that
        did go out finds its wid gone: a no-op)."""
        return s.gone is None and not isinstance(e, KVBlockError)

    def _put_call_on(self, s: "Session", op: str, args: dict, what: str,
                     allocated: bool = True, record: list | None = None):
        """A put's ``op`` (allocate, commit, commit_runs) on ``s``, the
        session its space is allocated on.  Where another call gave ``s``
        up (a call past timeout=) before it went out,
        ConnectionAbandonedError saying ``what`` was not stored (and, for
        an allocate, whether the put had space allocated on ``s`` before:
        ``allocated``), not that other call's error.  ``record``: see
        _call_locked."""
        try:
            return self._call_on(s, op, record=record, **args)
        except ConnectionAbandonedError as e:
            if not getattr(e, "not_sent", False):     # this request's own timeout
                raise
            raise self._abandoned_put_error(
                s, what, "allocate" if op == "allocate" else "commit",
                allocated=allocated or op != "allocate") from None

    def _count_committed(self, n: int) -> int:
        """A piece's commit answered: ``n`` blocks published, 0 when a
        clear() on the server overtook it; the counters; ``n``."""
        if not n:
            self.counters.add("cleared_puts")
            return 0
        self.counters.add_each(put_runs=1, put_blocks=n,
                               bytes_written=self.layout(n).run_bytes)
        return n

    def pin(self, keys: Sequence) -> list:
        """Protect the stored prefix of ``keys`` from eviction until
        :meth:`unpin` (see KVStore.pin); the server holds the pin, and drops
        it if this connection ends.  Release every handle with unpin() even
        after the connection was lost (ServerGoneError): the lost
        connection's socket stays open until its last handle is released
        (or collected)."""
        return self._segments(normalize_keys(keys))

    def unpin(self, pins) -> None:
        """Release a handle returned by :meth:`pin` (once, as KVStore.unpin:
        a second release is a ConfigError)."""
        if not isinstance(pins, PinnedSegments):
            raise ConfigError("unpin: pass the handle pin() returned")
        # Checked and marked under the lock (as KVStore.unpin): two threads
        # releasing one handle at once would both find it unreleased.
        with self._release_lock:
            if pins.released:
                raise ConfigError("unpin: this pin handle was released already")
            pins.released = True
        try:
            self._unpin(pins)
        except BaseException:
            # Marked released, the caller can no longer release it: one cut
            # before its request went out (the pin kept) goes again, as
            # KVStore.unpin's (releasing nothing twice).
            self._unpin(pins)
            raise

    def lookup(self, keys: Sequence) -> int:
        """Number of leading ``keys`` stored."""
        self._check_open()
        keys = normalize_keys(keys)
        n = self._count_answer("lookup", self._call("lookup", keys=encode_keys(keys)),
                               len(keys))
        self.counters.add_each(lookups=1, lookup_hit_blocks=n)
        return n

    def contains(self, key) -> bool:
        return self.lookup([key]) == 1

    def touch(self, keys: Sequence) -> int:
        """Mark the runs holding ``keys`` as just used on the server, for LRU
        eviction (KVStore.touch); returns how many of ``keys`` are stored."""
        self._check_open()
        keys = normalize_keys(keys)
        if not keys:
            return 0
        return self._count_answer("touch", self._call("touch", keys=encode_keys(keys)),
                                  len(keys))

    def present(self, keys: Sequence) -> np.ndarray:
        """Per key: is it stored on the device (what ranks read; a DRAM
        tier of the server's store is not looked at)?  One request."""
        self._check_open()
        keys = normalize_keys(keys)
        if not keys:
            return np.zeros(0, dtype=bool)
        flags = self._call("present", keys=encode_keys(keys))
        if not isinstance(flags, list) or len(flags) != len(keys) or \
                not all(type(f) is bool for f in flags):
            # taken as it came, put_runs planned from other keys' flags (a
            # run counted stored as a duplicate and never written)
            raise ServerError(
                f"the store server at {self.socket_path} answered present for {len(keys)} "
                f"keys with {str(flags)[:200]}, not one flag (true or false) per key; a "
                "server of another kvblock release?")
        return np.array(flags, dtype=bool)

    def removed_since(self, cursor: str | None = None) -> tuple[str, list[bytes] | None]:
        """Keys the server's store removed since ``cursor`` (KVStore.removed_since;
        a cursor from before a server restart answers None)."""
        self._check_open()
        r = self._call("removed", cursor=cursor)
        try:
            now, keys = r["cursor"], r["keys"]
            if isinstance(now, str) and (keys is None or isinstance(keys, str)):
                return now, None if keys is None else decode_keys(keys)
        except (KeyError, TypeError, ConfigError):
            pass
        # a bare KeyError or TypeError (a removal watch catches KVBlockError),
        # or a ConfigError blaming the caller's keys
        raise ServerError(
            f"the store server at {self.socket_path} answered removed with {str(r)[:200]}, "
            "not a cursor (text) and the keys removed (base64 of 16-byte keys, or null); "
            "a server of another kvblock release?")

    def delete(self, keys: Sequence) -> int:
        """Remove the runs holding any of ``keys``; returns the blocks removed."""
        self._check_open(writing=True)
        return self._count_answer("delete", self._call(
            "delete", keys=encode_keys(normalize_keys(keys))))

    def delete_prefix(self, prefix: bytes, keep: Sequence = ()) -> int:
        """Remove the runs holding a key that begins with ``prefix``, except
        those holding any of ``keep`` (see KVStore.delete_prefix), every
        rank's; returns the blocks removed."""
        self._check_open(writing=True)
        return self._count_answer("delete_prefix", self._call(
            "delete_prefix", prefix=check_key_prefix(prefix).hex(),
            keep=encode_keys(normalize_keys(keep))))

    def evict(self, nbytes: int | None = None, *, all: bool = False) -> int:
        """Reclaim unpinned regions on the server (see KVStore.evict)."""
        self._check_open(writing=True)
        check_evict(nbytes, all)      # bool("no") is True: the whole shared store would go
        return self._count_answer("evict", self._call(
            "evict", nbytes=None if nbytes is None else int(nbytes), all=bool(all)))

    def evict_older_than(self, cutoff: float) -> int:
        """Reclaim unpinned regions sealed before ``cutoff`` on the server
        (see KVStore.evict_older_than)."""
        self._check_open(writing=True)
        return self._count_answer("evict", self._call("evict",
                                                       older_than=time_cutoff(cutoff)))

    def clear(self) -> int:
        """KVStore.clear() on the server: every rank's blocks are forgotten,
        those other ranks are reading included (a rank has no DRAM tier)."""
        self._check_open(writing=True)
        return self._count_answer("clear", self._call("clear"))

    def clear_ticket(self) -> str:
        """The server's KVStore.clear_ticket(): it changes with every rank's
        clear() (and with a server restart, where a clear may have come)."""
        self._check_open()
        ticket = self._call("clear_ticket")
        if not isinstance(ticket, str) or not ticket:
            # made text by str() ("None"), a ticket no clear had: every put
            # given it would be refused as overtaken by a clear, silently
            raise ServerError(
                f"the store server at {self.socket_path} answered clear_ticket with "
                f"{str(ticket)[:200]!r}, not a ticket (text); a server of another kvblock "
                "release?")
        return ticket

    def checkpoint(self) -> None:
        self._check_open(writing=True)
        self._call("checkpoint")

    @in_flight      # it names this process's engine: close() must not free it meanwhile
    def stats(self) -> dict:
        """The server's stats (the whole store, every client), plus this
        process's own counters under ``"client"``."""
        self._check_open()
        s = self._call("stats")
        if not isinstance(s, dict):      # (s["client"] = ... failed as a bare TypeError)
            raise ServerError(
                f"the store server at {self.socket_path} answered stats with {str(s)[:200]}, "
                "not its numbers by name; a server of another kvblock release?")
        s["client"] = self.counters.snapshot()
        s["client"]["engine"] = self.io.engine.name
        if getattr(self, "_gpu_path", None):     # this rank's choice (the server reads none)
            s["client"].update(gpu_path=self._gpu_path, gpu_path_reason=self._gpu_path_reason)
        return s

    # ------------------------------------------------------- internals kvblock.tensors uses
    def _segments(self, keys: list[bytes]) -> PinnedSegments:
        """The stored prefix of ``keys`` as (run, position, count, first key
        index) tuples; the server pins the runs until :meth:`_unpin`."""
        self._check_open()
        s = self._current()
        keys = normalize_keys(keys)
        # Counted before the request goes out: a connection another thread
        # abandons (a call past timeout=) between the answer and the count
        # was closed at once, holding none by it, and the server released
        # the pin this read then read under (a miss, the server alive).
        s.hold(1)
        counted = True
        try:
            r = self._call_on(s, "segments", keys=encode_keys(keys))
            # From the answer on, one try: a Ctrl-C landing between its
            # steps (before the pin was looked at, or once the segments were
            # made) left the server holding the pin on a live connection,
            # for the connection's life.
            try:
                segs = self._checked_segments(r, len(keys), s)
                segs.pin, segs.session, counted = r["pin"], s, r["pin"] is None
                return segs       # (the count is the pin's now)
            except BaseException:
                pin = r.get("pin") if isinstance(r, dict) else None
                if _is_int(pin):          # the pins the answer took: given back
                    segs = PinnedSegments()
                    segs.pin, segs.session = pin, s
                    counted = False       # _unpin counts it out
                    self._unpin(segs)
                raise
        finally:
            if counted:
                s.hold(-1)

    def _checked_segments(self, r, nkeys: int, s: "Session") -> PinnedSegments:
        """segments' answer ``r`` for ``nkeys`` keys as PinnedSegments (no
        pin set yet), each run a place of its size inside one region of the
        data area with its checksums, each stretch within its run and the
        stretches the leading blocks of the request, in order.  This rank
        reads (and verifies) where the answer says and fills the request
        from it: a wrong answer (a bug, another release, a stray process on
        the socket) would hand back metadata or another run's bytes as this
        run's (unverified reads), or fail or fill past the request; refused
        with ServerError."""
        regions, g = self.regions, self.geometry
        segs, at = PinnedSegments(), 0
        try:
            pin, answered = r["pin"], r["segs"]
            ok = (pin is None) == (not answered) and (pin is None or _is_int(pin)) and \
                isinstance(answered, list)
            for seg in answered if ok else ():
                run, pos, count, first = seg
                run_id, region, gen, offset, nblocks, sums = run
                ok = all(map(_is_int, (run_id, region, gen, offset, nblocks, pos, count,
                                       first))) and isinstance(sums, list) and \
                    len(sums) == g.run_checksums and all(map(_is_int, sums)) and \
                    1 <= nblocks <= self.max_run_blocks and 0 <= region < regions.count and \
                    0 <= offset and offset % self.alignment == 0 and \
                    offset + self.layout(nblocks).run_bytes <= regions.size and \
                    0 <= pos and 1 <= count and pos + count <= nblocks and \
                    first == at and at + count <= nkeys
                if not ok:
                    break
                at += count
                segs.append((RemoteRun(*run, session=s), pos, count, first))
        except (KeyError, TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise ServerError(
                f"the store server at {self.socket_path} answered segments for {nkeys} keys "
                f"with {str(r)[:300]}: not runs inside its {regions.count} regions of "
                f"{regions.size} bytes holding the leading blocks asked for; nothing was read "
                "(a server of another kvblock release?)")
        return segs

    def _pins_hold(self, segs) -> bool:
        """Do the pins of a ``_segments`` answer still hold?  Not once the
        server's end of their connection has closed: it shuts a connection
        down before it releases its pins (a lease drop), and a killed
        server's pins die with it.  So what was read before a True here was
        read under the pins."""
        return getattr(segs, "pin", None) is None or not segs.session.hung_up()

    def _run_pin_held(self, run) -> bool:
        """Does the pin on ``run`` still hold (see ``_pins_hold``)?  A read
        that fails its checksums after it lapsed read space the server may
        have given to other runs: a miss, not corruption to count and drop."""
        return run.session is None or not run.session.hung_up()

    def _unpin(self, segs) -> bool:
        """Release the pins of a ``_segments`` answer.  Never raises for a
        gone server (its pins went with it): callers unpin in cleanup paths.
        False when the pins lapsed that way: a restarted server may have
        given their space to other runs while this process read it."""
        with self._release_lock:   # taken once: two releases would count it down twice
            pin = getattr(segs, "pin", None)
            if pin is None:
                return True
            segs.pin = None
        s = segs.session   # pin ids are the session's: never another session's
        kept = False
        try:
            self._call_on(s, "unpin", pin=pin)
        except StoreClosedError:
            if s.gone is None:      # not a connection given up (the server's own error)
                raise
            return not s.peer_closed()   # (StoreClosedError where this rank was closed)
        except BaseException as e:
            # Cut before the request went out: the server holds the pin on
            # a live connection, kept for the caller's second try, else
            # nothing would release it while the connection lives.
            if self._cut_before_sent(s, e):
                with self._release_lock:
                    segs.pin, kept = pin, True
            raise
        finally:
            if not kept:
                s.hold(-1)
        return True

    def _drop_runs(self, runs, why: str = "checksum") -> None:
        """Runs that failed their checksum (or a device read: ``why`` is
        "read_error") here: the server drops them and counts why.  Only a
        read in flight gets here: a close() under way (``closed`` set, the
        connection still open while it waits for a put) lets it finish, as
        it lets the read unpin; refused, the load that met the run failed
        with StoreClosedError and the run stayed.  Once close() has closed
        the connection, _call raises StoreClosedError."""
        ids = [int(r.run_id) for r in runs]
        if ids:
            self._call("drop_runs", run_ids=ids, why=why)

    # ------------------------------------------------------------------ lifetime
    def close(self, wait: float | None = None) -> None:
        """Disconnect (the server releases this connection's pins) and close
        this process's devices.  The store itself stays with the server.
        ``wait``: how long puts and calls in flight in other threads may go
        on before the connection is ended under them (default CLOSE_WAIT_S)."""
        # A forked child's copy: its sessions are closed; its locks may be
        # stale.  By the pid too: a copy the parent was closing at the fork
        # had left _LIVE, so the fork did not mark it, and its devices and
        # fence files were still open (the parent's release, cut off by
        # the fork, is the child's to finish: _release_devices).
        if self._forked or os.getpid() != getattr(self, "_pid", os.getpid()):
            finalizer = getattr(self, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            self.closed = True
            KVStore._release_devices(self)
            if self._fence is not None:
                self._fence.forget()
            return
        if self.closed and self.io is None:
            if getattr(self, "_releasing", None) is not None:
                KVStore._release_devices(self)     # another close() releasing: its end
            return
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        with self._reconnect_lock:
            self.closed = True
            self._stop.set()
            s = self._session
            # A hello the reconnect thread waits on (a hung server, no
            # timeout=): ended, as the store's own connection is below; it
            # waited for good, holding the store and a connection open.
            # (Under the lock: the thread lets go of it under it, before
            # it closes the socket.)
            if self._connecting is not None:
                try:
                    self._connecting.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._inflight.shut()           # later calls raise StoreClosedError
        # A put in flight in another thread (writing, or its commit not yet
        # answered): its connection (the server's pin on its space) and this
        # process's devices stay until it is done.
        deadline = time.monotonic() + (CLOSE_WAIT_S if wait is None else wait)
        while ((self._fence is not None and self._fence.writers) or self._publishing) and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        self._writes_cut = True         # no write from here: the connection ends below
        if not s.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            # A call waits for a server that does not answer (no timeout=; the
            # heartbeat's ping too, with no call of the caller's in flight):
            # end the connection under it, which wakes it (ServerGoneError).
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.lock.acquire()
        try:
            if s.gone is None:
                s.gone = "remote store is closed"
            s.close()                   # reads in flight: they turn into misses
        finally:
            s.lock.release()
        _LIVE.discard(self)
        # ... once their I/O is done: until then the devices and buffers stay
        if self._inflight.drained(CLOSE_WAIT_S, repr(self),
                                  "the last of them, released when it is done"):
            self._release_sessions_and_devices()
        else:
            # Not left to the garbage collector: the finalizer is detached
            # and a Device's descriptor is never closed by it; the rank
            # kept its devices, engine and buffers (and the server the
            # pins of its abandoned connections) for as long as it lived.
            self._inflight.after_drained(self._release_sessions_and_devices)
        if self._fence is not None:
            self._fence.close()

    def _release_sessions_and_devices(self) -> None:
        """close()'s end, once no call is in flight (no I/O under any
        connection's pins now): the connections abandoned earlier (a call
        past timeout=, then a reconnect), kept open while pins were held on
        them, end as the last one did (their pins a caller still holds are
        released with them; else they stayed on the server for good with
        leases off); then this process's devices and buffers go.  The
        heartbeat stops here, not before: until now it kept the pins of
        those connections from lapsing under the calls close() waited for."""
        self._beat_stop.set()
        for old in list(self._sessions):
            old.close()
        KVStore._release_devices(self)

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else (
            "server gone" if self._session.gone else "connected")
        return f"RemoteStore({self.socket_path!r}, {state})"


def _is_int(value) -> bool:
    """A JSON integer (not a bool, which int takes)."""
    return type(value) is int


class _OfferRecord:
    """_call_locked's ``record`` for an admit: its ok answer's offer (an id
    the server counted) goes into ``offers`` as (id, admitted), as _admit's
    callers keep them."""

    __slots__ = ("offers",)

    def __init__(self, offers: list):
        self.offers = offers

    def append(self, answer) -> None:
        offer = answer.get("offer") if isinstance(answer, dict) else None
        if _is_int(offer):
            self.offers.append((offer, answer.get("verdict") != "rejected"))


def _wid(a) -> int | None:
    """The allocation id of allocate's answer ``a``, None when it has none."""
    wid = a.get("wid") if isinstance(a, dict) else None
    return wid if _is_int(wid) else None


# A forked child must not use its parent's connection: replies would go to
# whichever process reads first, and the server would keep a dead parent's
# pins while the child lives.  The child's copy is closed and marked gone.
_LIVE: "weakref.WeakSet[RemoteStore]" = weakref.WeakSet()


def same_medium(fd_a: int, fd_b: int) -> bool:
    """Do two descriptors reach one medium (the same block device through
    any node, the same file through any path, or a loop device and the
    file it is over)?"""
    return medium_key(os.fstat(fd_a)) == medium_key(os.fstat(fd_b))


def _check_served_devices(store: "RemoteStore", devices) -> None:
    """connect() was given the devices: the store served at the socket must
    be on them (another store's server there would otherwise be used)."""
    def key(path):
        try:
            return medium_key(os.stat(os.fspath(path)))
        except OSError:                  # missing: not what is served
            return ("missing", os.fspath(path))
    served = {medium_key(os.fstat(d.fd)) for d in store.io.devices}
    if {key(p) for p in devices} != served or len(devices) != len(served):
        raise errors.GeometryMismatchError(
            f"the store server at {store.socket_path} serves store {store.uuid} on "
            f"{', '.join(d.path for d in store.io.devices)}, not on "
            f"{', '.join(map(os.fspath, devices))}: give each store its own socket "
            "(e.g. a {dp_rank} in it too)", os.fspath(devices[0]), 0)


def _after_fork_in_child() -> None:
    for store in list(_LIVE):
        store._forked = True
        store._release_lock = threading.Lock()   # another thread may have held it at the fork
        for s in list(store._sessions):
            s.gone = (f"this process was forked from the one that connected to "
                      f"{store.socket_path}: connect again here")
            s.forget()      # no locks here: another thread may have held them at the fork
        if store._fence is not None:
            store._fence.forget()
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_dropped(io, fence, sessions) -> None:
    """A RemoteStore collected without close(): no thread of it runs any more."""
    for s in list(sessions):
        s.close()
    try:
        io.close()
    finally:
        fence.close()


def connect(socket_path, devices: Sequence | None = None, *, start: bool = True,
            start_timeout: float = 600.0, server_options: dict | None = None,
            prepare=None, **client_options) -> RemoteStore:
    """A :class:`RemoteStore` on ``socket_path``, starting a server on
    ``devices`` first when none answers there (and ``start`` and ``devices``
    are given).  ``prepare()``, when given, runs just before the server is
    started, under the same lock (e.g. format the devices when they hold no
    store yet: the server only opens); when it returns a callable, that
    is called, still under the lock, if no server comes up (e.g. remove a
    store file it made).

    Race handling: every rank may call this at once.  Whoever finds no server
    takes an exclusive lock (``lockf``) on ``<socket_path>.lock``, tries to connect
    again (another rank may have started the server while it waited for the
    lock), waits for a server starting there without it (one recovering
    the store: an operator's, or one whose starter died) and only then
    starts a server process (``kvblock serve``, in its own
    session, so it outlives the rank that started it; its output goes to
    ``<socket_path>.log``) and waits until it accepts connections.  The lock
    is released when the starter returns or dies, so exactly one server is
    started by ranks sharing the lock file; beyond that, the server's
    exclusive claim on the devices refuses a second server on the same store.
    ``start_timeout`` bounds the wait for the new server, which first
    recovers the store (about 0.7 s per million blocks indexed): a server
    that exits meanwhile fails the call at once with its log's tail.
    Without ``devices`` (or with ``start=False``) a server starting there
    is waited for as long, none is started.

    With ``reconnect=True`` (a client option) and ``start``, a store whose
    server is lost later starts a new one the same way (without
    ``prepare``: the devices hold the store by then).
    """
    refuse_one_path(devices)         # one path, not its characters: refused by name
    socket_path = socket_path_str(socket_path)
    can_start = bool(start and devices)
    if devices and client_options.get("devices") is None:
        # I/O on the caller's names of the devices: the server's paths may
        # not reach them here (another mount, a relative path of its own).
        client_options["devices"] = list(devices)
    try:
        store = RemoteStore(socket_path, **client_options)
    except ServerGoneError:
        if can_start:
            ensure_server(socket_path, devices, start_timeout=start_timeout,
                          server_options=server_options, prepare=prepare)
        # A rank that may not start one still waits (up to start_timeout)
        # for a server starting there: it failed at once, told to start one.
        elif not wait_for_starting_server(socket_path, start_timeout):
            raise
        store = RemoteStore(socket_path, **client_options)
    if devices:
        try:
            _check_served_devices(store, list(devices))
        except BaseException:
            store.close()
            raise
    if can_start:
        store._restart = functools.partial(ensure_server, socket_path, list(devices),
                                           start_timeout=start_timeout,
                                           server_options=server_options,
                                           may_start=_start_guard(weakref.ref(store)),
                                           stop=store._stop)   # close() ends its waits
    return store


def _start_guard(ref):
    """ensure_server's ``may_start`` for the reconnect of ``ref()``: the
    server process is started under the lock close() sets ``closed`` by, so
    a close() that came first refuses it (StoreClosedError) and one that
    comes later waits for the start (a moment) and finds it made.  Checked
    before that, a close() landing between the check and the start (ensure_server
    waits for the start lock and for a server starting without it) left a
    server nobody asked for.  (A weak reference: the store's own partial
    must not keep it from being collected.)"""
    @contextlib.contextmanager
    def may_start():
        store = ref()
        if store is None:
            raise StoreClosedError("remote store was collected while it reconnected: "
                                   "no server started")
        with store._reconnect_lock:
            if store.closed or store._forked:
                raise StoreClosedError("remote store was closed while it reconnected: "
                                       "no server started")
            yield
    return may_start


__all__ = ["RemoteStore", "ServerError", "ServerGoneError", "connect", "ensure_server",
           "wait_for_server"]
