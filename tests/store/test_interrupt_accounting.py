"""A KeyboardInterrupt (Ctrl-C) landing in a store's accounting paths:
admission offers given back, a delete's DRAM copies, a reclaim that gives
up.  Each interrupt is injected at a chosen call (monkeypatch), as a
signal raised as that call returns."""

from __future__ import annotations

import contextlib
import dis

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import IOFailedError, StoreClosedError
from kvblock.index import normalize_keys
from kvblock.store.policy import Admission
from tests.store.workload import GEOM, REGION, run_data, run_keys

MIB = 1 << 20


def _format(paths, **kw):
    kw.setdefault("region_size", REGION)
    return KVStore.format([str(p) for p in paths], GEOM, **kw)


class CountingAdmission(Admission):
    """Admission counting the offers it admitted and those given back
    admitted; ``cut_after``: give_back calls (1, 2, ...) that raise
    KeyboardInterrupt once done (a Ctrl-C as the call returns)."""

    def __init__(self, admit_after, cut_after=()):
        super().__init__(admit_after)
        self.admitted = self.given_back = self.calls = 0
        self.cut_after = set(cut_after)

    def admit(self, key, record=None):
        ok = super().admit(key) if record is None else super().admit(key, record)
        self.admitted += ok
        return ok

    def give_back(self, key, admitted):
        super().give_back(key, admitted)
        self.given_back += admitted
        self.calls += 1
        if self.calls in self.cut_after:
            raise KeyboardInterrupt


@pytest.mark.parametrize("cut_after", [(1,), (1, 2), "as it began"],
                         ids=["once", "twice", "as it began"])
def test_a_put_runs_cut_as_it_gives_back_its_offers_gives_each_back_once(
        tmp_path, monkeypatch, cut_after):
    """A put_runs whose writes failed gives back the offers admission
    counted for its runs.  A KeyboardInterrupt landing as the first offer
    was given back stopped the loop: the other runs' offers stayed used
    up (admit_after=2: their next offer was declined again, the run took
    two more offers to be written).  Each is given back, once."""
    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    runs = [run_keys(80 + i, 2) for i in range(3)]
    with _format([path], admit_after=2) as store:
        items = [(keys, run_data(keys)) for keys in runs]
        assert store.put_runs(items) == [0, 0, 0]     # the first offers: declined
        counting = CountingAdmission(2, () if cut_after == "as it began" else cut_after)
        counting._offers = store.admission._offers
        store.admission = counting

        def fail(*a, **kw):
            raise IOFailedError("write failed (test)")
        monkeypatch.setattr(store, "_put_group", fail)
        if cut_after == "as it began":       # before any offer is given back
            real, cuts = store._give_back_offers, []

            def cut_as_it_begins(offers):
                if not cuts:
                    cuts.append(1)
                    raise KeyboardInterrupt
                return real(offers)
            monkeypatch.setattr(store, "_give_back_offers", cut_as_it_begins)
        with pytest.raises(KeyboardInterrupt):
            store.put_runs(items)
        monkeypatch.undo()
        assert counting.admitted == 3 and counting.given_back == 3
        counting.cut_after = set()
        # each run's next offer admits it (its offer was given back, once)
        assert store.put_runs(items) == [2, 2, 2]
        assert counting.admitted == 6 and counting.given_back == 3
        # offers counted == offers given back + runs stored
        assert counting.admitted == counting.given_back + store.counters["put_runs"]


