"""Several processes, one store: a store server owns the metadata, rank
processes (RemoteStore) do their own direct I/O on the device."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import ConfigError, DeviceBusyError, StoreClosedError
from kvblock.store.client import RemoteStore, ServerError, ServerGoneError, connect
from kvblock.store.server import serve_in_background, spawn_server
from tests.serve.rank import deleted, marker, nblocks, run_index, started
from tests.store.workload import GEOM, REGION, Journal, check_store, run_data, run_keys
from tests.support.races import in_two_threads, meet_in_statement, release_twice
from tests.support.servers import exit_code_in_child

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
KILL_ROUNDS = int(os.environ.get("KVBLOCK_SERVE_KILL_ROUNDS", "2"))


def _rank(*args, stdin=None) -> subprocess.Popen:
    # Read with _output(): communicate() with a timeout reads the raw pipe,
    # skipping lines readline() has already buffered.
    return subprocess.Popen([sys.executable, "-m", "tests.serve.rank", *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=stdin, text=True)


def _output(p: subprocess.Popen, timeout=45) -> str:
    """The rest of a rank's output (stdout and stderr) once it exits."""
    out = p.stdout.read()
    p.wait(timeout)
    p.stdout.close()
    return out


def _format(dev):
    KVStore.format([dev], GEOM, region_size=REGION, journal_bytes=256 << 10).close()


def _wait_gone(path, timeout=20.0):
    deadline = time.monotonic() + timeout
    while os.path.exists(path):
        assert time.monotonic() < deadline, f"server never removed {path}"
        time.sleep(0.02)


