"""A client's connection to the store server (kvblock/store/server.py).

:class:`Session` is one connected socket and the pins this process holds on
it; :func:`open_socket` connects (or says how to start a server);
:func:`recv_fence_files` takes the two descriptors the server sends after
hello, and :func:`fence_files` opens this process's side of the write fence
(kvblock/store/fence.py).  The messages themselves are in protocol.py.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
import weakref

from kvblock import errors
from kvblock.devices import Device
from kvblock.errors import ServerGoneError
from kvblock.store.fence import reopen, socket_fence_path

FENCE_FILES_WAIT_S = 10.0   # they follow the answer to hello at once
BACKLOG_POLL_S = 0.01       # a connect finding the server's backlog full tries again this often

# Every socket open_socket made, entered before it connects: a forked child
# closes them all (_close_sockets_in_child).  A store's at-fork handler knows
# only the sessions of live stores, and a connection being made (a store
# still opening, a reconnect's socket not yet among the store's sessions)
# was kept open in the child: the server saw it open after the parent
# closed it, with the pins taken on it, for as long as the child lived.
_SOCKETS: "weakref.WeakSet[socket.socket]" = weakref.WeakSet()


def _close_sockets_in_child() -> None:
    for sock in list(_SOCKETS):
        try:
            sock.close()
        except OSError:
            pass
    _SOCKETS.clear()


os.register_at_fork(after_in_child=_close_sockets_in_child)


class Session:
    """One connection to the server and the pins this process holds on it
    (reads in flight, writes not yet committed).  An abandoned session
    stays open until they are released: the server drops a connection's
    pins when it closes, and another rank could then overwrite what a
    thread here is still reading or writing."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()       # one request in flight on the connection
        self.gone: str | None = None       # why it can no longer be used
        self.held = 0
        self._held_lock = threading.Lock()
        self._open = True
        self.call_started: float | None = None   # monotonic start of the call in flight
        # given up on in the middle of sending a request: the server is
        # still reading its frame, so nothing more can be sent on it
        self.torn = False
        # given up on by this process (a call past its timeout, or one cut
        # off by an exception), its server perhaps alive: which call, how
        self.abandoned: str | None = None

    def overdue(self, timeout: float) -> bool:
        """Whether the call in flight has waited for its answer longer than
        ``timeout`` (a hung server)."""
        started = self.call_started
        return started is not None and time.monotonic() - started > timeout

    def hold(self, delta: int) -> None:
        """Count pins taken (+1) and released (-1) on this session."""
        with self._held_lock:
            self.held += delta
        if delta < 0 and self.gone is not None:
            self.close_when_released()

    def close_when_released(self) -> None:
        with self._held_lock:
            if self.held > 0:
                return
        self.close()

    def close(self) -> None:
        # The socket closed under _held_lock: peer_closed and keep_alive
        # read and send on it under that lock without its call lock (a
        # caller's thread releasing the last pin closes it from outside any
        # call), and a descriptor closed between their taking its number
        # and their system call is at once the next open()'s (another
        # connection's socket: a ping sent into that stream, its answer
        # read away).
        with self._held_lock:
            if not self._open:
                return
            self._open = False
            try:
                self.sock.close()
            except OSError:
                pass

    def peer_closed(self) -> bool:
        """For a session given up on: has the server's end closed?  Then
        the pins taken on it lapsed with it.  (One abandoned after a timeout
        stays open from here, and its pins hold, while the server lives.)
        Unread answers on it are discarded."""
        with self._held_lock:      # not closed under it (see close)
            return self._peer_closed()

    def _peer_closed(self) -> bool:
        """(under _held_lock)"""
        if not self._open:
            return True
        try:
            p = select.poll()       # not select(): a descriptor may be past 1023
            p.register(self.sock, select.POLLIN)
            while p.poll(0):
                if not self.sock.recv(1 << 16):
                    return True
        except BlockingIOError:
            # (another thread, the heartbeat's keep_alive, drained it between
            # the poll and the recv: open)
            return False
        except (OSError, ValueError):     # closed here already
            return True
        return False

    def keep_alive(self, frame: bytes) -> bool:
        """For a session given up on (after a timeout) while pins are held
        on it: send ``frame`` (a ping) so the server, which may live on,
        does not take it for a stopped process's and drop its pins (the
        runs a caller still reads could then be evicted and their space
        handed out).  Its answers, and any other left unread, are
        discarded: nothing on it is read as an answer again.  Whether it
        was sent (not: its lock is held, its server's end closed, or its
        stream torn by a request cut off in the middle)."""
        if self.torn or not self.lock.acquire(blocking=False):
            return False
        try:
            with self._held_lock:      # not closed under it (see close)
                return self._keep_alive(frame)
        finally:
            self.lock.release()

    def _keep_alive(self, frame: bytes) -> bool:
        """(under lock and _held_lock)"""
        if not self._open or self._peer_closed():
            return False
        try:
            # (in the try: an EBADF raised here ended the heartbeat)
            self.sock.settimeout(0)     # never used for a call again: no wait here
            sent = self.sock.send(frame)
        except BlockingIOError:     # its buffer is full: the next beat tries again
            return False
        except OSError:             # closed meanwhile
            return False
        if sent != len(frame):      # (a few bytes: sent whole in practice)
            self.torn = True
            return False
        return True

    def hung_up(self) -> bool:
        """Has the server's end closed (its process died or dropped us)?
        Reads nothing: another thread's answer may be waiting."""
        with self._held_lock:      # not closed under it (see close)
            if not self._open:
                return True
            try:
                p = select.poll()
                p.register(self.sock, select.POLLRDHUP)
                events = p.poll(0)
            except (OSError, ValueError):     # closed here already
                return True
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
                   for _, ev in events)

    def forget(self) -> None:
        """close() in a forked child: the locks may be held by a thread that
        does not exist there, so none are taken (and none are used again)."""
        self._open = False
        self.lock = threading.Lock()
        self._held_lock = threading.Lock()
        try:
            self.sock.close()
        except OSError:
            pass


