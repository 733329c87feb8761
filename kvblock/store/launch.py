"""Starting a store server where none answers: one rank of many does it.

:func:`ensure_server` is what :func:`kvblock.store.client.connect` calls
when nobody answers on the socket (and again, with ``reconnect``, when the
server is lost later); :func:`wait_for_server` waits for a server process
to listen; :func:`socket_dir` makes the socket's directory.

A server that stops closes its socket first (a rank connecting then finds
no server and starts the next one at once) but holds the devices until its
store is closed (a checkpoint).  Meanwhile it write-locks STOPPING_BYTE of
``<socket>.fence`` (:func:`announce_stopping`); a new server that finds the
devices busy waits while that lock is held (:func:`wait_for_stopping_server`)
instead of failing on a claim about to be released.

A server starting (from before it claims the devices until it listens:
a recovery of millions of blocks takes seconds) write-locks STARTING_BYTE
of the same file (:func:`announce_starting`); a rank that finds no server
answering waits for it (:func:`wait_for_starting_server`) instead of
starting a second one, which would find the devices busy and fail.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from typing import Sequence

from kvblock.devices import refuse_one_path
from kvblock.errors import (ConfigError, ServerBusyError, ServerError, ServerGoneError,
                            SocketInUseError, StoreClosedError)
from kvblock.store.fence import FENCE_BYTE, _FLOCK, _ofd_lock, file_id, socket_fence_path
from kvblock.store.session import open_socket

logger = logging.getLogger("kvblock")

# Beside the write fence's bytes of <socket>.fence (ranks lock those, never this).
STOPPING_BYTE = FENCE_BYTE + 2
STARTING_BYTE = FENCE_BYTE + 3
# Held by a server from its look at the socket path until it listens there
# (or gave up): servers of other stores told the same path take it in turn.
BINDING_BYTE = FENCE_BYTE + 4
# The look takes at most a second (a connect): one held longer is stuck.
BINDING_WAIT_S = 30.0
# Held shared by every server holding <socket>.fence open (open_fence): a
# start that made the file and failed removes it only when none does.
HOLDING_BYTE = FENCE_BYTE + 5
# How long a new server waits for a stopping one to let go of the devices:
# its stop drains each connection for up to 10 s, then checkpoints.  (A
# server spawn_server started is killed sooner, at its start timeout.)
STOPPING_WAIT_S = 120.0
STOPPING_POLL_S = 0.02


def ensure_server(socket_path, devices: Sequence, *, start_timeout: float = 600.0,
                  server_options: dict | None = None, prepare=None, may_start=None,
                  stop: threading.Event | None = None) -> None:
    """Start a store server on ``devices`` at ``socket_path`` unless one
    answers there, under ``<socket_path>.lock`` (see
    :func:`kvblock.store.client.connect` for how ranks race to start it).
    ``may_start``: see :func:`kvblock.store.server.spawn_server`.
    ``stop``: once set (a reconnecting store closed), the waits before a
    start (this process's start lock, the lock file, a server starting
    without it) end with StoreClosedError at their next look; else the
    reconnect thread lingered there after close(), up to start_timeout
    (the start lock: with no limit)."""
    refuse_one_path(devices)     # one path: refused by name (a server on its characters)
    socket_path = socket_path_str(socket_path)
    from kvblock.store.server import MAX_SOCKET_PATH

    # No server can listen there: refused before prepare() formats (making
    # the store file) and the folder is made, not by the server started.
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"socket path {socket_path!r} is {len(os.fsencode(socket_path))} "
                          f"bytes; a Unix socket's path holds at most {MAX_SOCKET_PATH}: "
                          "choose a shorter socket path")
    lock_path = socket_path + ".lock"
    socket_dir(socket_path)
    # lockf, not flock: a process forked meanwhile (from another thread) must
    # not inherit the lock and block every later start; lockf does not tell
    # this process's threads apart, so they take _START_LOCK first.
    lock = _START_LOCK
    if stop is None:
        lock.acquire()
    else:
        while not lock.acquire(timeout=START_LOCK_POLL_S):
            _check_stop(stop)
    try:
        _start_locked(socket_path, lock_path, devices, start_timeout, server_options, prepare,
                      may_start, stop)
    finally:
        lock.release()


def _check_stop(stop: threading.Event | None) -> None:
    """StoreClosedError once ``stop`` is set (ensure_server's)."""
    if stop is not None and stop.is_set():
        raise StoreClosedError("remote store was closed while it reconnected: no server "
                               "started")


def _pause(stop: threading.Event | None, seconds: float) -> None:
    """Sleep ``seconds``, ended by ``stop`` (then StoreClosedError)."""
    if stop is None:
        time.sleep(seconds)
        return
    stop.wait(seconds)
    _check_stop(stop)


_START_LOCK = threading.Lock()
START_LOCK_POLL_S = 0.1   # a rank waiting for another to start the server looks this often


def _reset_start_lock() -> None:
    global _START_LOCK
    _START_LOCK = threading.Lock()    # a forked child: held by a thread it does not have


os.register_at_fork(after_in_child=_reset_start_lock)


def _start_locked(socket_path, lock_path, devices, start_timeout, server_options,
                  prepare, may_start=None, stop=None) -> None:
    from kvblock.store.server import spawn_server

    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot open the store server's start lock {lock_path}: "
                          f"{e.strerror}; every rank that may start the server must be able "
                          "to open it read-write (same user, or remove it), or choose "
                          "another socket path") from None
    try:
        if not _lock_or_served(fd, socket_path, lock_path, start_timeout, stop):
            return                   # another rank started it while we waited
        if _answers(socket_path, 5.0):
            return                   # ... and released the lock just now
        # A server that no rank started under this lock (an operator's, or
        # one whose starter died) may be recovering the store: a second one
        # would find the devices busy (and prepare() would too).
        if wait_for_starting_server(socket_path, start_timeout, stop):
            return
        # prepare() may return an undo: called (still under the lock) when
        # no server comes up, e.g. to remove the store file it made.
        undo = prepare() if prepare is not None else None
        try:
            proc = spawn_server(devices, socket_path, timeout=start_timeout,
                                may_start=may_start, **(server_options or {}))
        except ServerError:
            # Ours failed, maybe on the devices of one that began to start
            # just after the look above (before it marked itself starting).
            if wait_for_starting_server(socket_path, start_timeout, stop) or \
                    _answers(socket_path, 5.0):
                return
            _undo(undo)
            raise
        except BaseException:
            # (no server started: Popen failed, or Ctrl-C, after which
            # spawn_server killed the one it started)
            _undo(undo)
            raise
        # Reap it when it ends (it outlives us otherwise: it is in its own session).
        threading.Thread(target=proc.wait, name="kvblock-server-reaper", daemon=True).start()
    finally:
        os.close(fd)  # releases the lock


