"""Test helpers around store servers: stopping one a test's ranks started
(``kvblock serve`` runs in its own session, so it outlives the test unless
stopped), waiting for clients to reconnect, and running code in a forked child."""

from __future__ import annotations

import os
import signal
import threading
import time


def stop_server(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM (a clean stop: it checkpoints), then SIGKILL if it lingers."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _exited(pid):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def _exited(pid: int) -> bool:
    """Gone, or a zombie: a server this process spawned stays one until its
    Popen reaps it, and kill(pid, 0) still finds it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):   # gone (reaped while we read)
        return True


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: the signal takes effect
    only when each of its threads next runs, and a thread busy on another
    core may still answer a request meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    tasks = f"/proc/{pid}/task"
    while True:
        states = []
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass   # a thread that just ended
        if states and all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.01)


def wait_reconnected(stores, old_pid: int, timeout: float = 60.0) -> int:
    """Wait until every RemoteStore in ``stores`` is connected to a server
    other than ``old_pid`` (the same one for all); its pid.  Each is asked
    something meanwhile: a store finds its server gone on a call."""
    from kvblock.store.client import ServerGoneError

    deadline = time.monotonic() + timeout
    while True:
        for s in stores:
            try:
                s.lookup([bytes(16)])
            except ServerGoneError:
                pass
        pids = {s.server_pid for s in stores if s.server_alive}
        if len(pids) == 1 and old_pid not in pids and \
                all(s.server_alive for s in stores):
            return pids.pop()
        assert time.monotonic() < deadline, \
            f"not reconnected after {timeout} s: {[repr(s) for s in stores]}"
        time.sleep(0.05)


def exit_code_in_child(fn, timeout: float = 10.0) -> int:
    """Fork; the child runs ``fn()`` (its return value is the exit code; an
    exception is 99) and exits without cleanup.  The parent waits at most
    ``timeout`` seconds (a child hung on a lock is killed: AssertionError)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child did not exit in {timeout} s")
        time.sleep(0.02)


def exit_code_in_child_while_held(lock, fn, timeout: float = 10.0) -> int:
    """exit_code_in_child(fn), forked while another thread of this process
    holds ``lock`` (any context manager): the child inherits it held by a
    thread it does not have."""
    held, go = threading.Event(), threading.Event()

    def holding():
        with lock:
            held.set()
            go.wait(20)
    t = threading.Thread(target=holding)
    t.start()
    try:
        assert held.wait(10)
        return exit_code_in_child(fn, timeout)
    finally:
        go.set()
        t.join(20)
