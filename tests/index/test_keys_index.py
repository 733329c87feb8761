"""Block keys (normalize_key, chain_keys) and the in-memory KeyIndex."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvblock.errors import ConfigError
from kvblock.index import KEY_BYTES, KeyIndex, Run, chain_keys, normalize_key, normalize_keys
from kvblock.index.index import POS_BITS


# ------------------------------------------------------------------ normalize_key
def test_sixteen_bytes_pass_through():
    k = bytes(range(16))
    assert KEY_BYTES == 16
    assert normalize_key(k) == k
    assert normalize_key(bytearray(k)) == k
    assert normalize_key(memoryview(k)) == k
    assert type(normalize_key(bytearray(k))) is bytes


@pytest.mark.parametrize("n", [0, 1, 8, 15, 17, 32, 64])
def test_other_lengths_are_hashed(n):
    k = bytes(range(n))
    out = normalize_key(k)
    assert len(out) == 16
    assert out == xxhash.xxh3_128_digest(k)
    assert out != k[:16]
    assert normalize_key(bytearray(k)) == out


def test_ints():
    # 16 zero bytes mark superseded positions in checkpoints: the key 0 has a stand-in
    assert normalize_key(0) == normalize_key(bytes(16)) == xxhash.xxh3_128_digest(bytes(16))
    assert normalize_key(0) != normalize_key(1)
    assert normalize_key(1) == b"\x01" + bytes(15)
    assert normalize_key(0x0102) == b"\x02\x01" + bytes(14)
    assert normalize_key((1 << 128) - 1) == b"\xff" * 16
    assert normalize_key(-1) == b"\xff" * 16            # two's complement, 128 bits
    assert normalize_key(-2) == b"\xfe" + b"\xff" * 15
    assert normalize_key(np.uint64(7)) == normalize_key(7)
    assert normalize_key(np.int32(-5)) == normalize_key(-5)
    # 64-bit hashes (Python hash(), vLLM int hashes) stay distinct
    assert normalize_key(hash("a")) != normalize_key(hash("b"))
    assert len({normalize_key(i) for i in range(-500, 500)}) == 1000


def test_str():
    assert normalize_key("abc") == xxhash.xxh3_128_digest(b"abc")
    assert normalize_key("abc") != normalize_key("abd")
    assert normalize_key("é") == xxhash.xxh3_128_digest("é".encode())
    assert len(normalize_key("")) == 16


@pytest.mark.parametrize("bad", [1.5, None, [1, 2], (1,), {"a": 1}, object()])
def test_bad_type_is_config_error(bad):
    with pytest.raises(ConfigError) as ei:
        normalize_key(bad)
    assert type(bad).__name__ in str(ei.value)
    assert "bytes, str or int" in str(ei.value)


def test_normalize_keys():
    ks = [bytes(16), b"x", 3, "s"]
    assert normalize_keys(ks) == [normalize_key(k) for k in ks]
    assert normalize_keys(iter(ks)) == normalize_keys(ks)
    assert normalize_keys([]) == []
    with pytest.raises(ConfigError):
        normalize_keys([b"ok", 2.0])


# ------------------------------------------------------------------ chain_keys
TOKENS = list(range(1000, 1100))


def test_chain_keys_count_and_partial_block():
    assert len(chain_keys(TOKENS, 16)) == 100 // 16 == 6
    assert len(chain_keys(TOKENS[:96], 16)) == 6
    assert len(chain_keys(TOKENS[:95], 16)) == 5
    assert chain_keys(TOKENS[:15], 16) == []
    assert chain_keys([], 16) == []
    assert all(len(k) == 16 for k in chain_keys(TOKENS, 16))


def test_chain_keys_definition():
    keys = chain_keys(TOKENS[:32], 16, salt=b"s")
    k0 = xxhash.xxh3_128_digest(np.asarray(TOKENS[:16], "<i4").tobytes() + b"s")
    k1 = xxhash.xxh3_128_digest(k0 + np.asarray(TOKENS[16:32], "<i4").tobytes() + b"s")
    assert keys == [k0, k1]


def test_chain_keys_deterministic():
    assert chain_keys(TOKENS, 16) == chain_keys(list(TOKENS), 16)
    assert chain_keys(TOKENS, 16) == chain_keys(np.array(TOKENS, dtype=np.int64), 16)
    assert chain_keys(TOKENS, 16) == chain_keys(tuple(TOKENS), 16)


def test_chain_keys_salt_and_parent():
    plain = chain_keys(TOKENS, 16)
    salted = chain_keys(TOKENS, 16, salt=b"tenant-a")
    other = chain_keys(TOKENS, 16, salt="tenant-b")
    assert len(set(plain) | set(salted) | set(other)) == 3 * len(plain)
    assert chain_keys(TOKENS, 16, salt="tenant-a") == salted   # str salt == its utf-8 bytes
    assert chain_keys(TOKENS, 16, salt="") == plain
    parent = bytes(range(16))
    child = chain_keys(TOKENS, 16, parent=parent)
    assert set(child).isdisjoint(plain)
    # a continuation computed from the last key of a prefix equals the full chain
    assert chain_keys(TOKENS[32:], 16, parent=plain[1]) == plain[2:]


def test_chain_keys_name_their_whole_prefix():
    a = chain_keys(TOKENS, 16)
    changed = list(TOKENS)
    changed[3] += 1  # one token in the first block
    b = chain_keys(changed, 16)
    assert all(x != y for x, y in zip(a, b))
    changed = list(TOKENS)
    changed[40] += 1  # a token in block 2
    c = chain_keys(changed, 16)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:]))


def test_chain_keys_block_size_matters():
    assert chain_keys(TOKENS, 16)[0] != chain_keys(TOKENS, 32)[0]
    assert chain_keys(TOKENS, 1) == chain_keys(TOKENS, 1)
    assert len(chain_keys(TOKENS, 1)) == 100


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 31) - 1), max_size=200), st.integers(1, 40),
       st.integers(0, 200), st.binary(max_size=8))
def test_chain_keys_prefix_property(tokens, bt, cut, salt):
    full = chain_keys(tokens, bt, salt=salt)
    assert len(full) == len(tokens) // bt
    prefix = chain_keys(tokens[:cut], bt, salt=salt)
    assert prefix == full[:len(prefix)]
    assert len(prefix) == min(cut, len(tokens)) // bt


# ------------------------------------------------------------------ KeyIndex
def k(i: int) -> bytes:
    return normalize_key(i)


def run(run_id, keys, region=0) -> Run:
    return Run(run_id, region, 0, 0, b"".join(k(i) for i in keys),
               np.zeros(3, dtype=np.uint64))


def test_run_properties():
    r = run(5, [10, 11, 12])
    assert r.nblocks == 3
    assert r.key(0) == k(10) and r.key(2) == k(12)
    assert r.key(3) == b""


def test_add_and_locate():
    idx = KeyIndex()
    assert len(idx) == 0
    a = run(1, [10, 11, 12])
    idx.add(a)
    assert len(idx) == 3
    assert idx.runs == {1: a}
    got = idx.locate(k(11))
    assert got is not None and got[0] is a and got[1] == 1
    assert idx.locate(k(10)) == (a, 0)
    assert idx.locate(k(12)) == (a, 2)
    assert idx.locate(k(13)) is None
    assert k(10) in idx and k(13) not in idx


def test_prefix_length():
    idx = KeyIndex()
    idx.add(run(1, [10, 11, 12]))
    idx.add(run(2, [20, 21]))
    assert idx.prefix_length([k(10), k(11), k(12), k(13)]) == 3
    assert idx.prefix_length([k(10), k(20), k(11)]) == 3  # across runs
    assert idx.prefix_length([k(99), k(10)]) == 0           # stops at the first miss
    assert idx.prefix_length([k(10), k(99), k(11)]) == 1
    assert idx.prefix_length([]) == 0


def test_remove():
    idx = KeyIndex()
    a, b = run(1, [10, 11]), run(2, [20])
    idx.add(a)
    idx.add(b)
    idx.remove(a)
    assert len(idx) == 1
    assert idx.runs == {2: b}
    assert idx.locate(k(10)) is None and idx.locate(k(11)) is None
    assert idx.locate(k(20)) == (b, 0)
    idx.remove(a)  # removing twice is harmless
    assert len(idx) == 1


def test_remove_keeps_keys_repointed_to_a_newer_run():
    idx = KeyIndex()
    old = run(1, [10, 11, 12])
    idx.add(old)
    new = run(2, [11, 12, 13])  # re-stores 11 and 12
    idx.add(new)
    assert idx.locate(k(11)) == (new, 0)
    assert idx.locate(k(10)) == (old, 0)
    idx.remove(old)
    assert idx.locate(k(10)) is None
    assert idx.locate(k(11)) == (new, 0)
    assert idx.locate(k(12)) == (new, 1)
    assert idx.locate(k(13)) == (new, 2)
    assert len(idx) == 3
    assert idx.runs == {2: new}


def test_remove_keeps_key_repointed_to_another_position():
    # the same key re-stored by a newer run at the *same position*: still not deleted
    idx = KeyIndex()
    old, new = run(1, [10, 11]), run(2, [10, 11])
    idx.add(old)
    idx.add(new)
    idx.remove(old)
    assert idx.locate(k(10)) == (new, 0) and idx.locate(k(11)) == (new, 1)
    idx.remove(new)
    assert len(idx) == 0 and idx.runs == {}


def test_large_run_ids_and_positions_do_not_collide():
    idx = KeyIndex()
    a = run((1 << 38) + 1, [1, 2])
    b = run(1 << 38, [3])
    idx.add(a)
    idx.add(b)
    assert idx.locate(k(2)) == (a, 1)
    assert idx.locate(k(3)) == (b, 0)
    assert POS_BITS == 24


# ------------------------------------------------------------------ few keys
# Up to FEW_KEYS keys are looked up one by one in Python (KeyTable.get_few,
# KeyIndex._few_segments); the answers must be those of the numpy path.
@settings(max_examples=60, deadline=None)
@given(stored=st.lists(st.integers(0, 400), min_size=1, max_size=300, unique=True),
       removed=st.lists(st.integers(0, 400), max_size=100),
       probes=st.lists(st.integers(0, 450), min_size=1, max_size=8))
def test_few_key_lookups_answer_as_the_numpy_path(stored, removed, probes):
    from kvblock.index.table import KeyTable, split_keys

    table = KeyTable(16)        # small: it grows, and probes run through collisions
    lo, hi = split_keys(b"".join(k(i) for i in stored))
    table.put(lo, hi, np.arange(len(stored)))
    gone = [i for i in removed if i in set(stored)]
    if gone:
        rlo, rhi = split_keys(b"".join(k(i) for i in gone))
        table.remove(rlo, rhi)            # tombstones the probes must step over
    keys = [k(i) for i in probes]
    plo, phi = split_keys(b"".join(keys))
    assert table.get_few(keys) == table.get(plo, phi).tolist()


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.integers(0, 12), min_size=1, max_size=8))
def test_few_key_segments_answer_as_the_numpy_path(picks):
    import kvblock.index.index as index_mod

    idx = KeyIndex()
    idx.add(run(1, [0, 1, 2, 3, 4]))
    idx.add(run(2, [5, 6, 7]))
    idx.add(run(3, [2, 3, 8]))            # re-stores 2 and 3: run 1's are superseded
    keys = [k(i) for i in picks]          # 9..12 are misses
    few, prefix = idx.segments(keys), idx.prefix_length(keys)
    saved = index_mod.FEW_KEYS
    index_mod.FEW_KEYS = 0                # every lookup through numpy
    try:
        assert idx.segments(keys) == few
        assert idx.prefix_length(keys) == prefix
        assert idx.lookup(keys).tolist() == [
            -1 if (got := idx.locate(key)) is None else (got[0].run_id << POS_BITS) | got[1]
            for key in keys]
    finally:
        index_mod.FEW_KEYS = saved


@settings(max_examples=60, deadline=None)
@given(present=st.lists(st.booleans(), min_size=1, max_size=200),
       run_len=st.integers(1, 40))
@example(present=[True] * 8 + [False] * 100, run_len=40)     # the second window's first
@example(present=[True] * 200, run_len=40)                   # all stored
@example(present=[True] * 3 + [False] + [True] * 50, run_len=7)
def test_windowed_segments_answer_as_one_lookup(present, run_len):
    """segments(windowed=True) (a load's device stretches, looked up a
    window at a time) answers as segments() of all the keys at once, and
    looks up the keys past the first absent one's window not at all."""
    idx = KeyIndex()
    stored = [i for i, p in enumerate(present) if p]
    runs = [run(r + 1, stored[at:at + run_len]) for r, at in
            enumerate(range(0, len(stored), run_len))]
    idx.add_many(runs)
    keys = [k(i) for i in range(len(present))]
    looked = []
    real = idx.lookup
    idx.lookup = lambda ks: looked.append(len(ks)) or real(ks)
    windowed = idx.segments(keys, windowed=True)
    del idx.lookup
    assert windowed == idx.segments(keys)
    prefix = idx.prefix_length(keys)
    if len(keys) > 8:
        assert sum(looked) <= 4 * prefix + 8, (prefix, looked)


