"""The store server: one process owns a store's metadata for many.

``kvblock serve DEV... --socket PATH`` (or :func:`serve_in_background` /
:func:`spawn_server` from Python) opens the store exclusively, recovers it and
answers :class:`~kvblock.store.client.RemoteStore` clients on a Unix socket
(protocol: see kvblock/store/protocol.py).  It holds the index, allocates
space, journals every change (group commit across all clients), checkpoints
and evicts; the clients move the data themselves.

Pins are per connection: a reader pin (``segments``) or writer pin
(``allocate``) lives until the client releases it (``unpin``, ``commit``,
``abort``) or its connection ends, whichever comes first, so a crashed rank
never keeps a region from being reclaimed.  They are also leased: a
connection that holds pins and sends nothing for ``pin_lease`` seconds (a
client pings while it holds pins; a stopped process does not) is dropped.
Its reads in flight turn into misses on its side; before its allocations
are given back the server waits for its writes in flight (the write fence,
kvblock/store/fence.py), and its later writes are refused.

Crash safety is the store's own: a put is published only by its PUT record,
which the server writes (after flushing the data devices) when the client,
having written and flushed the run's bytes itself, asks it to commit.  A
server killed at any moment leaves a store that ``KVStore.open`` recovers
exactly like one whose in-process owner was killed.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import itertools
import logging
import math
import numbers
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import Sequence

import numpy as np

from kvblock.errors import (
    ConfigError,
    DeviceBusyError,
    DevicePermissionError,
    KVBlockError,
    ProtocolMismatchError,
    ServerBusyError,
    ServerError,
    SocketInUseError,
    StoreClosedError,
)
from kvblock.format import journal as jfmt
from kvblock.index import Run
from kvblock.store import launch
from kvblock.store.launch import (
    announce_stopping,
    server_stopping,
    socket_dir,
    socket_path_str,
    wait_for_server,
    wait_for_stopping_server,
)
from kvblock.store.fence import (FENCE_WAIT_S, fence_writers, file_id, reopen,
                                 socket_fence_path)
from kvblock.store.protocol import (
    PROTOCOL,
    decode_keys,
    encode_keys,
    encode_msg,
    error_reply,
    recv_msg,
)
from kvblock.store.store import KVStore

logger = logging.getLogger("kvblock")


# A connection holding pins is dropped after this many seconds without a
# request (clients ping every quarter of it while they hold pins).
PIN_LEASE_S = 60.0
# Giving back a dropped connection's allocations: every tick a probe that
# stops nobody; when it fails, a try that waits this long for the write in
# flight (new writes wait meanwhile), repeated after 2, 4, ... up to
# DROPPED_FENCE_BACKOFF_S seconds, so a rank stopped mid-write stalls the
# others' writes for a small share of the time.
DROPPED_FENCE_WAIT_S = 1.0
DROPPED_FENCE_BACKOFF_S = 64.0
# A connection must say hello within this many seconds of its accept, else
# it is closed (a peer that says nothing must not keep a thread and a
# descriptor for good).
HELLO_TIMEOUT_S = 10.0
# Connections served at once; one more is refused (ServerBusyError).  Below
# the usual open-files limit (1024): a server out of descriptors cannot even
# refuse, and its new clients wait unanswered.
MAX_CLIENTS = 512
# The accept loop wakes this often to check idle_exit; stop() wakes it at once.
ACCEPT_POLL = 0.2
# spawn_server moves a longer log aside first (one older log is kept)
LOG_KEEP_BYTES = 64 << 20
# Offers admitted on one connection whose puts are not done (a client's puts
# in flight: a put_runs' runs, one call per thread).  One more is refused
# (not tracked, an offer untracked could not be given back): a bound on
# what a client that never settles its offers holds on the server.
OPEN_OFFERS_KEPT = 1 << 16
# what a client says of the runs it drops (drop_runs) -> the counter it adds to
DROP_REASONS = {"checksum": "checksum_failures", "read_error": "read_errors"}


class _Session:
    """One client connection and the pins it holds."""

    def __init__(self, conn: socket.socket, sid: int):
        self.conn, self.sid = conn, sid
        self.pid: int | None = None
        self.readers: dict[int, list] = {}            # pin id -> segments
        self.writers: dict[int, tuple] = {}           # wid -> (region, run_id, offset, gen, n)
        # offers admit counted on this connection that may still be undone:
        # offer id (admit's answer) -> (the run's keys, admitted), oldest
        # first.  An admitted one until its put is done (its last piece
        # committed) or gives the offer back; a declined one of a put_runs (admit told
        # count=False) until its call's plan stands (count_rejected) or the
        # call gives it back.  Given back when the connection ends first
        # (_release; see _settle_offers).  By id, not by first key: two
        # threads' puts on one connection may offer runs of one first key.
        self.offers: dict[int, tuple[list[bytes], bool]] = {}
        self.thread: threading.Thread | None = None
        self.last_seen = time.monotonic()             # the last request's arrival or answer
        self.accepted = self.last_seen
        self.greeted = False                          # its hello was answered yes (fence files sent)
        self.busy = False                             # a request is being answered
        self.taking: float | None = None              # since when a request is being read
        self.sending: float | None = None             # since when an answer is being sent
        self.dropped: str | None = None               # why the server ended the connection
        self.closing = False                          # ended: its pins are being given back


def _seconds(name: str, value, none: str) -> float | None:
    """A server time setting: seconds > 0, or None for 0, None or inf
    (``none``); anything else (text, a bool, nan) is a ConfigError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or math.isnan(value)):
        raise ConfigError(f"{name} must be seconds (0, None or inf: {none}), got {value!r}")
    if value is None or value <= 0 or math.isinf(value):
        return None
    return value


