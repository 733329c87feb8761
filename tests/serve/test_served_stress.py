"""A randomized multi-client stress test of the served store, to hunt races.

One store server over a small store file (full: eviction runs all the
time); clients in threads of this process (one of them shared by two
threads, as an engine's scheduler and load threads share one) and one in a
separate process, as an engine's TP ranks are (the even ones read with
verify="never": only the pins keep their reads whole), each doing a seeded random
mix of puts (put_run / put_runs / put_blocks / save_blocks), reads
(get_run / get_blocks / get_runs / read_range / load_blocks with
wait_layer), lookup / present / touch, pin / unpin, delete, evict, clear
and reconnects.

Every block's bytes derive from (key, version), a version per put call,
and each (layer, group) piece starts with a header naming them, so any
block read tells which put it claims to come from.  The oracle: a block
read is exactly the bytes of a put of that key begun before the read
ended (never torn, never another key's, never a version never put); no
read begun after a clear() returned gets a put that returned before the
clear began; only documented errors; every client and the server stop;
the store reopens locally, passes fsck and holds only oracle-passing
bytes.  The kill variant SIGKILLs the server mid-run and restarts it
(clients with reconnect=True): runs pinned when it died are stored after
it, and nothing wrong is ever read.

KVBLOCK_STRESS_SECONDS (default 4) sets each variant's workload time,
KVBLOCK_STRESS_SEED (default 1) the seed (each client's RNG is seeded from
it); a failure names both.
"""

from __future__ import annotations

import json
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

from kvblock import KVStore, create_file
from kvblock.errors import StoreFullError
from kvblock.store.client import RemoteStore, ServerGoneError
from kvblock.store.fsck import fsck
from kvblock.store.server import serve_in_background, spawn_server
from kvblock.tensors import VLLMLayout, load_blocks, save_blocks
from tests.store.workload import GEOM, REGION

ROOT = Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("KVBLOCK_STRESS_SECONDS", "4"))
SEED = int(os.environ.get("KVBLOCK_STRESS_SEED", "1"))
G = GEOM
L, GR, KV, BS, HG, D = (G.num_layers, G.head_groups, G.kv_parts, G.block_tokens,
                        G.heads_per_group, G.head_dim)
MAGIC = 0x6B76737472657373          # "kvstress"
POOL = 160                           # keys the clients share (~1.3 MiB of blocks)
WITNESS = 1000                       # key ids of the kill variant's pinned runs
PAGES = 12                           # pages of each client's vLLM cache
MAX_RUN = 4


def key(kid: int) -> bytes:
    return b"stress-%d" % kid


# ---------------------------------------------------------------- the bytes
_cache: dict = {}


def block_bytes(kid: int, version: int) -> np.ndarray:
    """Block ``kid``'s bytes as put ``version`` writes them, (L, GR, group
    block bytes): random bytes of (key, version), each piece's first 32
    bytes naming the key, the version and the piece."""
    b = _cache.get((kid, version))
    if b is None:
        b = np.random.default_rng([kid, version]).integers(
            0, 256, (L, GR, G.group_block_bytes), dtype=np.uint8)
        for layer in range(L):
            for group in range(GR):
                b[layer, group, :32] = np.array([MAGIC, kid, version, layer * GR + group],
                                                dtype=np.uint64).view(np.uint8)
        if len(_cache) > 4096:
            _cache.clear()
        _cache[(kid, version)] = b
    return b


def run_array(kids, version) -> np.ndarray:
    """put_run's data: (L, GR, n, group block bytes)."""
    return np.ascontiguousarray(np.stack([block_bytes(k, version) for k in kids], axis=2))


def piece_problem(kid: int, piece: np.ndarray, layer: int, group: int):
    """(version, None) when ``piece`` is piece (layer, group) of some
    version of key ``kid``, else (None, what is wrong)."""
    head = piece[:32].view(np.uint64)
    if int(head[0]) != MAGIC or int(head[3]) != layer * GR + group:
        return None, f"piece ({layer}, {group}) header {head.tolist()}: not this piece's"
    if int(head[1]) != kid:
        return None, f"piece ({layer}, {group}) holds key {int(head[1])}'s bytes"
    version = int(head[2])
    if not np.array_equal(piece, block_bytes(kid, version)[layer, group]):
        return None, f"piece ({layer}, {group}) of version {version} torn"
    return version, None


