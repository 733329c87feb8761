"""A randomized multi-threaded stress test of a local KVStore, to hunt races.

Several threads put, read and remove at once against one small store (a
few dozen regions, so puts keep it full and eviction runs all the time):
put_run / put_runs / put_blocks / save_blocks, get_run / get_blocks /
get_runs / read_range / load_blocks (layer-wise), lookup / present, pin /
unpin, touch, delete, evict, checkpoint and (rarely) clear.

Every block's bytes are derived from (key, version), each 8-byte word
naming both and its place, and every version is put once.  What must hold
however the threads interleave:
- a read returns, for every block it counts as returned, exactly the bytes
  of one version that was put of that key (never a torn mix, never another
  key's bytes, never a version nobody put);
- once a clear() returned, no block whose put returned before that clear
  began is returned;
- the store's counters never go negative, and only the documented errors
  are raised (StoreFullError for a run larger than the store);
- close() returns, and a reopen (after a clean close, and after a crash)
  serves only bytes that pass the same check, and fsck finds it clean.

The random choices come from a seeded RNG per thread: what varies between
runs is the interleaving.  A longer hunt: KVBLOCK_STRESS_SECONDS=60
KVBLOCK_STRESS_SEED=7 (a failure names the seed and each thread's last ops).
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import traceback

import numpy as np
import pytest

from kvblock import Geometry, KVStore
from kvblock.errors import StoreFullError
from kvblock.store.fsck import fsck
from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

MIB = 1 << 20
SECONDS = float(os.environ.get("KVBLOCK_STRESS_SECONDS", "2.5"))
SEED = int(os.environ.get("KVBLOCK_STRESS_SEED", "0"))
THREADS = 5

# 8 KiB blocks (2 layers x 4 KiB); 64 KiB regions hold 7 of them, and a
# 4 MiB file 32 regions (about 220 blocks) for 256 keys: puts evict.
GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16,
                head_groups=1)
REGION = 64 << 10
STORE_BYTES = 4 * MIB
NKEYS = 256
KEYS = [b"stress-%09d" % i for i in range(NKEYS)]
KEY_INDEX = {k: i for i, k in enumerate(KEYS)}
WORDS = GEOM.block_bytes // 8            # per block
LAYER_WORDS = GEOM.group_block_bytes // 8
OVERSIZED = 240                          # blocks: more than the store holds at once
PAGES = 16                               # per thread's vLLM cache


def block_image(k: int, v: int) -> np.ndarray:
    """Block of key k at version v, in the store's layout order: word w is
    (k, v, w), so any slice of it says whose it is and where it belongs."""
    return (np.uint64((k << 44) | (v << 16)) + np.arange(WORDS, dtype=np.uint64))


class Oracle:
    """What was put (every version of every key) and when clears happened."""

    def __init__(self):
        self.lock = threading.Lock()
        self.versions = itertools.count(1)
        self.issued: dict[int, dict[int, int | None]] = collections.defaultdict(dict)
        self.clears_started = 0
        self.clears_done = 0        # the highest clear number that returned
        self.clears_returned = 0    # how many returned

    def new_versions(self, ks) -> list[int]:
        """Versions for a put about to be made (recorded before it is made:
        a read may see its bytes before the put returns)."""
        with self.lock:
            vs = [next(self.versions) for _ in ks]
            for k, v in zip(ks, vs):
                self.issued[k][v] = None
        return vs

    def put_returned(self, ks, vs) -> None:
        """The clears begun by the time the put returned: a clear begun
        later must forget it."""
        with self.lock:
            for k, v in zip(ks, vs):
                self.issued[k][v] = self.clears_started

    def read_began(self) -> int:
        with self.lock:
            return self.clears_done

    def check(self, k: int, words: np.ndarray, first_word: int, cleared: int, what: str):
        """``words``: a block's words from ``first_word`` on, read of key k by
        a read that began after ``cleared`` clears had returned."""
        got = int(words[0])
        gk, gv = got >> 44, (got >> 16) & ((1 << 28) - 1)
        if gk != k:
            raise AssertionError(f"{what}: key {k} read as bytes of key {gk} (version {gv})")
        with self.lock:
            seen = self.issued[k].get(gv, "never")
        if seen == "never":
            raise AssertionError(f"{what}: key {k} read as version {gv}, which was never put")
        want = block_image(k, gv)[first_word:first_word + words.size]
        if not np.array_equal(words, want):
            bad = int(np.flatnonzero(words != want)[0])
            raise AssertionError(f"{what}: key {k} version {gv} torn at word "
                                 f"{first_word + bad}: {int(words[bad]):#x}, want "
                                 f"{int(want[bad]):#x}")
        if seen is not None and seen < cleared:
            raise AssertionError(f"{what}: key {k} version {gv}, put before clear {seen + 1} "
                                 f"began, read after {cleared} clears returned")


def run_data(images: list[np.ndarray]) -> np.ndarray:
    """put_run's data for blocks given as images: (layer, group, block, bytes)."""
    blocks = np.stack(images).reshape(len(images), GEOM.num_layers, LAYER_WORDS)
    return np.ascontiguousarray(blocks.transpose(1, 0, 2))