def test_a_put_runs_refused_in_its_plan_cut_as_it_gives_back_gives_each_back_once(
        tmp_path, monkeypatch):
    """The plan's refusal (a run that does not fit, checked once admitted)
    gives back every offer admit counted, declined ones too (each counts
    one offer less when given back): cut as the first was given back, the
    others stayed counted.  Each is given back once: the store's admission
    is as before the call."""
    path = tmp_path / "s.img"
    create_file(path, 3 * MIB)
    with _format([path], admit_after=2) as store:
        admitted, declined = run_keys(90, 2), run_keys(91, 2)
        huge = run_keys(93, store.regions.count * (REGION // GEOM.block_bytes))
        assert store.put_run(admitted, run_data(admitted)) == 0     # its first offer
        store.admission.admit(normalize_keys(huge)[0])              # likewise
        before = dict(store.admission._offers)
        counting = CountingAdmission(2, cut_after=(1,))
        counting._offers = store.admission._offers
        store.admission = counting
        # the long run checked in the plan, once admitted (as one whose
        # keys the call's earlier runs held, but for a run declined)
        monkeypatch.setattr(store, "_check_runs_fit", lambda items, found: {2})
        with pytest.raises(KeyboardInterrupt):
            store.put_runs([(admitted, run_data(admitted)), (declined, run_data(declined)),
                            (huge, np.zeros(len(huge) * GEOM.block_bytes, np.uint8))])
        monkeypatch.undo()
        assert counting.admitted == 2 and counting.calls == 3
        assert dict(store.admission._offers) == before


def test_a_delete_cut_in_its_drop_leaves_no_dram_copy_to_read(tmp_path, monkeypatch):
    """delete() cleared the DRAM tier's copies after _drop_runs: a
    KeyboardInterrupt raised out of _drop_runs (its runs out of the index,
    their DROP records durable) skipped it, and get_run answered the
    deleted keys from DRAM."""
    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(95, 3)
    with _format([path], host_cache_bytes=16 * GEOM.block_bytes) as store:
        assert store.put_run(keys, run_data(keys)) == 3
        assert len(store.host) == 3, store.host.stats()
        real = store._drop_runs

        def drop_then_cut(*a, **kw):
            real(*a, **kw)
            raise KeyboardInterrupt
        monkeypatch.setattr(store, "_drop_runs", drop_then_cut)
        with pytest.raises(KeyboardInterrupt):
            store.delete(keys)
        monkeypatch.undo()
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 0
        assert store.lookup(keys) == 0



def test_a_delete_cut_as_it_discards_its_dram_copies_discards_the_rest(tmp_path, monkeypatch):
    """delete()'s discard of the DRAM tier's copies was one loop over the
    keys: a KeyboardInterrupt in it (here: the first discard, cut as it
    began) left the keys after it in DRAM, answering reads of deleted keys.
    Every copy goes, then the interrupt is raised."""
    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(96, 3)
    with _format([path], host_cache_bytes=16 * GEOM.block_bytes) as store:
        assert store.put_run(keys, run_data(keys)) == 3
        assert len(store.host) == 3, store.host.stats()
        real, calls = store.host.discard, []

        def cut_first(key):
            calls.append(key)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(key)
        monkeypatch.setattr(store.host, "discard", cut_first)
        with pytest.raises(KeyboardInterrupt):
            store.delete(keys)
        monkeypatch.undo()
        assert len(store.host) == 0, store.host.stats()
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 0
        assert store.lookup(keys) == 0


def _fill_to_last_free_region(store):
    put, i = [], 0
    while store.regions.free or store.regions.open is None:
        keys = run_keys(7000 + i, 4)
        assert store.put_run(keys, run_data(keys)) == 4
        put.append(keys)
        i += 1
    with store._lock:
        store.regions.seal(store.regions.open)
    return put


@pytest.mark.parametrize("then", ["fails on", "succeeds"])
def test_a_reclaim_step_interrupted_after_an_error_raises_the_interrupt(tmp_path, then):
    """_finish_reclaim kept the first failure of its steps: a
    KeyboardInterrupt after an ordinary error was raised as that error,
    or, once it gave up after FINISH_TRIES, as StoreClosedError: the
    caller's Ctrl-C was lost.  The KeyboardInterrupt is raised; the store
    is as it would be without it (failed when it gave up, serving when
    the steps finished)."""
    path = tmp_path / "store.img"
    create_file(path, 3 * MIB)
    from tests.store.test_store import _evict_all_in_a_thread

    with _format([path], verify="never", eviction="fifo") as store:
        put = _fill_to_last_free_region(store)
        real, raised = store._end_removal, [0]

        def end_removal(ticket, durable):
            if ticket is not None and (raised[0] < 2 or then == "fails on"):
                raised[0] += 1
                if raised[0] == 2:
                    raise KeyboardInterrupt
                if raised[0] < 1000:
                    raise RuntimeError("ticket's end failed (test)")
            return real(ticket, durable)
        store._end_removal = end_removal
        got = _evict_all_in_a_thread(store)
        assert isinstance(got[0], KeyboardInterrupt), repr(got[0])
        if then == "fails on":
            assert store.closed
            assert isinstance(store._failure, StoreClosedError)
        else:
            assert not store.closed
            assert [k for k in put if store.lookup(k) == 0]
            assert not store._reclaims


def test_a_read_interrupted_at_any_line_of_its_pinning_leaves_no_pin_held(tmp_path):
    """A read pins its runs' regions one run after another (_segments): a
    KeyboardInterrupt landing between two runs (a loop's back jump, where
    CPython raises it) left the runs pinned before it held for good (the
    caller had no segments to unpin): their regions never evicted again.
    The pins taken are dropped, then the interrupt raised."""
    from kvblock.store.store import KVStore as Store
    from tests.store.test_store import _LineInterrupt

    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(96, 6)
    with _format([path]) as store:
        for at in range(0, 6, 2):                  # three runs, one read
            assert store.put_run(keys[at:at + 2], run_data(keys[at:at + 2])) == 2
        out = np.zeros(6 * GEOM.block_bytes, np.uint8)
        # (no KeyboardInterrupt lands at ``return segs``: no call, no jump)
        code = Store._segments.__code__
        ins = list(dis.get_instructions(code))
        returns = {a.offset for a, b in zip(ins, ins[1:])
                   if a.opname == "LOAD_FAST" and b.opname == "RETURN_VALUE"}
        fired, n = [], 0
        while True:
            n += 1
            cut = _LineInterrupt([Store._segments], n)
            cut.skip[code] |= returns
            with cut:
                try:
                    store.get_run(keys, out)
                except KeyboardInterrupt:
                    pass
            if cut.fired is None:
                break
            fired.append(cut.fired)
            assert int(store.regions.pins.sum()) == 0, (cut.fired, store.regions.pins)
            assert [r.pins for r in store.index.runs.values()] == [0, 0, 0], cut.fired
        assert len(fired) > 10, fired
        assert store.get_run(keys, out) == 6


def _quiet_returns(code) -> set:
    """Offsets of ``return`` lines of locals and constants (``return segs``,
    ``return segs, pos``): no KeyboardInterrupt lands there (no call, no
    backward jump before them), though a line trace stops there."""
    out, start = set(), None
    for x in dis.get_instructions(code):
        if x.starts_line is not None:
            start = x.offset
        if x.opname == "RETURN_VALUE" and start is not None:
            out.add(start)
        elif x.opname not in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CONST", "BUILD_TUPLE"):
            start = None
    return out


def _reads_cut_at_every_line(store, functions, read, min_fired=10):
    """Run ``read()`` under a KeyboardInterrupt at each line of
    ``functions`` in turn; after each, no region or run is pinned (and
    none below 0).  Returns where the cuts landed."""
    from tests.store.test_store import _LineInterrupt

    fired, n = [], 0
    while True:
        n += 1
        cut = _LineInterrupt(functions, n)
        for code in cut.codes:
            cut.skip[code] |= _quiet_returns(code)
        with cut:
            try:
                read()
            except KeyboardInterrupt:
                pass
        pins = store.regions.pins
        assert int(pins.min()) >= 0, (cut.fired, pins)
        assert int(pins.sum()) == 0, (cut.fired, pins)
        assert all(r.pins == 0 for r in store.index.runs.values()), (
            cut.fired, [r.pins for r in store.index.runs.values()])
        if cut.fired is None:
            break
        fired.append(cut.fired)
    assert len(fired) >= min_fired, fired
    return fired


def _pin_and_unpin(store, keys) -> None:
    """pin() then unpin() of ``keys``; cut by a KeyboardInterrupt, the
    caller's own cleanup first: a handle it got and did not see released
    is released (once)."""
    handle = None
    try:
        handle = store.pin(keys)
        store.unpin(handle)
    except KeyboardInterrupt:
        if handle is not None and not handle.released:
            store.unpin(handle)
        raise


@pytest.mark.parametrize("call", ["get_run", "get_runs", "pin and unpin",
                                  "pin and unpin with a DRAM tier"])
def test_a_read_interrupted_at_any_line_of_its_unpin_releases_each_pin_once(tmp_path, call):
    """_unpin released a read's runs one after another: a KeyboardInterrupt
    at its loop's back jump left the runs after it pinned for good (their
    regions never evicted again), and one as it began (or in a caller
    between its pinning and its try) skipped the release altogether (the
    caller counted it done: unpin() had marked its handle released).  Each
    run's pins now drop exactly once whatever line is cut: _unpin takes
    each run off the segments' record as its pin drops (a call cut as it
    began is made again, releasing only what is left)."""
    from kvblock.store.store import KVStore as Store

    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(97, 6)
    tier = call.endswith("tier")
    with _format([path], **({"host_cache_bytes": 16 * GEOM.block_bytes} if tier else {})
                 ) as store:
        for at in range(0, 6, 2):                  # three runs, one read
            assert store.put_run(keys[at:at + 2], run_data(keys[at:at + 2])) == 2
        out = np.zeros(6 * GEOM.block_bytes, np.uint8)
        out2 = np.zeros(4 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 6
        want, out[:] = out.copy(), 0
        if call == "get_run":
            functions = [Store.get_run, Store._read, Store._read_done, Store._unpin]

            def read():
                store.get_run(keys, out)
        elif call == "get_runs":
            functions = [Store.get_runs, Store._read_done, Store._unpin]

            def read():
                store.get_runs([(keys, out), (keys[2:], out2)])
        else:
            functions = [Store.pin, Store.unpin, Store._unpin, Store._release_handle]
            if tier:
                functions.append(Store._pin_tiered)

            def read():
                _pin_and_unpin(store, keys)
        fired = _reads_cut_at_every_line(store, functions, read)
        assert any(name == "_unpin" for name, _ in fired), fired
        if tier:
            assert any(name == "_pin_tiered" for name, _ in fired), fired
            assert not store.host.pins, store.host.pins
        assert store.get_run(keys, out) == 6
        assert np.array_equal(out, want)


class CutAfterAdmit(Admission):
    """Admission whose admit raises KeyboardInterrupt once it has counted
    the offer (a Ctrl-C as the store's ``with self._lock`` around it exits)."""

    def admit(self, key, record=None):
        if record is None:
            super().admit(key)
        else:
            super().admit(key, record)
        raise KeyboardInterrupt


@pytest.mark.parametrize("offer", ["declined", "admitted"])
def test_a_put_runs_cut_as_admit_returns_gives_that_offer_back(tmp_path, offer):
    """_plan_puts recorded an offer (to give it back if the call stored
    nothing) only once admit had returned: a KeyboardInterrupt landing as
    admission's count was made (the store's lock let go) skipped the
    record, and the offer stayed counted for good (declined: one offer
    less to go for that run; admitted: its count used up, its next offer
    declined again).  The count and the record are one step: the offer
    is given back, admission as before the call."""
    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(98, 2)
    with _format([path], admit_after=2) as store:
        if offer == "admitted":
            assert store.put_run(keys, run_data(keys)) == 0    # its first offer
        before = dict(store.admission._offers)
        cutting = CutAfterAdmit(2)
        cutting._offers = store.admission._offers
        store.admission = cutting
        with pytest.raises(KeyboardInterrupt):
            store.put_runs([(keys, run_data(keys))])
        assert dict(cutting._offers) == before
        assert store.lookup(keys) == 0


def test_a_pin_with_dram_blocks_interrupted_at_any_line_holds_each_tier_pin_once(tmp_path):
    """pin() of a prefix alternating DRAM-only blocks and device runs pins
    the DRAM ones in the tier (HostTier.pin), and unpin() releases them
    (HostTier.unpin, one loop over the handle's tokens).  A
    KeyboardInterrupt at that loop's back jump kept the tokens after it
    pinned for good (_release_handle had taken them off the handle first:
    nobody released them; those blocks never evicted again), and one as
    HostTier.pin returned counted a pin whose token no handle got.  Each
    token now leaves the handle's list in the line its pin drops (enters
    it in the line its pin is counted): cut anywhere, every pin of the
    call is released once, and another lease on the same blocks keeps
    its own."""
    from kvblock.store.store import KVStore as Store
    from kvblock.tiers import HostTier
    from tests.store.test_store import _LineInterrupt

    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(99, 6)
    dram, device = keys[0::2], keys[1::2]
    with _format([path], host_cache_bytes=16 * GEOM.block_bytes) as store:
        assert store.put_run(dram, run_data(dram)) == 3
        store.evict(all=True)                    # the even keys: only in DRAM
        assert store.put_run(device, run_data(device)) == 3
        for k in normalize_keys(device):         # the odd keys: only on the device
            store.host.discard(k)
        other = store.pin(keys)                  # another lease, held throughout
        assert len(other.host_keys) == 3 and len(other) == 3
        tier_pins, region_pins = dict(store.host.pins), store.regions.pins.copy()
        functions = [Store.pin, Store.unpin, Store._unpin, Store._release_handle,
                     Store._pin_tiered, HostTier.pin, HostTier.unpin]
        fired, n, cut = [], 0, _LineInterrupt(functions, 0)
        for code in cut.codes:
            cut.skip[code] |= _quiet_returns(code)
        while True:
            n += 1
            cut.n, cut.count, cut.fired = n, 0, None
            with cut, contextlib.suppress(KeyboardInterrupt):
                _pin_and_unpin(store, keys)
            assert store.host.pins == tier_pins, (cut.fired, store.host.pins)
            assert np.array_equal(store.regions.pins, region_pins), cut.fired
            if cut.fired is None:
                break
            fired.append(cut.fired)
        names = {name for name, _ in fired}
        assert {"pin", "unpin", "_pin_tiered", "_release_handle"} <= names, names
        store.unpin(other)
        assert not store.host.pins and int(store.regions.pins.sum()) == 0


def test_unpin_takes_segments_made_of_an_answer_and_releases_each_pin_once(tmp_path):
    """_unpin kept its record of the runs still pinned on the Segments it
    was given (``held``) and raised AttributeError for any other list of
    segments.  Segments made of an answer's segments (a copy, reordered)
    are taken; cut at any line, a second call releases only what is left,
    nothing twice (another read's pins of the same runs stay).  (A plain
    list, which carries no record, is refused: see
    test_a_retried_unpin_never_takes_another_readers_pin.)"""
    from kvblock.store.store import KVStore as Store
    from kvblock.store.store import Segments
    from tests.store.test_store import _LineInterrupt

    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(100, 6)
    nkeys = normalize_keys(keys)
    with _format([path]) as store:
        for at in range(0, 6, 2):                  # three runs
            assert store.put_run(keys[at:at + 2], run_data(keys[at:at + 2])) == 2
        with store._lock:
            other = store._segments(nkeys)         # another read's pins, held
        assert len(other) == 3
        region_pins = store.regions.pins.copy()
        run_pins = [r.pins for r in store.index.runs.values()]
        with store._lock:
            segs = store._segments(nkeys)
        assert store._unpin(Segments(segs)) is True    # a copy of the answer
        with store._lock:
            segs = store._segments(nkeys)
        assert store._unpin(Segments(segs[1:] + segs[:1])) is True
        assert np.array_equal(store.regions.pins, region_pins)
        fired, n, cut = [], 0, _LineInterrupt([Store._unpin], 0)
        for code in cut.codes:
            cut.skip[code] |= _quiet_returns(code)
        while True:
            n += 1
            cut.n, cut.count, cut.fired = n, 0, None
            with store._lock:
                copy = Segments(store._segments(nkeys))
            with cut:
                try:
                    store._unpin(copy)
                except KeyboardInterrupt:
                    store._unpin(copy)          # cut: again (the rest, once)
            assert np.array_equal(store.regions.pins, region_pins), (cut.fired, store.regions.pins)
            assert [r.pins for r in store.index.runs.values()] == run_pins, cut.fired
            if cut.fired is None:
                break
            fired.append(cut.fired)
        assert len(fired) > 5, fired
        store._unpin(other)
        assert int(store.regions.pins.sum()) == 0


def test_get_runs_cut_twice_releases_every_requests_pins(tmp_path, monkeypatch):
    """get_runs' cleanup after a KeyboardInterrupt released each request's
    pins in turn, and a second KeyboardInterrupt (a second Ctrl-C) as one of
    those unpins began was raised out of the loop: the requests after it
    stayed pinned for good (their regions never evicted again).  Every
    request's pins go, then the interrupt is raised."""
    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    runs = [run_keys(97 + i, 2) for i in range(3)]
    with _format([path]) as store:
        for keys in runs:
            assert store.put_run(keys, run_data(keys)) == 2
        real_unpin, calls = store._unpin, []

        def read_done_cut(*a, **kw):
            raise KeyboardInterrupt          # the first Ctrl-C: into the cleanup

        def unpin_cut_first(segs):
            calls.append(len(segs))
            if len(calls) == 1:
                raise KeyboardInterrupt      # the second, as the first unpin began
            return real_unpin(segs)
        monkeypatch.setattr(store, "_read_done", read_done_cut)
        monkeypatch.setattr(store, "_unpin", unpin_cut_first)
        outs = [np.zeros(2 * GEOM.block_bytes, np.uint8) for _ in runs]
        with pytest.raises(KeyboardInterrupt):
            store.get_runs(list(zip(runs, outs)))
        monkeypatch.undo()
        assert int(store.regions.pins.sum()) == 0, store.regions.pins
        assert all(store.index.locate(normalize_keys(keys)[0])[0].pins == 0 for keys in runs), \
            "a run left pinned"


def test_a_retried_unpin_never_takes_another_readers_pin(tmp_path):
    """_unpin took a plain list of segments as well as a Segments answer,
    keeping the plain list's record of pins still held in the store until
    its call ended uncut.  A call cut by a KeyboardInterrupt as it returned
    (its record gone) and made again by the caller, as every caller does,
    found no record and dropped every pin a second time: another reader's
    pins on the same runs were taken away (their regions evictable under
    its read).  A plain list is refused (TypeError, nothing dropped); a
    Segments answer's call made again drops nothing twice."""
    path = tmp_path / "s.img"
    create_file(path, 8 * MIB)
    keys = run_keys(100, 4)
    with _format([path]) as store:
        for at in (0, 2):                          # two runs
            assert store.put_run(keys[at:at + 2], run_data(keys[at:at + 2])) == 2
        with store._lock:
            other = store._segments(normalize_keys(keys))   # another reader's pins, held
            mine = store._segments(normalize_keys(keys))
        runs = [seg[0] for seg in mine]
        assert [r.pins for r in runs] == [2, 2]
        region_pins = store.regions.pins.copy()
        plain = list(mine)
        with pytest.raises(TypeError, match="Segments"):
            store._unpin(plain)
        with pytest.raises(TypeError, match="Segments"):
            store._unpin(plain)                    # the caller's call again
        assert [r.pins for r in runs] == [2, 2], "a refused call dropped pins"
        assert np.array_equal(store.regions.pins, region_pins)
        assert store._unpin(mine) is True
        assert store._unpin(mine) is True          # cut as it returned: called again
        assert [r.pins for r in runs] == [1, 1], "the other reader's pins were taken"
        assert store._unpin(other) is True
        assert [r.pins for r in runs] == [0, 0]
        assert int(store.regions.pins.sum()) == 0