def test_published_of_dates_each_key_by_its_run():
    idx = KeyIndex()
    a, b = run(1, [0, 1, 2]), run(2, [3, 4])
    a.published, b.published = 7, 9
    idx.add_many([a, b])
    keys = [k(4), k(0), k(9), k(3), k(2)]
    assert idx.published_of(idx.lookup(keys)).tolist() == [9, 7, -1, 9, 7]
    assert idx.published_of(idx.lookup([k(9)])).tolist() == [-1]
    assert idx.published_of(idx.lookup([])).tolist() == []


def test_few_key_segments_split_at_run_ends_and_stop_at_a_miss():
    idx = KeyIndex()
    a, b = run(1, [0, 1, 2]), run(2, [3, 4])
    idx.add(a)
    idx.add(b)
    assert idx.segments([k(1), k(2), k(3), k(4)]) == [(a, 1, 2, 0), (b, 0, 2, 2)]
    assert idx.segments([k(2), k(1)]) == [(a, 2, 1, 0), (a, 1, 1, 1)]    # not consecutive
    assert idx.segments([k(0), k(9), k(1)]) == [(a, 0, 1, 0)]            # the prefix only
    assert idx.segments([k(9), k(0)]) == []


@pytest.mark.parametrize("few", [True, False])
def test_segments_never_run_on_into_the_next_run(monkeypatch, few):
    """A run may hold POS_MASK + 1 blocks (the store's max_run_blocks
    allows 2**24): its last position packed, plus one, is the next run
    id's position 0, and segments() ran the two runs together into one
    stretch of the first, longer than it (a read past its end).  Shown
    with 2 position bits: runs of 4 blocks, ids 1 and 2."""
    import kvblock.index.index as index_mod

    monkeypatch.setattr(index_mod, "POS_BITS", 2)
    monkeypatch.setattr(index_mod, "POS_MASK", 3)
    if not few:
        monkeypatch.setattr(index_mod, "FEW_KEYS", 0)
    idx = KeyIndex()
    a, b = run(1, [0, 1, 2, 3]), run(2, [4, 5, 6, 7])
    idx.add_many([a, b])
    keys = [k(i) for i in range(8)]
    assert idx.segments(keys) == [(a, 0, 4, 0), (b, 0, 4, 4)]
    assert idx.segments(keys[2:6]) == [(a, 2, 2, 0), (b, 0, 2, 2)]


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(),
                              st.lists(st.integers(0, 60), min_size=1, max_size=8)),
                    min_size=1, max_size=60))