def check_run(oracle, ks, out, n, cleared, what):
    """get_run's out (layout order), its first n blocks."""
    arr = out.reshape(GEOM.num_layers, len(ks), LAYER_WORDS)
    for j in range(n):
        oracle.check(ks[j], np.ascontiguousarray(arr[:, j, :]).reshape(-1), 0, cleared,
                     f"{what} block {j}")


def check_stats(store):
    for name, value in store.stats().items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise AssertionError(f"stats()[{name!r}] went negative: {value}")


def page_words(cache, page) -> np.ndarray:
    """A page of one layer's vLLM cache as the store's words of that layer."""
    return np.ascontiguousarray(cache[:, page]).reshape(-1).view(np.uint64)


class Worker:
    def __init__(self, store, oracle, seed, index, stop, failures):
        self.store, self.oracle, self.stop, self.failures = store, oracle, stop, failures
        self.rng = np.random.default_rng([seed, index])
        self.name = f"thread {index} (seed {seed})"
        self.ops: collections.deque = collections.deque(maxlen=40)
        self.pins: list = []
        shape = (2, PAGES, GEOM.block_tokens, 1, GEOM.head_dim)
        self.src = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
        self.dst = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
        self.ops_done = collections.Counter()

    def keys(self, most=12):
        """A run of distinct consecutive keys (as key indices)."""
        n = int(self.rng.integers(1, most + 1))
        start = int(self.rng.integers(0, NKEYS))
        return [(start + j) % NKEYS for j in range(n)]

    def run(self):
        ops = [(self.put_run, 14), (self.put_runs, 5), (self.put_blocks, 6), (self.save, 5),
               (self.get_run, 12), (self.get_blocks, 6), (self.get_runs, 5),
               (self.read_range, 5), (self.load, 5), (self.lookup, 4), (self.pin, 3),
               (self.unpin, 3), (self.delete, 2), (self.evict, 2), (self.touch, 2),
               (self.checkpoint, 0.5), (self.stats, 1), (self.clear, 0.15),
               (self.oversized, 0.05)]
        fns = [f for f, _ in ops]
        weights = np.array([w for _, w in ops], float)
        weights /= weights.sum()
        try:
            while not self.stop.is_set():
                fn = fns[int(self.rng.choice(len(fns), p=weights))]
                fn()
                self.ops_done[fn.__name__] += 1
            while self.pins:
                self.unpin()
        except BaseException:
            self.failures.append(f"{self.name}: {traceback.format_exc()}\nlast ops:\n  "
                                 + "\n  ".join(self.ops))
            self.stop.set()

    def note(self, text):
        self.ops.append(text)

    # --- puts
    def _put(self, call, ks, vs, what, sizes=None):
        """``sizes``: put_runs' runs' lengths (else one run of ``ks``)."""
        self.note(f"{what} {ks[0]}+{len(ks)} v{vs[0]}..")
        with self.oracle.lock:
            clears = self.oracle.clears_started
            running = self.oracle.clears_returned < clears
        try:
            counts = call()
        except StoreFullError as e:
            if "pinned" not in str(e):      # every region pinned: documented
                raise
            counts = None
        self.oracle.put_returned(ks, vs)
        self.note(f"  -> {counts}")
        if counts is None:
            return
        with self.oracle.lock:     # a clear in flight at some point of the put
            cleared = running or self.oracle.clears_started != clears
        # a whole run stored (or found stored), or nothing when a clear
        # came in between (no admission here)
        for n, size in zip(counts if sizes else [counts], sizes or [len(ks)]):
            assert n == size or (n == 0 and cleared), \
                f"{what}: {n} of a run of {size} blocks stored, with no clear meanwhile"

    def put_run(self):
        ks = self.keys()
        vs = self.oracle.new_versions(ks)
        data = run_data([block_image(k, v) for k, v in zip(ks, vs)])
        self._put(lambda: self.store.put_run([KEYS[k] for k in ks], data), ks, vs, "put_run")

    def put_blocks(self):
        ks = self.keys()
        vs = self.oracle.new_versions(ks)
        blocks = [block_image(k, v).view(np.uint8) for k, v in zip(ks, vs)]
        self._put(lambda: self.store.put_blocks([KEYS[k] for k in ks], blocks), ks, vs,
                  "put_blocks")

    def put_runs(self):
        runs = [self.keys(6) for _ in range(int(self.rng.integers(1, 4)))]
        ks = [k for r in runs for k in r]
        vs = self.oracle.new_versions(ks)
        items, at = [], 0
        for r in runs:
            items.append(([KEYS[k] for k in r],
                          run_data([block_image(k, v) for k, v in zip(r, vs[at:at + len(r)])])))
            at += len(r)
        self._put(lambda: self.store.put_runs(items), ks, vs, f"put_runs x{len(runs)}",
                  [len(r) for r in runs])

    def save(self):
        ks = self.keys(PAGES)
        vs = self.oracle.new_versions(ks)
        pages = self.rng.permutation(PAGES)[:len(ks)]
        for k, v, p in zip(ks, vs, pages):
            img = block_image(k, v)
            for layer in range(GEOM.num_layers):
                words = img[layer * LAYER_WORDS:(layer + 1) * LAYER_WORDS]
                self.src[layer][:, p] = words.view(np.float16).reshape(self.src[layer][:, p].shape)
        layout = VLLMLayout(self.src)
        self._put(lambda: save_blocks(self.store, [KEYS[k] for k in ks], layout, pages.tolist()),
                  ks, vs, "save_blocks")

    def oversized(self):
        ks = list(range(OVERSIZED))
        self.note("put_run oversized")
        data = np.zeros(OVERSIZED * GEOM.block_bytes, np.uint8)
        with pytest.raises(StoreFullError, match="does not fit this store"):
            self.store.put_run([KEYS[k] for k in ks], data)

    # --- reads
    def get_run(self):
        ks = self.keys()
        out = np.empty(len(ks) * WORDS, np.uint64)
        cleared = self.oracle.read_began()
        self.note(f"get_run {ks[0]}+{len(ks)}")
        n = self.store.get_run([KEYS[k] for k in ks], out)
        self.note(f"  -> {n}")
        assert 0 <= n <= len(ks)
        check_run(self.oracle, ks, out, n, cleared, "get_run")

    def get_blocks(self):
        ks = self.keys()
        outs = [np.empty(WORDS, np.uint64) for _ in ks]
        cleared = self.oracle.read_began()
        self.note(f"get_blocks {ks[0]}+{len(ks)}")
        n = self.store.get_blocks([KEYS[k] for k in ks], [o.view(np.uint8) for o in outs])
        self.note(f"  -> {n}")
        assert 0 <= n <= len(ks)
        for j in range(n):
            self.oracle.check(ks[j], outs[j], 0, cleared, f"get_blocks block {j}")

    def get_runs(self):
        reqs = [self.keys(6) for _ in range(int(self.rng.integers(1, 5)))]
        outs = [np.empty(len(r) * WORDS, np.uint64) for r in reqs]
        cleared = self.oracle.read_began()
        self.note(f"get_runs {[(r[0], len(r)) for r in reqs]}")
        counts = self.store.get_runs([([KEYS[k] for k in r], o.view(np.uint8))
                                      for r, o in zip(reqs, outs)])
        self.note(f"  -> {counts}")
        assert len(counts) == len(reqs)
        for r, o, n in zip(reqs, outs, counts):
            assert 0 <= n <= len(r)
            check_run(self.oracle, r, o, n, cleared, "get_runs")

    def read_range(self):
        ks = self.keys()
        layer = int(self.rng.integers(0, GEOM.num_layers))
        out = np.empty(len(ks) * LAYER_WORDS, np.uint64)
        cleared = self.oracle.read_began()
        self.note(f"read_range {ks[0]}+{len(ks)} layer {layer}")
        n = self.store.read_range([KEYS[k] for k in ks], layer, 0, out.view(np.uint8))
        self.note(f"  -> {n}")
        assert 0 <= n <= len(ks)
        for j in range(n):
            self.oracle.check(ks[j], out[j * LAYER_WORDS:(j + 1) * LAYER_WORDS],
                              layer * LAYER_WORDS, cleared, f"read_range block {j}")

    def load(self):
        ks = self.keys(PAGES)
        pages = self.rng.permutation(PAGES)[:len(ks)]
        cleared = self.oracle.read_began()
        self.note(f"load_blocks {ks[0]}+{len(ks)}")
        handle = load_blocks(self.store, [KEYS[k] for k in ks], VLLMLayout(self.dst),
                             pages.tolist())
        seen = []      # each layer as it was when wait_layer returned
        for layer in range(GEOM.num_layers):
            n = handle.wait_layer(layer, timeout=60)
            seen.append([page_words(self.dst[layer], p) for p in pages[:n]])
        n = handle.wait(timeout=60)
        self.note(f"  -> {n}")
        assert 0 <= n <= len(ks)
        for layer, got in enumerate(seen):
            assert len(got) >= n, f"load_blocks: layer {layer} had {len(got)} pages, wait() {n}"
            for j in range(n):
                self.oracle.check(ks[j], got[j], layer * LAYER_WORDS, cleared,
                                  f"load_blocks layer {layer} block {j}")

    def lookup(self):
        ks = self.keys()
        n = self.store.lookup([KEYS[k] for k in ks])
        found = self.store.present([KEYS[k] for k in ks])
        assert 0 <= n <= len(ks) and found.shape == (len(ks),) and found.dtype == bool

    # --- the rest
    def pin(self):
        if len(self.pins) < 2:
            ks = self.keys(6)
            self.note(f"pin {ks[0]}+{len(ks)}")
            self.pins.append(self.store.pin([KEYS[k] for k in ks]))

    def unpin(self):
        if self.pins:
            self.note("unpin")
            self.store.unpin(self.pins.pop(int(self.rng.integers(0, len(self.pins)))))

    def delete(self):
        ks = self.keys(4)
        self.note(f"delete {ks}")
        assert self.store.delete([KEYS[k] for k in ks]) >= 0

    def evict(self):
        if self.rng.random() < 0.1:
            self.note("evict all")
            assert self.store.evict(all=True) >= 0
        else:
            nbytes = int(self.rng.integers(1, 4 * REGION))
            self.note(f"evict {nbytes}")
            assert self.store.evict(nbytes) >= 0

    def touch(self):
        ks = self.keys()
        assert 0 <= self.store.touch([KEYS[k] for k in ks]) <= len(ks)

    def checkpoint(self):
        self.note("checkpoint")
        self.store.checkpoint()

    def stats(self):
        check_stats(self.store)

    def clear(self):
        with self.oracle.lock:
            self.oracle.clears_started += 1
            number = self.oracle.clears_started
        self.note(f"clear {number}")
        assert self.store.clear() >= 0
        with self.oracle.lock:
            self.oracle.clears_done = max(self.oracle.clears_done, number)
            self.oracle.clears_returned += 1
        self.note(f"  clear {number} returned")