def _kill_servers_of(path: str) -> list[int]:
    """SIGKILL every process whose command line names ``path`` (a store
    server a rank started on the test's socket); their pids."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if path.encode() in cmdline:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except ProcessLookupError:
                pass
    return killed


@pytest.fixture
def sock(tmp_path):
    """The test's socket path; a server still serving it when the test ends
    (one that failed before stopping it) is killed, so it cannot keep a
    loop device attached or the cores busy."""
    path = str(tmp_path / "kv.sock")
    yield path
    _kill_servers_of(path)


def test_ranks_share_one_store(loop_device, sock):
    """3 ranks start at once: exactly one starts the server (connect's race),
    all put, delete and read their own and each other's runs, in step (each
    reads the others' last runs while they write their next); every byte is
    checked, no read fails a checksum, in the ranks and again after a clean
    stop and reopen."""
    dev = loop_device(64 * MIB)
    _format(dev)
    nranks, runs = 3, 24
    procs = [_rank("mix", sock, dev, r, nranks, runs) for r in range(nranks)]
    outs = []
    for p in procs:
        out = _output(p)
        assert p.returncode == 0, out
        outs.append(out.splitlines())
    pids = {int(lines[0].split()[1]) for lines in outs}
    assert len(pids) == 1, f"ranks reached different servers: {pids}"
    cross = [int(lines[-1].split()[1]) for lines in outs]
    assert all(c >= (nranks - 1) * (runs - 4) for c in cross), cross
    # read while their writers went on: the other ranks' runs 0..runs-2, less the deleted
    live = [int(lines[-2].split()[1]) for lines in outs]
    assert live == [(nranks - 1) * sum(not deleted(j, runs) for j in range(runs - 1))] * nranks, \
        live
    os.kill(pids.pop(), signal.SIGTERM)   # clean stop: checkpoint, socket removed
    _wait_gone(sock)
    log = Journal()
    for r in range(nranks):
        for m in (marker(r), started(r)):
            log.attempted[m[0]] = m
            log.acked.add(m[0])
        for j in range(runs):
            keys = run_keys(run_index(r, j), nblocks(j))
            log.attempted[keys[0]] = keys
            log.acked.add(keys[0])
            if deleted(j, runs):
                log.deleting.add(keys[0])
                log.deleted.add(keys[0])
    with KVStore.open([dev]) as store:
        assert store.clean_at_open
        assert check_store(store, log) == sum(nblocks(j) for j in range(runs)
                                              if not deleted(j, runs)) * nranks + 2 * nranks


def _check_served(sock, log) -> None:
    """Through a server: every acknowledged run of ``log`` (not deleted)
    reads back whole, byte for byte; nothing it deleted is found."""
    with RemoteStore(sock) as r:
        for first, keys in log.attempted.items():
            n = r.lookup(keys)
            if first in log.deleted:
                assert n == 0, f"deleted run {first!r} served again"
            elif first in log.acked and first not in log.deleting:
                assert n == len(keys), f"acknowledged run {first!r}: {n}/{len(keys)} blocks"
            if n:
                shape = (GEOM.num_layers, GEOM.head_groups, len(keys), GEOM.group_block_bytes)
                out = np.zeros(len(keys) * GEOM.block_bytes, np.uint8)
                assert r.get_run(keys, out) == n
                assert np.array_equal(out.reshape(shape)[:, :, :n],
                                      run_data(keys).reshape(shape)[:, :, :n]), first
        s = r.stats()
        assert s["checksum_failures"] == 0 and s["client"]["checksum_failures"] == 0


def test_server_sigkill_mid_writes(loop_device, sock):
    """SIGKILL the server while 3 ranks write and read each other's runs, one
    of them holding a put with its data written and its commit not asked
    (so a put is surely in flight): each rank fails with ServerGoneError; the
    store then recovers with no phantom (the held run is not there), right
    bytes and every acknowledged put, checked in one process and through a
    restarted server.  KVBLOCK_SERVE_KILL_ROUNDS rounds (2), each on the
    recovered store."""
    dev = loop_device(128 * MIB)
    _format(dev)
    rng = random.Random(6)
    log = Journal()
    nranks = 3
    for round_ in range(KILL_ROUNDS):
        server = spawn_server([dev], sock, timeout=30)
        if round_:
            _check_served(sock, log)    # the last round's puts, through a new server
        starts = [100_000 * (round_ + 1) + 10_000 * r for r in range(nranks)]
        hold = rng.randint(3, 12)
        ranks = [_rank("kill", sock, s, hold if r == 0 else 0,
                       *[o for o in starts if o != s], stdin=subprocess.PIPE if r == 0 else None)
                 for r, s in enumerate(starts)]
        firsts = []
        for p in ranks:  # every rank is writing
            firsts.append(p.stdout.readline())
            assert firsts[-1].startswith("put "), firsts[-1] + _output(p)
        held = [firsts[0].strip()]
        while not held[-1].startswith("holding "):   # rank 0 stops in its put
            held.append(ranks[0].stdout.readline().strip())
            assert held[-1], "\n".join(held) + _output(ranks[0])
        held_run = int(held[-1].split()[1])
        time.sleep(rng.uniform(0.0, 0.05))
        server.send_signal(signal.SIGKILL)
        server.wait()
        ranks[0].stdin.write("go\n")       # its write ends, its commit finds no server
        ranks[0].stdin.close()
        firsts[0] = "\n".join(held)
        for p, start, first in zip(ranks, starts, firsts):
            out = _output(p)
            lines = first.splitlines() + out.splitlines()
            assert p.returncode == 3 and lines[-1] == "gone ServerGoneError", out[-3000:]
            puts = [int(x.split()[1]) for x in lines if x.startswith("put ")]
            dels = [int(x.split()[1]) for x in lines if x.startswith("del ")]
            last = max(puts)
            for i in range(start, last + 2):  # the one after the last ack may have landed
                keys = run_keys(i, nblocks(i))
                log.attempted[keys[0]] = keys
            for i in puts:
                log.acked.add(run_keys(i, 1)[0])
            for i in dels:
                log.deleting.add(run_keys(i, 1)[0])
                log.deleted.add(run_keys(i, 1)[0])
            if last % 7 == 6 and last - 3 not in dels:  # its delete may have been in flight
                log.deleting.add(run_keys(last - 3, 1)[0])
        assert held_run == starts[0] + hold and held_run - 1 in \
            [int(x.split()[1]) for x in firsts[0].splitlines() if x.startswith("put ")]
        with KVStore.open([dev]) as store:
            assert check_store(store, log) > 0
            assert store.lookup(run_keys(held_run, nblocks(held_run))) == 0, \
                "a put whose commit was never sent is stored"
            assert store.stats()["regions_free"] > 0, "eviction would hide losses"
        with pytest.raises(ServerGoneError):
            RemoteStore(sock)   # the dead server's socket is stale
    server = spawn_server([dev], sock, timeout=30)
    try:
        _check_served(sock, log)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def test_rank_killed_mid_put_leaves_nothing_pinned(loop_device, sock):
    dev = loop_device(64 * MIB)
    _format(dev)
    server = serve_in_background([dev], sock)
    try:
        st = server.store
        p = _rank("stall", sock)
        line = p.stdout.readline()
        assert line == "stalled\n", line + (_output(p) if p.poll() is not None else "")
        with st._lock:
            assert st.regions.pins.sum() == 2     # its reader pin and its writer pin
        p.kill()
        _output(p)
        deadline = time.monotonic() + 10
        while True:
            with st._lock:
                if st.regions.pins.sum() == 0 and server.client_count() == 0:
                    break
            assert time.monotonic() < deadline, "pins of a dead rank were not released"
            time.sleep(0.01)
        with RemoteStore(sock) as r:
            stalled = run_keys(777, 3)
            assert r.lookup(stalled) == 0          # no phantom
            assert r.lookup([b"stall-read"]) == 1
            keys = run_keys(1, 2)
            r.put_run(keys, run_data(keys))       # the server still serves
            assert r.lookup(keys) == 2
            s = r.stats()
            assert s["pinned_regions"] == 0
            assert r.evict(all=True) > 0
            s = r.stats()
            assert s["regions_free"] == s["regions"], "a region stayed pinned"
            assert r.lookup([b"stall-read"]) == 0
    finally:
        server.stop()
    with KVStore.open([dev]) as store:
        assert store.lookup(run_keys(777, 3)) == 0 and not store.index.runs


def test_save_and_load_blocks_through_remote_store(loop_device, sock):
    torch = pytest.importorskip("torch")
    from kvblock.layout import Geometry
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    L, H, D, BS = 3, 8, 16, 16
    g = Geometry(L, H, D, "bfloat16", BS, 2, head_groups=2)
    dev = loop_device(64 * MIB)
    KVStore.format([dev], g, model="m").close()
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(2, 8, BS, H, D, generator=gen).to(torch.bfloat16) for _ in range(L)]
    keys = [f"page{i}".encode() for i in range(5)]
    src_pages, dst_pages = [4, 0, 7, 2, 5], [1, 3, 5, 7, 0]
    with serve_in_background([dev], sock, model="m") as server, \
            RemoteStore(sock) as saver, RemoteStore(sock) as rank0, RemoteStore(sock) as rank1:
        assert save_blocks(saver, keys, VLLMLayout(src), src_pages) == 5
        # a whole cache, loaded by another process's store handle
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(rank0, keys + [b"missing"], VLLMLayout(dst), dst_pages + [6])
        assert h.wait() == 5
        for layer in range(L):
            assert torch.equal(src[layer][:, src_pages].view(torch.int16),
                               dst[layer][:, dst_pages].view(torch.int16))
            assert not dst[layer][:, 6].any()
        # tensor parallelism: each rank reads its head group
        for tp_rank, store in enumerate((rank0, rank1)):
            part = [torch.zeros(2, 8, BS, H // 2, D, dtype=torch.bfloat16) for _ in range(L)]
            h = load_blocks(store, keys, VLLMLayout(part), dst_pages, tp_rank=tp_rank,
                            tp_size=2)
            assert h.wait() == 5
            heads = slice(tp_rank * H // 2, (tp_rank + 1) * H // 2)
            for layer in range(L):
                assert torch.equal(src[layer][:, src_pages][..., heads, :].view(torch.int16),
                                   part[layer][:, dst_pages].view(torch.int16))
        # a corrupt range fails its checksum in the rank: the server drops the run
        with rank0._lock:
            segs = rank0._segments(keys)
        run = segs[0][0]
        rank0._unpin(segs)
        devno, off = rank0.regions.address(run.region, run.offset)
        rank0.io.write_bytes(devno, off, b"\xa5" * 4096)
        h = load_blocks(rank1, keys, VLLMLayout(dst), dst_pages)
        assert h.wait() == 0
        assert rank0.lookup(keys) == 0
        st = server.store
        assert st.counters["checksum_failures"] == 1 and rank1.counters["checksum_failures"] == 1
        with st._lock:
            assert st.regions.pins.sum() == 0


def test_blocks_in_separate_buffers_through_remote_store(tmp_path, sock):
    from kvblock import create_file
    from tests.store.test_scatter import ALIGNED, _blocks

    path = str(tmp_path / "s.img")
    create_file(path, 16 * MIB)
    KVStore.format([path], ALIGNED, region_size=REGION).close()
    keys = run_keys(1, 4)
    data = run_data(keys, ALIGNED)
    with serve_in_background([path], sock), RemoteStore(sock) as a, RemoteStore(sock) as b:
        src = _blocks(data, ALIGNED)
        assert a.put_blocks(keys, src) == 4
        dst = _blocks(np.zeros_like(data), ALIGNED)
        assert b.get_blocks(keys, dst) == 4
        assert all(np.array_equal(x, y) for x, y in zip(dst, src))
        out = np.zeros_like(data)
        assert a.get_run(keys, out) == 4 and np.array_equal(out, data)
        assert b.present([keys[0], b"nope", keys[3]]).tolist() == [True, False, True]
        pins = b.pin(keys)
        assert len(pins) == 1
        b.unpin(pins)


def test_a_rank_reads_a_few_blocks_of_a_long_run_by_its_trailer(tmp_path, sock):
    """A rank's run carries its block digest trailer (written by the rank,
    its checksum published by the server): another rank reads two blocks of
    it without reading whole ranges, and damage there is still found."""
    from kvblock import create_file
    from tests.store.test_partial_verify import _blocks as run_blocks
    from tests.store.test_partial_verify import _flip

    path = str(tmp_path / "s.img")
    create_file(path, 32 * MIB)
    KVStore.format([path], GEOM, region_size=4 * MIB).close()
    keys = run_keys(5, 64)
    data = run_data(keys)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as a, \
            RemoteStore(sock) as b:
        assert a.put_run(keys, data) == 64
        lay = b.layout(64)
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert b.get_run(keys[30:32], out) == 2
        assert np.array_equal(out, run_blocks(data, GEOM, 30, 2))
        assert b.counters["partial_verified_reads"] == 1
        assert b.counters["bytes_read"] < lay.data_bytes // 4
        (run,) = server.store.index.runs.values()
        _flip(server.store, run, lay.range_bytes + 31 * GEOM.group_block_bytes)
        assert b.get_run(keys[30:32], out) == 0
        assert b.counters["checksum_failures"] == 1
        assert a.lookup(keys) == 0


def test_a_sigterm_right_after_start_stops_the_server_cleanly(tmp_path, sock):
    """spawn_server returns once the socket accepts; the serve command set
    its SIGTERM handler only after that, so a SIGTERM then (an operator's
    stop, a test's teardown) killed it: no checkpoint, no "stopped" line,
    exit -15.  Every start here is stopped at once and must stop cleanly."""
    from kvblock import create_file

    path = str(tmp_path / "s.img")
    create_file(path, 16 * MIB)
    KVStore.format([path], GEOM, region_size=REGION).close()
    for _ in range(5):
        server = spawn_server([path], sock, timeout=30)
        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0
        assert Path(sock + ".log").read_text().endswith("kvblock serve: stopped (clean)\n")


def test_spawn_moves_a_long_log_aside(tmp_path, sock, monkeypatch):
    """Servers auto-started for one socket append to one log: past
    LOG_KEEP_BYTES it moves to <log>.1 (the older one replaced) before the
    next server starts, so it does not grow without end."""
    from kvblock import create_file
    from kvblock.store import server as server_mod
    from tests.support.servers import stop_server

    path = str(tmp_path / "s.img")
    create_file(path, 16 * MIB)
    KVStore.format([path], GEOM, region_size=REGION).close()
    log = Path(sock + ".log")
    Path(sock + ".log.1").write_text("oldest\n")
    log.write_text("old\n" * 1000)
    monkeypatch.setattr(server_mod, "LOG_KEEP_BYTES", 2000)
    for starts in (1, 2):          # the second start finds a short log: kept
        server = spawn_server([path], sock, timeout=30)
        stop_server(server.pid)
        server.wait()
        assert Path(sock + ".log.1").read_text() == "old\n" * 1000
        assert log.read_text().count("kvblock serve: stopped (clean)") == starts, log.read_text()


@pytest.mark.parametrize("blocked", ["log", "older log"])
def test_a_server_log_that_cannot_be_written_is_a_config_error_naming_it(tmp_path, sock,
                                                                        monkeypatch, blocked):
    """connect() starts a server whose output goes to <socket>.log, moved
    to <socket>.log.1 past LOG_KEEP_BYTES.  A log that cannot be opened (a
    directory there) or moved aside was a bare IsADirectoryError out of
    connect(): now a ConfigError naming the log and the fix, and no server
    is started."""
    from kvblock.errors import KVBlockError
    from kvblock.store import server as server_mod

    path = _store_file(tmp_path)
    if blocked == "log":
        os.mkdir(sock + ".log")
    else:
        monkeypatch.setattr(server_mod, "LOG_KEEP_BYTES", 100)
        Path(sock + ".log").write_text("old\n" * 100)
        os.mkdir(sock + ".log.1")
    with pytest.raises(KVBlockError) as e:
        connect(sock, [path], start_timeout=30)
    assert isinstance(e.value, ConfigError), repr(e.value)
    assert sock + ".log" in str(e.value) and "log_path" in str(e.value), str(e.value)
    assert not os.path.exists(sock)
    with KVStore.open([path]):           # no server holds the store
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a server as another user")
def test_a_stale_socket_this_user_cannot_remove_is_refused_with_the_fix(tmp_path):
    """A server that died left its socket in a shared sticky directory (as
    /tmp is); the next server, run by another user, finds it stale but may
    not remove it.  That was a bare PermissionError (`kvblock serve`: the
    socket's path and 'Operation not permitted', exit 4, no fix); it is a
    DevicePermissionError naming the socket, its owner and the fix."""
    import socket as socket_mod
    import shutil
    import stat

    from kvblock import create_file

    nobody = 65534
    base = Path("/var/tmp") / f"kvblock-stale-{os.getpid()}-{tmp_path.name}"
    base.mkdir()                 # (tmp_path's parents are root's alone)
    try:
        os.chmod(base, 0o755)
        shared, home = base / "shared", base / "home"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        home.mkdir(mode=0o700)
        os.chown(home, nobody, nobody)
        path = str(home / "kv.img")
        create_file(path, 16 * MIB)
        _format(path)
        os.chown(path, nobody, nobody)
        sock = str(shared / "kv.sock")
        stale = socket_mod.socket(socket_mod.AF_UNIX)
        stale.bind(sock)          # root's, left by a server that died: nobody listens
        stale.close()
        os.chmod(sock, 0o777)     # (so anyone may connect: found stale, not unprobed)
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
        code = ("import sys\n"
                "from kvblock.errors import DevicePermissionError\n"
                "from kvblock.store.server import open_server\n"
                "try:\n"
                "    open_server([sys.argv[1]], sys.argv[2]).stop()\n"
                "except DevicePermissionError as e:\n"
                "    print('refused:', e)\n")
        as_nobody = ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"]
        out = subprocess.run([*as_nobody, sys.executable, "-c", code, path, sock],
                             capture_output=True, text=True, timeout=120, cwd=ROOT,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 0 and out.stdout.startswith("refused:"), \
            out.stdout + out.stderr
        assert sock in out.stdout and "owned by uid 0" in out.stdout and \
            "remove it" in out.stdout and "another --socket path" in out.stdout, out.stdout
        serve = subprocess.run([*as_nobody, sys.executable, "-m", "kvblock", "serve", path,
                                "--socket", sock], capture_output=True, text=True,
                               timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
        assert serve.returncode == 4 and "remove it" in serve.stderr, serve.stderr
        assert os.path.exists(sock)          # left as it was
    finally:
        shutil.rmtree(base)


def test_a_ranks_device_error_counts_as_a_read_error_on_the_server(tmp_path, sock):
    """A rank's read that fails with EIO drops the run on the server as a
    checksum failure does, but the server counted it as one (the drop did
    not say why): its stats showed corruption where a device failed."""
    from kvblock import create_file
    from kvblock.errors import IOFailedError
    from tests.support.faults import BadSectors

    path = str(tmp_path / "s.img")
    create_file(path, 16 * MIB)
    KVStore.format([path], GEOM, region_size=REGION).close()
    keys = run_keys(3, 4)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as a, \
            RemoteStore(sock) as b:
        assert a.put_run(keys, run_data(keys)) == 4
        (run,) = server.store.index.runs.values()
        bad = BadSectors()
        bad.add(*b.regions.address(run.region, run.offset), GEOM.block_bytes)
        bad.install(b)
        with pytest.raises(IOFailedError, match="EIO"):
            b.get_run(keys, np.zeros(4 * GEOM.block_bytes, np.uint8))
        assert a.lookup(keys) == 0                          # dropped for every rank
        assert b.counters["read_errors"] == 1 and b.counters["checksum_failures"] == 0
        assert server.store.counters["read_errors"] == 1
        assert server.store.counters["checksum_failures"] == 0


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_a_rank_reads_several_requests_with_get_runs(tmp_path, shm_target, sock, where):
    """get_runs through a server: parts of runs read together and checked
    against their trailers, a whole run, a miss; a damaged block fails its
    own request only, and the server drops that run for every rank."""
    from kvblock import create_file
    from tests.store.test_get_runs import SLOTS, _aligned
    from tests.store.test_get_runs import _blocks as run_blocks
    from tests.store.test_partial_verify import _flip

    path = shm_target(32 * MIB) if where == "shm" else str(create_file(tmp_path / "s.img",
                                                                       32 * MIB))
    KVStore.format([path], SLOTS, region_size=4 * MIB).close()
    keys = [run_keys(i, 16) for i in range(3)]
    data = [run_data(k, SLOTS) for k in keys]
    bb = SLOTS.block_bytes
    with serve_in_background([path], sock) as server, RemoteStore(sock) as a, \
            RemoteStore(sock) as b:
        for k, d in zip(keys, data):
            assert a.put_run(k, d) == 16
        outs = [_aligned(2 * bb), _aligned(3 * bb), _aligned(16 * bb), _aligned(bb)]
        reqs = [keys[0][5:7], keys[1][0:3], keys[2], [b"never-stored"]]
        assert b.get_runs(list(zip(reqs, outs))) == [2, 3, 16, 0]
        assert np.array_equal(outs[0], run_blocks(data[0], SLOTS, 5, 2))
        assert np.array_equal(outs[1], run_blocks(data[1], SLOTS, 0, 3))
        assert np.array_equal(outs[2], data[2])
        assert b.counters["partial_verified_reads"] == 2
        run = min(server.store.index.runs.values(), key=lambda r: r.run_id)   # keys[0]'s
        _flip(server.store, run, 6 * bb + 3)
        assert b.get_runs([(keys[0][5:7], outs[0]), (keys[1][0:3], outs[1])]) == [0, 3]
        assert b.counters["checksum_failures"] == 1
        assert a.lookup(keys[0]) == 0 and a.lookup(keys[1]) == 16


def test_ranks_on_a_tmpfs_store_file_write_through_the_kernel(shm_target, sock):
    """A store file on tmpfs: ranks read it through a mapping, but write
    through the kernel (the server may have punched holes a mapped write would
    fault on); the server's own writes (metadata) may use its mapping."""
    path = shm_target(16 * MIB)
    _format(path)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as a, \
            RemoteStore(sock) as b:
        eng = a.io.engine
        assert eng.mapped(0) and not eng.mapped_for_writes(0)
        assert server.store.io.engine.mapped_for_writes(0)
        for i in range(6):
            keys = run_keys(i, 1 + i % 3)
            assert a.put_run(keys, run_data(keys)) == len(keys)
        for i in range(6):
            keys = run_keys(i, 1 + i % 3)
            out = np.zeros(len(keys) * GEOM.block_bytes, np.uint8)
            assert b.get_run(keys, out) == len(keys) and np.array_equal(out, run_data(keys))


def test_a_server_with_mapped_reads_off_keeps_a_tmpfs_store_file_allocated(shm_target, sock,
                                                                           monkeypatch):
    """Ranks map a fully allocated tmpfs store file whatever the server's
    KVBLOCK_MAPPED_READS says: a server with it "never" trimmed evicted
    regions (punched holes), which a rank's read through its mapping (a
    reader whose pin lease ran out) faults on, a SIGBUS on a full tmpfs."""
    path = shm_target(16 * MIB)
    _format(path)
    allocated = os.stat(path).st_blocks
    monkeypatch.setenv("KVBLOCK_MAPPED_READS", "never")
    with serve_in_background([path], sock) as server:
        monkeypatch.delenv("KVBLOCK_MAPPED_READS")
        with RemoteStore(sock) as a:
            assert not server.store.io.engine.mapped(0) and a.io.engine.mapped(0)
            keys = run_keys(1, 2)
            assert a.put_run(keys, run_data(keys)) == 2
            server.store.evict(all=True)
            assert server.store.stats()["discards"] == 0
            assert server.store.trim_free()[0] == 0
            assert os.stat(path).st_blocks == allocated
            keys = run_keys(2, 3)
            assert a.put_run(keys, run_data(keys)) == 3
            out = np.zeros(3 * GEOM.block_bytes, np.uint8)
            assert a.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))