def block_problem(kid: int, blk: np.ndarray):
    """(version, None) when ``blk`` (L, GR, bytes) is a whole block of one
    version of key ``kid``, else (None, what is wrong)."""
    v0 = None
    for layer in range(L):
        for group in range(GR):
            v, why = piece_problem(kid, blk[layer, group], layer, group)
            if why:
                return None, why
            if v0 is not None and v != v0:
                return None, f"pieces of versions {v0} and {v} (torn across pieces)"
            v0 = v
    return v0, None


def to_pages(cache: list, page: int, blk: np.ndarray) -> None:
    """Block ``blk`` into vLLM (NHD) page ``page`` of every layer."""
    for layer in range(L):
        b = blk[layer].view(np.uint16).reshape(GR, KV, BS, HG, D)
        cache[layer].view(np.uint16)[:, page] = b.transpose(1, 2, 0, 3, 4).reshape(
            KV, BS, GR * HG, D)


def from_pages(cache: list, page: int) -> np.ndarray:
    blk = np.empty((L, GR, G.group_block_bytes), np.uint8)
    for layer in range(L):
        p = cache[layer].view(np.uint16)[:, page].reshape(KV, BS, GR, HG, D)
        blk[layer] = p.transpose(2, 0, 1, 3, 4).reshape(GR, -1).view(np.uint8)
    return blk


# ---------------------------------------------------------------- a client
ALLOWED = (StoreFullError,)              # a full store of pinned runs refuses a put
ALLOWED_KILL = (StoreFullError, ServerGoneError)   # (ConnectionAbandonedError is one)


