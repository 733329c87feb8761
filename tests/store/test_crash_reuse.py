"""Crash at sampled I/Os of a workload that reuses regions.

The sweeps in test_crash.py mostly write into space never written before:
a RECLAIM's generation committed without its journal record went unnoticed
by them.  Here a 1.5 MiB store (two 256 KiB regions) with a 64 KiB journal
is filled and refilled across sessions: puts that evict and reuse regions,
re-puts that replace keys an earlier session stored (new bytes under the
same keys), deletes, evict(nbytes), trim_free, checkpoint, clear,
evict_older_than.  The store dies at a sampled I/O (torn writes, sector
tears, a lost or reordering drive cache); after reopening, each key reads
as its value at the last acknowledged operation, or as a value of the put
in flight, or is absent only where the operation in flight may remove it;
never other bytes, never a checksum failure.
"""

from __future__ import annotations

import copy
import itertools
import shutil
import time

import numpy as np
import pytest
import xxhash

from kvblock import KVStore, create_file
from kvblock.errors import StoreClosedError
from kvblock.index import normalize_keys
from tests.store import test_crash
from tests.store.workload import GEOM, REGION, run_keys
from tests.support.faults import CrashPlan, SimulatedCrash

crash_dir = test_crash.crash_dir      # the fixture: store files on tmpfs

SIZE = 3 << 19              # 1.5 MiB: two 256 KiB regions after the metadata
JOURNAL = 64 << 10
FAMILIES = 24               # key sets; family i always holds run_keys(i, 1 + i % 4)


def family_keys(i: int) -> list[bytes]:
    return run_keys(i, 1 + i % 4)


def versioned_data(keys: list[bytes], version: int) -> np.ndarray:
    """A run's bytes: each version of the same keys different bytes."""
    seed = xxhash.xxh64_intdigest(b"".join(keys) + b"/v%d" % version)
    return np.random.default_rng(seed).integers(0, 256, len(keys) * GEOM.block_bytes,
                                                dtype=np.uint8)


def block_of(keys: list[bytes], version: int, j: int) -> np.ndarray:
    shape = (GEOM.num_layers, GEOM.head_groups, len(keys), GEOM.group_block_bytes)
    return versioned_data(keys, version).reshape(shape)[:, :, j]


ALL = [(i, j, k) for i in range(FAMILIES) for j, k in enumerate(family_keys(i))]
ALL_KEYS = [k for _, _, k in ALL]
ALL_NORMAL = normalize_keys(ALL_KEYS)


class Model:
    """What each key may read as after a crash.

    ``value[k]``: the version of family(k) stored (live) when the last
    operation returned, None when it was not stored; ``pending[k]``: the
    versions of a put in flight since; ``droppable``: keys the operation in
    flight may remove (all of them for one that evicts)."""

    def __init__(self):
        self.value = {k: None for k in ALL_NORMAL}
        self.version = {i: -1 for i in range(FAMILIES)}   # newest version put
        self.pending = {k: set() for k in ALL_NORMAL}
        self.droppable: set = set()
        self.inflight = "nothing"

    def begin(self, what: str, put=None, drops=()) -> None:
        """An operation starts; ``put``: (family, version) it writes."""
        self.inflight = what
        if put is not None:
            i, v = put
            keys = normalize_keys(family_keys(i))
            # A family is stored whole or not at all (one run, deleted or
            # evicted whole): a put of it while stored is a duplicate,
            # which writes nothing.
            if self.value[keys[0]] is None:
                self.version[i] = v
                for k in keys:
                    self.pending[k].add(v)
        self.droppable = set(drops)

    def acked(self, store: KVStore) -> None:
        """After an operation returned: the live store says what is stored
        (in memory: no I/O, so no crash point)."""
        present = store.present(ALL_KEYS)
        for (i, _, k), there in zip(ALL, present.tolist()):
            k = normalize_keys([k])[0]
            self.value[k] = self.version[i] if there else None
            self.pending[k] = set()
        self.droppable = set()
        self.inflight = "nothing"


def _session_ops(session: int):
    """The operations of a session, as (name, function of store, put, drops):
    ``put`` (family, version) for a put, ``drops`` the keys it may remove
    ("all": any key).  Each put writes a version of its family's bytes no
    other put writes (a family still stored is not written again: a
    duplicate, see Model.begin)."""
    ops, versions = [], itertools.count(session * 1000)

    def put(i):
        keys, v = family_keys(i), next(versions)
        return (f"put {i} v{v}", lambda s: s.put_run(keys, versioned_data(keys, v)), (i, v),
                "all")

    def delete(i):
        return (f"delete {i}", lambda s: s.delete(family_keys(i)[:1]), None,
                normalize_keys(family_keys(i)))

    def call(name, fn, drops):
        return (name, fn, None, drops)

    if session == 0:                      # the template: no crash here
        for i in range(10):
            ops.append(put(i))
    elif session == 1:
        for i in range(10, 24):           # fills, evicts the template's runs
            ops.append(put(i))
        for i in range(8):                # re-puts of the earlier session's keys
            ops.append(put(i))
        ops += [delete(20), delete(3), put(20)]
        ops.append(call("evict", lambda s: s.evict(REGION), "all"))
        ops.append(call("trim_free", lambda s: s.trim_free(), ()))
        for i in (3, 9, 11, 12, 13):
            ops.append(put(i))
        ops.append(call("checkpoint", lambda s: s.checkpoint(), ()))
        for i in range(14, 24):
            ops.append(put(i))
        ops += [delete(16), put(16)]
    elif session == 2:
        for i in range(0, 12):
            ops.append(put(i))
        ops.append(call("evict_older_than", lambda s: s.evict_older_than(time.time() + 60),
                        "all"))
        for i in (0, 1, 21, 22):
            ops.append(put(i))
        ops += [delete(21)]
        ops.append(call("clear", lambda s: s.clear(), "all"))
        for i in list(range(0, 24, 2)) + list(range(1, 24, 2)):   # the same keys, new bytes
            ops.append(put(i))
        ops += [delete(5), put(5), put(2)]
    else:
        raise AssertionError(session)
    return ops