def _undo(undo) -> None:
    """Run prepare()'s undo, if any; its failure is logged, not raised over
    the start's own error."""
    if not callable(undo):
        return
    try:
        undo()
    except Exception as e:
        logger.warning("kvblock: undoing the preparation of a store server that did not "
                       "start failed: %s", e)


def _lock_or_served(fd, socket_path, lock_path, start_timeout, stop=None) -> bool:
    """Take the start lock (True), or see a server answer first (False).
    Not a blocking lockf: a rank stopped while it holds the lock (SIGSTOP, a
    debugger) would hang every other rank's connect() for good."""
    deadline = time.monotonic() + start_timeout
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        if _answers(socket_path, 1.0):
            return False
        if time.monotonic() >= deadline:
            raise ServerError(
                f"no store server answers on {socket_path}, and the rank starting one has "
                f"held {lock_path} for over {start_timeout:g} s (start_timeout) without it "
                "listening: that process is stopped or stuck (find it with "
                f"`fuser {lock_path}`); kill it, or start `kvblock serve` yourself")
        _pause(stop, START_LOCK_POLL_S)


def _answers(socket_path, timeout: float) -> bool:
    """Does a server listen on ``socket_path``?  One too busy to take the
    connection in ``timeout`` does: a second one would be refused there."""
    try:
        open_socket(socket_path, timeout).close()
    except ServerBusyError:
        return True
    except ServerGoneError:
        return False
    return True


def socket_path_str(socket_path) -> str:
    """A server socket's path as every entry keeps it (connect, RemoteStore,
    ensure_server, StoreServer): a str, bytes decoded as the file system
    does (os.fsdecode), so that ".lock", ".log" and ".fence" join it and
    messages name it as given."""
    return os.fsdecode(socket_path)


def socket_dir(socket_path) -> str:
    """The directory of a server socket, made (as ``mkdir -p``) when missing:
    engine configs name sockets under /run/kvblock/, which a fresh host does
    not have."""
    path = os.path.dirname(os.path.abspath(os.fspath(socket_path)))
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make the directory {path} for the store server socket "
                          f"{socket_path}: {e.strerror}; create it or choose another socket "
                          "path") from None
    return path