class Client:
    """One client's workload: ``step()`` does one random operation on its
    store, logging what it did (times from CLOCK_MONOTONIC, which every
    process of the machine shares) for the oracle."""

    def __init__(self, cid: int, sock: str, seed: int, kill: bool, store=None,
                 may_close: bool = True, lock: threading.Lock | None = None):
        self.cid, self.sock, self.kill = cid, sock, kill
        self.rng = random.Random(seed)
        self.may_close = may_close
        self.store = store if store is not None else self._open()
        self.seq = 0
        self.puts: list = []          # [version, kids, began, ended, outcome]
        self.reads: list = []         # [kid, version, began, ended, how]
        self.clears: list = []        # [began, ended]
        self.failures: list = []
        self.errors: dict = {}
        self.ops: dict = {}
        self.pins: list = []
        self.lock = lock or threading.Lock()     # the log's (a shared client's two threads)
        self.cache = [np.zeros((KV, PAGES, BS, GR * HG, D), np.float16) for _ in range(L)]

    def _open(self):
        # even clients read unverified: only the pins keep their reads whole
        return RemoteStore(self.sock, reconnect=self.kill,
                           verify="never" if self.cid % 2 == 0 else None)

    def _version(self) -> int:
        with self.lock:
            self.seq += 1
            return self.cid * 10_000_000 + self.seq

    def _kids(self) -> list[int]:
        n = self.rng.randint(1, MAX_RUN)
        s = self.rng.randrange(POOL - n + 1)
        return list(range(s, s + n))

    # -- the oracle's records
    def _put(self, fn, kids_list, versions):
        began = time.monotonic()
        try:
            out = fn()
        except BaseException:
            ended = time.monotonic()
            with self.lock:
                for kids, v in zip(kids_list, versions):
                    self.puts.append([v, kids, began, ended, "raised"])
            raise
        ended = time.monotonic()
        counts = out if isinstance(out, list) else [out]
        with self.lock:
            for kids, v, n in zip(kids_list, versions, counts):
                self.puts.append([v, kids, began, ended, int(n)])

    def _got(self, how, kids, blocks, began):
        """``blocks``: the blocks a read reported as returned, (L, GR, bytes) each."""
        ended = time.monotonic()
        with self.lock:
            for kid, blk in zip(kids, blocks):
                v, why = block_problem(kid, blk)
                if why:
                    self.failures.append(f"client {self.cid} {how} of key {kid}: {why}")
                else:
                    self.reads.append([kid, v, began, ended, how])

    # -- operations
    def put_run(self):
        kids, v = self._kids(), self._version()
        self._put(lambda: self.store.put_run([key(k) for k in kids], run_array(kids, v)),
                  [kids], [v])

    def put_blocks(self):
        kids, v = self._kids(), self._version()
        blocks = [np.ascontiguousarray(block_bytes(k, v)) for k in kids]
        self._put(lambda: self.store.put_blocks([key(k) for k in kids], blocks),
                  [kids], [v])

    def put_runs(self):
        runs = [self._kids() for _ in range(self.rng.randint(2, 3))]
        vs = [self._version() for _ in runs]
        self._put(lambda: self.store.put_runs(
            [([key(k) for k in kids], run_array(kids, v)) for kids, v in zip(runs, vs)]),
            runs, vs)

    def save(self):
        kids, v = self._kids(), self._version()
        pages = self.rng.sample(range(PAGES), len(kids))
        for k, p in zip(kids, pages):
            to_pages(self.cache, p, block_bytes(k, v))
        self._put(lambda: save_blocks(self.store, [key(k) for k in kids],
                                      VLLMLayout(self.cache), pages),
                  [kids], [v])

    def get_run(self):
        kids = self._kids()
        out = np.zeros((L, GR, len(kids), G.group_block_bytes), np.uint8)
        began = time.monotonic()
        n = self.store.get_run([key(k) for k in kids], out)
        self._got("get_run", kids[:n], [out[:, :, j] for j in range(n)], began)

    def get_blocks(self):
        kids = self._kids()
        outs = [np.zeros((L, GR, G.group_block_bytes), np.uint8) for _ in kids]
        began = time.monotonic()
        n = self.store.get_blocks([key(k) for k in kids], outs)
        self._got("get_blocks", kids[:n], outs[:n], began)

    def get_runs(self):
        reqs = [self._kids() for _ in range(self.rng.randint(1, 3))]
        outs = [np.zeros((L, GR, len(kids), G.group_block_bytes), np.uint8) for kids in reqs]
        began = time.monotonic()
        counts = self.store.get_runs([([key(k) for k in kids], out)
                                      for kids, out in zip(reqs, outs)])
        for kids, out, n in zip(reqs, outs, counts):
            self._got("get_runs", kids[:n], [out[:, :, j] for j in range(n)], began)

    def read_range(self):
        kids = self._kids()
        layer, group = self.rng.randrange(L), self.rng.randrange(GR)
        out = np.zeros((len(kids), G.group_block_bytes), np.uint8)
        began = time.monotonic()
        n = self.store.read_range([key(k) for k in kids], layer, group, out)
        ended = time.monotonic()
        with self.lock:
            for kid, piece in zip(kids[:n], out[:n]):
                v, why = piece_problem(kid, piece, layer, group)
                if why:
                    self.failures.append(f"client {self.cid} read_range of key {kid}: {why}")
                else:
                    self.reads.append([kid, v, began, ended, "read_range"])

    def load(self):
        kids = self._kids()
        pages = self.rng.sample(range(PAGES), len(kids))
        began = time.monotonic()
        handle = load_blocks(self.store, [key(k) for k in kids], VLLMLayout(self.cache), pages)
        for layer in range(L):
            handle.wait_layer(layer, timeout=120)
        n = handle.wait(timeout=120)
        self._got("load_blocks", kids[:n], [from_pages(self.cache, p) for p in pages[:n]],
                  began)

    def lookup(self):
        kids = self._kids()
        n = self.store.lookup([key(k) for k in kids])
        flags = self.store.present([key(k) for k in kids])
        if not 0 <= n <= len(kids) or len(flags) != len(kids):
            with self.lock:
                self.failures.append(f"client {self.cid}: lookup {n}, present {flags}")

    def touch(self):
        kids = self._kids()
        self.store.touch([key(k) for k in kids])

    def pin(self):
        if len(self.pins) < 2:
            self.pins.append(self.store.pin([key(k) for k in self._kids()]))

    def unpin(self):
        if self.pins:
            self.store.unpin(self.pins.pop(self.rng.randrange(len(self.pins))))

    def delete(self):
        self.store.delete([key(self.rng.randrange(POOL))])

    def evict(self):
        if self.rng.random() < 0.1:
            self.store.evict(all=True)
        else:
            self.store.evict(self.rng.randint(1, 4) * REGION)

    def clear(self):
        began = time.monotonic()
        self.store.clear()
        with self.lock:
            self.clears.append([began, time.monotonic()])

    def reconnect(self):
        self.pins = []            # (a connection's pins go with it)
        self.store.close()
        self.store = None         # (a server away: opened again at a later step)
        self.store = self._open()

    OPS = [("put_run", 8), ("put_blocks", 4), ("put_runs", 3), ("save", 3), ("get_run", 8),
           ("get_blocks", 4), ("get_runs", 4), ("read_range", 3), ("load", 4), ("lookup", 3),
           ("touch", 2), ("pin", 2), ("unpin", 3), ("delete", 2), ("evict", 1),
           ("clear", 0.15), ("reconnect", 0.3)]

    def step(self) -> None:
        names, weights = zip(*self.OPS)
        op = self.rng.choices(names, weights)[0]
        if op == "reconnect" and not self.may_close:
            return
        if op == "clear" and self.kill:
            return                # (the witness runs must stay stored)
        self.ops[op] = self.ops.get(op, 0) + 1
        try:
            if self.store is None:
                self.store = self._open()
            getattr(self, op)()
        except ALLOWED_KILL if self.kill else ALLOWED as e:
            name = type(e).__name__
            with self.lock:
                self.errors[name] = self.errors.get(name, 0) + 1
            if isinstance(e, ServerGoneError):
                # (the pins of the lost connection are released by unpin as
                # usual: it never raises for a gone server, and closes it)
                time.sleep(0.01)      # (no spin while the server is away)
        except Exception as e:    # noqa: BLE001  (the oracle's: reported, not raised)
            with self.lock:
                self.failures.append(f"client {self.cid} {op}: {type(e).__name__}: {e}")

    def run(self, until: float, stop: threading.Event | None = None) -> None:
        while time.monotonic() < until and not (stop is not None and stop.is_set()) \
                and len(self.failures) < 20:
            self.step()

    def log(self) -> dict:
        return {"puts": self.puts, "reads": self.reads, "clears": self.clears,
                "failures": self.failures, "errors": self.errors, "ops": self.ops}


