"""Starting a store server: taking the socket path, and what a start that
is refused leaves behind."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading

import pytest

import kvblock.store.server as server_mod
from kvblock import KVStore, create_file
from kvblock.errors import SocketInUseError
from kvblock.store.server import open_server
from tests.store.workload import GEOM, REGION

MIB = 1 << 20


def _store_file(path) -> str:
    path = str(path)
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    return path


class _Seen(logging.Handler):
    """Sets ``event`` at the first kvblock log record holding ``words``."""

    def __init__(self, words: str, event: threading.Event):
        super().__init__(logging.DEBUG)
        self.words, self.event = words, event

    def emit(self, record):
        if self.words in record.getMessage():
            self.event.set()


def test_two_servers_of_different_stores_never_take_each_others_socket(tmp_path,
                                                                       monkeypatch, caplog):
    """Two servers of two stores told one socket path, where a server that
    died left its socket: each found it stale, and the check, the unlink
    and the bind were three steps.  A server that had checked unlinked the
    socket the other had bound since and bound its own: both started, one
    listening on a socket no rank could reach (its ranks went to the other
    store).  The steps are now one, under a lock of <socket>.fence: the
    second finds the first's live server and is refused."""
    a, b = _store_file(tmp_path / "a.img"), _store_file(tmp_path / "b.img")
    sock = str(tmp_path / "kv.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock)                       # a dead server's: nobody listens
    stale.close()

    servers, refused = {}, {}
    b_went = threading.Event()             # B started, was refused, or waits for A
    handler = _Seen("waiting for it", b_went)
    logging.getLogger("kvblock").addHandler(handler)
    caplog.set_level(logging.INFO, logger="kvblock")     # (the handler sees INFO)

    def start(name, path):
        try:
            servers[name] = open_server([path], sock)
        except SocketInUseError as e:
            refused[name] = e
        finally:
            if name == "B":
                b_went.set()

    real_check = server_mod._check_socket_path

    def check(path):
        found = real_check(path)
        # A, in _bind, between its look and its unlink: B starts now
        if threading.current_thread().name == "A" and \
                sys._getframe(1).f_code.co_name == "_bind" and "B" not in threads:
            threads["B"] = threading.Thread(target=start, args=("B", b), name="B")
            threads["B"].start()
            assert b_went.wait(60), "B neither started nor waited"
        return found

    monkeypatch.setattr(server_mod, "_check_socket_path", check)
    threads = {}
    threads["A"] = threading.Thread(target=start, args=("A", a), name="A")
    try:
        threads["A"].start()
        threads["A"].join(120)
        threads["B"].join(120)
        assert not threads["A"].is_alive() and not threads["B"].is_alive()
        assert len(servers) == 1, f"both started: {sorted(servers)}"
        (name, server), = servers.items()
        assert os.stat(sock).st_ino == server._socket_ino, "its socket was taken"
        (other, e), = refused.items()
        assert other != name and "already listens" in str(e), e
        assert sock in str(e) and "another --socket path" in str(e)
    finally:
        logging.getLogger("kvblock").removeHandler(handler)
        for server in servers.values():
            server.stop()


def test_a_refused_start_leaves_no_fence_file_it_made(tmp_path):
    """A start refused after it made <socket>.fence (a device that cannot
    be opened, one another process holds) left the file behind, beside no
    socket.  One that made it removes it; one refused by a live server
    keeps that server's, which its ranks fence on."""
    from kvblock.errors import KVBlockError

    sock = str(tmp_path / "kv.sock")
    fence = sock + ".fence"
    with pytest.raises(KVBlockError) as e:
        open_server([str(tmp_path / "missing.img")], sock)
    assert "missing.img" in str(e.value)
    assert not os.path.exists(fence), "the refused start left its fence file"
    assert not os.path.exists(sock)

    a, b = _store_file(tmp_path / "a.img"), _store_file(tmp_path / "b.img")
    with KVStore.open([b]):                        # the devices refused: busy
        with pytest.raises(KVBlockError):
            open_server([b], sock)
    assert not os.path.exists(fence), "the refused start left its fence file"

    server = open_server([a], sock)
    try:
        held = os.stat(fence).st_ino
        with pytest.raises(SocketInUseError, match="already listens"):
            open_server([b], sock)
        assert os.stat(fence).st_ino == held, "a live server's fence file was removed"
    finally:
        server.stop()
    assert os.path.exists(fence)                   # a stopped server's stays: ranks may write


def test_a_stopping_server_never_removes_the_socket_of_the_next(tmp_path, monkeypatch,
                                                                  caplog):
    """A server that stops closes its listener, looks that the socket path
    is still its socket, and removes it.  A server of another store starting
    on that path between the look and the removal found the socket stale,
    replaced it with its own (perhaps of the same inode number, the old one
    freed), and the stopping one then removed that: the new server served
    on a socket no rank could reach.  The look and the removal are now
    under the lock a start takes around its own look and bind."""
    a, b = _store_file(tmp_path / "a.img"), _store_file(tmp_path / "b.img")
    sock = str(tmp_path / "kv.sock")
    servers, errors = {}, {}
    b_went = threading.Event()             # B started, failed, or waits for A
    handler = _Seen("waiting for it", b_went)
    logging.getLogger("kvblock").addHandler(handler)
    caplog.set_level(logging.INFO, logger="kvblock")

    def start_b():
        try:
            servers["B"] = open_server([b], sock)
        except Exception as e:             # noqa: BLE001  (asserted on below)
            errors["B"] = e
        finally:
            b_went.set()

    real_unlink = os.unlink
    threads = []

    def unlink(path, *args, **kwargs):
        # A's stop, between its look at the socket and its removal: B starts
        if sys._getframe(1).f_code.co_name == "_unlink_socket" and not threads:
            threads.append(threading.Thread(target=start_b, name="B"))
            threads[0].start()
            assert b_went.wait(60), "B neither started nor waited"
        return real_unlink(path, *args, **kwargs)

    server_a = open_server([a], sock)
    try:
        monkeypatch.setattr(os, "unlink", unlink)
        server_a.stop()
        monkeypatch.undo()
        threads[0].join(120)
        assert not threads[0].is_alive()
        assert "B" in servers, errors
        assert os.path.exists(sock), "the stopping server removed the next one's socket"
        assert os.stat(sock).st_ino == servers["B"]._socket_ino
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(sock)            # B answers there
    finally:
        monkeypatch.undo()
        logging.getLogger("kvblock").removeHandler(handler)
        server_a.stop()
        for server in servers.values():
            server.stop()