def wait_for_server(socket_path, timeout: float = 30.0, proc=None) -> None:
    """Block until a server accepts connections on ``socket_path``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            open_socket(os.fspath(socket_path), 1.0).close()
            return
        except ServerBusyError:
            return               # listening, if behind on its accepts
        except ServerGoneError as e:
            if proc is not None and proc.poll() is not None:
                raise ServerError(f"store server exited with status {proc.returncode} "
                                  f"before listening on {socket_path}") from None
            if time.monotonic() >= deadline:
                raise ServerError(f"no store server listening on {socket_path} after "
                                  f"{timeout} s ({e})") from None
            time.sleep(0.02)


@contextlib.contextmanager
def binding(fence_fd: int, socket_path):
    """(a server about to listen on ``socket_path``) Hold BINDING_BYTE of
    its ``<socket>.fence`` while it looks for a server there, removes a
    stale socket and binds: another server (of another store: this one's
    devices are claimed) doing the same between our look and our bind
    would have its socket unlinked by ours.  Polled, up to BINDING_WAIT_S:
    a server stopped while it holds the lock must not hang ours."""
    deadline = time.monotonic() + BINDING_WAIT_S
    logged = False
    while not _ofd_lock(fence_fd, fcntl.F_WRLCK, wait=False, byte=BINDING_BYTE):
        fence = socket_fence_path(socket_path)
        if time.monotonic() >= deadline:
            raise SocketInUseError(
                f"another store server has been taking the socket {socket_path} for over "
                f"{BINDING_WAIT_S:g} s (it holds the lock of {fence}): it is stopped or "
                f"stuck; find it with `fuser {fence}`, let it go on or kill it, or choose "
                "another --socket path", socket_path, errno.EADDRINUSE)
        if not logged:
            logger.info("kvblock serve: another store server is taking the socket %s; "
                        "waiting for it (up to %g s)", socket_path, BINDING_WAIT_S)
            logged = True
        time.sleep(STOPPING_POLL_S)
    try:
        yield
    finally:
        # unlocked, not left to the close: a child forked meanwhile shares the description
        try:
            _ofd_lock(fence_fd, fcntl.F_UNLCK, wait=False, byte=BINDING_BYTE)
        except OSError:
            pass


def announce_stopping(fence_fd: int) -> None:
    """(a stopping server, on its ``<socket>.fence``) Held until the
    descriptor is closed (or :func:`stopped`), after the store is: see the module's notes."""
    try:
        _ofd_lock(fence_fd, fcntl.F_WRLCK, wait=False, byte=STOPPING_BYTE)
    except OSError as e:       # ENOLCK: the stop goes on; a new server may then fail busy
        logger.warning("kvblock serve: cannot mark the server stopping on its fence file: %s",
                       e)


def stopped(fence_fd: int) -> None:
    """(a stopped server, its store closed) Let go of the mark before the
    descriptor is closed: the lock is its open file description's, which a
    child forked meanwhile shares, and would keep until it exits."""
    try:
        _ofd_lock(fence_fd, fcntl.F_UNLCK, wait=False, byte=STOPPING_BYTE)
    except OSError as e:
        logger.warning("kvblock serve: cannot clear the stopping mark on its fence file: %s",
                       e)


def _stopping(fd: int, byte: int = STOPPING_BYTE) -> bool:
    """Does a stopping server hold STOPPING_BYTE of the file behind ``fd``?
    (tested, not taken: a server that begins to stop must never find it held)
    (``byte`` STARTING_BYTE: a starting server)"""
    arg = struct.pack(_FLOCK, fcntl.F_RDLCK, os.SEEK_SET, byte, 1, 0)
    return struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg))[0] != fcntl.F_UNLCK


def open_fence(socket_path) -> tuple[int, bool]:
    """(a server) ``<socket>.fence`` open read-write, made when missing,
    with HOLDING_BYTE held shared while it is open; and whether this call
    made the file.  A file removed meanwhile by a failed start
    (:func:`close_fence`) is made anew: the one opened would be no rank's.
    OSError as os.open raises it."""
    path = socket_fence_path(socket_path)
    deadline = time.monotonic() + BINDING_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            made = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue                       # removed meanwhile
            made = False
        try:
            # a failed start holds it exclusive only for its unlink
            while not _ofd_lock(fd, fcntl.F_RDLCK, wait=False, byte=HOLDING_BYTE):
                if time.monotonic() >= deadline:
                    break                      # (stuck there: used unheld, never removed)
                time.sleep(STOPPING_POLL_S)
            st = os.stat(path)
        except FileNotFoundError:
            os.close(fd)
            continue
        except OSError:            # ENOLCK: held by none, so never removed (made: False)
            return fd, False
        except BaseException:
            os.close(fd)
            raise
        if (st.st_dev, st.st_ino) == file_id(fd):
            return fd, made
        os.close(fd)                           # removed (and made anew) meanwhile