def test_errors_cross_the_socket(tmp_path, sock):
    from kvblock import create_file

    path = str(tmp_path / "kv.img")
    create_file(path, 32 * MIB)
    _format(path)
    with pytest.raises(ServerGoneError, match="no store server"):
        RemoteStore(sock)
    with pytest.raises(ServerGoneError):
        connect(sock)                       # no devices: nothing to start
    with serve_in_background([path], sock) as server:
        with pytest.raises(ConfigError, match="already listens"):
            serve_in_background([path], sock)
        with pytest.raises(DeviceBusyError):    # the server holds the device
            serve_in_background([path], sock + "2")
        r = RemoteStore(sock)
        with pytest.raises(ConfigError, match="allocate"):
            r._call("allocate", nblocks=10 ** 6)
        with pytest.raises(ConfigError, match="unknown request"):
            r._call("format")
        keys = run_keys(0, 2)
        r.put_run(keys, run_data(keys))
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert r.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
        assert r.put_run(keys, run_data(keys)) == 2   # duplicate
        assert server.store.counters["put_duplicate_runs"] == 1
    with pytest.raises(ServerGoneError):
        r.lookup(keys)
    assert isinstance(ServerGoneError("x"), StoreClosedError)
    assert issubclass(ServerGoneError, ServerError)
    r.close()
    with pytest.raises(StoreClosedError):
        r.lookup(keys)
    with KVStore.open([path]) as store:
        assert store.lookup(keys) == 2


def test_numpy_integer_arguments_cross_the_socket_as_in_one_process(tmp_path, sock):
    """KVStore.evict takes a numpy integer byte count (one computed from
    stats arrays); RemoteStore.evict failed on it with an untyped TypeError
    ("Object of type int64 is not JSON serializable") before anything was
    sent.  Numpy scalars travel as the numbers they hold; a value no JSON
    can carry is a ConfigError naming its type."""
    from kvblock import create_file
    from kvblock.store.protocol import encode_msg

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    _format(path)
    with serve_in_background([path], sock) as server:
        r = RemoteStore(sock)
        try:
            for i in range(12):                 # fills and seals the first region
                keys = run_keys(i, 3)
                assert r.put_run(keys, run_data(keys)) == 3
            assert r.evict(np.uint32(0)) == 0
            assert server.store.counters["evicted_regions"] == 0
            assert r.evict(np.int64(server.store.regions.count * REGION)) >= 1
            assert r.lookup(run_keys(0, 3)) == 0
            with pytest.raises(ConfigError, match="bytes"):
                encode_msg({"op": "evict", "nbytes": b"1"})
            assert r.stats()["clients"] == 1      # the connection still serves
        finally:
            r.close()