def _child(args: str) -> None:
    """The client in a process of its own (``python -c``): runs until the
    deadline (a CLOCK_MONOTONIC time), writes its log as JSON."""
    a = json.loads(args)
    c = Client(a["cid"], a["sock"], a["seed"], a["kill"])
    try:
        c.run(a["until"])
    finally:
        try:
            if c.store is not None:
                c.store.close()
        finally:
            with open(a["log"], "w") as f:
                json.dump(c.log(), f)


# ---------------------------------------------------------------- the oracle
def check_logs(logs: list, what: str) -> dict:
    """Every failure the clients saw, then every read against every put and
    clear of all clients; raises AssertionError naming the first problems."""
    problems = [f for lg in logs for f in lg["failures"]]
    puts = {}
    for lg in logs:
        for version, kids, began, ended, outcome in lg["puts"]:
            for k in kids:
                puts[(k, version)] = (began, ended, outcome)
    clears = sorted(tuple(c) for lg in logs for c in lg["clears"])
    reads = 0
    for lg in logs:
        for kid, version, began, ended, how in lg["reads"]:
            reads += 1
            put = puts.get((kid, version))
            if put is None:
                problems.append(f"{how} of key {kid} returned version {version}, never put")
                continue
            if put[0] > ended:
                problems.append(f"{how} of key {kid} returned version {version} before its "
                                f"put began")
            for c_began, c_ended in clears:
                # a put returned before the clear began, a read begun after it returned
                if c_ended < began and isinstance(put[2], int) and put[1] < c_began:
                    problems.append(f"{how} of key {kid} returned version {version} put "
                                    f"before a clear ({put[1]:.3f} < {c_began:.3f}), read "
                                    f"after it ({began:.3f} > {c_ended:.3f})")
                    break
    assert not problems, f"{what} (seed {SEED}, {SECONDS} s): {len(problems)} problems: " \
                         f"{problems[:10]}"
    return {"reads": reads, "puts": len(puts), "clears": len(clears)}