def close_fence(fd: int, socket_path, remove: bool = False) -> None:
    """Close what :func:`open_fence` opened (unlocked first: a child forked
    meanwhile shares the description).  ``remove`` (a start that made the
    file and failed): the file goes too, unless another server holds it
    (it would fence on a file its ranks no longer find) or it is another
    file now."""
    try:
        if remove and _ofd_lock(fd, fcntl.F_WRLCK, wait=False, byte=HOLDING_BYTE):
            path = socket_fence_path(socket_path)
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == file_id(fd):
                os.unlink(path)
    except OSError:
        pass                                   # left behind: harmless, as before
    finally:
        try:
            _ofd_lock(fd, fcntl.F_UNLCK, wait=False, byte=HOLDING_BYTE)
        except OSError:
            pass
        os.close(fd)


def announce_starting(socket_path) -> tuple[int, bool] | None:
    """(a server about to open its store for ``socket_path``) Mark it
    starting until :func:`started`; the fence file's descriptor holding the
    mark and whether it was made here (:func:`open_fence`), or None when
    the fence file cannot be opened (the server's start says why, if it
    matters)."""
    try:
        fd, made = open_fence(socket_path)
    except OSError:
        return None
    try:
        _ofd_lock(fd, fcntl.F_WRLCK, wait=False, byte=STARTING_BYTE)
    except OSError:
        pass           # ENOLCK: ranks then start a server of their own, as before
    return fd, made


def started(starting: tuple[int, bool] | None, socket_path=None, failed: bool = False) -> None:
    """(a starting server, listening or failed) Let go of its mark
    (unlocked first: a child forked meanwhile shares the description).
    ``failed``: a fence file this start made goes too (see close_fence)."""
    if starting is None:
        return
    fd, made = starting
    try:
        _ofd_lock(fd, fcntl.F_UNLCK, wait=False, byte=STARTING_BYTE)
    except OSError:
        pass
    finally:
        close_fence(fd, socket_path, remove=failed and made)


def server_starting(socket_path) -> bool:
    """Is a server starting on ``socket_path`` (its mark held) now?"""
    try:
        fd = os.open(socket_fence_path(socket_path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _stopping(fd, STARTING_BYTE)
    finally:
        os.close(fd)


def wait_for_starting_server(socket_path, timeout: float,
                             stop: threading.Event | None = None) -> bool:
    """True once a server answers on ``socket_path``, waiting (up to
    ``timeout``) while one is starting there; False at once when none
    answers and none is starting (or one gave up starting).  ``stop``: see
    ensure_server."""
    deadline = time.monotonic() + timeout
    logged = False
    while True:
        starting = server_starting(socket_path)   # first: it lets go once it listens
        if _answers(socket_path, 1.0):
            return True
        if not starting:
            return False
        if time.monotonic() >= deadline:
            raise ServerError(
                f"a store server starting on {socket_path} (recovering its store, or waiting "
                f"for its devices) has not listened after {timeout:g} s (start_timeout); find "
                f"it with `fuser {socket_fence_path(socket_path)}`, or wait longer")
        if not logged:
            logger.info("kvblock: a store server is starting on %s; waiting for it (up to "
                        "%g s)", socket_path, timeout)
            logged = True
        _pause(stop, START_LOCK_POLL_S)


def server_stopping(socket_path) -> bool:
    """Is a server stopping on ``socket_path`` (its mark held) now?"""
    try:
        fd = os.open(socket_fence_path(socket_path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False                 # no server has served there
    try:
        return _stopping(fd)
    finally:
        os.close(fd)


def wait_for_stopping_server(socket_path, timeout: float = STOPPING_WAIT_S,
                             was_stopping: bool = False,
                             stop: threading.Event | None = None) -> bool:
    """Wait (up to ``timeout``) while a server stopping on ``socket_path``
    still holds its devices.  True once it has let go; False at once when
    none is stopping there (the devices' holder is something else) unless
    ``was_stopping`` (:func:`server_stopping` before the open that found the
    devices busy): that server may have let go of them since (True).
    False as soon as ``stop`` is set (kvblock serve told to stop meanwhile:
    SIGTERM, Ctrl-C)."""
    try:
        fd = os.open(socket_fence_path(socket_path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return was_stopping          # no server has served there (or it was removed)
    try:
        if not _stopping(fd):
            return was_stopping
        logger.warning("kvblock serve: the store server stopping on %s still holds the "
                       "devices; waiting for it (up to %g s)", socket_path, timeout)
        deadline = time.monotonic() + timeout
        while _stopping(fd):
            if time.monotonic() >= deadline:
                return False
            if stop is not None and stop.wait(STOPPING_POLL_S):
                return False        # told to stop: not after up to STOPPING_WAIT_S
            if stop is None:
                time.sleep(STOPPING_POLL_S)
        return True
    finally:
        os.close(fd)
