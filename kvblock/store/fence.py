"""The write fence: a rank's late write never lands on space a restarted
store server has handed out again.

A rank of a shared store writes a run at offsets its server allocated.  If
that server dies, a new one recovers the store and sees the space as free
(nothing was committed there), so a write of the old allocation that lands
after the new server handed the space to another rank would overwrite that
rank's committed run.  Nothing can cancel a write already in the kernel, and
a rank stalled between allocating and writing (a stopped process, a slow
thread) writes whenever it goes on.  So:

- a rank writes (and flushes) a run holding a shared lock, and under it
  first checks that the connection the space came from is still open;
- whoever opens the store to own it (a server, or ``KVStore.open`` in one
  process) takes the same lock exclusively once before it hands out space.
  That waits for every write in flight; every later write of an older
  connection finds its connection closed (the old owner is dead: it held
  the devices' exclusive claim the new one now holds) and is refused.

The locks are open-file-description locks (``F_OFD_SETLK``) on one byte far
past the end of store device 0, and of ``<socket>.fence`` beside a server's
socket: the first meets ranks that name the device by another socket path,
the second ranks whose device node is another inode (a container's own
/dev).  They are independent of the devices' flock claim, taken by no other
program, and released by the kernel when a process dies.
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

from kvblock.errors import DeviceBusyError

logger = logging.getLogger("kvblock")

# The bytes locked: far past any device's end, so they never meet a lock
# that some other tool takes on the device's bytes.  Ranks hold FENCE_BYTE
# shared while they write; an owner takes TURNSTILE_BYTE first, which stops
# new writes from starting, so ranks that keep writing cannot starve it.
FENCE_BYTE = 1 << 62
TURNSTILE_BYTE = FENCE_BYTE + 1
# How long a new owner waits for writes in flight before it gives up.  A
# write of a whole run takes well under a second on any device; what holds
# the lock longer is a rank stopped mid-write.
FENCE_WAIT_S = 60.0
FENCE_LOG_AFTER_S = 2.0

_FLOCK = "hhqqi4x"     # struct flock: l_type, l_whence, l_start, l_len, l_pid


def _ofd_lock(fd: int, kind: int, wait: bool, byte: int = FENCE_BYTE) -> bool:
    """Set an open-file-description lock of ``kind`` on ``byte``; False
    when ``wait`` is off and another description holds a conflicting one."""
    arg = struct.pack(_FLOCK, kind, os.SEEK_SET, byte, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def socket_fence_path(socket_path) -> str:
    return os.fsdecode(socket_path) + ".fence"


def file_id(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of the file behind ``fd``."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def reopen(fd: int | None, flags: int, file: tuple[int, int] | None = None) -> int:
    """A new open file description of the file behind ``fd`` (the same
    inode, whatever path it was opened by).

    ``file`` ((st_dev, st_ino), :func:`file_id`): the file ``fd`` was
    known to be, for a descriptor the caller does not own for the whole
    call (a store's, whose close() another thread may run; a server's
    fence file, which stop() closes).  Closed meanwhile, its number may
    already be another file's (the next open() in this process takes the
    lowest free number): OSError EBADF then, and that other file is never
    opened (a fence that locked it would take an unrelated file's writes
    for the store's, or miss the store's).  The file is pinned first by
    an O_PATH descriptor of our own (no open of its own kind: a FIFO, a
    device's driver), checked, and reopened through that."""
    if fd is None or fd < 0:
        raise OSError(errno.EBADF, f"descriptor {fd} is closed")
    pinned = os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    try:
        if file is not None and file_id(pinned) != tuple(file):
            raise OSError(errno.EBADF, f"descriptor {fd} was closed meanwhile (its number "
                                       "is another file's now)")
        return os.open(f"/proc/self/fd/{pinned}", flags | os.O_CLOEXEC)
    finally:
        os.close(pinned)


class WriteFence:
    """A rank's side: ``with fence.writing():`` around each run's write and
    flush.  One shared lock per file for the whole process, held while any
    thread writes (a lock belongs to its open file description, so threads
    sharing one must not take and drop it each on their own).

    Its files: the rank's own (``own``: store device 0 and ``<socket>.fence``
    by the paths it was given) and those its current server sent
    (:meth:`served`), which replace an earlier server's once no write is in
    flight."""

    def __init__(self, own: Sequence[int] = ()):
        self._own: list[int] = []      # owned: closed by close()
        self._served: list[int] = []
        self._old: list[int] = []      # an earlier server's, until no write is in flight
        self._writers = 0
        self._kept = 0                 # of them, writes left in flight (see keep)
        self._passing = 0              # writers at the turnstile (not yet counted in _writers)
        self._closing = False          # close() came while a write was in flight
        self._lock = threading.Lock()
        for fd in own:
            self._add(self._own, fd)

    @property
    def writers(self) -> int:
        """Threads writing under the fence now (not the writes :meth:`keep`
        holds it for: nothing waiting for them sees them end)."""
        return self._writers - self._kept

    def _fds(self) -> list[int]:
        return self._own + self._served + self._old

    @staticmethod
    def _file(fd: int) -> tuple[int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def _add(self, into: list, fd: int) -> None:
        """(under _lock) ``fd`` joins ``into`` unless its file is fenced on
        already (then it is closed)."""
        if self._file(fd) in {self._file(o) for o in self._fds()}:
            os.close(fd)
            return
        if self._writers:              # writes in flight hold the others' locks
            _ofd_lock(fd, fcntl.F_RDLCK, wait=True)
        into.append(fd)

    def served(self, fds: Sequence[int]) -> None:
        """The files a (new) server fences on; this takes the descriptors over."""
        with self._lock:
            self._old += self._served
            self._served = []
            mine = {self._file(fd) for fd in self._own}
            for fd in fds:
                f = self._file(fd)
                same = [o for o in self._old if self._file(o) == f]
                if f in mine or same:          # fenced on already: keep that one
                    os.close(fd)
                    if same:
                        self._old.remove(same[0])
                        self._served.append(same[0])
                    continue
                self._add(self._served, fd)
            self._drop_old()

    def _drop_old(self) -> None:
        """(under _lock) An earlier server's files, once no write holds them
        (nor a writer at the turnstile, which locks the files it saw)."""
        if self._writers == 0 and self._passing == 0:
            old, self._old = self._old, []
            for fd in old:
                os.close(fd)

    @contextlib.contextmanager
    def writing(self):
        # A writer at the turnstile counts in _passing: close() and a new
        # server's files leave the descriptors it took open until it has
        # passed (closed under it, its lock call would meet a closed
        # descriptor, EBADF, or one reopened meanwhile for another file).
        with self._lock:
            fds = self._fds()
            self._passing += 1
        try:
            for fd in fds:             # wait while an owner checks (not under _lock:
                _ofd_lock(fd, fcntl.F_RDLCK, wait=True, byte=TURNSTILE_BYTE)  # writers
                _ofd_lock(fd, fcntl.F_UNLCK, wait=False, byte=TURNSTILE_BYTE)  # must leave)
        except BaseException:
            # (an interrupt between a turnstile lock and its unlock) The
            # lock stays with the description, the rank's, until dropped:
            # every later owner would find the turnstile held and fail busy.
            with self._lock:
                self._unlock(fds, TURNSTILE_BYTE)
                self._passing -= 1
                self._settle()
            raise
        with self._lock:
            self._passing -= 1
            if self._writers == 0:
                try:
                    for fd in self._fds():
                        _ofd_lock(fd, fcntl.F_RDLCK, wait=True)
                except BaseException:
                    # (interrupted) No writer is counted: those taken would
                    # never be dropped.
                    self._unlock(self._fds(), FENCE_BYTE)
                    self._settle()
                    raise
            self._writers += 1
        try:
            yield
        finally:
            with self._lock:
                self._writers -= 1
                if self._writers == 0:
                    for fd in self._fds():
                        _ofd_lock(fd, fcntl.F_UNLCK, wait=False)
                self._settle()

    def keep(self) -> None:
        """(inside :meth:`writing`) Stay a writer until this process ends: a
        write the engine could not wait for (a broken io_uring's) may still
        land, and the kernel drops the locks only with the process.  An
        owner's fence then waits for it, as for a rank stopped mid-write."""
        with self._lock:
            self._writers += 1
            self._kept += 1

    @staticmethod
    def _unlock(fds, byte: int) -> None:
        """(under _lock) Drop this process's lock on ``byte`` of ``fds``,
        held or not."""
        for fd in fds:
            try:
                _ofd_lock(fd, fcntl.F_UNLCK, wait=False, byte=byte)
            except OSError:
                pass

    def _settle(self) -> None:
        """(under _lock) A writer left: once none writes or waits at the
        turnstile, an earlier server's files go, and all of them when
        close() came meanwhile."""
        if self._writers == 0 and self._passing == 0:
            self._drop_old()
            if self._closing:
                self._close_fds()

    def close(self) -> None:
        """Close the files, or, while a write is in flight (a close() that
        gave up waiting for it), once it is done: closing them drops the
        locks it holds, and an owner would then hand its space out under it."""
        with self._lock:           # not between a writer's lock and unlock
            if self._writers or self._passing:
                self._closing = True
                return
            self._close_fds()

    def _close_fds(self) -> None:
        """(under _lock)"""
        fds = self._fds()
        self._own, self._served, self._old = [], [], []
        for fd in fds:
            os.close(fd)

    def forget(self) -> None:
        """In a forked child: drop this copy of the files without locking
        (the parent's threads own the count)."""
        self._lock = threading.Lock()
        self._writers = self._kept = self._passing = 0
        fds = self._fds()
        self._own, self._served, self._old = [], [], []
        for fd in fds:
            os.close(fd)


def fence_writers(files: Sequence[tuple[int, str]], timeout: float | None = None,
                  waiting_for: str = "a rank's write in flight from before this store "
                                     "was opened", turnstile: bool = True,
                  stop: threading.Event | None = None) -> None:
    """The owner's side: wait until no rank writes under an allocation made
    before now to the files behind ``files`` ((fd, path for messages)
    pairs, or (fd, path, file) where the caller does not own ``fd`` for
    the whole call: see :func:`reopen`).  Meanwhile no new write starts (unless ``turnstile`` is off: a
    probe that stops nobody, and that ranks writing back to back can starve).
    Raises :class:`DeviceBusyError` after ``timeout`` (FENCE_WAIT_S) seconds,
    or as soon as ``stop`` is set while it waits (kvblock serve told to
    stop: SIGTERM, Ctrl-C).

    Each phase takes all files' locks or none: a rank may take its shared
    locks in another order (its own paths first), and holding one file
    while waiting for another could wait on a rank that waits on us."""
    timeout = FENCE_WAIT_S if timeout is None else timeout
    own = []
    try:
        for fd, path, *file in files:
            own.append((reopen(fd, os.O_RDWR, *file), path))
        t0 = time.monotonic()
        logged = False
        for byte in ((TURNSTILE_BYTE, FENCE_BYTE) if turnstile else (FENCE_BYTE,)):
            while True:
                held, busy = [], None
                for fd, path in own:
                    if not _ofd_lock(fd, fcntl.F_WRLCK, wait=False, byte=byte):
                        busy = path
                        break
                    held.append(fd)
                if busy is None:
                    break
                for fd in held:
                    _ofd_lock(fd, fcntl.F_UNLCK, wait=False, byte=byte)
                waited = time.monotonic() - t0
                if waited >= timeout:
                    raise DeviceBusyError(
                        f"{busy}: a process still writes to this store under an "
                        f"allocation made before now, after {waited:.1f} s of waiting for "
                        f"{waiting_for} (a rank stopped in the middle of a write?). Going "
                        "on could let that write land on space handed out again: look for "
                        f"a stopped (state T) or hung process among those that have {busy} "
                        f"open (`ps -o pid,stat,cmd -p $(fuser {busy} 2>/dev/null)`), let "
                        "it go on or kill it, and try again", busy, errno.EBUSY)
                if stop is not None and stop.is_set():
                    raise DeviceBusyError(
                        f"{busy}: told to stop after {waited:.1f} s of waiting for "
                        f"{waiting_for}; nothing was handed out", busy, errno.EBUSY)
                if not logged and waited >= FENCE_LOG_AFTER_S:
                    logger.warning("%s: waiting for %s (up to %.0f s)", busy, waiting_for,
                                   timeout)
                    logged = True
                if stop is not None:
                    stop.wait(0.002)
                else:
                    time.sleep(0.002)
    finally:
        for fd, _ in own:
            # Unlocked, not only closed: closing drops an OFD lock only with
            # the description's last descriptor, and a child forked meanwhile
            # (by another thread) holds a copy for as long as it lives.
            for byte in (TURNSTILE_BYTE, FENCE_BYTE):
                try:
                    _ofd_lock(fd, fcntl.F_UNLCK, wait=False, byte=byte)
                except OSError:
                    pass
            os.close(fd)


__all__ = ["WriteFence", "fence_writers", "socket_fence_path", "reopen", "file_id",
           "FENCE_WAIT_S"]