def _run_session(path, plan, model: Model, session: int) -> bool:
    """Open, run the session's operations, close; False once the plan crashed."""
    model.begin(f"open (session {session})")
    try:
        store = KVStore.open([path], storeio_factory=plan.factory())
    except SimulatedCrash:
        return False
    try:
        model.acked(store)
        for name, fn, put, drops in _session_ops(session):
            model.begin(name, put, ALL_NORMAL if drops == "all" else drops)
            fn(store)
            model.acked(store)
        model.begin(f"close (session {session})")
        store.close()
        return True
    except (SimulatedCrash, StoreClosedError):
        if not plan.crashed:
            raise
        store._release_devices()  # the process "died": no clean shutdown
        return False


def _workload(path, plan, model: Model) -> None:
    for session in (1, 2):
        if not _run_session(path, plan, model, session):
            return


def _check(path, model: Model, where: str) -> None:
    with KVStore.open([path]) as store:
        out = np.zeros(GEOM.block_bytes, np.uint8)
        shape = (GEOM.num_layers, GEOM.head_groups, GEOM.group_block_bytes)
        for i, j, key in ALL:
            k = normalize_keys([key])[0]
            allowed = model.pending[k] | ({model.value[k]} if model.value[k] is not None
                                          else set())
            got = store.get_run([key], out)
            assert store.counters["checksum_failures"] == 0, \
                f"{where}: key {key!r} failed its checksum (allowed versions {allowed})"
            if not got:
                assert model.value[k] is None or k in model.droppable, \
                    f"{where}: key {key!r} (version {model.value[k]}, acknowledged) is lost"
                continue
            match = [v for v in allowed if np.array_equal(out.reshape(shape), block_of(family_keys(i), v, j))]
            assert match, (f"{where}: key {key!r} reads as bytes of none of the versions "
                           f"allowed ({sorted(allowed) or 'absent'})")
        for run in list(store.index.runs.values()):
            for p in range(run.nblocks):
                assert run.key(p) in model.value, f"{where}: phantom key {run.key(p)!r}"
        # the recovered store keeps working, and reuses its space
        for i in range(4):
            keys = [b"after-%d-%d" % (i, b) for b in range(2)]
            assert store.put_run(keys, versioned_data(keys, 0)) == 2
            assert store.lookup(keys) == 2


def _template(directory) -> tuple:
    """The earlier session's store (no crash in it), copied for each crash,
    and its model."""
    path = directory / "template.img"
    create_file(path, SIZE)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=JOURNAL).close()
    model = Model()
    with KVStore.open([path]) as store:
        for name, fn, put, _ in _session_ops(0):
            model.begin(name, put)
            fn(store)
            model.acked(store)
    return path, model


MODES = {                     # CrashPlan options
    "clean-stop": dict(torn=False, lose_unflushed=False),
    "torn+lost-cache": dict(torn=True, lose_unflushed=True),
    "torn+reordered-cache": dict(torn=True, lose_unflushed="random"),
    "sectors+reordered-cache": dict(torn="sectors", lose_unflushed="random"),
}
SAMPLES = 45                  # crash points per mode (of about 400 I/Os), drawn with a fixed seed


@pytest.mark.parametrize("mode", list(MODES))
def test_crash_while_regions_are_reused(crash_dir, mode):
    template, start = _template(crash_dir)
    path = crash_dir / "store.img"
    shutil.copyfile(template, path)
    counting = CrashPlan()
    _workload(path, counting, copy.deepcopy(start))
    with KVStore.open([path]) as store:     # each region written over several times
        assert int(store.regions.generation.min()) >= 4, store.regions.generation
    total = counting.ops
    assert total > 150, total
    rng = np.random.default_rng(0x5EED + list(MODES).index(mode))
    points = sorted(rng.choice(np.arange(1, total + 1), min(SAMPLES, total), replace=False))
    for n in points:
        shutil.copyfile(template, path)
        plan = CrashPlan(crash_at=int(n), seed=int(n), **MODES[mode])
        model = copy.deepcopy(start)
        _workload(path, plan, model)
        assert plan.crashed, f"crash point {n} of {total} was never reached"
        _check(path, model, f"crash at I/O {n} of {total} ({mode}, in {model.inflight})")
