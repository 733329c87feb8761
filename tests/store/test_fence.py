"""The write fence's locks (kvblock/store/fence.py): a process holds its
shared lock while any of its threads writes, a forked child's copy neither
takes nor drops it, and a dead process's lock is gone with it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvblock.errors import DeviceBusyError
from kvblock.store.fence import WriteFence, fence_writers


@pytest.fixture
def target(tmp_path):
    path = str(tmp_path / "dev0")
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    fd = os.open(path, os.O_RDWR)
    yield fd, path
    os.close(fd)


def _fenced(target) -> bool:
    """Could an owner take the fence now (without waiting)?"""
    try:
        fence_writers([target], timeout=0)
    except DeviceBusyError:
        return False
    return True


def _rank(path) -> WriteFence:
    return WriteFence([os.open(path, os.O_RDONLY)])


def test_held_while_any_thread_writes(target):
    rank = _rank(target[1])
    try:
        assert _fenced(target)
        inside, leave = threading.Event(), threading.Event()

        def writer():
            with rank.writing():
                inside.set()
                assert leave.wait(10)
        t = threading.Thread(target=writer)
        with rank.writing():
            t.start()
            assert inside.wait(10)
        assert not _fenced(target), "the first writer's exit dropped the second's lock"
        leave.set()
        t.join(10)
        assert _fenced(target)
    finally:
        rank.close()


def test_the_owner_waits_then_gives_up_naming_the_device(target):
    rank = _rank(target[1])
    try:
        with rank.writing():
            with pytest.raises(DeviceBusyError, match="still writes") as e:
                fence_writers([target], timeout=0.2)
            assert e.value.path == target[1] and target[1] in str(e.value)
        fence_writers([target], timeout=0)      # released: no wait
    finally:
        rank.close()


def test_a_forked_childs_copy_leaves_the_parents_lock(target):
    rank = _rank(target[1])
    try:
        with rank.writing():
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    rank.forget()
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert not _fenced(target), "a child's exit dropped its parent's lock"
        assert _fenced(target)
    finally:
        rank.close()


def test_a_killed_writers_lock_goes_with_it(target):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            rank = _rank(target[1])
            with rank.writing():
                os.write(w, b"x")
                signal.pause()
        finally:
            os._exit(1)
    try:
        assert os.read(r, 1) == b"x"
        assert not _fenced(target)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    assert _fenced(target)


def test_writers_that_never_pause_cannot_starve_an_owner(target):
    """Threads whose writes overlap keep the process's shared lock held for
    ever; an owner's turn stops new writes from starting, so it gets the
    fence, and the writers go on after it."""
    rank = _rank(target[1])
    stop = threading.Event()
    done = [0]

    def writer():
        while not stop.is_set():
            with rank.writing():
                time.sleep(0.005)
            done[0] += 1
    threads = [threading.Thread(target=writer) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while done[0] == 0:                       # the writers are writing
            assert time.monotonic() < deadline, "the writers never wrote"
            time.sleep(0.01)
        fence_writers([target], timeout=5)
        before = done[0]
        # they go on: soon, however slowly they are scheduled (a fence that
        # kept them out would keep them out for good)
        deadline = time.monotonic() + 20
        while done[0] <= before:
            assert time.monotonic() < deadline, "the writers did not go on after the owner's turn"
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        rank.close()


def test_an_owner_does_not_wait_on_a_rank_that_waits_on_it(tmp_path):
    """A rank locks its own file first, then its server's; an owner locks the
    server's first.  A rank holding its own file and waiting for the
    server's must not meet an owner holding the server's and waiting for
    the rank's own: the owner lets go of what it took and tries again."""
    import kvblock.store.fence as fence_mod

    paths = [str(tmp_path / name) for name in ("server-dev0", "own-dev0")]
    for p in paths:
        open(p, "wb").close()
    rank = WriteFence([os.open(paths[1], os.O_RDONLY)])
    rank.served([os.open(paths[0], os.O_RDONLY)])
    owner_fds = [os.open(p, os.O_RDWR) for p in paths]
    real = fence_mod._ofd_lock
    took_own, owner_took_servers = threading.Event(), threading.Event()
    me = []
    owner = threading.get_ident()

    def slow_after_own(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        out = real(fd, kind, wait, byte)
        if me and threading.get_ident() == me[0] and byte == fence_mod.FENCE_BYTE \
                and kind == fence_mod.fcntl.F_RDLCK and not took_own.is_set():
            took_own.set()          # the rank holds its own file: now the owner runs
            # until it holds the server's file (the first it locks), however
            # slowly it is scheduled; then the rank asks for the server's
            assert owner_took_servers.wait(20), "the owner never locked the server's file"
        elif threading.get_ident() == owner and out and byte == fence_mod.FENCE_BYTE \
                and kind == fence_mod.fcntl.F_WRLCK:
            owner_took_servers.set()
        return out

    def write():
        me.append(threading.get_ident())
        with rank.writing():
            pass
    fence_mod._ofd_lock = slow_after_own
    try:
        t = threading.Thread(target=write)
        t.start()
        assert took_own.wait(10)
        # an owner that waited on the rank would wait its whole timeout (and
        # fail busy); one that lets go and tries again takes a small part of it
        timeout = 30.0
        t0 = time.monotonic()
        fence_writers([(owner_fds[0], paths[0]), (owner_fds[1], paths[1])], timeout=timeout)
        assert time.monotonic() - t0 < timeout / 2, "the owner waited on a rank that waited on it"
        t.join(10)
        assert not t.is_alive()
    finally:
        fence_mod._ofd_lock = real
        rank.close()
        for fd in owner_fds:
            os.close(fd)


def test_a_new_servers_files_replace_the_last_ones_once_no_write_holds_them(tmp_path):
    paths = [str(tmp_path / f"f{i}") for i in range(5)]
    for p in paths:
        open(p, "wb").close()

    def opened(*idx):
        return [os.open(paths[i], os.O_RDONLY) for i in idx]
    rank = WriteFence(opened(0))
    try:
        rank.served(opened(1, 2))
        assert len(rank._fds()) == 3
        rank.served(opened(0, 2))          # its own file and one it holds: no new ones
        assert len(rank._fds()) == 2
        with rank.writing():               # a write in flight keeps the last server's
            rank.served(opened(3, 4))
            assert len(rank._fds()) == 4
        assert len(rank._fds()) == 3
        want = opened(0, 3, 4)
        assert {WriteFence._file(fd) for fd in rank._fds()} == \
            {WriteFence._file(fd) for fd in want}
        for fd in want:
            os.close(fd)
    finally:
        rank.close()


def _close_in_turnstile(monkeypatch, rank, then):
    """While a writer waits at the turnstile (its files' numbers taken, its
    shared lock not yet), run ``then()`` once: another thread's close() or
    a new server's files arriving."""
    import kvblock.store.fence as fence_mod

    real = fence_mod._ofd_lock
    fired = []

    def hooked(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        if byte == fence_mod.TURNSTILE_BYTE and not fired:
            fired.append(fd)
            then()
        return real(fd, kind, wait, byte)
    monkeypatch.setattr(fence_mod, "_ofd_lock", hooked)
    return fired


def _is_open(fd) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_close_while_a_writer_is_at_the_turnstile_waits_for_it(target, monkeypatch):
    """close() between a writer's look at the files and its locks on them
    closed them under it: the writer's lock call met a closed descriptor
    (OSError EBADF instead of the StoreClosedError its caller gives for a
    closed store), or one reopened meanwhile for another file (a lock taken
    and dropped on someone else's file)."""
    rank = _rank(target[1])
    fd = rank._own[0]
    _close_in_turnstile(monkeypatch, rank, rank.close)
    with rank.writing():
        assert _is_open(fd), "close() closed the files a writer was locking"
    assert not _is_open(fd) or WriteFence._file(fd) != WriteFence._file(target[0])
    assert rank._fds() == []


def test_a_new_server_while_a_writer_is_at_the_turnstile_keeps_the_last_files(tmp_path,
                                                                                monkeypatch):
    paths = [str(tmp_path / f"f{i}") for i in range(3)]
    for p in paths:
        open(p, "wb").close()
    rank = WriteFence([os.open(paths[0], os.O_RDONLY)])
    try:
        rank.served([os.open(paths[1], os.O_RDONLY)])
        old = rank._served[0]
        _close_in_turnstile(monkeypatch, rank,
                            lambda: rank.served([os.open(paths[2], os.O_RDONLY)]))
        with rank.writing():
            assert _is_open(old), "a new server's files closed the last's under a writer"
        assert len(rank._fds()) == 2
    finally:
        rank.close()


def test_a_child_forked_while_an_owner_holds_the_fence_keeps_no_lock(target, monkeypatch):
    """A process forked (by another thread) while an owner holds the fence
    shares the owner's open file descriptions.  The owner let go of its
    locks by closing its descriptors, which drops an OFD lock only when the
    last copy is closed: the child's copy kept the turnstile and the fence
    locked for its whole life, and every rank's write waited (without
    bound) for a process that does not write at all."""
    import kvblock.store.fence as fence_mod

    real = fence_mod._ofd_lock
    r, w = os.pipe()
    child = []

    def forking(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        out = real(fd, kind, wait, byte)
        if out and kind == fence_mod.fcntl.F_WRLCK and byte == fence_mod.FENCE_BYTE \
                and not child:
            pid = os.fork()
            if pid == 0:            # holds copies of the owner's files until told to go
                try:
                    os.read(r, 1)
                finally:
                    os._exit(0)
            child.append(pid)
        return out
    monkeypatch.setattr(fence_mod, "_ofd_lock", forking)
    try:
        fence_writers([target], timeout=0)
        monkeypatch.setattr(fence_mod, "_ofd_lock", real)
        assert child, "the test needs a child forked while the owner held the fence"
        assert _fenced(target), "a forked child kept the owner's fence locks"
        rank = _rank(target[1])
        try:
            with rank.writing():       # no wait on the child
                pass
        finally:
            rank.close()
    finally:
        os.write(w, b"x")
        for pid in child:
            os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def test_an_interrupt_between_the_turnstile_lock_and_its_unlock_leaves_no_lock(target,
                                                                                 monkeypatch):
    """A KeyboardInterrupt (Ctrl-C, or any exception a signal handler raises)
    that lands after a writer took its shared turnstile lock and before it
    dropped it: the writer gave up, but the lock stayed with the rank's open
    file description, so every later owner (a restarted server) found the
    turnstile held and failed busy after FENCE_WAIT_S, for as long as the
    rank lived."""
    import kvblock.store.fence as fence_mod

    real = fence_mod._ofd_lock
    fired = []

    def interrupted(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        if kind == fence_mod.fcntl.F_UNLCK and byte == fence_mod.TURNSTILE_BYTE and not fired:
            fired.append(True)
            raise KeyboardInterrupt       # the signal lands before the unlock runs
        return real(fd, kind, wait, byte)
    rank = _rank(target[1])
    try:
        monkeypatch.setattr(fence_mod, "_ofd_lock", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with rank.writing():
                pass
        monkeypatch.setattr(fence_mod, "_ofd_lock", real)
        assert fired
        assert _fenced(target), "an interrupted writer left the turnstile locked"
        with rank.writing():             # the rank writes on
            pass
        assert _fenced(target)
    finally:
        rank.close()


def test_an_interrupt_while_a_writer_takes_the_fence_leaves_no_lock(tmp_path, monkeypatch):
    """The same, once past the turnstile: an interrupt while the first
    writer takes the shared fence lock on its second file left the first
    file's lock held with no writer counted, never dropped."""
    import kvblock.store.fence as fence_mod

    paths = [str(tmp_path / f"f{i}") for i in range(2)]
    for p in paths:
        open(p, "wb").close()
    owner_fds = [os.open(p, os.O_RDWR) for p in paths]
    rank = WriteFence([os.open(p, os.O_RDONLY) for p in paths])
    real = fence_mod._ofd_lock
    taken = []

    def interrupted(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        if kind == fence_mod.fcntl.F_RDLCK and byte == fence_mod.FENCE_BYTE:
            if taken:
                raise KeyboardInterrupt   # on the second file, the first one locked
            taken.append(fd)
        return real(fd, kind, wait, byte)
    try:
        monkeypatch.setattr(fence_mod, "_ofd_lock", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with rank.writing():
                pass
        monkeypatch.setattr(fence_mod, "_ofd_lock", real)
        assert rank.writers == 0
        fence_writers(list(zip(owner_fds, paths)), timeout=0)   # not busy
    finally:
        rank.close()
        for fd in owner_fds:
            os.close(fd)
