#!/usr/bin/env python3
"""Time to the first usable layer of a long prefix: kvblock vs the peers.

A 32K-token prefix (default geometry: 32 layers, 2 KV heads, head dim 128,
bfloat16, 16-token blocks; 32 KiB of KV per token, 1 GiB in all) is stored in
each backend from the same bytes, the page cache is dropped, and the prefix
is restored:

- kvblock: ``load_blocks`` into a vLLM-layout CPU cache, from a store on a
  loop device (direct I/O) over a file in the location; layer l is usable
  once ``wait_layer(l)`` returns, so the first layer is usable after one
  read per run of that layer's range (``layer_ready_at[0]``, counted from
  the ``load_blocks`` call, as the peers' times count from their submit).
  Time to all layers is ``layer_ready_at[-1]``, counted the same way.  Two loads per round from one open
  store: ``kvblock`` (the first after open: it maps and touches its staging
  memory, one layer's bytes of the prefix, before layer 0 can land; this
  row is the one held to the bar) and ``kvblock-warm`` (the next load,
  reusing that memory, as in a serving engine).
- vLLM 0.33's filesystem tier (``FileSystemTierManager``, 16 read threads),
  in a directory in the same location: an offloaded slot holds every layer
  of its 16 tokens, so a layer of the prefix is usable only once every slot
  of the prefix is in the CPU pool.  One promotion job with all the
  prefix's keys, as vLLM submits it for a request; its time to the first
  usable layer is its time to all layers.
- SGLang 0.5.23's ``HiCacheFile`` (when perf/sglang_vs_hicachefile.py is
  present): pages hold every layer too (SGLang prefetches whole pages from
  storage into the host pool before any layer moves to the GPU), so the
  same holds.  ``batch_get`` of every page of the prefix, as SGLang's
  controller reads pages for a v0 backend, in batches of 128 pages
  (``first_usable_layer`` there; its hit query is not timed).

Bar (issue 6): kvblock's time to the first layer <= 1/8 of the peer's time
to a usable first layer.  Each location runs ``--rounds`` rounds, the order
alternating; medians are printed.  The bytes restored are checked against
the source in every backend.

    .venv/bin/python perf/first_layer_vs_peers.py                # ~2 minutes, root
    .venv/bin/python perf/first_layer_vs_peers.py --tokens 8192 --locations shm --json

Buffers are allocated and touched before anything is timed; loop devices and
files are removed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402
import layerwise_restore as lw  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
BAR = 1 / 8
LOCATIONS = {"disk": Path("/var/tmp"), "shm": Path("/dev/shm")}


# ------------------------------------------------------------------ the bytes
def slot_pool(src: list, pages: int):
    """A page-aligned CPU primary pool whose slot p holds page p of every layer
    of ``src`` (K and V): what vLLM offloads for one 16-token block."""
    import torch

    per_layer = src[0][:, 0].numel() * src[0].element_size()
    slot = per_layer * len(src)
    raw = torch.empty(pages * slot + mmap.PAGESIZE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % mmap.PAGESIZE
    pool = raw[shift:shift + pages * slot].view(pages, len(src), per_layer)
    for layer, t in enumerate(src):
        pool[:, layer] = t.view(torch.uint8).reshape(2, pages, -1).permute(1, 0, 2) \
            .reshape(pages, per_layer)
    return pool.view(pages, slot)


# ------------------------------------------------------------------ the backends
def run_kvblock(dev: str, g, keys, src, dst, ids) -> list[dict]:
    """Save, then two loads from one open store: the first pays for mapping
    its staging memory, the second reuses it (an engine's steady state)."""
    from kvblock import KVStore
    from kvblock.tensors import VLLMLayout, load_blocks

    save_s, _plan = lw.save(dev, g, keys, src, ids)
    rows = []
    with KVStore.open([dev], geometry=g, verify="always") as store:
        for name in ("kvblock", "kvblock-warm"):
            for t in dst:
                t.zero_()
            layout = VLLMLayout(dst)
            fs.drop_caches()
            t = time.perf_counter()
            handle = load_blocks(store, keys, layout, ids)
            # the handle's clock starts after the keys' lookup: time from the call
            lead = handle.started_at - t
            if handle.wait() != len(keys) or not lw.same_cache(src, dst, ids, ids):
                raise SystemExit("kvblock: restored KV differs from the saved KV")
            rows.append({"backend": name, "store_s": save_s,
                         "first_ms": (lead + handle.layer_ready_at[0]) * 1e3,
                         "all_ms": (lead + handle.layer_ready_at[-1]) * 1e3})
    return rows


def run_vllm_fs(where: Path, pool, expected, slot_tokens: int, layers: int) -> dict:
    import torch
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    from vllm_tier_vs_fs import make_spec

    n = pool.shape[0]
    keys = [make_offload_key(i.to_bytes(8, "big") + b"ttfl-bench", 0) for i in range(n)]
    ctx = ReqContext(req_id="bench")
    base = Path(tempfile.mkdtemp(prefix="kvblock-ttfl-fs-", dir=where))
    view = memoryview(pool.numpy())
    try:
        spec = make_spec(slot_tokens, tuple(f"l{i}" for i in range(layers)))
        tier = FileSystemTierManager(spec, view, "fs", root_dir=str(base))
        try:
            def run(job_id, promotion):
                t = time.perf_counter()
                job = TransferJob(job_id=job_id, keys=keys, chunk_ids=np.arange(n),
                                  is_promotion=promotion, req_context=ctx)
                (tier.submit_load if promotion else tier.submit_store)(job)
                tier.drain_jobs()
                seconds = time.perf_counter() - t
                res = list(tier.get_finished_jobs())
                if len(res) != 1 or not res[0].success:
                    raise SystemExit(f"vLLM fs tier: {'load' if promotion else 'store'} failed")
                return seconds
            store_s = run(1, False)
            pool.zero_()
            fs.drop_caches()
            load_s = run(2, True)
            if not torch.equal(pool, expected):
                raise SystemExit("vLLM fs tier: loaded bytes differ from stored")
        finally:
            tier.shutdown()
    finally:
        view.release()
        shutil.rmtree(base, ignore_errors=True)
    return {"backend": "vllm-fs", "store_s": store_s, "first_ms": load_s * 1e3,
            "all_ms": load_s * 1e3}


def hicachefile_runner():
    """perf/sglang_vs_hicachefile.py's HiCacheFile driver, if that script is here."""
    try:
        import sglang_vs_hicachefile as sh
    except ImportError:
        return None
    return getattr(sh, "first_usable_layer", None)


# ------------------------------------------------------------------ the run
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--locations", default="disk,shm", type=fs.comma_choices(LOCATIONS),
                    help=f"comma separated, of {sorted(LOCATIONS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    why = fs.benchmark_skip_reason()
    if why:
        print(f"first_layer_vs_peers: cannot run here: {why}", file=sys.stderr)
        return 2
    g = lw.geometry(args.layers, args.kv_heads, args.head_dim)
    pages = -(-args.tokens // g.block_tokens)
    kv_bytes = pages * g.block_bytes
    keys = [b"ttfl" + i.to_bytes(12, "big") for i in range(pages)]   # 16-byte keys
    ids = np.arange(pages, dtype=np.int64)
    print(f"{args.tokens} tokens, {g.describe()}: {kv_bytes / GIB:.2f} GiB; allocating ...",
          file=sys.stderr, flush=True)
    src = lw.make_cache(g, pages, "random")
    dst = lw.make_cache(g, pages)
    pool = slot_pool(src, pages)
    expected = pool.clone()
    hicache = hicachefile_runner()
    locations = args.locations
    rows = []

    def body():
        dirs = {loc: LOCATIONS[loc] for loc in locations}
        size = lw.store_size(g, pages)
        for loc, dev in fs.attached_targets(locations, dirs, size):
            samples: dict[str, list] = {}
            for rnd in range(args.rounds):
                order = ["kvblock", "vllm-fs"] + (["hicachefile"] if hicache else [])
                if rnd % 2:
                    order.reverse()
                for backend in order:
                    if backend == "kvblock":
                        got = run_kvblock(dev, g, keys, src, dst, ids)
                    elif backend == "vllm-fs":
                        got = [run_vllm_fs(dirs[loc], pool, expected, g.block_tokens,
                                           g.num_layers)]
                        pool.copy_(expected)
                    else:
                        got = [hicache(dirs[loc], src, g)]
                    for r in got:
                        samples.setdefault(r["backend"], []).append(r)
                        print(f"  {loc} round {rnd}: {r['backend']} first {r['first_ms']:.1f} "
                              f"ms, all {r['all_ms']:.1f} ms", file=sys.stderr, flush=True)
            for backend, runs in samples.items():
                rows.append({"location": loc, "backend": backend,
                             "first_ms": statistics.median(r["first_ms"] for r in runs),
                             "all_ms": statistics.median(r["all_ms"] for r in runs),
                             "samples": runs})

    code = fs.run_guarded("first_layer_vs_peers", body)
    if code is not None:
        return code
    if args.json:
        print(json.dumps({"tokens": args.tokens, "geometry": g.describe(),
                          "kv_bytes": kv_bytes, "rows": rows}, indent=2))
        return 0
    print(f"{args.tokens}-token prefix, {g.describe()}, {kv_bytes / GIB:.2f} GiB; median of "
          f"{args.rounds} rounds; page cache dropped before every load")
    head = (f"{'where':<6} {'backend':<12} {'first usable layer':>19} {'all layers':>11} "
            f"{'kvblock first / this first':>27}")
    print(head)
    print("-" * len(head))
    for loc in locations:
        mine = next(r for r in rows if r["location"] == loc and r["backend"] == "kvblock")
        for r in (x for x in rows if x["location"] == loc):
            ratio = mine["first_ms"] / r["first_ms"]
            verdict = "" if r["backend"].startswith("kvblock") else \
                f"{ratio:>10.3f} (bar <= {BAR:.3f}: {'met' if ratio <= BAR else 'NOT met'})"
            print(f"{loc:<6} {r['backend']:<12} {r['first_ms']:>16.1f} ms {r['all_ms']:>8.1f} ms "
                  f"{verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