def test_leftover_servers_are_killed_at_teardown(sock):
    """The sock fixture's cleanup: a process naming the socket is killed."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sock])
    try:
        # Popen returns once the exec began; /proc shows the new command
        # line only once the exec has set it up (empty until then).
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{p.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _kill_servers_of(sock) == [p.pid]
        assert p.wait(10) == -signal.SIGKILL
    finally:
        p.kill()
        p.wait()


def _store_file(tmp_path, size=8 * MIB):
    from kvblock import create_file

    path = str(tmp_path / "kv.img")
    create_file(path, size)
    _format(path)
    return path


@pytest.mark.parametrize("op", ["read", "write"])
def test_an_abandoned_connection_keeps_its_pins_until_its_io_is_done(tmp_path, sock, op,
                                                                    monkeypatch):
    """One thread's call times out (a slow server: here a slow checkpoint),
    so the connection is abandoned; another thread of the same process is
    in the middle of a read or write under a pin.  The pins must hold until
    that I/O is done: were they dropped at once, another rank could evict
    and rewrite the region under the read (wrong bytes) or have its own run
    overwritten by the late write.  (The checkpoint is answered once the
    client has given up, and only its answer has the short timeout=: no
    race with a loaded machine.)"""
    import threading

    from tests.support.timeouts import GENEROUS_S, hold_checkpoint, short_timeout_on

    path = _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        let_go = hold_checkpoint(server)    # until the client has given up on it
        short_timeout_on(monkeypatch, {"checkpoint"}, 0.3)
        a, b = RemoteStore(sock, timeout=GENEROUS_S), RemoteStore(sock)
        try:
            mine = run_keys(1, 3)
            if op == "read":
                a.put_run(mine, run_data(mine))
            for i in range(100, 110):                    # fill and seal the first regions
                b.put_run(run_keys(i, 3), run_data(run_keys(i, 3)))
            in_io, go = threading.Event(), threading.Event()
            if op == "read":
                real = a._segments

                def pinned_then_wait(keys):
                    segs = real(keys)
                    in_io.set()
                    go.wait(20)
                    return segs
                a._segments = pinned_then_wait
            else:
                real = a._stage_run

                def allocated_then_wait(*args, **kw):
                    in_io.set()
                    go.wait(20)
                    return real(*args, **kw)
                a._stage_run = allocated_then_wait
            result = {}

            def work():
                try:
                    if op == "read":
                        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
                        result["n"], result["out"] = a.get_run(mine, out), out
                    else:
                        result["n"] = a.put_run(mine, run_data(mine))
                except Exception as e:      # noqa: BLE001
                    result["error"] = e
            t = threading.Thread(target=work)
            t.start()
            assert in_io.wait(20)
            with pytest.raises(ServerGoneError, match="did not answer checkpoint in time"):
                a.checkpoint()
            let_go()                        # the server has finished the slow request
            assert server.client_count() == 2 and server.store.regions.pins.sum() == 1
            b.evict(all=True)               # cannot take the pinned region
            for i in range(200, 200 + 4 * server.store.regions.count):
                b.put_run(run_keys(i, 3), run_data(run_keys(i, 3)))
            go.set()
            t.join(20)
            if op == "read":
                assert result["n"] == 3 and np.array_equal(result["out"], run_data(mine))
            else:
                assert isinstance(result["error"], ServerGoneError)
            deadline = time.monotonic() + 10     # released: the connection closes
            while server.client_count() > 1 or server.store.regions.pins.sum():
                assert time.monotonic() < deadline, "the abandoned connection stayed open"
                time.sleep(0.02)
            got = np.zeros(3 * GEOM.block_bytes, np.uint8)
            for i in range(200, 200 + 4 * server.store.regions.count):
                keys = run_keys(i, 3)
                if b.get_run(keys, got) == 3:
                    assert np.array_equal(got, run_data(keys)), f"run {i} overwritten"
        finally:
            let_go(wait=False)
            a.close()
            b.close()


def test_server_edge_cases(tmp_path, sock, monkeypatch):
    """An answer too large to send gives back the pin it carried; a broken
    frame (deep nesting, bad base64) ends or fails that request only; a
    forked child cannot use its parent's connection."""
    from kvblock.store import protocol

    path = _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        r = RemoteStore(sock)
        try:
            keys = [k for i in range(40) for k in run_keys(i, 2)]
            for i in range(40):
                r.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
            monkeypatch.setattr(protocol, "MAX_FRAME", 4096)   # both ends: one process
            with pytest.raises(ConfigError, match="exceeds 4096"):
                r.get_run(keys, np.zeros(len(keys) * GEOM.block_bytes, np.uint8))
            assert server.store.regions.pins.sum() == 0
            monkeypatch.undo()
            with pytest.raises(ConfigError, match="base64"):
                r._call("lookup", keys="!!!")
            import socket as socket_mod
            raw = socket_mod.socket(socket_mod.AF_UNIX)
            raw.connect(sock)
            body = b"[" * 200000                       # nested past the parser: no message
            try:
                raw.sendall(len(body).to_bytes(4, "big") + body)
                reply = protocol.recv_msg(raw)         # answered, that connection only
                assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            finally:
                raw.close()
            assert r.lookup(run_keys(0, 2)) == 2
            def child():                                 # gone there, no traffic
                try:
                    r.lookup(run_keys(0, 2))
                    return 1
                except ServerGoneError as e:
                    return 0 if "forked" in str(e) else 2
            assert exit_code_in_child(child) == 0
            assert r.lookup(run_keys(0, 2)) == 2       # the parent's connection works
        finally:
            r.close()


class _AcceptLoopClock:
    """The server module's clock, moved on by the test only (a loaded
    machine's scheduling then makes no connection late, nor any check
    early); counts the accept loop's reads of it, so that a test can wait
    for the loop to have looked at the idle time again."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0
        self._lock = threading.Condition()

    def monotonic(self) -> float:
        with self._lock:
            if threading.current_thread().name == "kvblock-serve":
                self.reads += 1
                self._lock.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def wait_reads(self, n: int, stopped: threading.Event, timeout: float = 30.0) -> None:
        """Until the accept loop has read the clock ``n`` more times (or
        the server has stopped: its loop reads it no more)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self.reads + n
            while self.reads < target and not stopped.is_set():
                assert time.monotonic() < deadline, "the accept loop did not look at the clock"
                self._lock.wait(0.05)

    def __getattr__(self, name):       # time.sleep, time.time: the real ones
        return getattr(time, name)


def test_idle_exit_counts_short_connections(tmp_path, sock, monkeypatch):
    """--idle-exit: a server used by short connections (opened and closed
    between two of its checks) is not idle.  On the server's own clock
    (moved by the test: no sleep races a loaded machine): 8 connections
    0.3 s apart, 2.4 s in all with idle_exit=1, each followed by a full
    idle check of the accept loop; then 1 s of no connection stops it."""
    from kvblock.store import server as server_mod

    clock = _AcceptLoopClock()
    monkeypatch.setattr(server_mod, "time", clock)
    monkeypatch.setattr(server_mod, "ACCEPT_POLL", 0.02)
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock, idle_exit=1.0)
    try:
        for n in range(1, 9):
            clock.advance(0.3)
            with RemoteStore(sock) as r:
                r.lookup(run_keys(0, 1))
            deadline = time.monotonic() + 30
            while server.connections_total < n or server._sessions:   # its end seen
                assert time.monotonic() < deadline, "the connection did not end"
                time.sleep(0.01)
            # two more reads: at least one whole check (sessions looked at,
            # then the clock) began after the connection ended
            clock.wait_reads(2, server.stopped)
            assert not server.stopped.is_set(), f"stopped as idle after {n * 0.3:.1f} s"
        clock.advance(1.0)
        assert server.stopped.wait(30)     # then idle: it stops
    finally:
        server.stop()


def test_stop_wakes_the_accept_loop_instead_of_waiting_for_its_poll(tmp_path, sock,
                                                                      monkeypatch):
    """stop() ends the accept loop at once (a connection wakes it), not at
    its next poll: with a poll of a minute, the loop has ended when stop()
    returns, and the wake-up counted as no client."""
    from kvblock.store import server as server_mod

    monkeypatch.setattr(server_mod, "ACCEPT_POLL", 60.0)
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    with RemoteStore(sock) as r:
        r.lookup(run_keys(0, 1))
    server.stop(timeout=5)
    assert not server._thread.is_alive()
    assert server.connections_total == 1
    assert not os.path.exists(sock)


def test_contains_nowait_never_queues_behind_another_call(tmp_path, sock):
    """The vLLM tier's lookup runs on vLLM's scheduler thread: on a shared
    store it answers None (RETRY) instead of waiting behind a worker's call
    on the same connection."""
    import threading

    path = _store_file(tmp_path)
    with serve_in_background([path], sock):
        with RemoteStore(sock) as r:
            keys = run_keys(7, 1)
            r.put_run(keys, run_data(keys))
            assert r.contains_nowait(keys[0], 0.001) is True
            assert r.contains_nowait(run_keys(8, 1)[0], 0.001) is False
            # A worker's commit in flight, held until the lookup answered (or
            # HELD_S passed): answering None while it is held, and well within
            # HELD_S on any load, it did not queue behind it.
            HELD_S = 30.0
            r._rpc_lock.acquire()
            try:
                answers = []
                t = threading.Thread(target=lambda: answers.append(
                    r.contains_nowait(keys[0], 0.01)))
                t0 = time.monotonic()
                t.start()
                t.join(HELD_S)
                took = time.monotonic() - t0
                assert answers == [None] and took < HELD_S / 2, (answers, took)
            finally:
                r._rpc_lock.release()
            assert r.contains_nowait(keys[0], 0.001) is True


def test_a_client_can_require_the_served_store_geometry_and_model(tmp_path, sock):
    from kvblock import Geometry
    from kvblock.errors import GeometryMismatchError

    path = str(tmp_path / "kv.img")
    from kvblock import create_file

    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, model="llama-a", region_size=REGION).close()
    with serve_in_background([path], sock):
        other = Geometry(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
                         block_tokens=16, head_groups=2)
        with pytest.raises(GeometryMismatchError, match="this process needs"):
            RemoteStore(sock, geometry=other)
        with pytest.raises(GeometryMismatchError, match="another model than 'llama-b'"):
            RemoteStore(sock, model="llama-b")
        with RemoteStore(sock, geometry=GEOM, model="llama-a") as r:
            assert r.geometry == GEOM


def test_a_served_store_of_another_geometry_or_model_names_its_server_and_the_fix(tmp_path,
                                                                                  sock):
    """An engine restarted with another page size or model while the store
    server of its last run still serves the devices (a server outlives the
    ranks that started it): the error names that server and what to do,
    not only the two geometries (format "force" cannot apply meanwhile)."""
    from kvblock import Geometry, create_file
    from kvblock.errors import GeometryMismatchError
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, model="m", region_size=REGION).close()
    other = Geometry(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
                     block_tokens=16, head_groups=2)
    with serve_in_background([path], sock, model="m"):
        for geometry, model in ((other, "m"), (GEOM, "m2")):
            with pytest.raises(GeometryMismatchError) as e:
                open_shared(sock, [path], geometry, model, format="force")
            assert f"pid {os.getpid()}" in str(e.value), str(e.value)
            assert "stop that server" in str(e.value) and "its own socket" in str(e.value)


def test_stats_while_another_thread_closes_the_store(tmp_path, sock, monkeypatch):
    """close() from another thread while stats() waits for its answer (a
    metrics thread at shutdown): stats answers, and close() waits for it,
    instead of stats failing with an AttributeError on the devices close()
    has just released."""
    path = _store_file(tmp_path)
    with serve_in_background([path], sock):
        r = RemoteStore(sock)
        closer = threading.Thread(target=r.close)
        waits, released = threading.Event(), threading.Event()
        drained = r._inflight.drained

        def drained_seen(timeout, what, *rest):
            if r._inflight.calls:
                waits.set()                  # close() waits for the call in flight
            return drained(timeout, what, *rest)

        release = KVStore._release_devices

        def release_seen(store):
            release(store)
            released.set()                   # close() freed the devices under the call

        call = r._call

        def call_then_close(op, **args):
            out = call(op, **args)
            if op == "stats":
                closer.start()
                deadline = time.monotonic() + 20
                while not (waits.is_set() or released.is_set()):
                    assert time.monotonic() < deadline, "close() neither waited nor ended"
                    time.sleep(0.005)
            return out

        monkeypatch.setattr(r._inflight, "drained", drained_seen)
        monkeypatch.setattr(KVStore, "_release_devices", release_seen)
        monkeypatch.setattr(r, "_call", call_then_close)
        try:
            s = r.stats()
            assert s["client"]["engine"] and s["server_pid"] > 0
            closer.join(20)
            assert not closer.is_alive() and r.io is None
            with pytest.raises(StoreClosedError):
                r.stats()
        finally:
            if closer.is_alive():
                closer.join(20)
            r.close()