# Two new keys of one put aiming at the same slot, one removed, a third key
# probing past its tombstone: the Python path once placed them in the other
# order, reused no tombstone there, and counted one more slot used.
@example(ops=[(True, [21, 55]), (False, [21]), (True, [34])])
def test_few_key_puts_answer_as_the_numpy_path(ops):
    """Puts of up to FEW_KEYS keys (repeats in a batch included) go one by
    one in Python; a table fed the same puts and removes through numpy
    answers every lookup the same, counts the same and holds every key in
    the same slot."""
    import kvblock.index.table as table_mod
    from kvblock.index.table import KeyTable, split_keys

    few, many = KeyTable(16), KeyTable(16)
    value = 0
    for is_put, ids in ops:
        lo, hi = split_keys(b"".join(k(i) for i in ids))
        if is_put:
            values = np.arange(value, value + len(ids))
            value += len(ids)
            got = few.put(lo, hi, values)
            saved = table_mod.FEW_KEYS
            table_mod.FEW_KEYS = 0
            try:
                want = many.put(lo, hi, values)
            finally:
                table_mod.FEW_KEYS = saved
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
        else:
            assert few.remove(lo, hi) == many.remove(lo, hi)
        assert (len(few), few.used, few.cap) == (len(many), many.used, many.cap)
        assert np.array_equal(few.val, many.val)
        live = few.val >= 0
        assert np.array_equal(few.lo[live], many.lo[live])
        assert np.array_equal(few.hi[live], many.hi[live])
    alo, ahi = split_keys(b"".join(k(i) for i in range(61)))
    assert few.get(alo, ahi).tolist() == many.get(alo, ahi).tolist()


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add_many", "remove"]),
                              st.lists(st.integers(0, 40), min_size=1, max_size=6),
                              st.integers(0, 4)), max_size=40))
