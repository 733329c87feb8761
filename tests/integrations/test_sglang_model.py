"""kvblock's SGLang backend against a model: random rounds of
``batch_set_v1`` and ``batch_get_v1`` calls over scattered host pages, with
``batch_exists``, clears and restarts between them, checked page by page.

SGLang's page keys name content (hashes of the tokens), so the model is the
set of stored keys and each key's page bytes follow from the key.  A set
stores every page; a get loads the leading pages whose keys are stored (its
result is True for them, False from the first miss on) and leaves the other
pages untouched; ``batch_exists`` is the stored prefix.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.sglang_pools import HostPool
from tests.integrations.test_sglang import attach, keys_for

PAGES = 24
KEYS = keys_for("model", 30)
EXAMPLES = int(os.environ.get("KVBLOCK_MODEL_EXAMPLES", "40"))


def page_for(pool: HostPool, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randint(0, 256, pool.page_bytes(0).shape, dtype=torch.uint8, generator=g)


@st.composite
def calls(draw):
    """(kind, key ids, page ids) per call: kind is "set", "get", "exists",
    "clear" or "restart"; the pages of a call are distinct."""
    out = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["set", "set", "get", "get", "exists", "clear",
                                     "restart"]))
        n = draw(st.integers(1, 8))
        keys = draw(st.lists(st.integers(0, len(KEYS) - 1), min_size=n, max_size=n,
                             unique=True))
        pages = draw(st.permutations(range(PAGES)))[:n]
        out.append((kind, keys, pages))
    return out


@pytest.mark.parametrize("mla, layout", [(False, "page_first"), (False, "page_first_direct"),
                                         (True, "page_first"), (False, "layer_first")],
                         ids=["mha-page_first", "mha-direct", "mla-page_first",
                              "mha-layer_first"])
def test_backend_answers_as_its_model(file_target, mla, layout):
    path = file_target()

    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(script=calls(), max_run_pages=st.sampled_from([2, 64]))
    def run(script, max_run_pages):
        pool = HostPool(mla=mla, layout=layout, pages=PAGES)
        page_bytes = pool.page_bytes(0).numel()
        options = {"max_run_bytes": max_run_pages * page_bytes}
        backend = attach(pool, [path], format="force", **options)
        stored: set[int] = set()
        try:
            for kind, ids, pages in script:
                keys = [KEYS[k] for k in ids]
                n_stored = 0
                while n_stored < len(ids) and ids[n_stored] in stored:
                    n_stored += 1
                if kind == "set":
                    for k, p in zip(ids, pages):
                        pool.fill_page(p, page_for(pool, k))
                    assert backend.batch_set_v1(keys, pool.token_indices(pages)) == \
                        [True] * len(keys)
                    stored.update(ids)
                elif kind == "get":
                    pool.randomize(len(stored))
                    before = [pool.page_bytes(p) for p in pages]
                    got = backend.batch_get_v1(keys, pool.token_indices(pages))
                    assert got == [True] * n_stored + [False] * (len(ids) - n_stored)
                    for i, (k, p) in enumerate(zip(ids, pages)):
                        want = page_for(pool, k) if i < n_stored else before[i]
                        assert torch.equal(pool.page_bytes(p), want), (i, k, p)
                elif kind == "exists":
                    assert backend.batch_exists(keys) == n_stored
                elif kind == "clear":        # after a weight update
                    assert backend.clear()
                    stored.clear()
                else:
                    backend.close()
                    backend = attach(pool, [path], **options)
        finally:
            backend.close()

    run()
