"""kvblock's LMCache plugin against a model: random puts, gets, lookups,
pins and removes through LMCache's own StorageManager, checked chunk by
chunk.

LMCache's chunk keys name content (chained hashes of the tokens), so the
model is the set of stored chunk hashes, and each chunk's bytes follow from
its hash.  A batched get, blocking or on LMCache's event loop, answers the
stored prefix of its keys (None from the first miss on), as do
``batched_contains`` and ``batched_async_contains``; ``remove`` takes one
chunk and says whether it was there; a pinned chunk survives a remove that
is not forced.  One engine serves all the examples of a case, each with
chunk hashes of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.test_lmcache import Engine, obj_bytes

CHUNKS = 16                # chunk hashes per example
EXAMPLES = int(os.environ.get("KVBLOCK_MODEL_EXAMPLES", "40"))


ops = st.lists(st.tuples(
    st.sampled_from(["put", "put", "get", "contains", "remove", "pin", "unpin"]),
    st.lists(st.integers(0, CHUNKS - 1), min_size=1, max_size=6, unique=True),
    st.booleans()), min_size=1, max_size=14)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_plugin_answers_as_its_model(store_target, engines, mla):
    e = Engine([store_target()], mla=mla)
    engines.append(e)
    examples = itertools.count()

    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(script=ops)
    def run(script):
        base = next(examples) * CHUNKS + 1          # hashes of this example's own
        stored: set[int] = set()
        pins: dict[int, int] = {}                   # chunk -> pins held
        try:
            for op, ids, flag in script:
                keys = [e.key(base + i) for i in ids]
                prefix = 0
                while prefix < len(ids) and ids[prefix] in stored:
                    prefix += 1
                if op == "put":
                    e.put(keys, [e.chunk(seed=base + i) for i in ids])
                    stored.update(ids)
                elif op == "get":
                    if flag:         # the prefetch path, on the manager's event loop
                        objs = asyncio.run_coroutine_threadsafe(
                            e.plugin.batched_get_non_blocking("req", keys),
                            e.manager.loop).result(30)
                        assert len(objs) == prefix
                    else:
                        objs = e.plugin.batched_get_blocking(keys)
                        assert [o is not None for o in objs] == \
                            [True] * prefix + [False] * (len(ids) - prefix)
                    for i, o in zip(ids, objs[:prefix]):
                        want = e.chunk(seed=base + i)
                        assert obj_bytes(o) == obj_bytes(want), i
                        want.ref_count_down()
                        o.ref_count_down()
                elif op == "contains":
                    if flag:
                        hits, _ = e.manager.batched_contains(keys)
                        assert hits == prefix
                        assert asyncio.run_coroutine_threadsafe(
                            e.plugin.batched_async_contains("req", keys, pin=False),
                            e.manager.loop).result(30) == prefix
                    else:
                        assert [e.plugin.contains(k) for k in keys] == \
                            [i in stored for i in ids]
                elif op == "remove":
                    i = ids[0]
                    kept = not flag and pins.get(i, 0) > 0
                    assert e.plugin.remove(keys[0], force=flag) is (i in stored and not kept)
                    if i in stored and not kept:
                        stored.discard(i)
                        pins.pop(i, None)
                elif op == "pin":
                    assert e.plugin.pin(keys[0]) is (ids[0] in stored)
                    if ids[0] in stored:
                        pins[ids[0]] = pins.get(ids[0], 0) + 1
                elif pins.get(ids[0]):          # unpin what is pinned
                    assert e.plugin.unpin(keys[0])
                    pins[ids[0]] -= 1
        finally:
            for i, n in pins.items():
                for _ in range(n):
                    e.plugin.unpin(e.key(base + i))

    run()