def _absolute(path) -> str:
    """``path`` for hello: an absolute one as given; a relative one with the
    working directory in front, nothing folded (the kernel resolves it as
    it did for the server).  A working directory since removed names none:
    the path then goes as given, as it did before hello made paths absolute."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return path
    try:
        return os.path.join(os.getcwd(), path)
    except OSError:
        return path


class StoreServer:
    """Serves ``store`` on the Unix socket ``socket_path``.

    ``start()`` binds and accepts in a background thread; ``stop()`` drops
    every client (releasing their pins), then closes the store (checkpoint)
    unless ``close_store=False``.  ``idle_exit``: stop by itself after that
    many seconds without a client (None or 0: never).
    """

    def __init__(self, store: KVStore, socket_path, *, close_store: bool = True,
                 idle_exit: float | None = None, pin_lease: float | None = PIN_LEASE_S,
                 hello_timeout: float | None = HELLO_TIMEOUT_S,
                 max_clients: int | None = MAX_CLIENTS):
        self.store = store
        # Its ranks read a tmpfs store file through mappings (whatever this
        # process's KVBLOCK_MAPPED_READS): the store must not punch holes there.
        store.io.served = True
        self.socket_path = socket_path_str(socket_path)
        # The devices' paths as hello names them: absolute, taken now (a
        # rank given no devices opens these; one working in another
        # directory would not find a path relative to the server's).  The
        # working directory goes in front and nothing is folded: abspath
        # folds '..' by the text, which after a symlinked directory names
        # another file than the one opened ('lnk/../kv0.img').  Absolute
        # paths (/dev/disk/by-id/... links too) go as they were given, and
        # ask for no working directory (one since removed has none).
        self._device_paths = [_absolute(d.path) for d in store.io.devices]
        # The files the store's descriptors are, taken now, while the
        # caller's store is open: the fence and hello reopen those by
        # number, and a close() in another thread (close_store=False) frees
        # the number for any open to take (see fence.reopen).
        self._device_files = [file_id(d.fd) for d in store.io.devices]
        self.close_store = close_store
        # 0 is never, as for the lease and the hello wait (not: stop at the first poll)
        self.idle_exit = _seconds("idle_exit", idle_exit, "never")
        self.pin_lease = _seconds("pin_lease", pin_lease, "no lease")
        self.hello_timeout = _seconds("hello_timeout", hello_timeout, "no limit")
        if max_clients is not None and (type(max_clients) is not int or max_clients < 0):
            raise ConfigError(f"max_clients must be a connection count >= 1 (0 or None: no "
                              f"limit), got {max_clients!r}")
        self.max_clients = max_clients or None
        self.expired_sessions = 0
        self.refused_connections = 0
        self.stopped = threading.Event()
        self.failed: BaseException | None = None
        self._sessions: dict[int, _Session] = {}
        self._sessions_lock = threading.Lock()
        self._last_session_end = 0.0       # monotonic time the last session ended
        self._ids = itertools.count(1)
        # admit's clear ticket names this server run: the store's clear count
        # starts at 0 on every open, so a put admitted by an earlier run (a
        # clear may have come after it there) never matches a count here
        self._run_tag = os.urandom(8).hex()
        # when this run's counters started from zero: the store's at its open, the
        # server's own here (exported as each counter's Prometheus _created)
        self._started = min(time.time(), getattr(store.counters, "created", float("inf")))
        self._listener: socket.socket | None = None
        self._socket_ino: int | None = None
        self._stopping = False
        self._stop_lock = threading.Lock()
        self._unlink_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.connections_total = 0
        self._fence_fd: int | None = None     # <socket>.fence, held open while serving
        self._fence_file: tuple[int, int] | None = None   # its (st_dev, st_ino)
        self._dropped_writers: list = []      # regions of dropped connections' allocations
        self._dropped_lock = threading.Lock()
        self._dropped_retry = (0.0, 1.0)      # (next try, backoff), monotonic seconds
        # set by stop() (the store kept open) once it gave back the queue: the
        # lease thread takes no more, a later release fences and gives back itself
        self._dropped_late = False
        self._halt = threading.Event()        # stop() began
        self._lease_thread: threading.Thread | None = None
        self._tick_failures: set = set()      # (step, type, where) of lease ticks that failed
        self._accept_trouble_logged = -1e9    # monotonic time of the last such warning
        self._pid = os.getpid()               # a forked child's stop() lets go of its copy

    # ------------------------------------------------------------------ lifetime
    def start(self, stop: threading.Event | None = None) -> "StoreServer":
        """Bind and accept.  ``stop`` (:func:`stop_signals`' event): once set,
        the wait for ranks' writes in flight before it listens ends
        (DeviceBusyError) instead of lasting up to FENCE_WAIT_S."""
        # Ranks of a server that died may still write under its allocations:
        # wait for them (the store's open did so on its device 0; the socket's
        # fence meets ranks that reach the device by another inode).
        fence = socket_fence_path(self.socket_path)
        try:
            self._fence_fd, made = launch.open_fence(self.socket_path)
        except PermissionError as e:
            if not os.path.lexists(fence):
                # no file there: the directory is what this user may not write
                raise DevicePermissionError(
                    f"cannot create {fence}, the write fence beside the socket "
                    f"{self.socket_path}: {(e.strerror or 'permission denied').lower()} in "
                    "its directory; choose another --socket path (in a directory this user "
                    "may write), or run kvblock serve as a user who may write there",
                    fence, e.errno) from None
            raise DevicePermissionError(
                f"cannot open {fence}, the write fence beside the socket {self.socket_path}: "
                "permission denied (left by a server run as another user?); run kvblock serve "
                "as that user, remove the file if no server of that user runs, or choose "
                "another --socket path", fence, errno.EACCES) from None
        except OSError as e:
            # (a read-only filesystem, a folder that takes no files: the
            # --socket path is wrong, as when the socket cannot be bound;
            # not the store's read-only device, nor a device not found).
            # Said as it is: a fence there already (an earlier server's) is
            # one that cannot be opened, not created; a folder in its place
            # is what to remove.
            what = (e.strerror or str(e)).lower()
            if isinstance(e, IsADirectoryError):
                raise ConfigError(
                    f"cannot open {fence}, the write fence beside the socket "
                    f"{self.socket_path}: it is a directory, not the fence file kvblock serve "
                    "keeps there; remove it, or choose another --socket path") from None
            if os.path.lexists(fence):
                raise ConfigError(
                    f"cannot open {fence} for writing, the write fence beside the socket "
                    f"{self.socket_path}: {what}; choose another --socket path (in a "
                    "writable directory)") from None
            raise ConfigError(
                f"cannot create {fence}, the write fence beside the socket "
                f"{self.socket_path}: {what}; choose another "
                "--socket path (in a writable directory)") from None
        try:
            self._fence_file = file_id(self._fence_fd)
            self._fence_writers(stop=stop)
            with launch.binding(self._fence_fd, self.socket_path):
                self._listener = _bind(self.socket_path)
                self._socket_ino = os.stat(self.socket_path).st_ino
        except BaseException:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            launch.close_fence(self._fence_fd, self.socket_path, remove=made)
            self._fence_fd = None
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="kvblock-serve",
                                        daemon=True)
        self._thread.start()
        self._lease_thread = threading.Thread(target=self._lease_loop,
                                              name="kvblock-serve-lease", daemon=True)
        self._lease_thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect every client, close the store, remove the socket.
        In a process forked from the one serving, only let go of the copy
        (see _let_go_of_copy)."""
        if os.getpid() != self._pid:
            self._let_go_of_copy()
            return
        with self._stop_lock:
            if self._stopping:
                self.stopped.wait(timeout)
                return
            self._stopping = True
        self._halt.set()
        if self.close_store and self._fence_fd is not None:
            announce_stopping(self._fence_fd)   # a new server waits for our devices
        if self._listener is not None:
            # A connection wakes accept() now instead of at its next timeout
            # (ACCEPT_POLL); the accept loop sees _stopping and closes it.  Only on
            # our own socket: a newer server may have taken the path.
            try:
                if os.stat(self.socket_path).st_ino == self._socket_ino:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                        wake.settimeout(1.0)
                        wake.connect(self.socket_path)
            except OSError:
                pass       # gone or refused: the poll ends the loop anyway
        try:
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout)
            # Listening no more before the drain and the checkpoint: a rank
            # connecting now finds no server and starts the next one at once.
            self._unlink_socket()
            if self._lease_thread is not None and \
                    self._lease_thread is not threading.current_thread():
                self._lease_thread.join(timeout)
            with self._sessions_lock:
                sessions = list(self._sessions.values())
            for s in sessions:  # their threads see the end of stream and release pins
                try:
                    s.conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            for s in sessions:
                if s.thread is not None and s.thread is not threading.current_thread():
                    s.thread.join(timeout)
            if self.close_store:
                self.store.close()
            else:
                self._give_back_dropped_writers(timeout)
        finally:
            self._unlink_socket()
            if self._fence_fd is not None:
                # after the store's close: lets a new server go (unlocked first:
                # a child forked meanwhile shares the file, and the mark)
                if self.close_store:
                    launch.stopped(self._fence_fd)
                launch.close_fence(self._fence_fd, self.socket_path)
                self._fence_fd = None
            self.stopped.set()

    def _let_go_of_copy(self) -> None:
        """stop() in a forked child: its listener, connections and fence
        file are the parent's open files, which the parent goes on serving
        with.  Shutting the connections down would end the parent's clients'
        (their calls fail), removing the socket would leave no way to reach
        the parent's server, a stopping mark would mark the parent's; so
        this process's descriptors are only closed (the open files stay the
        parent's), and its store copy closed (KVStore's forked close: no
        checkpoint).  No lock is taken: a thread of the parent may have held
        one at the fork, and none of those threads runs here."""
        try:
            if self._listener is not None:
                self._listener.close()
            for s in list(self._sessions.values()):
                try:
                    s.conn.close()
                except OSError:
                    pass
            if self.close_store:
                self.store.close()
        finally:
            self._socket_ino = None
            if self._fence_fd is not None:
                os.close(self._fence_fd)
                self._fence_fd = None
            self._stopping = True
            self._halt.set()
            self.stopped.set()

    def client_count(self) -> int:
        with self._sessions_lock:
            return len(self._sessions)

    def wait(self, timeout: float | None = None) -> bool:
        return self.stopped.wait(timeout)

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _unlink_socket(self):
        with self._unlink_lock:
            # Under launch.binding from before the close: a server starting
            # meanwhile (of another store) would find ours stale and bind
            # its own there, maybe of our inode number, which we then removed.
            binding = contextlib.nullcontext()
            if self._socket_ino is not None and self._fence_fd is not None:
                binding = launch.binding(self._fence_fd, self.socket_path)
            try:
                with binding:
                    if self._listener is not None:
                        self._listener.close()
                    # only our own socket: a newer server may have taken the path
                    if self._socket_ino is not None and \
                            os.stat(self.socket_path).st_ino == self._socket_ino:
                        os.unlink(self.socket_path)
            except SocketInUseError as e:      # (an OSError too) left: the next server replaces it
                logger.warning("kvblock serve: socket %s left in place: %s", self.socket_path, e)
            except OSError:
                pass
            finally:
                if self._listener is not None:
                    self._listener.close()
                self._socket_ino = None    # once: a newer server's socket may reuse the inode

    # ------------------------------------------------------------------ connections
    def _accept_loop(self):
        self._listener.settimeout(ACCEPT_POLL)
        idle_since = time.monotonic()
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                with self._sessions_lock:
                    busy = bool(self._sessions)
                    ended = self._last_session_end
                if busy:
                    idle_since = time.monotonic()
                    continue
                idle_since = max(idle_since, ended)   # a session that came and went
                if self.idle_exit is not None and \
                        time.monotonic() - idle_since >= self.idle_exit:
                    threading.Thread(target=self.stop, daemon=True).start()
                    return
                continue
            except OSError as e:
                if self._stopping:
                    return
                if e.errno not in ACCEPT_RETRY_ERRNOS:
                    # The listener is broken: the thread would end and leave
                    # a server that answers nobody.  Stop as a failed store
                    # does (`kvblock serve` exits 1; a client's reconnect
                    # starts another server).
                    logger.error("kvblock serve: accepting on %s failed: %s; stopping",
                                 self.socket_path, e)
                    self.failed = e
                    threading.Thread(target=self.stop, daemon=True).start()
                    return
                # Out of descriptors or memory for now: the accept thread
                # must outlive it (else the server answers nobody again).
                self._note_accept_trouble(e)
                time.sleep(ACCEPT_RETRY_S)
                continue
            conn.settimeout(None)
            if self.pin_lease:
                # An answer the client does not take (a stopped process with a
                # full socket buffer) must not keep its session, and pins, for
                # good: the lease loop passes busy sessions by, so a send that
                # makes no progress for a lease ends it (its pins released).
                # (at most what a timeval's seconds hold: a longer lease is as good)
                secs = min(max(self.pin_lease, 0.001), float(1 << 31))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                struct.pack("ll", int(secs), int(secs % 1 * 1e6)))
            idle_since = time.monotonic()
            session = _Session(conn, next(self._ids))
            with self._sessions_lock:
                if self._stopping:
                    # no socket first: this rank then finds no server (and
                    # starts the next one), not this stopping one again
                    self._unlink_socket()
                    conn.close()
                    return
                # a connection that has ended (its pins being given back, its
                # descriptor closed) no longer takes a place
                full = self.max_clients is not None and sum(
                    not o.closing for o in self._sessions.values()) >= self.max_clients
                if not full:
                    self._sessions[session.sid] = session
            if full:
                self._refuse(conn)
                continue
            session.thread = threading.Thread(target=self._serve, args=(session,),
                                              name=f"kvblock-serve-{session.sid}", daemon=True)
            try:
                session.thread.start()
            except RuntimeError as e:          # no thread to be had: turn this one away
                with self._sessions_lock:
                    self._sessions.pop(session.sid, None)
                conn.close()
                self._note_accept_trouble(e)
                time.sleep(ACCEPT_RETRY_S)

    def _refuse(self, conn: socket.socket) -> None:
        """Answer a connection past max_clients with ServerBusyError and
        close it (the client reads the answer as hello's, also when it
        sends its hello after the close)."""
        self.refused_connections += 1
        error = ServerBusyError(
            f"the store server at {self.socket_path} (pid {os.getpid()}) serves its limit of "
            f"{self.max_clients} connections (--max-clients) and refused this one: close "
            "clients that are done, or restart it with a higher --max-clients")
        if self.refused_connections == 1 or self.refused_connections % 100 == 0:
            logger.warning("kvblock serve: %s (%d refused so far)", error,
                           self.refused_connections)
        try:
            conn.setblocking(False)        # a few hundred bytes into an empty buffer
            conn.send(encode_msg(error_reply(error)))
        except OSError:
            pass
        finally:
            conn.close()

    def _note_accept_trouble(self, error) -> None:
        now = time.monotonic()
        if now - self._accept_trouble_logged >= 10.0:
            self._accept_trouble_logged = now
            logger.warning("kvblock serve: cannot take a connection on %s now (%s); retrying "
                           "(raise the open-files limit, ulimit -n, for many ranks)",
                           self.socket_path, error)

    def _note_expired(self, s) -> None:
        """Count and log a connection dropped for its lease (from the lease
        thread or the connection's own: the count is locked)."""
        with self._sessions_lock:
            self.expired_sessions += 1
        logger.warning("kvblock serve: dropping the connection of pid %s: %s", s.pid, s.dropped)

    def _lease_loop(self):
        """Drop the connections that hold pins and have gone quiet; give back
        dropped connections' allocations once their writes are done.

        It must live as long as the server (else leases stop lapsing, the
        allocations of dropped connections stay pinned for good, idle
        connections are never closed): a step of a tick that fails
        unexpectedly (a bug, a MemoryError) is logged, once per distinct
        error, and the loop goes on.  A KeyboardInterrupt or SystemExit
        raised in this thread (never a signal's: Python delivers those to
        the main thread) asks it to end: the server stops, as failed,
        rather than serve on with no lease thread."""
        lease, hello = self.pin_lease, self.hello_timeout
        tick = min([1.0, *(t / 4 for t in (lease, hello) if t)])
        steps = [("giving back dropped connections' allocations",
                  lambda: self._release_dropped_writers())]
        if hello is not None:
            steps.append(("closing connections that said no hello",
                          lambda: self._drop_silent(hello)))
        if lease is not None:
            steps.append(("dropping quiet connections", lambda: self._drop_quiet(lease)))
        while not self._halt.wait(tick):
            for what, step in steps:
                try:
                    step()
                except Exception as e:  # noqa: BLE001  (said; the next tick tries again)
                    self._note_tick_failure(what, e)
                except BaseException as e:
                    logger.error("kvblock serve: %s was interrupted (%s: %s); the lease "
                                 "thread ends, stopping the server", what,
                                 type(e).__name__, e, exc_info=True)
                    self.failed = e
                    threading.Thread(target=self.stop, daemon=True).start()
                    return

    def _note_tick_failure(self, what: str, e: BaseException) -> None:
        """A lease tick's step failed: logged with its traceback, once per
        distinct error (its type and where it was raised), not every tick."""
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else None
        key = (what, type(e), where)
        if key in self._tick_failures:
            logger.debug("kvblock serve: %s failed again: %s: %s", what, type(e).__name__, e)
            return
        if len(self._tick_failures) < 256:
            self._tick_failures.add(key)
        logger.error("kvblock serve: %s failed (%s: %s); the lease thread goes on (this "
                     "error is logged once)", what, type(e).__name__, e,
                     exc_info=(type(e), e, e.__traceback__))

    def _drop_quiet(self, lease: float) -> None:
        """Drop the connections that hold pins and sent nothing for a lease."""
        now = time.monotonic()
        with self._sessions_lock:
            quiet = [s for s in self._sessions.values() if self._quiet(s, now, lease)]
        for s in quiet:
            try:       # a request not read yet (a starved server): it is alive
                # (poll: select() refuses descriptors past 1023, many ranks)
                p = select.poll()
                p.register(s.conn, select.POLLIN)
                if p.poll(0):
                    continue
            except (OSError, ValueError):
                continue    # closed meanwhile: its thread releases the pins
            if not self._claim(s, self._quiet, lease, (
                    f"it held {len(s.readers)} read and {len(s.writers)} write "
                    f"pins and sent nothing for {now - s.last_seen:.0f} s "
                    f"(pin lease {lease:g} s)")):
                continue
            self._note_expired(s)
            try:
                s.conn.shutdown(socket.SHUT_RDWR)   # its thread releases the pins
            except OSError:
                pass

    def _drop_silent(self, hello: float) -> None:
        """Close the connections that have not said hello in time."""
        now = time.monotonic()
        with self._sessions_lock:
            late = [s for s in self._sessions.values() if self._late(s, now, hello)]
        for s in late:
            if not self._stuck(s, now, hello):
                try:       # a hello not read yet (a starved server): it did say it
                    p = select.poll()
                    p.register(s.conn, select.POLLIN)
                    if p.poll(0):
                        continue
                except (OSError, ValueError):
                    continue    # closed meanwhile
            # (one stuck sending an answer reads nothing more: a hello
            # waiting behind it is never answered)
            if not self._claim(s, self._late, hello,
                               f"it did not say hello within {hello:g} s of connecting"):
                continue
            logger.warning("kvblock serve: closing a connection to %s: %s", self.socket_path,
                           s.dropped)
            try:
                s.conn.shutdown(socket.SHUT_RDWR)   # its thread releases what it holds
            except OSError:
                pass

    @staticmethod
    def _idle(s: _Session, now: float, limit: float) -> bool:
        """Neither answering nor reading a request (one whose frame has
        been coming for ``limit`` seconds counts as none: a client stopped
        in the middle of sending).  Under _sessions_lock."""
        return not s.busy and s.dropped is None and \
            (s.taking is None or now - s.taking > limit)

    @classmethod
    def _quiet(cls, s: _Session, now: float, lease: float) -> bool:
        """Holding pins, it has sent nothing for a lease."""
        return bool(s.readers or s.writers) and now - s.last_seen > lease and \
            cls._idle(s, now, lease)

    @staticmethod
    def _stuck(s: _Session, now: float, limit: float) -> bool:
        """It has been sending one answer for ``limit`` seconds (its peer
        takes none)."""
        return s.dropped is None and s.sending is not None and now - s.sending > limit

    @classmethod
    def _late(cls, s: _Session, now: float, hello: float) -> bool:
        """It has not said hello in time (and is not being answered, or has
        been sending an answer for the whole wait: a peer that sends
        requests and takes no answer held a thread for good, as the send
        waits on for a connection holding no pins)."""
        return not s.greeted and now - s.accepted > hello and (
            cls._idle(s, now, hello) or cls._stuck(s, now, hello))

    def _claim(self, s: _Session, still, limit: float, why: str) -> bool:
        """Mark ``s`` dropped for ``why`` if ``still`` holds: its thread may
        have taken a request since the lease thread looked at the socket
        (gone from its buffer then), and a request taken is answered,
        never cut off in the middle."""
        with self._sessions_lock:
            if not still(s, time.monotonic(), limit):
                return False
            s.dropped = why
            return True

    def _serve(self, s: _Session):
        try:
            while True:
                # A request is read only once its first byte is here and
                # it is marked taken under the lock _claim drops by: a
                # connection being dropped takes no request, one whose
                # request is taken is not dropped.
                try:
                    if not s.conn.recv(1, socket.MSG_PEEK):
                        break
                except OSError:
                    break
                with self._sessions_lock:
                    if s.dropped is not None:
                        break
                    s.taking = time.monotonic()
                try:
                    req = recv_msg(s.conn)
                except KVBlockError as e:   # a whole frame, not a request: answered
                    req = e
                except Exception:  # noqa: BLE001  (a broken or hostile frame: drop the connection)
                    s.dropped = s.dropped or "it sent a frame that is not a request"
                    break
                if req is None:
                    break
                with self._sessions_lock:
                    if s.dropped is not None:     # a frame taken for too long
                        break
                    s.busy, s.taking, s.last_seen = True, None, time.monotonic()
                op = req.get("op") if isinstance(req, dict) else None
                try:
                    if isinstance(req, KVBlockError):
                        raise req
                    reply = {"ok": True, "result": self._dispatch(s, req)}
                except KVBlockError as e:
                    reply = error_reply(e)
                except Exception as e:  # noqa: BLE001  (answered; the server keeps serving)
                    reply = {"ok": False, "error": "ServerError",
                             "message": f"{type(e).__name__}: {e}"}
                fence_fds = None
                if op == "hello" and reply["ok"]:
                    try:             # before answering: a rank told yes gets them
                        fence_fds = self._fence_files()
                        # counted here, not at accept: a probe for a live
                        # server (wait_for_server) or a refused hello is no
                        # client's connection; and once: a hello said again
                        # is the same connection
                        with self._sessions_lock:
                            self.connections_total += not s.greeted
                        # only a hello answered yes is said: one refused
                        # stays under the hello wait
                        s.greeted = True
                    except KVBlockError as e:     # the store closed meanwhile
                        reply = error_reply(e)
                    except OSError as e:
                        reply = {"ok": False, "error": "ServerError",
                                 "message": f"the store server at {self.socket_path} cannot "
                                            f"hand out its fence files now ({e}); try again"}
                try:
                    data = encode_msg(reply)
                except KVBlockError as e:   # an answer too large for one frame
                    self._undo(s, reply.get("result"))
                    data = encode_msg(error_reply(e))
                try:
                    self._send(s, data)
                    if fence_fds is not None:
                        socket.send_fds(s.conn, [b"F"], fence_fds)
                except (BlockingIOError, TimeoutError):
                    # SO_SNDTIMEO: the client took nothing for a lease (a
                    # stopped process?).  Dropped as the lease drops a quiet
                    # one: its allocations wait for the write fence.
                    s.dropped = (f"it took none of an answer for {self.pin_lease:g} s "
                                 "(pin lease)")
                    self._note_expired(s)
                    break
                except OSError:
                    break
                finally:
                    for fd in fence_fds or ():
                        os.close(fd)
                    s.busy, s.last_seen = False, time.monotonic()
                if self.store.closed and not self._stopping:
                    # A metadata write failed: the in-memory state may be ahead of
                    # the medium.  Stop; a restarted server recovers the store.
                    self.failed = StoreClosedError("metadata write failed; store closed")
                    threading.Thread(target=self.stop, daemon=True).start()
        finally:
            with self._sessions_lock:
                s.closing = True
            try:            # ended before its pins go: the client sees them lapse first
                # (shut down, not only closed: a child forked meanwhile in this
                # process holds a copy, which kept the connection open for the
                # rank, its lapsed pins unseen)
                s.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.conn.close()
            except OSError:
                pass
            try:
                self._release(s)
            except Exception as e:  # noqa: BLE001  (the thread ends here: said, not raised)
                logger.warning("kvblock serve: giving back the pins of the connection of "
                               "pid %s failed: %s", s.pid, e)
            finally:
                # gone from the sessions whatever the release raised: left,
                # it counted as a client for good (idle_exit never came)
                with self._sessions_lock:
                    self._sessions.pop(s.sid, None)
                    self._last_session_end = time.monotonic()

    def _undo(self, s: _Session, result) -> None:
        """An answer that could not be sent: give back the pin it carried."""
        if not isinstance(result, dict):
            return
        if result.get("pin") is not None:
            self._op_unpin(s, result["pin"])
        if result.get("wid") is not None:
            self._op_abort(s, result["wid"])

    def _send(self, s: _Session, data: bytes) -> None:
        """sendall, except that a send making no progress for a lease
        (SO_SNDTIMEO) ends only a connection holding pins or allocations
        (as the lease does); one holding none waits on for its client (a
        stopped process holds nothing up), until the server stops, or
        (one that has not said hello) the hello wait closes it."""
        view = memoryview(data)
        s.sending = time.monotonic()
        try:
            while view:
                try:
                    view = view[s.conn.send(view):]
                except (BlockingIOError, TimeoutError):
                    if s.readers or s.writers or self._halt.is_set():
                        raise
                    # (SO_SNDTIMEO again: no busy loop)
        finally:
            s.sending = None

    def _release(self, s: _Session):
        """The connection ended: give back every pin it held.  The client
        may still be writing under its allocations (the server ended it, or
        the client's close() gave up waiting for a write in flight: a client
        that ends cleanly holds none): those are given back once its writes
        in flight are done (its later ones find the connection closed and
        are refused)."""
        store = self.store
        readers, s.readers = list(s.readers.values()), {}
        writers, s.writers = list(s.writers.values()), {}
        offers, s.offers = list(s.offers.values()), {}
        # Each kind is released whatever another raises (an OSError freeing
        # an emptied region, a KeyboardInterrupt): the allocations first
        # (handed to the write fence: a write in flight must be fenced
        # before its space is reused), then the readers' pins, each, then
        # the open offers; the first error is raised once all are done.
        error = None
        regions = [region for region, *_ in writers]
        if regions:
            try:
                # Whoever ended the connection: given back at once, a write
                # still in flight would land on the space once another rank
                # is handed it.
                if not store.closed:
                    # after the fence (_lease_loop; past stop(), here)
                    if not self._queue_dropped(regions):
                        self._give_back_late(regions)
                else:
                    store._unpin_writers(regions)
            except BaseException as e:
                error = e
        for segs in readers:
            try:
                store._unpin(segs)
            except BaseException as e:
                error = error or e
        try:
            self._give_back_open_offers(offers)
        except BaseException as e:
            error = error or e
        if error is not None:
            raise error

    def _give_back_open_offers(self, offers: list) -> None:
        """A connection ended with offers admitted on it whose puts did not
        store their run whole nor give the offer back (the client gave the
        connection up after a timeout, its give_back refused there; it died;
        its lease lapsed): given back here, as the client would have, so the
        key's next offer (any rank's) admits it, not the admit_after-th one
        after it.  One stored whole meanwhile (by another rank too) is left.
        So are the declined offers of a put_runs whose plan had not stood
        (no count_rejected came): the call counts no offer, and the key's
        next offer is its first again, not one that admits at once."""
        st = self.store
        if not offers or st.closed:
            return
        with st._lock:
            back = [(keys[0], admitted) for keys, admitted in reversed(offers)
                    if not admitted or st.index.prefix_length(keys) < len(keys)]
        st._give_back_offers(back)

    def _settle_offers(self, s: _Session, published: list) -> None:
        """The admitted offers open on ``s`` whose puts are done: a commit
        published the run's last piece (``published``: the runs it
        published; a put's pieces commit in order, so every piece was),
        or the run is stored whole.  By the last piece too: one evicted
        before it (or the run before the lock below) left the offer open
        though the put stored the run, and the connection's end gave it
        back (the key's next offer admitted at once, unlike KVStore)."""
        if not s.offers:
            return
        st = self.store
        step = st.max_run_blocks
        lasts = {run.keys for run in published}

        def done(keys: list[bytes]) -> bool:
            return b"".join(keys[(len(keys) - 1) // step * step:]) in lasts or \
                st.index.prefix_length(keys) == len(keys)
        with st._lock:
            s.offers = {offer: (keys, admitted) for offer, (keys, admitted) in s.offers.items()
                        if not admitted or not done(keys)}

    def _release_dropped_writers(self) -> None:
        with self._dropped_lock:
            regions, self._dropped_writers = self._dropped_writers, []
        if not regions:
            return
        try:
            fenced = self._fence_dropped_writers(regions)
        except BaseException:
            # (an unexpected error, not a try that failed): the regions stay
            # queued for the next tick, not lost (pinned for good)
            if not self._queue_dropped(regions):
                self._give_back_late(regions)
            raise
        if not fenced:
            if not self._queue_dropped(regions):
                self._give_back_late(regions)
            return
        self._dropped_retry = (0.0, 1.0)
        self.store._unpin_writers(regions)

    def _fence_dropped_writers(self, regions: list) -> bool:
        """Are the writes in flight under ``regions`` (dropped connections'
        allocations) done?  False: not yet, try again later."""
        next_try, backoff = self._dropped_retry
        if self.store.closed:
            return True
        # OSError: the fence files are opened anew, and a server out of
        # descriptors (EMFILE, many ranks) fails that for a while; the
        # try failed, the lease thread must go on.
        try:                 # a probe that stops nobody, every tick
            self._fence_writers(0, "the writes of dropped connections", turnstile=False)
        except (KVBlockError, OSError):
            if time.monotonic() < next_try:
                return False
            try:             # a try that holds new writes back: after a backoff
                self._fence_writers(DROPPED_FENCE_WAIT_S,
                                    "the writes of dropped connections")
            except (KVBlockError, OSError) as e:
                backoff = min(2 * backoff, DROPPED_FENCE_BACKOFF_S)
                self._dropped_retry = (time.monotonic() + backoff, backoff)
                logger.warning("kvblock serve: regions %s stay pinned, next try in %.0f "
                               "s: %s", sorted(set(regions)), backoff, e)
                return False
        return True

    def _give_back_dropped_writers(self, timeout: float) -> None:
        """(stop, the store kept open) The lease thread has ended: the
        allocations of the connections dropped so far (stop's own ended
        them) go back to the store once their writes in flight are done
        (for up to ``timeout`` seconds; else they stay pinned, said)."""
        with self._dropped_lock:
            regions, self._dropped_writers = self._dropped_writers, []
            # from now on nobody serves the queue: a connection whose thread
            # stop() gave up waiting for releases later, and gives back itself
            self._dropped_late = True
        if not regions or self.store.closed:
            return
        try:
            self._fence_writers(timeout, "the writes of dropped connections")
        except (KVBlockError, OSError) as e:
            if not self.store.closed:      # (closed meanwhile: as a closed one, below)
                logger.warning("kvblock serve: stopping; regions %s stay pinned in the "
                               "store: %s", sorted(set(regions)), e)
                return
        self.store._unpin_writers(regions)

    def _queue_dropped(self, regions: list) -> bool:
        """Queue dropped connections' allocations for the lease thread to
        give back after the write fence; False once stop() has given back
        the queue for the last time (the caller gives them back itself)."""
        with self._dropped_lock:
            if self._dropped_late:
                return False
            self._dropped_writers += regions
            return True

    def _give_back_late(self, regions: list) -> None:
        """(after stop, the store kept open) Give back dropped allocations
        once the writes in flight under them are done, waiting as long as a
        new owner would (FENCE_WAIT_S: stop() has returned, this is a
        connection's thread; else they stay pinned, said).  Fenced on store
        device 0 alone: stop() has closed the socket's fence file, and every
        rank this server allocated for locks device 0's inode too (the
        descriptor hello sent it)."""
        st = self.store
        io = st.io           # once: a close() in another thread sets it to None
        if st.closed or io is None:
            st._unpin_writers(regions)     # (as _release does on a closed store)
            return
        dev0 = io.devices[0]
        try:
            # (its descriptor the store's, which a close() in another thread
            # may free meanwhile for another file to take: checked)
            fence_writers([(dev0.fd, dev0.path, self._device_files[0])], FENCE_WAIT_S,
                          waiting_for="the writes of dropped connections")
        except (KVBlockError, OSError) as e:
            if not st.closed:      # (closed meanwhile: its pins go, as on a closed store)
                logger.warning("kvblock serve: stopped; regions %s stay pinned in the store: "
                               "%s", sorted(set(regions)), e)
                return
        st._unpin_writers(regions)

    def _fence_writers(self, timeout: float | None = None, waiting_for: str | None = None,
                       turnstile: bool = True, stop: threading.Event | None = None):
        """Wait until no rank writes under an allocation made before now.
        The descriptors are reopened checked (fence.reopen): the store's
        may be closed meanwhile by another thread (its close(), the server
        keeping the store open), the fence file's by stop()."""
        io = self.store.io   # once: a close() in another thread sets it to None
        if io is None:
            raise self._closed_error()
        dev0 = io.devices[0]
        files = [(dev0.fd, dev0.path, self._device_files[0]),
                 (self._fence_fd, socket_fence_path(self.socket_path), self._fence_file)]
        fence_writers(files, timeout, turnstile=turnstile, stop=stop,
                      **({"waiting_for": waiting_for} if waiting_for else {}))

    def _fence_files(self) -> list[int]:
        """What a rank gets right after hello: the files this server fences
        on, as descriptors of their own (a lock belongs to its open file
        description), so a rank locks the very inodes whatever paths it
        reaches them by."""
        io = self.store.io   # once: a close() in another thread sets it to None
        if io is None:       # closed since hello's answer was made
            raise self._closed_error()
        devices, files = io.devices, self._device_files
        # Checked reopens (fence.reopen): a close() in another thread may
        # free a descriptor meanwhile, its number another file's at once;
        # that file went out as the store's device.
        fds = []
        try:
            fds.append(reopen(devices[0].fd, os.O_RDONLY, files[0]))
            fds.append(reopen(self._fence_fd, os.O_RDONLY, self._fence_file))
            # then devices 1..: a rank checks each is the medium it writes
            for d, f in zip(devices[1:], files[1:]):
                fds.append(reopen(d.fd, os.O_RDONLY, f))
        except BaseException as e:
            for fd in fds:
                os.close(fd)
            if isinstance(e, OSError) and self.store.closed:
                raise self._closed_error() from None
            raise
        return fds

    # ------------------------------------------------------------------ requests
    def _dispatch(self, s: _Session, req: dict):
        op = req.pop("op", None)
        fn = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if fn is None:
            raise ConfigError(f"store server: unknown request {op!r}")
        if op not in ("hello", "unpin", "abort") and self.store.closed:
            raise self._closed_error()
        try:
            inspect.signature(fn).bind(s, **req)
        except TypeError as e:
            raise ConfigError(f"store server: bad arguments for {op!r}: {e}") from None
        return fn(s, **req)

    def _closed_error(self) -> StoreClosedError:
        return StoreClosedError(f"the store server at {self.socket_path} (pid {os.getpid()}) "
                                "has closed its store (a metadata write failed, or it is "
                                "stopping): restart it (kvblock serve) and reconnect")

    def _op_hello(self, s, protocol, pid=None):
        if protocol != PROTOCOL:
            raise ProtocolMismatchError(
                f"the client speaks store protocol {str(protocol)[:40]}, this server (pid "
                f"{os.getpid()}) speaks {PROTOCOL}: run one kvblock release in the server "
                "and every client (stop the server with SIGTERM and start it again from "
                "the clients' release)")
        # Answered on a closed store only to say the mismatch above: a
        # closed store has no devices to describe (nor fence files to send).
        st = self.store
        io = st.io        # once: a close() in another thread sets it to None
        if st.closed or io is None:
            raise self._closed_error()
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 1):
            # kept for the log of a dropped connection: no text of any length
            raise ConfigError(f"hello: pid must be this process's id, got {str(pid)[:40]!r}")
        s.pid = pid
        return {
            "protocol": PROTOCOL, "pid": os.getpid(),
            "uuid": st.uuid,
            "devices": list(self._device_paths), "geometry": st.geometry.as_dict(),
            "alignment": st.alignment, "region_size": st.regions.size,
            "region_count": st.regions.count, "data_offsets": st.regions.data_offsets,
            "max_run_blocks": st.max_run_blocks, "journal_bytes": st.sb.journal_bytes,
            "verify": st.verify,
            "fingerprint": st.sb.fingerprint.hex(), "pin_lease": self.pin_lease,
            "eviction": st.eviction, "admit_after": st.admission.admit_after,
        }

    def _op_ping(self, s):
        """A client holding pins says it is alive (see PIN_LEASE_S)."""
        return None

    def _op_lookup(self, s, keys):
        # The device's index only, as _op_present and _op_segments: a DRAM
        # tier of the store (StoreServer over a caller's store) serves no
        # rank, and KVStore.lookup counting keys held only there answered
        # more blocks than the rank's read then found.  Counted as
        # KVStore.lookup counts.
        st = self.store
        st._check_open()
        keys = decode_keys(keys)
        with st._lock:    # the index's arrays are swapped when it grows
            n = st.index.prefix_length(keys)
        st.counters.add_each(lookups=1, lookup_hit_blocks=n)
        return n

    def _op_present(self, s, keys):
        # The device's index only: ranks read the device, and put_runs plans
        # from this as KVStore's plan does from its index.  A DRAM tier of
        # the store (StoreServer over a caller's store) serves no rank: a
        # key held only there counted a run as a repeat, never written.
        st = self.store
        st._check_open()
        keys = decode_keys(keys)
        with st._lock:
            return (st.index.lookup(keys) >= 0).tolist()

    def _op_touch(self, s, keys):
        """An engine's hint that it is about to use ``keys`` (KVStore.touch)."""
        return self.store.touch(decode_keys(keys))

    def _op_removed(self, s, cursor=None):
        cursor, keys = self.store.removed_since(cursor)
        return {"cursor": cursor, "keys": None if keys is None else encode_keys(keys)}

    def _op_segments(self, s, keys):
        st = self.store
        with st._lock:
            segs = st._segments(decode_keys(keys))
        if not segs:
            return {"pin": None, "segs": []}
        pin = next(self._ids)
        s.readers[pin] = segs
        return {"pin": pin, "segs": [
            [[run.run_id, run.region, run.generation, run.offset, run.nblocks,
              [int(c) for c in run.checksums]], pos, count, at]
            for run, pos, count, at in segs]}

    def _op_unpin(self, s, pin):
        _check_id("unpin", "pin", pin)
        segs = s.readers.pop(pin, None)
        if segs is not None:
            self.store._unpin(segs)
        return None

    def _op_drop_runs(self, s, run_ids, why="checksum"):
        """Runs that failed a client's checksum (or device read: ``why``);
        counted once each, by the rank that dropped them first."""
        st = self.store
        if not isinstance(run_ids, list):
            raise ConfigError(f"drop_runs: run_ids must be a list of run ids (integers), got "
                              f"{type(run_ids).__name__} {str(run_ids)[:80]}")
        if not isinstance(why, str) or why not in DROP_REASONS:   # a list or dict: unhashable
            raise ConfigError(f"drop_runs: why must be one of {sorted(DROP_REASONS)}, got "
                              f"{str(why)[:80]!r}")
        for i in run_ids:
            _check_id("drop_runs", "run_ids", i)
        with st._lock:
            runs = [st.index.runs[i] for i in dict.fromkeys(run_ids) if i in st.index.runs]
        st._drop_runs(runs, count=DROP_REASONS[why])   # counts what another rank did not drop
        return len(runs)

    def _op_clear_ticket(self, s):
        self.store._check_open()
        return self._clear_ticket()

    def _clear_ticket(self) -> str:
        """What names the clear() calls so far, on this server run (another
        run's ticket matches none: a clear may have come there)."""
        return f"{self._run_tag}:{self.store._clears}"

    def _op_admit(self, s, keys, count=True):
        """``count``: false for a put_runs' run (the call may still be
        refused, its offers given back): a declined run is counted by
        count_rejected once the call's plan stands, so that
        admission_rejected_runs only goes up."""
        st = self.store
        st._check_open(writing=True)
        if type(count) is not bool:
            raise ConfigError(f"admit: count must be true or false, got {str(count)[:40]!r}")
        keys = decode_keys(keys)
        if not keys:   # no run: an empty prefix is "stored", and would count a duplicate
            raise ConfigError("admit: keys must hold the run's keys (at least one); a put of "
                              "no keys stores nothing and needs no admit")
        # the put's pieces commit only if no clear() comes first (on this run)
        clears = self._clear_ticket()
        with st._lock:
            if st.index.prefix_length(keys) == len(keys):
                st.counters.add("put_duplicate_runs")
                return {"verdict": "duplicate", "clears": clears}
            # (after the duplicate check: a stored run opens no offer)
            if len(s.offers) >= OPEN_OFFERS_KEPT and st.admission.admit_after > 1:
                raise ConfigError(f"admit: this connection to the store server at "
                                  f"{self.socket_path} holds {len(s.offers)} open offers "
                                  "(puts admitted whose runs are not stored nor given back), "
                                  "the most one may hold: nothing counted; finish those puts "
                                  "first (a put_runs of fewer runs at a time)")
            if not st.admission.admit(keys[0]):
                if count:
                    st.counters.add("admission_rejected_runs")
                    return {"verdict": "rejected", "clears": clears, "offer": None}
                # open until the call's plan stands (count_rejected) or
                # it gives the offer back; the connection ending first
                # gives it back (_release)
                return {"verdict": "rejected", "clears": clears,
                        "offer": self._open_offer(s, keys, False)}
        if st.admission.admit_after == 1:   # (one offer admits: nothing to give back)
            return {"verdict": "ok", "clears": clears, "offer": None}
        # open until the put stores the run or gives the offer back;
        # the connection ending first gives it back (_release)
        return {"verdict": "ok", "clears": clears, "offer": self._open_offer(s, keys, True)}

    def _open_offer(self, s: _Session, keys: list[bytes], admitted: bool) -> int:
        """Track an offer admit counted on ``s``; its id, which give_back
        and count_rejected name."""
        offer = next(self._ids)
        s.offers[offer] = (keys, admitted)
        return offer

    def _op_give_back(self, s, offers):
        """Offers admit counted for puts that stored nothing (see
        Admission.give_back): ``offers`` their ids (admit's answer), latest
        first."""
        st = self.store
        _check_offers("give_back", offers)
        if st.admission.admit_after == 1:     # no offer counted, none tracked
            return None
        # Only offers open on this connection: another connection's (a
        # stray or buggy client naming them) are its own, given back by its
        # puts or at its end; given back here too, they went back twice.
        mine = [s.offers.pop(offer) for offer in offers if offer in s.offers]
        st._give_back_offers([(keys[0], admitted) for keys, admitted in mine])
        if len(mine) < len(offers):
            raise ConfigError(f"give_back: {len(offers) - len(mine)} of the {len(offers)} "
                              "offers named are not open on this connection (not admitted "
                              "on it, or given back or settled already): those were not "
                              "given back")
        return None

    def _op_count_duplicates(self, s, runs):
        """put_runs' runs found whole in the call's earlier runs (duplicates
        no admit saw): counted as KVStore counts them."""
        return self._count_runs("count_duplicates", "put_duplicate_runs", runs)

    def _op_count_rejected(self, s, runs, offers):
        """put_runs' declined runs (admitted with count=false), once the
        call's plan stands: counted as KVStore counts them, their offers
        no longer given back when the connection ends.  ``offers``: the
        declined runs' offer ids (admit's answer), one per run: those
        offers are settled (two threads' put_runs share a connection: the
        other offers open on it may be another call's, which may still be
        given back)."""
        _check_offers("count_rejected", offers)
        if len(offers) != runs:
            raise ConfigError(f"count_rejected: offers must name the {runs} declined runs' "
                              f"offers, one each, got {len(offers)}")
        # each a declined offer open on this connection, once: another id
        # (an admitted offer's, one settled) counted a run no admit declined
        bad = [o for o in offers if o not in s.offers or s.offers[o][1]]
        if bad or len(set(offers)) < len(offers):
            raise ConfigError(f"count_rejected: offers {str(bad or offers)[:80]} are not "
                              "declined offers open on this connection, each named once "
                              "(admitted, settled or given back already, or another "
                              "connection's): nothing counted; name the ids admit answered "
                              "with verdict rejected")
        self._count_runs("count_rejected", "admission_rejected_runs", runs)
        for offer in offers:
            del s.offers[offer]
        return None

    def _count_runs(self, op: str, counter: str, runs) -> None:
        """A rank's count of ``runs`` (a whole number >= 1) added to ``counter``."""
        if type(runs) is not int or runs < 1:
            raise ConfigError(f"{op}: runs must be a count >= 1, got {str(runs)[:40]!r}")
        self.store.counters.add(counter, runs)
        return None

    def _op_allocate(self, s, nblocks):
        st = self.store
        st._check_open(writing=True)
        if type(nblocks) is not int or not 1 <= nblocks <= st.max_run_blocks:
            raise ConfigError(f"allocate: {nblocks!r} blocks; a run holds 1 to "
                              f"{st.max_run_blocks}")
        region, offset, run_id, gen = st._begin_put(st.layout(nblocks).run_bytes)
        wid = next(self._ids)
        s.writers[wid] = (region, run_id, offset, gen, nblocks)
        return {"wid": wid, "region": region, "offset": offset, "run_id": run_id,
                "generation": gen}

    # (Arguments default to None so that a request missing one still
    # reaches the code that gives back the allocations it names.)
    def _op_commit(self, s, wid=None, keys=None, checksums=None, clears=None):
        return self._commit_runs(s, "commit", [[wid, keys, checksums]], clears)[0]

    def _op_commit_runs(self, s, puts=None, clears=None):
        """Publish the runs of several allocations with one journal commit
        (put_runs): all of them, or none when a clear() came after admit."""
        return self._commit_runs(s, "commit_runs", puts, clears)

    def _commit_runs(self, s, op, puts, clears) -> list[int]:
        st = self.store
        entries = puts if isinstance(puts, list) else []
        # Every allocation named is given back, whatever is wrong with the
        # request (a malformed entry's too): the client counts them released
        # once it asked; left, they stayed pinned while the connection lived.
        taken = [(s.writers.pop(p[0], None)
                  if isinstance(p, list) and p and type(p[0]) is int else None, p)
                 for p in entries]
        try:
            if not entries or not all(isinstance(p, list) and len(p) == 3 for p in entries):
                raise ConfigError(f"{op}: puts must be a non-empty list of [wid, keys, "
                                  f"checksums], got {str(puts)[:80]}")
            if clears is None:
                raise ConfigError(f"{op}: clears (admit's clear ticket) is missing")
            runs = []
            for w, (wid, keys, checksums) in taken:
                _check_id(op, "wid", wid)
                if w is None:
                    raise ConfigError(f"{op}: no allocation {wid} on this connection")
                runs.append(self._run_of(op, w, keys, checksums))
            # One entry's records go in one journal write: one past the
            # journal would fail the commit and close the store for everyone.
            need = sum(jfmt.record_bytes(jfmt.PutRun(r.run_id, r.region, r.generation,
                                                     r.offset, r.keys, tuple(r.checksums)))
                       for r in runs)
            if need > st.sb.journal_bytes // 2:
                raise ConfigError(f"{op}: {len(runs)} runs need {need} journal bytes, more "
                                  f"than half the {st.sb.journal_bytes}-byte journal; commit "
                                  "fewer runs at a time")
            # flushes data, journals, indexes; refused after a clear
            published = st._publish_puts(runs, self._clear_count(clears))
        finally:
            st._unpin_writers([w[0] for w, *_ in taken if w is not None])
        if published:               # the offers of the puts now done
            self._settle_offers(s, [run for run in runs if run.run_id in published])
        out = []
        for run in runs:    # none or all: a clear() refuses the whole commit
            n = run.nblocks if run.run_id in published else 0
            if n:
                st.counters.add_each(put_runs=1, put_blocks=n,
                                     bytes_written=st.layout(n).run_bytes)
            out.append(n)
        return out

    def _run_of(self, op, w, keys, checksums) -> Run:
        """The Run an allocation ``w`` holds, with what the client sent."""
        st = self.store
        region, run_id, offset, gen, n = w
        keys = decode_keys(keys)
        # Checked here, not in the journal commit: a record that fails to
        # encode there fails the commit leader, which closes the store for
        # every client.
        if not isinstance(checksums, list) or not all(
                type(c) is int and 0 <= c < 1 << 64 for c in checksums):
            raise ConfigError(f"{op}: checksums must be a list of unsigned 64-bit "
                              f"integers, got {type(checksums).__name__} "
                              f"{str(checksums)[:80]}")
        if len(keys) != n or len(checksums) != st.geometry.run_checksums:
            raise ConfigError(f"{op}: {len(keys)} keys and {len(checksums)} checksums "
                              f"for a run of {n} blocks x {st.geometry.ranges} ranges (and a trailer)")
        return Run(run_id, region, gen, offset, b"".join(keys),
                   np.array(checksums, dtype=np.uint64), created=time.time())

    def _clear_count(self, ticket) -> int:
        """The clear count of admit's ticket; -1 (matching no count) for one
        an earlier server run gave: a clear may have come after it there."""
        tag, sep, count = str(ticket).partition(":")
        # ASCII digits only, and few: isdigit() takes digits int() refuses
        if not sep or not (count.isascii() and count.isdigit() and len(count) <= 20):
            raise ConfigError(f"commit: clear ticket {str(ticket)[:80]!r} is not one admit "
                              "gives")
        return int(count) if tag == self._run_tag else -1

    def _op_abort(self, s, wid):
        _check_id("abort", "wid", wid)
        w = s.writers.pop(wid, None)
        if w is not None:
            self.store._unpin_writers([w[0]])
        return None

    def _op_delete(self, s, keys):
        return self.store.delete(decode_keys(keys))

    def _op_delete_prefix(self, s, prefix, keep=None):
        if not isinstance(prefix, str):
            raise ConfigError(f"delete_prefix: prefix must be a hex string, got "
                              f"{type(prefix).__name__} {str(prefix)[:80]}")
        try:
            raw = bytes.fromhex(prefix)
        except ValueError:
            raise ConfigError(f"delete_prefix: prefix {prefix[:40]!r} is not hex") from None
        return self.store.delete_prefix(raw, [] if keep is None else decode_keys(keep))

    def _op_evict(self, s, nbytes=None, all=False, older_than=None):
        # Typed as sent: a truthy "false" for all would evict the whole
        # shared store; evict_older_than checks the cutoff is a number.
        if not isinstance(all, bool):
            raise ConfigError(f"evict: all must be true or false, got {all!r}")
        if older_than is not None:
            if nbytes is not None or all:     # one of them would be ignored
                raise ConfigError("evict: give older_than, nbytes or all, one of them")
            return self.store.evict_older_than(older_than)
        return self.store.evict(nbytes, all=all)

    def _op_clear(self, s):
        return self.store.clear()

    def _op_checkpoint(self, s):
        self.store.checkpoint()
        return None

    def _op_stats(self, s):
        st = self.store
        out = st.stats()     # a closed store's: StoreClosedError, as in one process
        with st._lock:
            pinned = int((st.regions.pins > 0).sum())
        with self._sessions_lock:      # as max_clients counts: a closing one is served no more
            clients = sum(not o.closing for o in self._sessions.values())
        # server_run: this run of the server (its counters start at zero, at
        # server_started); a restart under the same pid (PID 1 in a container) changes it
        out.update({"server_pid": os.getpid(), "server_run": self._run_tag,
                    "server_started": self._started, "clients": clients,
                    "connections_total": self.connections_total, "pinned_regions": pinned,
                    "pin_lease": self.pin_lease, "expired_sessions": self.expired_sessions,
                    "refused_connections": self.refused_connections})
        return out


def _check_offers(op: str, offers) -> None:
    if not isinstance(offers, list) or not all(type(o) is int for o in offers):
        raise ConfigError(f"{op}: offers must be a list of the offer ids admit answered, "
                          f"got {str(offers)[:80]}")


def _check_id(op: str, field: str, value) -> None:
    """A pin, allocation or run id as the server gave it: an integer (not
    true/false, which would pass for 1 and 0)."""
    if type(value) is not int:
        raise ConfigError(f"{op}: {field} must hold integer ids the server gave, got "
                          f"{type(value).__name__} {str(value)[:80]}")


def _check_socket_path(path: str) -> bool:
    """True when ``path`` holds a stale socket (nobody listening); False when
    it is free.  Refuses a live server's socket and anything not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; choose another --socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True  # nobody listening: left by a server that died
    except PermissionError:
        # maybe a live server of another user: never unlink what cannot be probed
        raise ConfigError(f"cannot tell whether a store server listens on {path}: "
                          "permission denied on the socket; stop that server (or remove "
                          "the socket if none runs), or choose another --socket path") from None
    except OSError:
        pass   # a timeout: a server too busy to accept at once is still a server
    finally:
        probe.close()
    # busy, not a bad argument (exit 5, as the same store served on another
    # socket is): a ConfigError still, as before
    raise SocketInUseError(f"a store server already listens on {path}; stop it or choose "
                           "another --socket path", path, errno.EADDRINUSE)


def _bind(path: str) -> socket.socket:
    """Listen on ``path``; a stale socket of a dead server is replaced, a live
    one (or anything that is not a socket) is refused.  Called with the
    store's devices claimed, so no other server of this store races here,
    and under launch.binding, so no server of another store does."""
    if _check_socket_path(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass               # removed meanwhile
        except OSError as e:
            raise _stale_socket_error(path, e) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {path}: {e.strerror or e}; choose another "
                          "--socket path (at most 107 bytes, in a writable directory)") \
            from None
    except BaseException:
        sock.close()
        raise
    return sock


def _stale_socket_error(path: str, e: OSError) -> KVBlockError:
    """A stale socket (nobody listens) this user may not remove: another
    user's in a sticky directory such as /tmp, or one in a directory it
    may not write.  (Was a bare OSError: the path and 'Operation not
    permitted', no fix.)"""
    try:
        owner = f"owned by uid {os.lstat(path).st_uid}"
    except OSError:
        owner = "its owner unknown"
    msg = (f"{path} is a stale socket (no store server listens on it: left by one that "
           f"died; {owner}) and this user cannot remove it: "
           f"{(e.strerror or str(e)).lower()}; remove it as its owner or root "
           f"(rm {path}), or choose another --socket path")
    if isinstance(e, PermissionError):
        return DevicePermissionError(msg, path, e.errno)
    return ConfigError(msg)


ACCEPT_RETRY_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_RETRY_S = 0.1
MAX_SOCKET_PATH = 107   # sun_path is 108 bytes, its last one the terminating NUL


def open_server(devices: Sequence, socket_path, *, idle_exit: float | None = None,
                pin_lease: float | None = PIN_LEASE_S,
                hello_timeout: float | None = HELLO_TIMEOUT_S,
                max_clients: int | None = MAX_CLIENTS, stop: threading.Event | None = None,
                **options) -> StoreServer:
    """Open (and recover) the store on ``devices`` and serve it on
    ``socket_path``.  ``options`` go to :meth:`KVStore.open` (no
    ``host_cache_bytes``: a DRAM tier in the server would hold blocks its
    clients cannot read).  ``stop`` (:func:`stop_signals`' event) ends the
    wait for a server stopping on ``socket_path`` to let go of the devices,
    and the waits for a dead server's ranks' writes in flight (the store's
    open, the server's start), with DeviceBusyError."""
    if options.get("host_cache_bytes"):
        raise ConfigError("a store server cannot keep a DRAM tier (its clients read the "
                          "devices themselves); give each rank its own cache instead")
    # fail fast: before recovery writes a checkpoint, before any file is made
    if len(os.fsencode(os.fspath(socket_path))) > MAX_SOCKET_PATH:
        raise ConfigError(f"socket path {os.fspath(socket_path)!r} is "
                          f"{len(os.fsencode(os.fspath(socket_path)))} bytes; a Unix socket's "
                          f"path holds at most {MAX_SOCKET_PATH}: choose a shorter --socket path")
    socket_dir(socket_path)
    _check_socket_path(os.fspath(socket_path))
    # Until it listens (a recovery takes seconds at millions of blocks): a
    # rank finding no server waits for this one instead of starting another.
    starting = launch.announce_starting(socket_path)
    failed = True          # then a fence file made here goes (launch.close_fence)
    try:
        server = _open_server(devices, socket_path, idle_exit, pin_lease, hello_timeout,
                              max_clients, stop, options)
        failed = False
        return server
    finally:
        launch.started(starting, socket_path, failed)


def _open_server(devices, socket_path, idle_exit, pin_lease, hello_timeout, max_clients, stop,
                 options) -> StoreServer:
    # Looked at before the open too: a stopping server that lets go of the
    # devices and of its mark between our open finding them busy and the
    # look after it would otherwise be taken for some other holder.
    was_stopping = server_stopping(socket_path)
    try:
        store = KVStore.open(list(devices), _stop=stop, **options)
    except DeviceBusyError as e:
        # held by the server stopping on this socket: free once its store is closed
        began, limit = time.monotonic(), launch.STOPPING_WAIT_S
        if not wait_for_stopping_server(socket_path, limit, was_stopping=was_stopping,
                                        stop=stop):
            if time.monotonic() - began >= limit and not (stop is not None and stop.is_set()):
                raise DeviceBusyError(
                    f"{e} (the store server stopping on {socket_path} still held them after "
                    f"{limit:g} s of waiting: let its stop finish, or stop it, then start "
                    "again)") from None
            raise
        store = KVStore.open(list(devices), _stop=stop, **options)
    try:
        return StoreServer(store, socket_path, idle_exit=idle_exit, pin_lease=pin_lease,
                           hello_timeout=hello_timeout, max_clients=max_clients).start(stop)
    except BaseException:
        store.close()
        raise


def serve_in_background(devices: Sequence, socket_path, **options) -> StoreServer:
    """Serve the store on ``devices`` from a thread of this process; returns
    the running :class:`StoreServer` (``.stop()`` or ``with`` to end it).
    The server dies with this process: to outlive it, use :func:`spawn_server`."""
    return open_server(devices, socket_path, **options)


def spawn_server(devices: Sequence, socket_path, *, timeout: float = 600.0,
                 log_path=None, model=None, eviction=None, admit_after=None, engine=None,
                 verify=None, idle_exit=None, pin_lease=None, hello_timeout=None,
                 max_clients=None, may_start=None) -> subprocess.Popen:
    """Start ``kvblock serve`` in its own process (and session) and wait until
    it accepts connections.  Its output goes to ``log_path`` (default
    ``<socket_path>.log``).  Returns the process.  ``may_start``: a context
    manager factory entered around the process's start, which refuses it by
    raising (a RemoteStore's reconnect: one closed meanwhile starts none)."""
    socket_path = os.fspath(socket_path)
    cmd = [sys.executable, "-m", "kvblock", "serve", *map(os.fspath, devices),
           "--socket", socket_path]
    for flag, value in (("--model", model), ("--eviction", eviction),
                        ("--admit-after", admit_after), ("--engine", engine),
                        ("--verify", verify), ("--idle-exit", idle_exit),
                        ("--pin-lease", pin_lease), ("--hello-timeout", hello_timeout),
                        ("--max-clients", max_clients)):
        if value is not None:
            cmd += [flag, str(value)]
    log_path = os.fspath(log_path) if log_path else socket_path + ".log"
    with (may_start() if may_start is not None else contextlib.nullcontext()):
        with _open_log(log_path) as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, close_fds=True)
    try:
        wait_for_server(socket_path, timeout, proc)
    except ServerError as e:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tail = ""
        try:
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace").strip()
        except OSError:
            pass
        raise ServerError(f"{e}" + (f"; its log ({log_path}) ends: {tail}" if tail else "")) \
            from None
    except BaseException:
        # (Ctrl-C meanwhile) The start is given up: a server left to come up
        # in its own session would serve what the caller undoes (a store
        # file it made, removed again).
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return proc


def _open_log(path: str):
    """The server's log, moved aside first when long (_rotate_log), open
    for appending.  One that cannot be (a directory there, another user's
    file) was a bare OSError out of connect()."""
    try:
        _rotate_log(path)
        return open(path, "ab")
    except OSError as e:
        msg = (f"cannot write the store server's log {path} (or move it aside to {path}.1 "
               f"past {LOG_KEEP_BYTES >> 20} MiB): {(e.strerror or str(e)).lower()}; remove "
               "what is in its place or make it writable for this user, or give another "
               "log_path (spawn_server) or socket path")
        if isinstance(e, PermissionError):
            raise DevicePermissionError(msg, path, e.errno) from None
        raise ConfigError(msg) from None


def _rotate_log(path: str) -> None:
    """A server log past LOG_KEEP_BYTES moves to ``<path>.1`` (replacing the
    one there) before a new server appends to it: the servers started for
    one socket over months share a log that would otherwise only grow."""
    try:
        if os.path.getsize(path) > LOG_KEEP_BYTES:
            os.replace(path, path + ".1")
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def stop_signals():
    """SIGTERM / SIGINT set the event it yields, from now until the block
    ends: enter it before open_server, whose socket accepts (what
    spawn_server waits for) before run_forever runs; a SIGTERM in between
    killed the server uncleanly.  One during recovery stops the server once
    it is open; one while open_server(stop=...) waits for a stopping
    server's devices ends that wait (DeviceBusyError)."""
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_forever(server: StoreServer, stop: threading.Event) -> int:
    """Serve until ``stop`` is set (stop_signals: SIGTERM / SIGINT; a clean
    stop, checkpoint) or a failure.  Returns an exit status."""
    try:
        while not stop.is_set() and not server.stopped.is_set():
            stop.wait(0.2)
    finally:
        server.stop()
    return 1 if server.failed is not None else 0


__all__ = ["StoreServer", "open_server", "serve_in_background", "spawn_server", "run_forever",
           "stop_signals"]