def check_reopened(path: str, logs: list, what: str) -> None:
    """The store opened locally: fsck finds nothing wrong, and each stored
    key of the pool reads back as a put the oracle accepts."""
    with KVStore.open([path]) as store:
        report = fsck(store, deep=True)
        assert report.problems == [], f"{what} (seed {SEED}): fsck {report.as_dict()}"
        lg = Client.__new__(Client)          # (its reads' check and log, no store)
        lg.cid, lg.lock, lg.reads, lg.failures = "reopened", threading.Lock(), [], []
        began = time.monotonic()
        for kid in range(POOL):
            out = np.zeros((L, GR, 1, G.group_block_bytes), np.uint8)
            if store.get_run([key(kid)], out):
                lg._got("get_run", [kid], [out[:, :, 0]], began)
    check_logs(logs + [{"reads": lg.reads, "failures": lg.failures, "puts": [],
                        "clears": []}], what + ", reopened")


# ---------------------------------------------------------------- the runs
@pytest.fixture
def served(tmp_path):
    """(socket, store file); a server or client process left (a failed
    test's) is killed, the files go with tmp_path."""
    from tests.serve.test_serve import _kill_servers_of

    sock = str(tmp_path / "kv.sock")
    path = str(tmp_path / "kv.img")
    create_file(path, 3 << 20)
    KVStore.format([path], G, region_size=REGION, journal_bytes=256 << 10).close()
    procs: list = []
    yield sock, path, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    _kill_servers_of(sock)


