"""pytest-benchmark (group "restore-vs-recompute"): time to first token of the
demo's Llama-architecture model when its prompt prefix is recomputed vs
restored from kvblock (layer by layer, the model consuming layers as they
land), over prompt lengths.  The recompute time is the reference."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvblock import KVStore, chain_keys, create_file  # noqa: E402
from kvblock import demo  # noqa: E402
from kvblock.integrations.transformers import streaming_cache  # noqa: E402
from kvblock.tensors import HFDynamicLayout, load_blocks, save_blocks  # noqa: E402


@pytest.fixture(scope="module")
def model():
    m = demo.build_model()
    demo.warm_up(m)
    return m


@pytest.mark.parametrize("tokens", [512, 1024, 2048, 4096])
def test_ttft_restore_vs_recompute(benchmark, model, tmp_path, tokens):
    benchmark.group = "restore-vs-recompute"
    g = demo.geometry()
    ids = demo.make_prompt(tokens)
    prefix = demo.split(tokens)
    keys = chain_keys(ids[0, :prefix].tolist(), demo.BLOCK, salt=demo.SALT)
    t0 = time.perf_counter()
    # the prefix's KV only, as the demo's prefill (and a serving engine):
    # the logits of its positions would be LM-head work no engine does
    with torch.no_grad():
        cache = model(ids[:, :prefix], use_cache=True, logits_to_keep=1).cache
    first, want, _ = demo.decode(model, cache, ids, prefix)
    recompute_s = first - t0
    path = tmp_path / "kv.img"
    create_file(path, prefix // demo.BLOCK * g.block_bytes * 2 + (64 << 20))
    with KVStore.format([str(path)], g, model=demo.SALT) as store:
        save_blocks(store, keys, HFDynamicLayout.from_cache(cache, demo.BLOCK),
                    list(range(len(keys))))
    del cache
    demo.drop_page_cache(str(path))
    layout = HFDynamicLayout.empty(g.num_layers, g.num_kv_heads, tokens + demo.DECODE_STEPS,
                                   g.head_dim, demo.BLOCK, torch.float32)
    result = {}

    def restore():
        t = time.perf_counter()
        with KVStore.open([str(path)]) as store:
            n = store.lookup(keys)
            handle = load_blocks(store, keys, layout, list(range(n)))
            cache = streaming_cache(handle, layout, n * demo.BLOCK, config=model.config)
            f, logits, _ = demo.decode(model, cache, ids, n * demo.BLOCK)
            handle.wait()
        result.update(ttft=f - t, equal=bool(torch.equal(logits, want)))

    benchmark.pedantic(restore, rounds=1, iterations=1)
    assert result["equal"]
    fig = "Time to first token vs prompt length (8-layer Llama-architecture model, CPU)"
    benchmark.extra_info.update({
        "tokens": tokens, "recompute_s": round(recompute_s, 3),
        "restore_s": round(result["ttft"], 3), "reference": "recompute (prefill) TTFT",
        "ratio": round(recompute_s / result["ttft"], 2),
        "points": [{"figure": fig, "series": "recompute", "x": tokens, "y": round(recompute_s, 3),
                    "xlabel": "prompt tokens", "ylabel": "seconds"},
                   {"figure": fig, "series": "kvblock restore", "x": tokens,
                    "y": round(result["ttft"], 3)}]})
