"""KVStore against a model: random sequences of puts, gets, deletes,
evictions, clears, checkpoints and reopens, each checked against a plain
dict of what every key must read back as.

The model follows the documented semantics (README "Using the store"):
- a put whose keys are all stored already writes nothing (the stored bytes
  stay); otherwise each piece of at most ``max_run_blocks`` keys becomes a
  new run, and a key stored again names the newest copy;
- ``delete(keys)`` removes the runs that hold any of the keys, with every key
  they still name;
- ``evict(all=True)`` forgets everything on the device but the regions
  that pins hold (``pin``: the runs it pinned stay); with a DRAM tier, a
  block may live on there ("maybe": if it is read, it must read as the
  value it had); ``clear()`` forgets everything, DRAM included;
- a reopen keeps everything on the device (the DRAM tier starts empty),
  after a clean close (from the checkpoint) or a crash (replaying the
  journal); through a store server, a server killed and replaced keeps
  every put, delete and clear it answered, and only its pins lapse.

Every read is checked byte for byte: a get returns at least the prefix the
model is sure of, and never a block the model does not know or with bytes
other than its latest value.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from kvblock import Geometry, KVStore, aligned_empty
from kvblock.index import normalize_keys
from kvblock.store.client import RemoteStore, connect
from kvblock.store.server import serve_in_background
from tests.support.servers import stop_server, wait_reconnected

MIB = 1 << 20
KEYS = [b"key-%02d" % i for i in range(20)]
HASHED = dict(zip(KEYS, normalize_keys(KEYS)))    # the 16-byte keys the store logs

GEOMETRIES = {
    # 2 KiB per (layer, group) block: partial reads go through windows of
    # whole 4 KiB sectors and scatter from staging.
    "2k": Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16,
                   head_groups=2),
    # 4 KiB per (layer, group) block: partial reads go straight into place,
    # a block per I/O (get_runs) or a window per range (get_run).
    "4k": Geometry(num_layers=2, num_kv_heads=1, head_dim=4096, dtype="uint8", block_tokens=1,
                   kv_parts=1, head_groups=1),
}

# Examples per case (half of them through a server, whose examples take
# longer); a longer hunt: KVBLOCK_MODEL_EXAMPLES=400 with --timeout=0.
EXAMPLES = int(os.environ.get("KVBLOCK_MODEL_EXAMPLES", "25"))

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=9, unique=True)


def make_machine(path: str, geom: Geometry, host_blocks: int, sock: str | None = None,
                 verify: str = "always", full: bool = False, server_process: bool = False):
    """The model of a store on ``path``; with ``sock``, the same store served
    there and driven through a RemoteStore (this process does the I/O, a
    server thread the metadata).  ``server_process``: the server is a
    ``kvblock serve`` process that the clients start (``connect``, as the
    engines' ranks do) and start again when it is gone (``reconnect``), and
    a rule kills it.  ``full``: ``path`` holds a few regions, so puts evict:
    which runs went is asked of the store after each put (the keys just put
    and the runs pinned must be there), then checked by every later read."""
    options = {"host_cache_bytes": host_blocks * geom.block_bytes} if host_blocks else {}
    options["verify"] = verify

    class StoreModel(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.store = None
            self.server = None
            self.clients: list = []        # through a server: two, self.store is one of them
            self.sure: dict[bytes, tuple[int, np.ndarray]] = {}   # key -> (run, block)
            self.maybe: dict[bytes, np.ndarray] = {}              # key -> block (DRAM only)
            self.run_keys: dict[int, list] = {}                   # model run -> its keys
            self.pins: list = []                          # (store, handle, model runs)
            self.next_run = 0
            self.seed = 0
            self.restarts = 0        # server processes replaced (a second each)
            self.cursor = None       # removed_since's, and what was on the device then
            self.sure_then: set[bytes] = set()

        @initialize()
        def format(self):
            # Regions of 64 KiB: runs of more than a few blocks are split
            # into pieces, and 512 regions leave room for every example's
            # puts (no eviction but the explicit ones) unless ``full``.
            store = KVStore.format([path], geom, region_size=64 << 10, force=True, **options)
            if sock is None:
                self.store = store
            else:
                store.close()
                self._serve()

        def _serve(self):
            """A server, and two clients of it (as two ranks): what one
            writes, the other reads at the offsets the server gives it."""
            if server_process:
                self.clients = [connect(sock, [path], reconnect=True, verify=verify)
                                for _ in range(2)]
            else:
                self.server = serve_in_background([path], sock)
                self.clients = [RemoteStore(sock, verify=verify) for _ in range(2)]
            self.store = self.clients[0]

        def _close(self):
            self._unpin_all()
            for store in self.clients or [self.store]:
                store.close()
            self.store, self.clients = None, []

        def teardown(self):
            pid = self.store.server_pid if server_process and self.store is not None else None
            if self.store is not None:
                self._close()
            if self.server is not None:
                self.server.stop()
            if pid is not None:
                stop_server(pid)

        def _replace_server(self, sig: int) -> None:
            """Stop (SIGTERM: it checkpoints) or kill (SIGKILL) the server
            process; the clients start a new one, which opens the store.
            The pins lapse with the old server: unpinning them does nothing."""
            pid = self.store.server_pid
            if sig == signal.SIGKILL:
                os.kill(pid, signal.SIGKILL)
            stop_server(pid)
            wait_reconnected(self.clients, pid)
            self.restarts += 1
            lapsed, self.pins = self.pins, []
            for store, handle, _ in lapsed:
                store.unpin(handle)

        @precondition(lambda self: sock is not None)
        @rule()
        def switch_client(self):
            self.store = self.clients[1 - self.clients.index(self.store)]

        # -- what the model expects ------------------------------------------

        def _data(self, n: int) -> np.ndarray:
            self.seed += 1
            rng = np.random.default_rng(self.seed)
            return rng.integers(0, 256, n * geom.block_bytes, dtype=np.uint8)

        @staticmethod
        def _block(data: np.ndarray, n: int, k: int) -> np.ndarray:
            return data.reshape(geom.num_layers, geom.head_groups, n,
                                geom.group_block_bytes)[:, :, k].copy()

        def _expect_put(self, items: list) -> list[int]:
            """Apply put_runs(items) to the model; the counts it returns."""
            found = {k for keys, _ in items for k in keys if k in self.sure}
            counts = []
            for keys, data in items:
                n = len(keys)
                counts.append(n)
                if all(k in found for k in keys):
                    continue                 # all stored already: nothing written
                step = self.store.max_run_blocks
                for start in range(0, n, step):
                    run = self.next_run
                    self.next_run += 1
                    piece = keys[start:start + step]
                    self.run_keys[run] = piece
                    for j, key in enumerate(piece):
                        self.sure[key] = (run, self._block(data, n, start + j))
                        self.maybe.pop(key, None)
                # as in calls one after another: a later run of these keys
                # is a duplicate (a RemoteStore's too: it publishes them together)
                found = found | set(keys)
            return counts

        def _sure_prefix(self, keys: list[bytes]) -> int:
            """How many leading ``keys`` the device surely holds."""
            n = 0
            while n < len(keys) and keys[n] in self.sure:
                n += 1
            return n

        def _check_read(self, keys: list[bytes], got: int, block_of) -> None:
            """A read of ``keys`` returned ``got`` leading blocks; block_of(k)
            is block k as read, in (layers, groups, group_block_bytes)."""
            sure = self._sure_prefix(keys)
            assert sure <= got <= len(keys), (keys, got, sure)
            for k in range(got):
                key = keys[k]
                want = self.sure[key][1] if key in self.sure else self.maybe.get(key)
                assert want is not None, f"block {k} ({key!r}) read back, never stored"
                assert np.array_equal(block_of(k), want), f"block {k} ({key!r}) differs"

        def _blocks_out(self, n: int, aligned: bool):
            if aligned:
                return aligned_empty(n * geom.block_bytes)
            return np.empty(n * geom.block_bytes + 1, np.uint8)[1:]

        # -- rules -----------------------------------------------------------

        @rule(keys=key_lists, aligned=st.booleans())
        def put_run(self, keys, aligned):
            data = self._data(len(keys))
            if aligned:
                image = aligned_empty(data.size)
                image[:] = data
                data = image
            want = self._expect_put([(keys, data)])
            assert self.store.put_run(keys, data) == want[0]
            self._after_put(keys)

        @rule(keys=key_lists, aligned=st.booleans())
        def put_blocks(self, keys, aligned):
            data = self._data(len(keys))
            blocks = []
            for k in range(len(keys)):
                b = self._blocks_out(1, aligned)
                b[:] = self._block(data, len(keys), k).reshape(-1)
                blocks.append(b)
            want = self._expect_put([(keys, data)])
            assert self.store.put_blocks(keys, blocks) == want[0]
            self._after_put(keys)

        @rule(runs=st.lists(key_lists, min_size=1, max_size=4))
        def put_runs(self, runs):
            items = []
            for keys in runs:
                data = self._data(len(keys))
                image = aligned_empty(data.size)
                image[:] = data
                items.append((keys, image))
            want = self._expect_put(items)
            assert self.store.put_runs(items) == want
            # Of several runs, a later group of the call may evict an earlier one.
            self._after_put(runs[0] if len(runs) == 1 else [])

        def _request(self, data) -> list[bytes]:
            """Keys to read: often a stretch of a stored run (a partial read),
            else any keys."""
            runs = sorted({run for run, _ in self.sure.values()})
            if runs and data.draw(st.booleans()):
                run = data.draw(st.sampled_from(runs))
                # A stretch of the run's keys, in its order, that it still holds
                # (a newer run may have taken some).
                keys, stretches = self.run_keys[run], [[]]
                for key in keys:
                    if self.sure.get(key, (None,))[0] == run:
                        stretches[-1].append(key)
                    elif stretches[-1]:
                        stretches.append([])
                keys = data.draw(st.sampled_from([s for s in stretches if s]))
                a = data.draw(st.integers(0, len(keys) - 1))
                b = data.draw(st.integers(a + 1, len(keys)))
                extra = data.draw(st.lists(st.sampled_from(KEYS), max_size=2))
                return list(dict.fromkeys(keys[a:b] + extra))
            return data.draw(key_lists)

        @rule(data=st.data(), aligned=st.booleans())
        def get_run(self, data, aligned):
            keys = self._request(data)
            out = self._blocks_out(len(keys), aligned)
            got = self.store.get_run(keys, out)
            view = out.reshape(geom.num_layers, geom.head_groups, len(keys), -1)
            self._check_read(keys, got, lambda k: view[:, :, k])

        @rule(data=st.data(), aligned=st.booleans())
        def get_blocks(self, data, aligned):
            keys = self._request(data)
            outs = [self._blocks_out(1, aligned) for _ in keys]
            got = self.store.get_blocks(keys, outs)
            shape = (geom.num_layers, geom.head_groups, geom.group_block_bytes)
            self._check_read(keys, got, lambda k: outs[k].reshape(shape))

        @rule(separate=st.booleans())
        def get_whole_runs(self, separate):
            """Every run still whole, one after another: one read of many
            runs' images (one batch, numpy-built when large)."""
            keys = [k for run, ks in sorted(self.run_keys.items())
                    if all(self.sure.get(k, (None,))[0] == run for k in ks) for k in ks]
            if not keys:
                return
            if separate:
                outs = [self._blocks_out(1, True) for _ in keys]
                got = self.store.get_blocks(keys, outs)
                shape = (geom.num_layers, geom.head_groups, geom.group_block_bytes)
                self._check_read(keys, got, lambda k: outs[k].reshape(shape))
            else:
                out = self._blocks_out(len(keys), True)
                got = self.store.get_run(keys, out)
                view = out.reshape(geom.num_layers, geom.head_groups, len(keys), -1)
                self._check_read(keys, got, lambda k: view[:, :, k])
            assert got == len(keys)

        @rule(data=st.data())
        def get_runs(self, data):
            requests = []
            for _ in range(data.draw(st.integers(1, 4))):
                keys = self._request(data)
                requests.append((keys, self._blocks_out(len(keys), data.draw(st.booleans()))))
            counts = self.store.get_runs(requests)
            assert len(counts) == len(requests)
            for (keys, out), got in zip(requests, counts):
                view = out.reshape(geom.num_layers, geom.head_groups, len(keys), -1)
                self._check_read(keys, got, lambda k: view[:, :, k])

        @rule(data=st.data(), layer=st.integers(0, geom.num_layers - 1),
              group=st.integers(0, geom.head_groups - 1))
        def read_range(self, data, layer, group):
            keys = self._request(data)
            out = np.empty(len(keys) * geom.group_block_bytes, np.uint8)
            got = self.store.read_range(keys, layer, group, out)
            rows = out.reshape(len(keys), -1)
            sure = self._sure_prefix(keys)    # and blocks left in DRAM, as get_run
            assert sure <= got <= len(keys), (keys, got, sure)
            for k in range(got):
                key = keys[k]
                want = self.sure[key][1] if key in self.sure else self.maybe.get(key)
                assert want is not None, f"block {k} ({key!r}) read back, never stored"
                assert np.array_equal(rows[k], want[layer, group]), f"block {k} differs"

        @rule(keys=key_lists)
        def lookup(self, keys):
            found = self.store.present(keys)
            self._check_present(keys, found)
            assert self.store.lookup(keys) == \
                (int(np.argmin(found)) if not found.all() else len(keys))

        def _check_present(self, keys, found) -> None:
            for key, hit in zip(keys, found.tolist()):
                if key in self.sure:
                    assert hit, f"{key!r} is stored, present() says no"
                elif key not in self.maybe:
                    assert not hit, f"{key!r} is not stored, present() says yes"

        @rule(keys=key_lists)
        def delete(self, keys):
            runs = {self.sure[k][0] for k in keys if k in self.sure}
            gone = [k for k, (run, _) in self.sure.items() if run in runs]
            host_only = {k for k in keys if k in self.maybe}
            removed = self.store.delete(keys)
            expected = len(gone)      # a position a newer run took stays stored
            if host_blocks:   # DRAM copies of the keys asked for count, if still there
                assert expected <= removed <= expected + len(host_only)
            else:
                assert removed == expected
            for k in gone:
                del self.sure[k]
            for k in set(keys) | set(gone):
                self.maybe.pop(k, None)

        @precondition(lambda self: len(self.pins) < 3)
        @rule(data=st.data())
        def pin(self, data):
            keys = self._request(data)
            handle = self.store.pin(keys)
            n = self._sure_prefix(keys)
            pinned = sum(count for _, _, count, _ in handle)
            if host_blocks:
                # pin() holds lookup()'s prefix: the device runs past a
                # block held only in DRAM too (that one pinned in the tier)
                pinned += len(handle.host_keys)
                assert n <= pinned <= len(keys), (keys, pinned, n)
                assert all(k in self.sure or k in self.maybe for k in keys[:pinned])
                n = pinned
            else:
                assert pinned == n
            self.pins.append((self.store, handle,
                              {self.sure[k][0] for k in keys[:n] if k in self.sure}))

        @precondition(lambda self: self.pins)
        @rule(data=st.data())
        def unpin(self, data):
            store, handle, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
            store.unpin(handle)

        def _unpin_all(self):
            while self.pins:
                store, handle, _ = self.pins.pop()
                store.unpin(handle)

        def _on_device(self, key) -> bool:
            if host_blocks:         # present() counts DRAM copies too; touch() does not
                return self.store.touch([key]) == 1
            return bool(self.store.present([key])[0])

        def _after_put(self, keys: list[bytes]) -> None:
            """In a full store: forget what the put evicted; ``keys`` (just
            put) must all be there."""
            if full:
                self._evicted()
                assert all(k in self.sure for k in keys), "a put evicted its own run"

        def _evicted(self) -> None:
            """Ask the store which runs an eviction took: the pinned ones must
            stay (so may others that share their regions); the others leave
            the model (to the DRAM tier's maybes)."""
            kept = {run for _, _, runs in self.pins for run in runs}
            for key, (run, block) in list(self.sure.items()):
                on_device = self._on_device(key)
                if run in kept:
                    assert on_device, f"{key!r} of a pinned run was evicted"
                if not on_device:
                    del self.sure[key]
                    if host_blocks:
                        self.maybe[key] = block

        @rule()
        def evict_all(self):
            self.store.evict(all=True)
            self._evicted()

        @rule()
        def clear(self):
            self.store.clear()
            self.sure.clear()
            self.maybe.clear()

        @rule()
        def checkpoint(self):
            self.store.checkpoint()

        @precondition(lambda self: not server_process or self.restarts < MAX_RESTARTS)
        @rule()
        def reopen(self):
            if not server_process:
                self._close()
            if sock is None:
                self.store = KVStore.open([path], geometry=geom, **options)
            elif server_process:
                self._replace_server(signal.SIGTERM)
                return
            else:             # a clean stop of the server checkpoints; a new one opens
                self.server.stop()
                self.server = None
                self._serve()
            self.maybe.clear()

        @precondition(lambda self: server_process and self.restarts < MAX_RESTARTS)
        @rule()
        def kill_server(self):
            """The metadata owner dies mid-run: every call it answered is
            durable (a put is acknowledged after its journal record is)."""
            self._replace_server(signal.SIGKILL)

        @precondition(lambda self: sock is None)
        @rule()
        def crash_and_reopen(self):
            """The process dies without close(): no checkpoint is written,
            pins and the DRAM tier die with it, and the next open replays the
            journal.  Every call returned before, so all of it is durable."""
            store, self.store, self.pins = self.store, None, []
            store.closed = True
            store._release_devices()          # what the kernel does for a dead process
            self.store = KVStore.open([path], geometry=geom, **options)
            self.maybe.clear()

        @precondition(lambda self: self.sure and sock is None)   # no touch through a server
        @rule(data=st.data())
        def touch(self, data):
            keys = data.draw(st.lists(st.sampled_from(sorted(self.sure)), min_size=1,
                                      unique=True))
            assert self.store.touch(keys) == len(keys)

        @invariant()
        def every_key_present_or_not_as_modelled(self):
            if self.store is not None:
                self._check_present(KEYS, self.store.present(KEYS))

        @invariant()
        def every_key_that_left_the_device_is_in_the_removal_log(self):
            """removed_since names every key whose run went since the last
            step (a key may be named and back, or held by a newer run);
            it loses track only when the store was opened again."""
            if self.store is None:
                return
            cursor, logged = self.store.removed_since(self.cursor)
            if self.cursor is not None:
                if logged is None:
                    assert cursor.split(":")[0] != self.cursor.split(":")[0], \
                        "the removal log lost keys within one open of the store"
                else:
                    assert set(logged) <= set(HASHED.values()), "a key never put was logged"
                    gone = self.sure_then - set(self.sure)
                    missing = [k for k in gone if HASHED[k] not in set(logged)]
                    assert not missing, f"left the device, not logged: {missing}"
            self.cursor, self.sure_then = cursor, set(self.sure)

    return StoreModel


SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SERVED_SETTINGS = settings(SETTINGS, max_examples=max(1, EXAMPLES // 2))
KILLED_SETTINGS = settings(SETTINGS, max_examples=max(1, EXAMPLES // 5), stateful_step_count=25)
# Server processes replaced per example (each takes about a second): more
# with a longer hunt.
MAX_RESTARTS = 3 if EXAMPLES <= 25 else 8


@pytest.mark.parametrize("host_blocks", [0, 6], ids=["device", "dram-tier"])
@pytest.mark.parametrize("geom_name", sorted(GEOMETRIES))
def test_store_answers_as_its_model(store_target, geom_name, host_blocks):
    path = store_target(32 * MIB)
    run_state_machine_as_test(make_machine(path, GEOMETRIES[geom_name], host_blocks),
                              settings=SETTINGS)


def test_unverified_store_answers_as_its_model(store_target):
    """Reads that check no checksum take paths of their own (whole images,
    windows without the trailer)."""
    path = store_target(32 * MIB)
    run_state_machine_as_test(make_machine(path, GEOMETRIES["2k"], 0, verify="never"),
                              settings=SETTINGS)


@pytest.mark.parametrize("host_blocks", [0, 6], ids=["device", "dram-tier"])
def test_full_store_answers_as_its_model(store_target, host_blocks):
    """A store of 16 regions, so that puts evict (least recently used
    regions first): what went is asked of the store and checked from then
    on; pinned runs and the keys just put stay."""
    path = store_target(3 * MIB)
    run_state_machine_as_test(make_machine(path, GEOMETRIES["2k"], host_blocks, full=True),
                              settings=SETTINGS)


@pytest.mark.parametrize("geom_name", sorted(GEOMETRIES))
def test_served_store_answers_as_its_model(store_target, tmp_path, geom_name):
    """The same model through a store server and two clients of it: puts
    published by the server, reads done by the clients at the offsets they
    are given, each call by either client, reopen = a clean stop of the
    server and a new one."""
    path = store_target(32 * MIB)
    run_state_machine_as_test(make_machine(path, GEOMETRIES[geom_name], 0,
                                           sock=str(tmp_path / "kv.sock")),
                              settings=SERVED_SETTINGS)


def test_store_whose_server_is_killed_answers_as_its_model(store_target, tmp_path):
    """Served by a ``kvblock serve`` process that the two clients started
    (``connect(..., reconnect=True)``), which a rule SIGKILLs or stops:
    the clients start a new one, and the store answers as before, pins
    aside."""
    path = store_target(32 * MIB)
    run_state_machine_as_test(make_machine(path, GEOMETRIES["2k"], 0,
                                           sock=str(tmp_path / "kv.sock"),
                                           server_process=True),
                              settings=KILLED_SETTINGS)