def test_stats_name_the_server_run(tmp_path, sock):
    """A restarted server counts from zero; under the same pid (PID 1 in a
    container; here two servers of one process) only its run tells it from
    the old one: stats' server_run, the same for every call of one run."""
    path = _store_file(tmp_path)
    runs = []
    for _ in range(2):
        with serve_in_background([path], sock), RemoteStore(sock) as r:
            first, again = r.stats(), r.stats()
            assert first["server_pid"] == os.getpid()
            assert isinstance(first["server_run"], str) and first["server_run"]
            assert again["server_run"] == first["server_run"]
            runs.append(first["server_run"])
    assert runs[0] != runs[1]


def test_prometheus_counters_name_the_server_runs_start(tmp_path, sock):
    """A restarted server counts from zero; one whose counters climbed past
    their old values before the next scrape looked to Prometheus like no
    reset (the exported counters had no ``_created`` sample: prometheus_client
    exports one per counter, our collector passed none).  Each counter now
    carries its server run's start as its created time: a new run, a later one."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvblock.metrics import StoreCollector

    path = _store_file(tmp_path)
    created = []
    for i in range(2):
        began = time.time()
        with serve_in_background([path], sock), RemoteStore(sock) as r:
            keys = run_keys(40 + i, 2)
            assert r.put_run(keys, run_data(keys)) == 2
            families = [f for f in StoreCollector(r.stats).collect() if f.type == "counter"]
            assert families
            times = set()
            for f in families:
                c = [x.value for x in f.samples if x.name == f.name + "_created"]
                assert len(c) == 1, f.name
                times.add(c[0])
            assert len(times) == 1
            t = times.pop()
            assert began <= t <= time.time()
            created.append(t)
            registry = CollectorRegistry()
            registry.register(StoreCollector(r.stats))
            text = generate_latest(registry).decode()
            assert "kvblock_store_put_runs_created{" in text
            assert "kvblock_store_server_started" not in text
    assert created[1] > created[0]


def test_in_process_prometheus_counters_name_when_they_started(tmp_path):
    """An in-process store's counters start at its open: their created time."""
    from kvblock.metrics import StoreCollector

    path = _store_file(tmp_path)
    began = time.time()
    with KVStore.open([path]) as store:
        families = [f for f in StoreCollector(store).collect() if f.type == "counter"]
        assert families
        for f in families:
            c = [x.value for x in f.samples if x.name == f.name + "_created"]
            assert len(c) == 1 and began <= c[0] <= time.time(), f.name


def test_stats_of_a_servers_closed_store_is_a_typed_error(tmp_path, sock):
    """A server whose store has closed (a metadata write failed; it is
    stopping) answered stats with {"closed": true} and its own numbers,
    no uuid and no gauges: every consumer of stats() broke on it, a
    Prometheus exporter (kvblock stats --socket --prometheus) with a
    KeyError at each scrape instead of serving the last numbers.  It is
    StoreClosedError, as a closed KVStore's stats() is."""
    from kvblock.cli.admin import _Cached
    from kvblock.metrics import StoreCollector

    path = _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        r = RemoteStore(sock)
        try:
            scrape = StoreCollector(_Cached(r.stats, 0.0))
            before = {f.name: f for f in scrape.collect()}
            assert before["kvblock_store_capacity_bytes"].samples[0].value > 0
            server.store.close()
            with pytest.raises(StoreClosedError, match="closed"):
                r.stats()
            after = {f.name: f for f in scrape.collect()}     # the last numbers
            assert after["kvblock_store_capacity_bytes"].samples == \
                before["kvblock_store_capacity_bytes"].samples
        finally:
            r.close()


def test_an_engines_bad_store_settings_are_refused_while_a_server_runs(tmp_path, sock):
    """The engines' "server" option (provision.open_shared): a misspelt
    format or eviction is a ConfigError naming it, as without a server,
    also when a server already answers (it used to be ignored then: the
    values only reach a server the caller starts)."""
    from kvblock import create_file
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, model="m", region_size=REGION).close()
    with serve_in_background([path], sock, model="m"):
        with pytest.raises(ConfigError, match="format must be one of"):
            open_shared(sock, [path], GEOM, "m", format="forse")
        with pytest.raises(ConfigError, match="eviction must be one of"):
            open_shared(sock, [path], GEOM, "m", eviction="lfu")
        with pytest.raises(ConfigError, match="admit_after must be >= 1"):
            open_shared(sock, [path], GEOM, "m", admit_after=0)
        # queue_depth 0 became 32 and 2.5 became 2 unsaid, "deep" a bare ValueError
        for depth in (0, 2.5, "deep", -1):
            with pytest.raises(ConfigError, match="queue_depth must be"):
                open_shared(sock, [path], GEOM, "m", queue_depth=depth)
        store = open_shared(sock, [path], GEOM, "m", format="never", eviction="fifo")
        store.close()


def test_an_engines_bad_verify_or_engine_starts_no_server(tmp_path, sock):
    """open_shared with no server yet: a misspelt verify or engine (or one
    of another type) is a ConfigError before anything is made, as format,
    eviction and queue_depth are.  They were checked only by the client
    once connected: the first rank formatted (creating the store file),
    started a kvblock serve that outlived the engine, then failed."""
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    for bad in ({"verify": "sometimes"}, {"verify": 1}, {"engine": "bogus"},
                {"engine": 1}):
        with pytest.raises(ConfigError, match="verify must be|I/O engine"):
            open_shared(sock, [path], GEOM, "m", size=8 * MIB, **bad)
        assert not os.path.exists(path), f"{bad}: the store file was made"
        assert not os.path.exists(sock), f"{bad}: a server was started"
        assert not _kill_servers_of(sock), f"{bad}: a server was started"


def test_an_engines_socket_path_too_long_is_refused_before_anything_is_made(tmp_path):
    """open_shared with a socket path past a Unix socket's 107 bytes: no
    server can ever listen there, and the refusal is a ConfigError naming
    the path before anything is made.  It came only from the server that
    the first rank started, after that rank had made the socket folder and
    made and formatted the store file, which stayed behind (a ServerError)."""
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    folder = tmp_path / "run"
    sock = str(folder / ("s" * (110 - len(str(folder)))) ) + ".sock"
    assert len(sock) > 107
    with pytest.raises(ConfigError, match="at most 107") as e:
        open_shared(sock, [path], GEOM, "m", size=8 * MIB)
    assert sock in str(e.value)
    assert not os.path.exists(path), "the store file was made"
    assert not folder.exists(), "the socket folder was made"


def test_an_engines_start_whose_server_does_not_come_up_leaves_no_store_file(
        tmp_path, sock, monkeypatch):
    """open_shared (the engines' "server") with size: the first rank makes
    and formats the store file (space reserved), then the kvblock serve it
    starts exits before it listens.  The start fails (ServerError, with the
    server's log) and removes the file it made, as a start without a server
    does; the file stayed behind, formatted with this failed start's size
    and region_size, which the next start then used as they were.  A file
    that was there before is kept."""
    from kvblock import create_file
    from kvblock.errors import ServerError
    from kvblock.store.provision import open_shared

    monkeypatch.setattr(sys, "executable", "/bin/false")   # the server exits at once
    path = str(tmp_path / "store" / "kv.img")
    with pytest.raises(ServerError, match="exited with status 1 before listening"):
        open_shared(sock, [path], GEOM, "m", size=8 * MIB, region_size=REGION)
    assert not os.path.exists(path), "the formatted store file stayed behind"
    assert not os.path.exists(os.path.dirname(path)), "the folder made for it stayed behind"
    kept = str(tmp_path / "kept.img")
    create_file(kept, 8 * MIB)                            # blank: prepare formats it
    with pytest.raises(ServerError, match="exited with status 1 before listening"):
        open_shared(sock, [kept], GEOM, "m", size=8 * MIB, region_size=REGION)
    assert os.path.getsize(kept) == 8 * MIB


def test_an_engines_start_interrupted_while_its_server_comes_up_leaves_nothing_behind(
        tmp_path, sock, monkeypatch):
    """open_shared with size, Ctrl-C (KeyboardInterrupt) while spawn_server
    waits for the server it started to listen: the undo of prepare() ran
    for Exceptions only, so the store file made and formatted for the
    start stayed behind (used at the next start with this one's size and
    region_size), and the server spawned, in a session of its own, went
    on to serve it after the start was given up."""
    import kvblock.store.server as server_mod
    from kvblock.store.provision import open_shared

    real_popen = server_mod.subprocess.Popen
    procs = []

    def popen(*a, **kw):
        procs.append(real_popen(*a, **kw))
        return procs[-1]

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(server_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(server_mod, "wait_for_server", interrupted)
    path = str(tmp_path / "store" / "kv.img")
    try:
        with pytest.raises(KeyboardInterrupt):
            open_shared(sock, [path], GEOM, "m", size=8 * MIB, region_size=REGION)
        assert len(procs) == 1
        assert procs[0].poll() is not None, "the spawned server was left running"
        assert not os.path.exists(path), "the formatted store file stayed behind"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_an_engines_devices_may_come_from_a_generator(tmp_path, sock):
    """open_shared given its devices as a generator: connect's check that
    the server serves them used it up before comparing, and the start
    failed with a bare IndexError."""
    from kvblock import create_file
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, model="m", region_size=REGION).close()
    with serve_in_background([path], sock, model="m"):
        open_shared(sock, (p for p in [path]), GEOM, "m", size=8 * MIB).close()