def _start_child(procs, tmp_path, cid, sock, kill, until) -> tuple:
    log = str(tmp_path / f"client{cid}.json")
    args = json.dumps({"cid": cid, "sock": sock, "seed": SEED * 100 + cid, "kill": kill,
                       "until": until, "log": log})
    p = subprocess.Popen([sys.executable, "-c", "import sys; from tests.serve."
                          "test_served_stress import _child; _child(sys.argv[1])", args],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(p)
    return p, log


def _run_clients(sock, tmp_path, procs, kill, until, during=None) -> list:
    """Clients 1-2 in threads (each its own connection, reconnecting now
    and then), client 3 shared by two threads (never closed), client 4 in a
    process; ``during()`` runs meanwhile in this thread.  Their logs."""
    stop = threading.Event()
    clients = [Client(c, sock, SEED * 100 + c, kill) for c in (1, 2)]
    shared = Client(3, sock, SEED * 100 + 3, kill, may_close=False)
    twin = Client(3, sock, SEED * 100 + 33, kill, store=shared.store, may_close=False,
                  lock=shared.lock)
    twin.seq = 5_000_000                 # (versions apart from its twin's)
    child, child_log = _start_child(procs, tmp_path, 4, sock, kill, until)
    threads = [threading.Thread(target=c.run, args=(until, stop), name=f"client{c.cid}")
               for c in clients + [shared, twin]]
    for t in threads:
        t.start()
    try:
        if during is not None:
            during()
    finally:
        for t in threads:
            t.join(max(0.0, until - time.monotonic()) + 60)
        stop.set()
        for t in threads:
            t.join(60)
        stuck = [t.name for t in threads if t.is_alive()]
        closing = []
        for c in clients + [shared]:
            if c.store is None:
                continue
            closer = threading.Thread(target=c.store.close)
            closer.start()
            closing.append(closer)
        for closer in closing:
            closer.join(60)
    out = child.communicate(timeout=max(1.0, until - time.monotonic()) + 60)[0]
    assert not stuck, f"clients did not stop: {stuck}"
    assert not any(c.is_alive() for c in closing), "a client's close() hung"
    assert child.returncode == 0, f"the client process failed: {out}"
    with open(child_log) as f:
        logs = [c.log() for c in clients + [shared, twin]] + [json.load(f)]
    return logs


def _busy(logs) -> dict:
    ops, errors = {}, {}
    for lg in logs:
        for k, v in lg["ops"].items():
            ops[k] = ops.get(k, 0) + v
        for k, v in lg["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {"ops": ops, "errors": errors}


def test_clients_race_on_a_full_served_store(served, tmp_path):
    sock, path, procs = served
    server = serve_in_background([path], sock)
    try:
        logs = _run_clients(sock, tmp_path, procs, False, time.monotonic() + SECONDS)
        evictions = server.store.stats().get("evicted_regions", None)
    finally:
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        stopper.join(60)
    assert not stopper.is_alive(), "the server did not stop"
    summary = check_logs(logs, "served stress")
    print(summary, _busy(logs), "evicted regions:", evictions)
    assert summary["reads"] > 0
    check_reopened(path, logs, "served stress")


def test_a_server_killed_mid_run_loses_nothing_and_serves_nothing_wrong(served, tmp_path):
    sock, path, procs = served
    server = spawn_server([path], sock, timeout=120)
    procs.append(server)
    witness = [list(range(WITNESS + 4 * i, WITNESS + 4 * i + 4)) for i in range(2)]
    seen: dict = {}
    until = time.monotonic() + SECONDS + 3    # (the restart's time)

    def kill_and_restart():
        # mid-run: runs pinned by this connection, then the server SIGKILLed
        w = RemoteStore(sock)
        try:
            time.sleep(SECONDS / 3)          # (the clients at work meanwhile)
            pins = []
            for i, kids in enumerate(witness):
                keys, v = [key(k) for k in kids], 90_000_000 + i
                # Again until it is stored and pinned whole: an eviction may
                # come between put and pin, and the clients' pins may hold
                # every region for a moment (StoreFullError, as they see it).
                deadline = time.monotonic() + 60
                while True:
                    try:
                        w.put_run(keys, run_array(kids, v))
                    except StoreFullError:
                        pass
                    else:
                        pin = w.pin(keys)
                        if sum(c for _, _, c, _ in pin) == len(kids):
                            break
                        w.unpin(pin)
                    assert time.monotonic() < deadline, \
                        f"witness run {i} not stored and pinned whole in 60 s (seed {SEED})"
                pins.append(pin)
                for k in kids:
                    seen[k] = v
            os.kill(server.pid, signal.SIGKILL)
            server.wait(30)
        finally:
            w.close()
        # the pinned runs are there after the crash: opened locally, recovered
        with KVStore.open([path]) as store:
            for kids in witness:
                out = np.zeros((L, GR, len(kids), G.group_block_bytes), np.uint8)
                assert store.get_run([key(k) for k in kids], out) == len(kids), \
                    f"a run pinned when the server was killed is gone (seed {SEED})"
                assert np.array_equal(out, run_array(kids, seen[kids[0]]))
        procs.append(spawn_server([path], sock, timeout=120))

    logs = _run_clients(sock, tmp_path, procs, True, until, kill_and_restart)
    os.kill(procs[-1].pid, signal.SIGTERM)
    procs[-1].wait(60)
    assert procs[-1].returncode == 0, "the restarted server did not stop cleanly"
    wlog = {"puts": [[v, kids, 0.0, 0.0, len(kids)] for kids, v in
                     ((kids, seen[kids[0]]) for kids in witness)],
            "reads": [], "clears": [], "failures": [], "errors": {}, "ops": {}}
    summary = check_logs(logs + [wlog], "served stress, server killed")
    busy = _busy(logs)
    print(summary, busy)
    assert busy["errors"].get("ServerGoneError", 0) > 0, "no client saw the server die"
    check_reopened(path, logs + [wlog], "served stress, server killed")