def test_region_and_superseded_bookkeeping_matches_a_scan(ops):
    """by_region (what a reclaim drops), partly and superseded() (what a
    checkpoint marks SUPERSEDED) agree with a scan of every run, whatever
    adds (keys re-stored, duplicates in a batch) and removes came before;
    checkpoint_keys zeroes exactly the positions whose key moved on."""
    idx, next_id = KeyIndex(), 1
    for op, keys, region in ops:
        if op == "remove":
            if idx.runs:
                victims = sorted(idx.runs)[region % len(idx.runs)]
                idx.remove(idx.runs[victims])
            continue
        batch = [run(next_id + j, [x + 100 * j for x in keys] if j else keys, region)
                 for j in range(2 if op == "add_many" else 1)]
        next_id += len(batch)
        for dropped in idx.add_many(batch):
            idx.remove(dropped)
    runs = list(idx.runs.values())
    for region in range(5):
        assert sorted(r.run_id for r in idx.runs_in(region)) == \
            sorted(r.run_id for r in runs if r.region == region)
    assert idx.partly == {r.run_id for r in runs if r.live < r.nblocks}
    expected = []
    for r in runs:
        for pos in range(r.nblocks):
            got = idx.locate(r.key(pos))
            mine = got is not None and got[0] is r and got[1] == pos
            expected.append(r.key(pos) if mine else bytes(KEY_BYTES))
    keys = KeyIndex.checkpoint_keys(runs, idx.superseded())
    assert [bytes(row) for row in keys] == expected