def test_an_engines_size_and_region_size_are_said_not_to_apply_to_a_running_server(
        tmp_path, sock, caplog):
    """open_shared with a server already serving the store: a region_size or
    size the store was not made with is logged as not applied (as
    open_or_format logs it), not silently dropped; matching ones are quiet."""
    import logging

    from kvblock import create_file
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, model="m", region_size=REGION).close()
    with serve_in_background([path], sock, model="m"):
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            open_shared(sock, [path], GEOM, "m", size=8 * MIB, region_size=REGION).close()
        assert not caplog.records
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            open_shared(sock, [path], GEOM, "m", size=16 * MIB, region_size=2 * REGION).close()
        text = caplog.text
        assert "size 16777216 applies to new files only" in text
        assert f"region_size {2 * REGION} applies when a store is formatted" in text


def test_an_engines_eviction_and_admit_after_a_running_server_does_not_use_are_said(
        tmp_path, sock, caplog):
    """open_shared with a server already serving the store with another
    eviction or admit_after: the engine's values do not apply (the server's
    do), which used to pass silently; a warning names both values.  Matching
    ones are quiet, and neither is an error."""
    import logging

    from kvblock import create_file
    from kvblock.store.provision import open_shared

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, model="m", region_size=REGION).close()
    with serve_in_background([path], sock, model="m", eviction="lru", admit_after=2):
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            open_shared(sock, [path], GEOM, "m", eviction="lru", admit_after=2).close()
        assert not caplog.records
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            open_shared(sock, [path], GEOM, "m", eviction="fifo", admit_after=3).close()
        text = caplog.text
        assert "eviction 'fifo'" in text and "'lru'" in text, text
        assert "admit_after 3" in text and "admit_after 2" in text, text
        assert sock in text


def test_an_engine_rank_does_its_io_on_its_own_paths_of_the_served_store(tmp_path, sock):
    """open_shared (the engines' "server"): a rank does its I/O on the
    devices its config names, which may be other names of the medium the
    server serves (another mount, a by-id link, a relative path the server
    was started with in another directory).  The rank used to open the
    server's paths instead: missing in the rank, its start failed with
    DeviceNotFoundError naming a path the rank's config never had."""
    from kvblock import create_file
    from kvblock.store.provision import open_shared

    paths = [str(tmp_path / f"kv{i}.img") for i in range(2)]
    links = [str(tmp_path / f"server-side-name{i}.img") for i in range(2)]
    for path, link in zip(paths, links):
        create_file(path, 8 * MIB)
        os.symlink(path, link)
    KVStore.format(paths, GEOM, model="m", region_size=REGION).close()
    with serve_in_background(links, sock, model="m"):
        for link in links:
            os.unlink(link)              # the server's names for them: not this rank's
        keys = run_keys(3, 2)
        # in another order than the store's, as KVStore.open takes them
        with open_shared(sock, paths[::-1], GEOM, "m") as rank:
            assert [d.path for d in rank.io.devices] == paths
            rank.put_run(keys, run_data(keys))
            out = np.zeros_like(run_data(keys))
            assert rank.get_run(keys, out) == 2
            assert np.array_equal(out, run_data(keys))


def test_a_server_out_of_descriptors_serves_again_once_some_are_free(tmp_path):
    """More connections than the server has descriptors for: accept fails
    with EMFILE for a while.  The accept thread must outlive it (it used to
    die, leaving a live process whose socket nobody answered)."""
    import shutil
    import socket

    from kvblock.store.launch import wait_for_server
    from tests.store.workload import small_store

    assert shutil.which("prlimit"), "prlimit (util-linux) is installed by make"
    path, sock = small_store(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(["prlimit", "--nofile=48:48", "--", sys.executable, "-m",
                               "kvblock", "serve", path, "--socket", sock],
                              stdout=log, stderr=log, cwd=ROOT, start_new_session=True)
    try:
        wait_for_server(sock, 30, server)
        keys = run_keys(1, 2)
        with RemoteStore(sock, timeout=10) as rank:
            rank.put_run(keys, run_data(keys))
        conns = []
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX)
            c.settimeout(2)
            c.connect(sock)
            conns.append(c)
        # held open until the server has run out (a sleep ended before a
        # server not yet scheduled had accepted any, on a loaded machine)
        deadline = time.monotonic() + 60
        while "cannot take a connection" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None, "the server died"
            assert time.monotonic() < deadline, "the server never ran out of descriptors"
            time.sleep(0.05)
        for c in conns:
            c.close()
        with RemoteStore(sock, timeout=20) as rank:
            assert rank.lookup(keys) == 2
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def test_a_remote_pin_is_released_once_as_in_one_process(tmp_path, sock):
    """RemoteStore.unpin as KVStore.unpin: a second release of one handle,
    or something pin() did not return, is a ConfigError (it used to pass
    silently, so an engine's double release went unnoticed on a served
    store only); the other lease's pin holds."""
    path = _store_file(tmp_path)
    keys = run_keys(52, 2)
    with serve_in_background([path], sock), RemoteStore(sock) as r:
        r.put_run(keys, run_data(keys))
        first, second = r.pin(keys), r.pin(keys)
        r.unpin(first)
        with pytest.raises(ConfigError, match="released already"):
            r.unpin(first)
        with pytest.raises(ConfigError, match="the handle pin"):
            r.unpin(list(second))
        assert r.stats()["pinned_regions"] == 1              # the second lease holds
        assert r.evict(all=True) == 0 and r.lookup(keys) == 2
        r.unpin(second)
        assert r.stats()["pinned_regions"] == 0
        empty = r.pin(run_keys(53, 1))                        # nothing stored: [] as KVStore's
        assert empty == []
        r.unpin(empty)
        with pytest.raises(ConfigError, match="released already"):
            r.unpin(empty)


def test_idle_exit_of_zero_means_never_as_the_other_zeros_do(tmp_path, sock, monkeypatch):
    """--idle-exit 0, like --pin-lease 0 and --hello-timeout 0, means
    never: such a server stopped at its first poll with no client yet."""
    from click.testing import CliRunner

    from kvblock.cli.main import cli
    from kvblock.store import server as server_mod

    help_text = " ".join(CliRunner().invoke(cli, ["serve", "--help"]).output.split())
    assert "without a client. 0: never." in help_text
    monkeypatch.setattr(server_mod, "ACCEPT_POLL", 0.01)
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock, idle_exit=0)
    try:
        assert not server.stopped.wait(0.5)       # some 50 polls with no client
        with RemoteStore(sock) as r:
            keys = run_keys(0, 2)
            assert r.put_run(keys, run_data(keys)) == 2
    finally:
        server.stop()


def test_a_run_stored_whole_is_a_duplicate_remotely_even_when_too_long_to_put(tmp_path,
                                                                               sock):
    """A run the store holds whole (stored as several shorter runs) is a
    duplicate, however long: KVStore checks a run fits only when it would
    be written, and so must a rank (put_run and put_runs), not refuse it
    with StoreFullError."""
    from tests.store.workload import small_store

    path = small_store(tmp_path / "kv.img", 2 * MIB)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as r:
        m = r.max_run_blocks
        chain = [f"chain-{j}".encode() for j in range(4 * m)]   # the store's 4 regions
        for a in range(0, len(chain), m):
            assert r.put_run(chain[a:a + m], run_data(chain[a:a + m])) == m
        assert r.lookup(chain) == len(chain)
        before = server.store.counters["put_duplicate_runs"]
        assert r.put_run(chain, run_data(chain)) == len(chain)
        head = chain[:m]
        assert r.put_runs([(chain, run_data(chain)), (head, run_data(head))]) == \
            [len(chain), m]
        assert server.store.counters["put_duplicate_runs"] == before + 3
        assert r.counters["put_duplicate_runs"] == 3
    with KVStore.open([path]) as st:      # as in one process
        assert st.put_run(chain, run_data(chain)) == len(chain)


def test_a_forked_child_does_not_keep_a_stopped_servers_stopping_mark(tmp_path, sock):
    """A process serving in a thread forks (a worker); the child shares
    the open <socket>.fence, and so the mark a stopping server holds on it
    (an open-file-description lock).  Once stop() returns the mark is gone,
    child or no child: else the next server that finds the devices busy
    (a block device the child still has open) waits its whole
    STOPPING_WAIT_S for a server that has stopped."""
    from kvblock.store.launch import server_stopping

    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                       # the child: holds what it inherited until told
        try:
            os.close(w_fd)
            os.read(r_fd, 1)
        finally:
            os._exit(0)
    os.close(r_fd)
    try:
        server.stop()
        assert not server_stopping(sock), "the stopped server's mark is still held"
    finally:
        os.close(w_fd)
        os.waitpid(pid, 0)


def test_a_forked_childs_stop_of_its_server_copy_leaves_the_parents_server(tmp_path, sock):
    """A process serving in a thread forks (a worker), and the child stops
    its copy of the server (a with block it unwinds, a cleanup hook).  That
    copy's listener, connections and fence file are the parent's open
    files: its stop() shut every client's connection down (their calls
    failed: ServerGoneError), removed the parent's socket (no rank could
    connect any more) and marked the parent's server stopping.  The child's
    stop() only lets go of its copy, as its store's close() does."""
    from kvblock.store.launch import server_stopping

    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    try:
        r = RemoteStore(sock)
        try:
            r.put_run(run_keys(0, 2), run_data(run_keys(0, 2)))

            def child():
                server.stop(timeout=5)
                return 0 if server.stopped.is_set() else 1
            assert exit_code_in_child(child, timeout=20) == 0
            assert not server_stopping(sock)
            assert os.path.exists(sock), "the child removed the parent's socket"
            assert r.lookup(run_keys(0, 2)) == 2         # the parent's client is served
            with RemoteStore(sock) as r2:                # and a new one connects
                assert r2.lookup(run_keys(0, 2)) == 2
        finally:
            r.close()
    finally:
        server.stop()