def stress(store, oracle, seed, seconds):
    stop, failures = threading.Event(), []
    workers = [Worker(store, oracle, seed, i, stop, failures) for i in range(THREADS)]
    threads = [threading.Thread(target=w.run, name=w.name, daemon=True) for w in workers]
    for t in threads:
        t.start()
    stop.wait(seconds)
    # On a slow machine the time may run out before every kind of call ran:
    # on until a put_run and a get_run did (or a thread failed), not failed.
    later = time.monotonic() + 120
    while not failures and time.monotonic() < later and not all(
            any(w.ops_done[op] for w in workers) for op in ("put_run", "get_run")):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(120)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still running: {stuck}"
    assert not failures, "\n\n".join(failures)
    check_stats(store)
    done = sum((w.ops_done for w in workers), collections.Counter())
    assert done["put_run"] and done["get_run"], done     # it did run


def check_reopened(store, oracle, what):
    """Every key read back, one by one, passes the oracle."""
    cleared = oracle.read_began()
    out = np.empty(WORDS, np.uint64)
    for k in range(NKEYS):
        if store.get_run([KEYS[k]], out.view(np.uint8)) == 1:
            oracle.check(k, out, 0, cleared, what)
    check_stats(store)


def close_promptly(store):
    """close() in a thread: a hang fails the test instead of stopping it."""
    errors = []

    def close():
        try:
            store.close()
        except BaseException as e:      # noqa: BLE001  (raised below)
            errors.append(e)
    t = threading.Thread(target=close, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "close() did not return"
    if errors:
        raise errors[0]


# On /dev/shm with verify="never": a read of bytes being overwritten is not
# caught (and dropped) by a checksum there, the oracle sees it.
@pytest.mark.parametrize("kind,host_blocks,verify",
                         [("file", 0, "always"), ("shm", 0, "never"), ("file", 48, "always")],
                         ids=["file", "shm-unverified", "file-dram-tier"])
def test_threads_race_puts_reads_and_removals(kind, host_blocks, verify, request):
    path = request.getfixturevalue(f"{kind}_target")(STORE_BYTES)
    options = {"host_cache_bytes": host_blocks * GEOM.block_bytes} if host_blocks else {}
    options["verify"] = verify
    seed = SEED + (1000 if host_blocks else 0) + (100 if kind == "shm" else 0)
    oracle = Oracle()
    store = KVStore.format([path], GEOM, region_size=REGION, force=True, **options)
    try:
        stress(store, oracle, seed, SECONDS)
    finally:
        close_promptly(store)
    # a clean close: reopened from its checkpoint
    with KVStore.open([path], **options) as store:
        assert store.clean_at_open
        check_reopened(store, oracle, "reopened")
        assert fsck(store).status == "clean"
        stress(store, oracle, seed + 1, SECONDS / 2)
        store.closed = True           # "killed": no checkpoint, the journal replayed
        store._release_devices()
    with KVStore.open([path], **options) as store:
        assert not store.clean_at_open
        check_reopened(store, oracle, "reopened after a crash")
        report = fsck(store)
        assert report.status == "clean", report.as_dict()
