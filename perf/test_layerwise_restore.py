"""pytest-benchmark: layer-wise restore of a large model's KV vs fio, and the
paged-layout copies alone (perf/layerwise_restore.py is the longer version).

    .venv/bin/python -m pytest perf/ --benchmark-only        # or: make bench

Geometry of a large model (62 layers, 8 KV heads, head dim 128, bfloat16,
16-token blocks), TOKENS tokens (0.97 GiB of KV) in a vLLM-layout CPU cache,
saved once with ``save_blocks`` to a store (256 MiB regions: runs of 66
blocks) on a /dev/shm loop device.

- group "layerwise-restore": ``load_blocks`` into a fresh vLLM-layout cache,
  checksums verified or not; before every round (pedantic ``setup``) fio
  reads as many bytes sequentially with ``bs`` = the loader's per-I/O size
  and ``iodepth`` = its I/Os per layer.  ``extra_info``: time to the first
  layer and to all layers (both from the ``load_blocks`` call), restore
  GiB/s (``bytes_read`` / time to all layers), fio GiB/s and the ratio
  (bar 0.90).
- group "gather-scatter": save_blocks' gather into its (preallocated)
  staging buffer with the store write replaced by a sink, and the loader's
  scatter of every layer, run by run, into the cache; the reference is the
  device's bandwidth (fio sequential read as above, before every round) and
  the bar 2x.

Bars are recorded (``meets_bar``, on the median of the per-round ratios), not
asserted: timings on a shared machine are noisy.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402
import layerwise_restore as lr  # noqa: E402

TOKENS = 4096
ROUNDS = 5

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def saved():
    why = fs.benchmark_skip_reason()
    if why:
        pytest.skip(f"layer-wise restore benchmarks: {why}")
    pytest.importorskip("torch")
    from kvblock.memory import HostBuffer
    g = lr.geometry()
    n = TOKENS // g.block_tokens
    keys = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    ids = lr.page_ids(n, "consecutive", n)
    src = lr.make_cache(g, n, "random")
    dst = lr.make_cache(g, n)
    size = lr.store_size(g, n)
    with fs.loop_target(fs.SHM, size) as dev, HostBuffer(n * g.block_bytes,
                                                          register=False) as staging:
        save_s, plan = lr.save(dev, g, keys, src, ids)
        lr.restore(dev, g, keys, dst, ids, "always")
        assert lr.same_cache(src, dst, ids, ids), "restored KV differs from the saved KV"
        yield {"g": g, "dev": dev, "keys": keys, "ids": ids, "src": src, "dst": dst,
               "plan": plan, "size": size, "save_s": save_s, "staging": staging,
               "kv_bytes": n * g.block_bytes}


def _fio_read(ctx, runs):
    plan = ctx["plan"]
    runs.append(fs.fio_round(ctx["dev"], "read", plan["io_size"], plan["in_flight"],
                             size=ctx["size"], io_size=plan["layer_bytes"] * ctx["g"].num_layers))


def _common(ctx) -> dict:
    plan = ctx["plan"]
    return {"tokens": TOKENS, "kv_bytes": ctx["kv_bytes"], "layers": ctx["g"].num_layers,
            "runs_per_layer": plan["runs"], "io_size": plan["io_size"],
            "in_flight": plan["in_flight"], "device": f"loop over /dev/shm, "
            f"{ctx['size'] >> 20} MiB", "save_blocks_s": round(ctx["save_s"], 3)}


@pytest.mark.parametrize("verify", ["always", "never"])
def test_layerwise_restore(benchmark, saved, verify):
    from kvblock import KVStore
    from kvblock.tensors import VLLMLayout, load_blocks

    benchmark.group = "layerwise-restore"
    ctx, plan = saved, saved["plan"]
    fio_runs: list[dict] = []
    handles, leads = [], []
    with KVStore.open([ctx["dev"]], geometry=ctx["g"], verify=verify) as store:
        layout = VLLMLayout(ctx["dst"])

        def load():
            t = time.perf_counter()
            h = load_blocks(store, ctx["keys"], layout, ctx["ids"])
            # the handle's clock starts after the keys' lookup: times count
            # from the call, as perf/layerwise_restore.py counts them
            leads.append(h.started_at - t)
            assert h.wait() == len(ctx["keys"])
            handles.append(h)

        benchmark.pedantic(load, setup=lambda: _fio_read(ctx, fio_runs), rounds=ROUNDS,
                           iterations=1, warmup_rounds=1)
    kept = list(zip(handles[-ROUNDS:], fio_runs[-ROUNDS:]))
    first_s = [lead + h.layer_ready_at[0] for lead, h in zip(leads[-ROUNDS:], handles[-ROUNDS:])]
    all_s = [lead + h.layer_ready_at[-1] for lead, h in zip(leads[-ROUNDS:], handles[-ROUNDS:])]
    gib = [h.bytes_read / s / 2**30 for (h, _), s in zip(kept, all_s)]
    fio_gib_s = statistics.median(f["gib_s"] for _, f in kept)
    restore_gib_s = statistics.median(gib)
    paired = statistics.median(x / f["gib_s"] for x, (_, f) in zip(gib, kept))
    fig = "Layer-wise restore vs fio (62 layers, loop over /dev/shm)"
    benchmark.extra_info.update({
        **_common(ctx), "verify": verify,
        "reference": f"fio rw=read bs={plan['io_size'] >> 10}K iodepth={plan['in_flight']} "
                     "io_uring direct=1, same bytes, same device, alternating rounds",
        "first_layer_ms": round(statistics.median(first_s) * 1e3, 2),
        "all_layers_ms": round(statistics.median(all_s) * 1e3, 2),
        "bytes_read": kept[0][0].bytes_read,
        "restore_gib_s": round(restore_gib_s, 4), "fio_gib_s": round(fio_gib_s, 4),
        "ratio": round(restore_gib_s / fio_gib_s, 4), "paired_ratio": round(paired, 4),
        "bar": lr.RESTORE_BAR, "meets_bar": paired >= lr.RESTORE_BAR,
        "points": [{"figure": fig, "series": f"restore verify={verify}", "x": TOKENS,
                    "y": round(restore_gib_s, 4), "xlabel": "tokens", "ylabel": "GiB/s"}] + (
            [{"figure": fig, "series": "fio read", "x": TOKENS, "y": round(fio_gib_s, 4),
              "xlabel": "tokens", "ylabel": "GiB/s"}] if verify == "always" else []),
    })
    assert restore_gib_s > 0 and fio_gib_s > 0


@pytest.mark.parametrize("copy", ["gather", "scatter"])
def test_gather_scatter(benchmark, saved, copy):
    benchmark.group = "gather-scatter"
    ctx = saved
    fio_runs: list[dict] = []
    seconds: list[float] = []

    def run():
        if copy == "gather":
            seconds.append(lr.time_gather(ctx["g"], ctx["keys"], ctx["src"], ctx["ids"],
                                          ctx["staging"]))
        else:
            seconds.append(lr.time_scatter(ctx["g"], ctx["staging"], ctx["dst"], ctx["ids"],
                                           ctx["plan"]["run_blocks"]))

    if copy == "scatter":  # the staging buffer must hold the saved layers
        lr.time_gather(ctx["g"], ctx["keys"], ctx["src"], ctx["ids"], ctx["staging"])
    benchmark.pedantic(run, setup=lambda: _fio_read(ctx, fio_runs), rounds=ROUNDS,
                       iterations=1, warmup_rounds=1)
    if copy == "scatter":
        assert lr.same_cache(ctx["src"], ctx["dst"], ctx["ids"], ctx["ids"])
    kept = list(zip(seconds[-ROUNDS:], fio_runs[-ROUNDS:]))
    gib = [ctx["kv_bytes"] / s / 2**30 for s, _ in kept]
    fio_gib_s = statistics.median(f["gib_s"] for _, f in kept)
    copy_gib_s = statistics.median(gib)
    paired = statistics.median(x / f["gib_s"] for x, (_, f) in zip(gib, kept))
    fig = "Paged-layout copies (as save/load run them) vs device bandwidth (loop over /dev/shm)"
    benchmark.extra_info.update({
        **_common(ctx), "copy": copy,
        "reference": "device bandwidth: fio sequential read at the restore's I/O size, "
                     "same device, alternating rounds",
        "copy_gib_s": round(copy_gib_s, 4), "device_gib_s": round(fio_gib_s, 4),
        "ratio": round(copy_gib_s / fio_gib_s, 4), "paired_ratio": round(paired, 4),
        "bar": lr.COPY_BAR, "meets_bar": paired >= lr.COPY_BAR,
        "points": [{"figure": fig, "series": copy, "x": TOKENS, "y": round(copy_gib_s, 4),
                    "xlabel": "tokens", "ylabel": "GiB/s"}] + (
            [{"figure": fig, "series": "device (fio read)", "x": TOKENS,
              "y": round(fio_gib_s, 4), "xlabel": "tokens", "ylabel": "GiB/s"}]
            if copy == "gather" else []),
    })
    assert copy_gib_s > 0 and fio_gib_s > 0