def recv_fence_files(sock: socket.socket, socket_path: str, devices: int = 1) -> list[int]:
    """The files the server fences on, which it sends right after its
    answer to hello (kvblock/store/fence.py), then its devices 1.. of the
    ``devices`` the store has (protocol.py)."""
    want = 1 + max(int(devices), 1)
    wrong = errors.ProtocolMismatchError(
        f"the store server at {socket_path} did not send its fence files after hello (a "
        "server of another kvblock build?): run one kvblock release on both sides")
    before = sock.gettimeout()
    sock.settimeout(FENCE_FILES_WAIT_S if before is None else min(before, FENCE_FILES_WAIT_S))
    try:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1, want, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise wrong from None
    except OSError as e:
        raise ServerGoneError(f"store server at {socket_path} is gone (hello: {e})") from None
    finally:
        sock.settimeout(before)
    if msg == b"" and not fds:
        # the server closed the connection: stopping, or out of descriptors
        raise ServerGoneError(f"the store server at {socket_path} closed the connection "
                              "right after hello; try again")
    if msg != b"F" or len(fds) != want:
        for fd in fds:
            os.close(fd)
        raise wrong
    return fds


def fence_files(dev0: Device, socket_path: str) -> list[int]:
    """The files a rank's writes are fenced on (kvblock/store/fence.py):
    store device 0 and, when its server made it, ``<socket>.fence``."""
    fds = [reopen(dev0.fd, os.O_RDONLY)]
    try:
        fds.append(os.open(socket_fence_path(socket_path), os.O_RDONLY | os.O_CLOEXEC))
    except FileNotFoundError:
        pass
    except BaseException:
        os.close(fds[0])
        raise
    return fds


def _not_a_socket(path: str) -> str | None:
    """What is at ``path`` when it exists and is no socket (a regular file,
    a directory...), in words; None otherwise."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode)
            else "a device or pipe")


def open_socket(path: str, timeout: float | None) -> socket.socket:
    """A socket connected to the server at ``path``; ServerGoneError (with
    the command that starts one) when nobody answers there, ServerBusyError
    when a server there has no room in its listen backlog for ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _SOCKETS.add(sock)     # before it connects: a fork from here on closes it there
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            # A full backlog fails a connect with a timeout at once (EAGAIN),
            # where a blocking one waits: a live server, so wait as well.
            if e.errno != errno.EAGAIN and not isinstance(e, TimeoutError):
                what = _not_a_socket(path)
                if what:     # (connect says ECONNREFUSED): no serve would listen there
                    raise ServerGoneError(
                        f"no store server at {path}: it is {what}, not a socket; give the "
                        "--socket path `kvblock serve` listens on") from None
                why = {errno.ENOENT: "no socket there", errno.ECONNREFUSED: "nobody listening "
                       "(a stale socket of a stopped server)"}.get(e.errno, str(e))
                raise ServerGoneError(f"no store server at {path}: {why}; start one with "
                                      f"`kvblock serve DEV... --socket {path}`") from None
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.ServerBusyError(
                    f"the store server at {path} took no connection for {timeout:g} s (its "
                    "listen backlog is full: it is starved or stuck); try again, or see "
                    "its log") from None
        time.sleep(BACKLOG_POLL_S)