@pytest.mark.parametrize("batched", [False, True])
def test_an_admitted_put_the_server_gave_no_space_gives_its_offer_back(tmp_path, sock,
                                                                        monkeypatch, batched):
    """admit_after=2 on the server: the second offer admits the run (its
    count used up there).  A rank's put so admitted that then stored
    nothing (here the server had no space for it: StoreFullError) left the
    count used up on the server, and the third offer was declined again.
    The rank gives the offer back: the next one admits."""
    from kvblock.errors import StoreFullError

    path = _store_file(tmp_path)
    keys, other = run_keys(6, 2), run_keys(7, 1)
    with serve_in_background([path], sock, admit_after=2) as server, RemoteStore(sock) as r:
        def put():
            if batched:
                return r.put_runs([(keys, run_data(keys)), (other, run_data(other))])[0]
            return r.put_run(keys, run_data(keys))
        assert put() == 0                                    # offer 1: declined

        def allocate(s, nblocks):
            raise StoreFullError("every region holds pinned runs (test)")
        monkeypatch.setattr(server, "_op_allocate", allocate)
        with pytest.raises(StoreFullError):
            put()                                            # offer 2: admitted, not stored
        monkeypatch.undo()
        assert put() == 2                                    # offer 3: admitted again
        assert r.lookup(keys) == 2


def test_put_runs_refused_by_a_rank_before_a_write_counts_no_offer_on_the_server(tmp_path,
                                                                                 sock):
    """As KVStore's: a put_runs refused by the late check of a long run
    (StoreFullError, nothing written) counts none of its offers on the
    server, nor its declined runs in admission_rejected_runs."""
    from kvblock.errors import StoreFullError
    from tests.store.test_store import _halves_and_whole, _zeros

    path = _store_file(tmp_path, 12 << 20)
    with serve_in_background([path], sock, admit_after=2) as server, RemoteStore(sock) as r:
        first, second, _ = _halves_and_whole(r)
        whole = second + first          # offered under second's first key: admitted there
        with pytest.raises(StoreFullError, match="does not fit this store"):
            r.put_runs([(first, _zeros(first)), (second, _zeros(second)),
                        (whole, _zeros(whole))])
        assert server.store.counters["admission_rejected_runs"] == 0
        assert r.counters["admission_rejected_runs"] == 0
        assert r.put_run(first, _zeros(first)) == 0          # its first offer, declined
        assert r.put_run(first, _zeros(first)) == len(first)
        assert r.put_run(second, _zeros(second)) == 0


def test_put_runs_refused_by_a_rank_never_takes_a_declined_run_off_a_counter(tmp_path, sock):
    """The server counted a put_runs' declined run at its admit and took it
    off again at the give_back of the call's offers (the rank refused the
    call after it): the server's admission_rejected_runs (and the rank's)
    went down, which Prometheus reads as a counter reset.  A declined run is
    counted once the call's plan stands, never taken off."""
    from kvblock.errors import StoreFullError
    from tests.store.test_store import NeverDown, _halves_and_whole, _zeros

    path = _store_file(tmp_path, 12 << 20)
    with serve_in_background([path], sock, admit_after=2) as server, RemoteStore(sock) as r:
        server.store.counters = NeverDown(server.store.counters)
        r.counters = NeverDown(r.counters)
        first, second, _ = _halves_and_whole(r)
        whole = second + first
        with pytest.raises(StoreFullError, match="does not fit this store"):
            r.put_runs([(first, _zeros(first)), (second, _zeros(second)),
                        (whole, _zeros(whole))])
        assert server.store.counters.fell == [] and r.counters.fell == []
        assert server.store.counters["admission_rejected_runs"] == 0
        assert r.counters["admission_rejected_runs"] == 0
        # a call that stands counts its declined runs, on the server and the rank
        assert r.put_runs([(first, _zeros(first)), (second, _zeros(second))]) == [0, 0]
        fresh = run_keys(99, 1)
        assert r.put_run(fresh, _zeros(fresh)) == 0         # counted by the server's admit
        assert server.store.counters["admission_rejected_runs"] == 3
        assert r.counters["admission_rejected_runs"] == 3
        assert r.stats()["admission_rejected_runs"] == 3
        assert server.store.counters.fell == [] and r.counters.fell == []


def test_puts_at_once_lose_no_count_on_the_server_or_the_rank(tmp_path, sock, monkeypatch):
    """The server's connection threads, and a rank's threads, counted a put
    with ``counters[name] += n``, ``n`` a Python call away (layout(): the
    GIL may pass there): two puts at once both read the counter and wrote
    back their own sum, one put's bytes lost (its put_runs too without a
    GIL).  Each count is added under the counters' own lock."""
    path = _store_file(tmp_path)
    runs = [run_keys(1, 2), run_keys(2, 2), run_keys(3, 2), run_keys(4, 2)]
    with serve_in_background([path], sock) as server, RemoteStore(sock) as r1, \
            RemoteStore(sock) as r2:
        written = r1.layout(2).run_bytes
        # two ranks at once: the server's two connection threads meet
        meet_in_statement(monkeypatch, server.store, "layout", '"bytes_written"')
        in_two_threads(lambda job: job[0].put_run(job[1], run_data(job[1])),
                       (r1, runs[0]), (r2, runs[1]))
        assert server.store.counters["bytes_written"] == 2 * written
        assert r1.stats()["bytes_written"] == 2 * written
        # two threads of one rank
        meet_in_statement(monkeypatch, r1, "layout", '"bytes_written"')
        in_two_threads(lambda keys: r1.put_run(keys, run_data(keys)), *runs[2:])
        assert r1.counters["put_runs"] == 3 and r1.counters["bytes_written"] == 3 * written
        assert r1.stats()["client"]["bytes_written"] == 3 * written
        assert server.store.counters["bytes_written"] == 4 * written


def test_put_runs_duplicates_within_the_call_are_counted_by_the_server(tmp_path, sock):
    """A run put_runs finds whole in the call's earlier runs is a duplicate
    (as put one call after another): the rank counted it, the server's
    put_duplicate_runs (the store's stats, every rank's) did not."""
    path = _store_file(tmp_path)
    keys = run_keys(8, 2)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as r:
        assert r.put_runs([(keys, run_data(keys)), (keys, run_data(keys))]) == [2, 2]
        assert r.counters["put_duplicate_runs"] == 1
        assert r.stats()["put_duplicate_runs"] == 1
        assert server.store.counters["put_duplicate_runs"] == 1


def test_a_too_long_put_declined_by_the_server_counts_no_rejected_run_on_the_rank(tmp_path,
                                                                                   sock,
                                                                                   monkeypatch):
    """put_run of a run too long for the store, found whole in it (a
    duplicate) and then declined by the server's admit (its keys removed
    meanwhile): StoreFullError, its offer given back.  The give-back took
    one off the rank's admission_rejected_runs, which that path had never
    counted (it counts a declined run only when it returns 0): the rank's
    stats said -1.  Nor does the server count it (it counted it at the
    admit, and took it off at the give-back: a counter that fell)."""
    from kvblock.errors import StoreFullError
    from tests.store.test_store import NeverDown

    path = _store_file(tmp_path)
    keys = run_keys(8, 2)
    with serve_in_background([path], sock, admit_after=2) as server, RemoteStore(sock) as r:
        def check_fits(n):
            raise StoreFullError(f"a run of {n} blocks does not fit this store (test)")
        monkeypatch.setattr(r, "_check_fits", check_fits)
        monkeypatch.setattr(r, "present", lambda ks: np.ones(len(ks), dtype=bool))
        server.store.counters = NeverDown(server.store.counters)
        with pytest.raises(StoreFullError):
            r.put_run(keys, run_data(keys))                  # offer 1: declined, refused
        assert server.store.counters.fell == []              # counted, then taken off
        assert server.store.counters["admission_rejected_runs"] == 0
        assert r.counters["admission_rejected_runs"] == 0
        assert r.stats()["client"]["admission_rejected_runs"] == 0


def test_one_remote_handle_released_by_two_threads_at_once_is_released_once(tmp_path, sock):
    """RemoteStore.unpin as KVStore.unpin: two threads releasing one handle
    together both passed the released check before either set it, both
    released it, and neither got the documented ConfigError; when both
    reached the pin too, the session's pin count went down twice (another
    lease's pin no longer counted: no heartbeat kept it past the lease)."""
    from kvblock.store.client import PinnedSegments

    path = _store_file(tmp_path)
    keys = run_keys(54, 2)
    both = threading.Barrier(2)

    class Racing(PinnedSegments):
        _released = False

        @property
        def released(self):       # the released check, held open until its set
            seen = self._released
            try:
                both.wait(0.3)    # the two unpin() calls meet here, when they can
            except threading.BrokenBarrierError:
                pass
            return seen

        @released.setter
        def released(self, value):
            self._released = value

    with serve_in_background([path], sock), RemoteStore(sock) as r:
        r.put_run(keys, run_data(keys))
        other, pinned = r.pin(keys), r.pin(keys)
        handle = Racing(pinned)
        handle.pin, handle.session = pinned.pin, pinned.session
        outcomes = release_twice(r.unpin, handle)
        assert sorted(outcomes) == ["released", "unpin: this pin handle was released already"]
        assert r._session.held == 1                       # the other lease's pin
        assert r.stats()["pinned_regions"] == 1
        r.unpin(other)
        assert r._session.held == 0 and r.stats()["pinned_regions"] == 0


def test_a_close_that_gave_up_waiting_lets_go_of_the_devices_once_the_call_is_done(
        tmp_path, sock, monkeypatch):
    """close() waits CLOSE_WAIT_S for a call in flight (a read here), then
    returns leaving this rank's devices, engine and buffers to that call.
    Nothing let go of them afterwards (the finalizer was detached, and a
    Device's descriptor is not closed by the garbage collector): the rank
    kept the device descriptors open for as long as it lived.  The last
    call to leave releases them, as KVStore.close's."""
    from kvblock.store import client as client_mod
    from tests.serve.test_shared_clear import _wait_in

    monkeypatch.setattr(client_mod, "CLOSE_WAIT_S", 0.2)
    path = _store_file(tmp_path)
    with serve_in_background([path], sock):
        r = RemoteStore(sock)
        keys = run_keys(1, 2)
        assert r.put_run(keys, run_data(keys)) == 2
        fds = [d.fd for d in r.io.devices]
        reached, go = _wait_in(r, "_segments")
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        box = {}
        t = threading.Thread(target=lambda: box.update(n=r.get_run(keys, out)))
        t.start()
        try:
            assert reached.wait(20)
            r.close()                        # gives up on the read after 0.2 s
            assert r.closed and r.io is not None
        finally:
            go.set()
            t.join(20)
        assert "n" in box
        assert r.io is None, "the devices stayed open after the last call left"
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)