def test_a_run_of_superseded_positions_only_is_handed_back_to_drop():
    """A run whose every position is SUPERSEDED (zero: a raw client's commit
    of the key 0, which the server takes as it is) holds no key: add_many
    returns it to be dropped, as any run left with none, rather than keep
    it indexed with nothing pointing at it (counted in stats and its
    region, written to every checkpoint)."""
    idx = KeyIndex()
    zero = Run(1, 0, 0, 0, bytes(KEY_BYTES), np.zeros(3, dtype=np.uint64))
    assert idx.add_many([zero, run(2, [10])]) == [zero]
    assert zero.live == 0


@pytest.mark.parametrize("tokens,block,match", [
    (np.array([1, 2, 3, (1 << 32) + 1], dtype=np.int64), 2, "int32's range, got int64"),
    ([1.0, 2.5, 3.0, 4.0], 2, "integers in int32's range, got float64"),
    ([[1, 2, 3, 4]], 2, r"flat sequence .* shape \(1, 4\)"),
    ([1, 2, 1 << 70, 4], 2, "integers"),
    ([1, 2, 3, 4], 0, "block_tokens must be a whole number"),
    ([1, 2, 3, 4], 1.5, "block_tokens must be a whole number"),
])
def test_chain_keys_refuses_token_ids_it_cannot_hash_as_given(tokens, block, match):
    """Ids past int32 wrapped (1 and 2**32 + 1 made one key: two prompts,
    one cached KV), floats were cut, a (1, n) batch gave no keys at all and
    block_tokens=0 raised a bare ValueError."""
    with pytest.raises(ConfigError, match=match):
        chain_keys(tokens, block)
    assert chain_keys(np.array([1, 2, 3, 4], dtype=np.int64), 2) == chain_keys([1, 2, 3, 4], 2)