@pytest.mark.parametrize("call", ["put_run", "put_runs", "lookup"])
def test_a_call_overtaken_by_its_ranks_close_is_no_server_gone(tmp_path, sock, monkeypatch,
                                                               call):
    """Another thread closes the rank after a call passed its open check and
    before it reached the server: the call fails with StoreClosedError
    (the rank was closed), not ServerGoneError 'remote store is closed',
    on which a caller waits for a reconnect a closed rank never makes."""
    path = _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        r = RemoteStore(sock)
        keys = run_keys(1, 2)
        closer = threading.Thread(target=r.close)
        current = RemoteStore._current

        def closed_meanwhile(store):
            if closer.ident is None:
                closer.start()              # it waits for this call once it closed the session
                deadline = time.monotonic() + 10
                while r._session.gone is None:
                    assert time.monotonic() < deadline and closer.is_alive()
                    time.sleep(0.001)
            return current(store)

        monkeypatch.setattr(RemoteStore, "_current", closed_meanwhile)
        with pytest.raises(StoreClosedError) as e:
            if call == "put_run":
                r.put_run(keys, run_data(keys))
            elif call == "put_runs":
                r.put_runs([(keys, run_data(keys))])
            else:
                r.lookup(keys)
        assert not isinstance(e.value, ServerGoneError), repr(e.value)
        closer.join(20)
        assert not closer.is_alive()
        assert server.store.lookup(keys) == 0


def test_a_call_whose_connection_close_ends_under_it_is_no_server_gone(tmp_path, sock,
                                                                       monkeypatch):
    """A lookup waits for an answer the server holds back; the rank is
    closed in another thread, waits CLOSE_WAIT_S, then ends the connection
    under the call: it raised ServerGoneError ("the store server is gone"),
    on which a caller waits for a reconnect a closed rank never makes."""
    from kvblock.store import client as client_mod

    monkeypatch.setattr(client_mod, "CLOSE_WAIT_S", 0.3)
    path = _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        arrived, go = threading.Event(), threading.Event()
        real = server._op_lookup

        def held_back(s, keys):
            arrived.set()
            go.wait(20)
            return real(s, keys)
        server._op_lookup = held_back
        r = RemoteStore(sock)
        box = {}

        def lookup():
            try:
                box["n"] = r.lookup(run_keys(1, 2))
            except BaseException as e:      # checked below
                box["error"] = e
        t = threading.Thread(target=lookup)
        t.start()
        try:
            assert arrived.wait(20)
            r.close()                        # ends the connection after 0.3 s
            t.join(20)
        finally:
            go.set()
        assert isinstance(box.get("error"), StoreClosedError), box
        assert not isinstance(box["error"], ServerGoneError), repr(box["error"])


def test_a_ranks_stats_name_the_gpu_path_it_chose(tmp_path, monkeypatch):
    """A rank chooses its own path into CUDA memory (the server reads
    none): KVStore.stats() names it, RemoteStore.stats() had it nowhere.
    It is under "client", with its reason, once chosen."""
    from kvblock.io.gpu import gpu_path

    monkeypatch.setenv("KVBLOCK_GPU_PATH", "host")
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([_store_file(tmp_path)], sock)
    try:
        with RemoteStore(sock) as rank:
            assert "gpu_path" not in rank.stats()["client"]       # none chosen yet
            assert gpu_path(rank) == "host"
            client = rank.stats()["client"]
            assert (client["gpu_path"], client["gpu_path_reason"]) == ("host", "KVBLOCK_GPU_PATH")
    finally:
        server.stop()


def test_a_closed_rank_names_its_socket_and_the_fix(tmp_path, sock):
    """A closed RemoteStore's calls said "remote store is closed; connect
    again": which store (a process holds ranks of several servers) and how
    to connect again went unsaid.  Every way a call meets the close names
    the server's socket and RemoteStore(socket)."""
    path = _store_file(tmp_path)
    with serve_in_background([path], sock):
        r = RemoteStore(sock)
        keys = run_keys(0, 2)
        r.put_run(keys, run_data(keys))
        r.close()
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        errors = []
        for call in (lambda: r.lookup(keys),            # _check_open
                     lambda: r.get_run(keys, out),      # a call in flight refused
                     lambda: r._current()):             # its connection given up
            with pytest.raises(StoreClosedError) as e:
                call()
            errors.append(str(e.value))
    for message in errors:
        assert "remote store is closed" in message, message
        assert sock in message and f"RemoteStore({sock!r})" in message, message


def test_put_runs_through_a_server_writes_a_run_its_store_holds_only_in_dram(tmp_path, sock):
    """A served store opened with a DRAM tier (StoreServer over the
    caller's store) held ``b`` only there (its run evicted from the
    device).  put_runs planned from the server's present(), which counted
    that DRAM copy: [a, b] after [a] was taken for a repeat of the call's
    earlier run and never written, though the ranks read only the device
    (and KVStore's plan, from its index, writes it).  The plan now sees the
    device: [a, b] is written, and a rank reads it back."""
    from kvblock.index.keys import normalize_keys
    from kvblock.store.server import StoreServer

    path = _store_file(tmp_path)
    a, b = normalize_keys([run_keys(1, 1)[0], run_keys(2, 1)[0]])
    store = KVStore.open([path], host_cache_bytes=4 * GEOM.block_bytes)
    server = StoreServer(store, sock, close_store=False).start()
    try:
        assert store.put_run([b], run_data([b])) == 1
        store.evict(all=True)                       # b: in the DRAM tier only
        assert store.index.lookup([b])[0] < 0 and store.present([b]).all()
        # in one process a key held only in DRAM is written
        assert store.put_run([b], run_data([b])) == 1 and store.index.lookup([b])[0] >= 0
        store.evict(all=True)
        ab = [a, b]
        with RemoteStore(sock) as r:
            assert r.put_runs([([a], run_data([a])), (ab, run_data(ab))]) == [1, 2]
            assert (store.index.lookup(ab) >= 0).all(), "b was not written to the device"
            out = np.zeros(2 * GEOM.block_bytes, dtype=np.uint8)
            assert r.get_run(ab, out) == 2
            assert np.array_equal(out, run_data(ab))
    finally:
        server.stop()
        store.close()


def test_a_served_lookup_counts_only_what_a_rank_can_read_of_a_store_with_dram(tmp_path,
                                                                                sock):
    """A StoreServer over a caller's store opened with a DRAM tier
    answered lookup with KVStore.lookup, which counts keys held only in
    that tier, while segments (what a rank reads) answers the device's
    runs only: lookup said 2 blocks and get_run then read 1.  lookup now
    answers from the device's index, as present does, and is counted on
    the server as KVStore.lookup counts it."""
    from kvblock.index.keys import normalize_keys
    from kvblock.store.server import StoreServer

    path = _store_file(tmp_path)
    a, b = normalize_keys([run_keys(1, 1)[0], run_keys(2, 1)[0]])
    store = KVStore.open([path], host_cache_bytes=4 * GEOM.block_bytes)
    server = StoreServer(store, sock, close_store=False).start()
    try:
        assert store.put_run([a], run_data([a])) == 1
        assert store.put_run([a, b], run_data([a, b])) == 2
        store.evict(all=True)                    # both in the DRAM tier only
        assert store.put_run([a], run_data([a])) == 1    # a on the device again
        assert store.lookup([a, b]) == 2         # (in one process: DRAM counts)
        before = store.stats()
        with RemoteStore(sock) as r:
            out = np.zeros(2 * GEOM.block_bytes, dtype=np.uint8)
            found = r.lookup([a, b])
            read = r.get_run([a, b], out)
            assert found == read == 1, (found, read)
            one = np.zeros(GEOM.block_bytes, dtype=np.uint8)
            assert r.get_run([a], one) == 1 and np.array_equal(one, run_data([a]))
        after = store.stats()
        assert after["lookups"] - before["lookups"] == 1
        assert after["lookup_hit_blocks"] - before["lookup_hit_blocks"] == 1
    finally:
        server.stop()
        store.close()


def test_put_runs_refuses_a_too_long_run_removed_between_its_plan_and_its_admit(tmp_path,
                                                                                sock, monkeypatch):
    """put_runs checks a run fits the store only when it would be written:
    one present() found whole (stored as shorter runs) is left to admit,
    a duplicate.  Removed between that look and its admit (another rank's
    delete or eviction), the server's admit answered ok and the run was
    written unchecked: its pieces, more than the store holds at once,
    evicted one another (the call answered its blocks stored; lookup found
    none of them).  Refused as put_run refuses it (StoreFullError), before
    anything is written."""
    from kvblock.errors import StoreFullError
    from kvblock.index.keys import normalize_keys
    from tests.store.workload import small_store

    path = small_store(tmp_path / "kv.img", 2 * MIB)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as r:
        m = r.max_run_blocks
        chain = normalize_keys([f"chain-{j}".encode() for j in range(4 * m)])  # 4 regions
        for a in range(0, len(chain), m):
            assert r.put_run(chain[a:a + m], run_data(chain[a:a + m])) == m
        other = run_keys(1, 1)
        real_admit = RemoteStore._admit

        def admit(self, keys, *args, **kwargs):
            if keys == chain:               # after present(), before the server's admit
                assert server.store.delete(chain[:1]) == m
            return real_admit(self, keys, *args, **kwargs)
        monkeypatch.setattr(RemoteStore, "_admit", admit)
        with pytest.raises(StoreFullError, match=f"run of {4 * m} blocks"):
            r.put_runs([(chain, run_data(chain)), (other, run_data(other))])
        monkeypatch.undo()
        assert r.lookup(other) == 0
        for a in range(m, len(chain), m):   # the store's other runs stay, readable
            out = np.zeros(m * GEOM.block_bytes, dtype=np.uint8)
            assert r.get_run(chain[a:a + m], out) == m
            assert np.array_equal(out, run_data(chain[a:a + m]))