@pytest.mark.parametrize("batch", [1, 16])
def test_churn_near_the_load_limit_does_not_rebuild_the_table_at_every_put(batch):
    """A full store at steady state evicts keys (tombstones) and puts as
    many new ones.  With its live keys just under MAX_LOAD of the table,
    every rebuild at the same capacity freed only the slots of the keys
    removed since the last: the next few puts rebuilt the whole table again
    (2M slots, ~150 ms under the store's lock, every other put of 32 keys).
    A rebuild must leave room for a share of the table's slots, so that
    its cost per key inserted stays bounded."""
    from kvblock.index.table import MAX_LOAD, KeyTable, split_keys

    table = KeyTable(1024)
    live = int(MAX_LOAD * table.cap) - 1
    lo, hi = split_keys(b"".join(k(i) for i in range(live)))
    table.put(lo, hi, np.arange(live))
    assert table.cap == 1024
    rebuilt, grow = [], table._grow

    def counting_grow(need):
        rebuilt.append(table.cap)
        grow(need)
    table._grow = counting_grow
    oldest, newest, inserted = 0, live, 0
    for _ in range(2000 // batch):
        rlo, rhi = split_keys(b"".join(k(i) for i in range(oldest, oldest + batch)))
        assert table.remove(rlo, rhi) == batch
        nlo, nhi = split_keys(b"".join(k(i) for i in range(newest, newest + batch)))
        table.put(nlo, nhi, np.arange(newest, newest + batch))
        oldest, newest, inserted = oldest + batch, newest + batch, inserted + batch
    assert len(table) == live
    assert sum(rebuilt) <= 32 * inserted, f"{len(rebuilt)} rebuilds for {inserted} keys"
    alo, ahi = split_keys(b"".join(k(i) for i in range(oldest - 50, newest)))
    assert table.get(alo, ahi).tolist() == [-1] * 50 + list(range(oldest, newest))


def test_the_table_shrinks_once_most_of_its_keys_are_removed():
    """A clear() (or a large delete) removed every key, but the table kept
    its peak capacity (4.2M slots, 117 MB, after 2M keys) and the slots as
    tombstones, which every probe of an absent key walked (~28x slower
    lookups), until ~500k new inserts rebuilt it, at the peak size again.
    Once its live keys are a small share of its slots, it is rebuilt at the
    size they need."""
    from kvblock.index.table import KeyTable

    idx = KeyIndex()
    fresh = KeyTable()
    runs = [run(i, [i * 1000 + p for p in range(1000)], region=i % 4) for i in range(100)]
    idx.add_many(runs)
    assert len(idx) == 100_000 and idx.table.cap > 100_000
    for r in runs[:90]:                          # a large delete: 10% left
        idx.remove(r)
    assert len(idx) == 10_000
    assert idx.table.cap <= 65_536, idx.table.cap      # near what 10k keys need, not the peak
    left = [k(i * 1000 + p) for i in range(90, 100) for p in range(1000)]
    assert (idx.lookup(left) >= 0).all()
    assert (idx.lookup([k(p) for p in range(1000)]) == -1).all()
    for r in runs[90:]:                          # the rest: a clear()
        idx.remove(r)
    assert len(idx) == 0
    assert idx.table.cap == fresh.cap and idx.table.nbytes == fresh.nbytes
    assert idx.table.used == 0                   # no tombstones for probes to walk
    assert (idx.lookup(left) == -1).all()
    idx.add(run(500, [7, 8]))
    assert idx.locate(k(8))[0].run_id == 500 and k(7) in idx and k(9) not in idx


def _interrupt_at_line(functions, n, call):
    """Run ``call()`` with a KeyboardInterrupt raised at the ``n``-th line
    run in ``functions``; returns where (None: fewer lines ran)."""
    import sys

    codes = {getattr(f, "__wrapped__", f).__code__ for f in functions}
    seen = [0, None]

    def line(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                seen[1] = (frame.f_code.co_name, frame.f_lineno)
                raise KeyboardInterrupt
        return line

    sys.settrace(lambda frame, event, arg: line if frame.f_code in codes else None)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return seen[1]


@pytest.mark.parametrize("shrink", [False, True], ids=["remove", "remove that shrinks"])
def test_a_remove_interrupted_at_any_line_keeps_the_table_and_its_count(shrink):
    """A KeyboardInterrupt landing at any line of KeyTable.remove (and the
    rebuild a shrink runs): cut between the tombstones and the live count,
    the count stayed too high for good (a remove again finds the keys
    gone); cut in the rebuild, the table was left empty or half filled
    (every key not yet reinserted lost from the index).  Now the table
    holds either the keys before or after the remove, and counts them."""
    from kvblock.index.table import KeyTable, split_keys

    n, fired = 0, []
    while True:
        n += 1
        idx = KeyIndex()
        # one large run (most of the keys when it shrinks), ten small ones
        runs = [run(0, range(950 if shrink else 8))] + [
            run(i, [i * 1000 + p for p in range(5)]) for i in range(1, 11)]
        idx.add_many(runs)
        cap = idx.table.cap
        doomed = runs[:2]
        where = _interrupt_at_line([KeyTable.remove, KeyTable._rebuild, KeyTable._alloc,
                                    KeyTable._insert_new],
                                   n, lambda: [idx.table.remove(*split_keys(r.keys),
                                                                expect=r.packed())
                                               for r in doomed])
        if where is None:
            break
        fired.append(where)
        t = idx.table
        assert t.live == int((t.val >= 0).sum()), where
        for r in runs:
            found = idx.lookup([r.key(p) for p in range(r.nblocks)])
            assert (found == r.packed()).all() or (r in doomed and (found == -1).all()), where
    assert len(fired) > (20 if shrink else 8), len(fired)
    assert not shrink or idx.table.cap < cap


# ------------------------------------------------------------------ KeyTable rebuilds
def _random_keys(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    words = np.random.default_rng(seed).integers(0, 1 << 63, size=(n, 2), dtype=np.int64)
    words = words.view(np.uint64)
    return np.ascontiguousarray(words[:, 0]), np.ascontiguousarray(words[:, 1])


def test_a_grow_holds_little_beyond_the_old_and_the_new_table():
    """A grow (and a shrink) reinserted the live keys from full copies of
    them (a live mask, then lo, hi and val fancy-indexed) in one batch,
    whose probing made several more key-sized arrays, beside the old table
    and the new one: a table of 2.5M keys (112 MB) growing to 224 MB took
    446 MB more at its peak, not 224, in a store whose operators size host
    memory for the index.  The keys are reinserted a chunk of the old
    table at a time; only the new table (and a chunk's scratch) is added."""
    import tracemalloc

    from kvblock.index.table import MAX_LOAD, KeyTable

    table = KeyTable(1 << 20)
    n = int(MAX_LOAD * table.cap) - 1
    lo, hi = _random_keys(n, 1)
    table.put(lo, hi, np.arange(n))
    assert table.cap == 1 << 20
    old_bytes = table.nbytes
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table._grow(table.live + 1000)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert table.cap == 1 << 21 and table.nbytes == 2 * old_bytes
    # the new table, and at most an eighth of it for the reinsertion's scratch
    assert peak <= table.nbytes * 9 // 8, (peak >> 20, table.nbytes >> 20)
    assert (table.get(lo, hi) == np.arange(n)).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), removed=st.integers(0, 3000),
       extreme=st.lists(st.sampled_from([0, 1, (1 << 63), (1 << 64) - 1, (1 << 64) - 2]),
                        min_size=2, max_size=2).map(tuple))
def test_a_rebuild_keeps_every_key_and_its_value(n, removed, extreme):
    """Grows, rebuilds at the same size and shrinks (in chunks of the old
    table, and batches placed and looked up in chunks: small ones here)
    keep every live key with its value, drop every
    removed one and its tombstone, and count both right; keys whose halves
    are 0 or all ones (the arrays' fill, -1 as uint64) included."""
    import kvblock.index.table as table_mod
    from kvblock.index.table import KeyTable

    lo, hi = _random_keys(n, n)
    edge = np.array([(a, b) for a in extreme for b in extreme], dtype=np.uint64)
    lo, hi = np.r_[lo, edge[:, 0]], np.r_[hi, edge[:, 1]]
    _, first = np.unique(np.stack([lo, hi], axis=1), axis=0, return_index=True)
    lo, hi = lo[np.sort(first)], hi[np.sort(first)]
    values = np.arange(lo.size, dtype=np.int64) * 7
    chunks = [name for name in ("REBUILD_CHUNK", "BATCH_CHUNK") if hasattr(table_mod, name)]
    saved = [getattr(table_mod, name) for name in chunks]
    for name in chunks:                            # several chunks, small ones
        setattr(table_mod, name, 64)
    try:
        table = KeyTable(16)
        for at in range(0, lo.size, 500):          # grows on the way
            table.put(lo[at:at + 500], hi[at:at + 500], values[at:at + 500])
        gone = min(removed, lo.size)
        assert table.remove(lo[:gone], hi[:gone]) == gone     # may shrink
        cap = table.cap
        table._rebuild(table.cap, table.live)      # drops the tombstones
        assert table.cap in (cap, 2 * cap)         # (twice: live keys past its room)
    finally:
        for name, value in zip(chunks, saved):
            setattr(table_mod, name, value)
    assert len(table) == table.used == lo.size - gone
    assert int((table.val >= 0).sum()) == table.live
    assert (table.val != table_mod.TOMBSTONE).all()
    assert (table.get(lo, hi) == np.r_[np.full(gone, -1), values[gone:]]).all()
    assert table.get_few([bytes(np.array([a, b], dtype="<u8").data)
                          for a, b in zip(lo[:8].tolist(), hi[:8].tolist())]) == \
        table.get(lo[:8], hi[:8]).tolist()


def test_a_large_put_holds_little_beyond_the_table():
    """Recovery indexes a checkpoint's keys in one put (millions): its
    find() and its insert each made several key-sized arrays at once (probe
    positions, positions left, masks, gathered keys: ~90 bytes a key), 187
    MB beside a 112 MB table for 2M keys.  They work a chunk of the keys at
    a time; the put keeps only its per-key answer (slots, masks)."""
    import tracemalloc

    from kvblock.index.table import KeyTable

    n = 300_000
    lo, hi = _random_keys(n, 2)
    values = np.arange(n)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = KeyTable()
        table.put(lo, hi, values)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(table) == n
    # the table, ~16 bytes a key the put holds, and 8 MB of a chunk's scratch
    assert peak <= table.nbytes + 16 * n + (8 << 20), (peak >> 20, table.nbytes >> 20)
    assert (table.get(lo, hi) == values).all()


@pytest.mark.parametrize("batch", [5, 300], ids=["few keys", "a batch"])
def test_a_put_interrupted_at_any_line_keeps_the_table_and_its_counts(batch):
    """A KeyboardInterrupt landing at any line of KeyTable.put (the grow it
    runs, the insert): cut between a round's keys placed and the live count,
    len() stayed short of the keys the table holds for good (a remove of
    them then took it below zero), and a grow sized the new table by that
    count.  The table holds the keys before the put, each new one with its
    value or not at all, and counts them (its used count no lower than the
    slots taken, on which its probes' ending rests)."""
    from kvblock.index.table import EMPTY, KeyTable, split_keys

    old = 20
    n, fired = 0, []
    while True:
        n += 1
        table = KeyTable(16)
        lo, hi = split_keys(b"".join(k(i) for i in range(old)))
        table.put(lo, hi, np.arange(old))
        table.remove(lo[:3], hi[:3])                  # tombstones an insert reuses
        nlo, nhi = split_keys(b"".join(k(i) for i in range(1000, 1000 + batch)))
        where = _interrupt_at_line([KeyTable.put, KeyTable._put_few, KeyTable._insert_few, KeyTable._grow,
                                    KeyTable._rebuild, KeyTable._alloc, KeyTable._insert_new,
                                    KeyTable.find],
                                   n, lambda: table.put(nlo, nhi, np.arange(batch) + 5000))
        if where is None:
            break
        fired.append(where)
        assert table.live == int((table.val >= 0).sum()), where
        assert table.used >= int((table.val != EMPTY).sum()), where
        assert table.get(lo, hi).tolist() == [-1] * 3 + list(range(3, old)), where
        got = table.get(nlo, nhi)
        assert ((got == np.arange(batch) + 5000) | (got == -1)).all(), where
    assert len(fired) > 20, len(fired)


@pytest.mark.parametrize("bad", [True, False, np.bool_(True)])
def test_a_bool_key_is_config_error_not_the_key_1_or_0(bad):
    """True passed the int check (bool is an int) and was stored as the
    key 1 (False as the key 0): a bool key is a caller's bug (a flag passed
    where the keys belong), refused by name, in a sequence too."""
    with pytest.raises(ConfigError, match="bool"):
        normalize_key(bad)
    with pytest.raises(ConfigError, match="bool"):
        normalize_keys([1, bad])
