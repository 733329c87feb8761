#!/usr/bin/env python3
"""Layer-wise restore of a large model's KV (issue 4) vs fio, and the
paged-layout copies alone.

Geometry shaped like a large model: 62 layers, 8 KV heads, head dim 128,
bfloat16, 16-token blocks (248 KiB of KV per token; 8192 tokens = 1.94 GiB).
A vLLM-layout CPU cache (one ``(2, pages, 16, 8, 128)`` tensor per layer) is
saved with ``save_blocks``, then restored with ``load_blocks`` into a fresh
vLLM-layout cache, for each target (a loop device over a file in /dev/shm,
and one over a file on disk, as in perf/vs_fio.py), alternating for several
rounds with:

- fio ``rw=read`` at the same per-I/O size and I/Os in flight: the loader
  reads, per layer, one batch holding that layer's range of every run of the
  prefix (a run holds at most a region's worth of blocks), each range split
  by the engine into <= 8 MiB pieces; fio runs with ``bs`` = the most common
  piece size and ``iodepth`` = the pieces of one layer (at most the queue
  depth), and reads as many bytes as the restore.  (The loader has since
  come to read in units of about 8 MiB, at most two of them in flight
  (kvblock/tensors/transfer.py): fio may have more I/Os in flight than it,
  8 against 2 at 8K tokens, so the ratio errs against kvblock.);
- restore with checksums verified (``verify="always"``) and without
  (``verify="never"``): time to the first layer (``layer_ready_at[0]``), time
  to all layers (``layer_ready_at[-1]``), both counted from the
  ``load_blocks`` call, and GiB/s = ``bytes_read`` / time to all layers (bar:
  >= 0.90x fio);
- on the /dev/shm target, the copies alone on the CPU: save_blocks' gather of
  the cache pages into its staging buffer (the store write replaced by a
  sink; on up to two threads, as save_blocks runs it), and the scatter of
  loaded layers into the cache (the loader's ``_scatter_pages``, fed run by
  run like the loader does, on one thread as the loader runs it), against
  the device bandwidth measured there (the fio sequential read above).
  Bar: >= 2x.

    .venv/bin/python perf/layerwise_restore.py                  # ~2 minutes, needs root
    .venv/bin/python perf/layerwise_restore.py --tokens 4096 --targets shm --json
    .venv/bin/python perf/layerwise_restore.py --pages random   # scattered page ids

Buffers and caches are allocated and touched before anything is timed; the
page cache is dropped before every read; the cache is zeroed before every
restore and compared with the saved one after it (untimed); loop devices are
always detached.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402
from vs_fio import human, log, parse_size  # noqa: E402

MIB = 1 << 20
RESTORE_BAR = 0.90
COPY_BAR = 2.0
# The store's region size on any device of 4 GiB or more (its default is
# min(256 MiB, capacity / 16)); set here so that the small test devices get
# the runs, and so the I/O sizes, of a production-size device.
REGION = 256 * MIB
TARGETS = ("shm", "disk")


def geometry(layers=62, kv_heads=8, head_dim=128, block_tokens=16):
    from kvblock import Geometry

    return Geometry(layers, kv_heads, head_dim, "bfloat16", block_tokens)


def make_cache(g, pages: int, fill: str = "zeros") -> list:
    """A vLLM NHD cache (one tensor per layer), every page touched now."""
    import torch

    caches = []
    for _ in range(g.num_layers):
        t = torch.empty(2, pages, g.block_tokens, g.num_kv_heads, g.head_dim,
                        dtype=torch.bfloat16)
        if fill == "random":
            t.view(torch.int16).random_(-32768, 32767)
        else:
            t.view(torch.int16).zero_()
        caches.append(t)
    return caches


def page_ids(n: int, order: str, pages: int) -> np.ndarray:
    if order == "random":
        return np.random.default_rng(1).permutation(pages)[:n].astype(np.int64)
    return np.arange(n, dtype=np.int64)


def store_size(g, blocks: int, region_size: int = REGION) -> int:
    """A device that holds the prefix in whole regions, with one region and
    the metadata to spare."""
    from kvblock.layout import RunLayout

    per_region = RunLayout.max_blocks(g, 4096, region_size)
    regions = -(-blocks // per_region) + 1
    return regions * region_size + 128 * MIB


def io_plan(store, keys, qd: int) -> dict:
    """What one layer's read looks like on the device (see the module docstring)."""
    from kvblock.io.batch import DEFAULT_MAX_IO

    sizes = []
    for run, _pos, _count, _at in store.index.segments(keys):
        length = store.layout(run.nblocks).range_bytes
        while length > 0:
            sizes.append(min(length, DEFAULT_MAX_IO))
            length -= sizes[-1]
    common = collections.Counter(sizes).most_common(1)[0][0]
    return {"runs": len(store.index.segments(keys)), "pieces_per_layer": len(sizes),
            "io_size": common, "in_flight": min(qd, len(sizes)),
            "layer_bytes": sum(sizes), "io_sizes": sorted(set(sizes)),
            "run_blocks": store.max_run_blocks}


def save(dev: str, g, keys, src, ids, qd: int = 32,
         region_size: int | None = REGION) -> tuple[float, dict]:
    """Format ``dev``, save the cache; returns (seconds, io plan)."""
    from kvblock import KVStore
    from kvblock.tensors import VLLMLayout, save_blocks

    with KVStore.format([dev], g, force=True, queue_depth=qd,
                        region_size=region_size) as store:
        t = time.perf_counter()
        got = save_blocks(store, keys, VLLMLayout(src), ids)
        seconds = time.perf_counter() - t
        if got != len(keys):
            raise RuntimeError(f"save_blocks wrote {got} of {len(keys)} blocks")
        return seconds, io_plan(store, keys, qd)


def restore(dev: str, g, keys, dst, ids, verify: str, qd: int = 32) -> dict:
    """One layer-wise load into ``dst`` (already touched) from a store opened for it."""
    from kvblock import KVStore

    with KVStore.open([dev], geometry=g, verify=verify, queue_depth=qd) as store:
        return load(store, keys, dst, ids)


def load(store, keys, dst, ids) -> dict:
    """One layer-wise load into ``dst`` (already touched) from an open
    store, with its ``verify``.  A store's first load makes its unit
    buffers (store.spares: 3 x 8 MiB, touched at 0.25-0.5 GiB/s on this VM
    after memory was freed) before layer 0 can land; later loads from it
    reuse them, as in a serving engine: time those."""
    from kvblock.tensors import VLLMLayout, load_blocks

    layout = VLLMLayout(dst)
    fs.drop_caches()
    t = time.perf_counter()
    handle = load_blocks(store, keys, layout, ids)
    got = handle.wait()
    wall = time.perf_counter() - t
    if got != len(keys):
        raise RuntimeError(f"load_blocks restored {got} of {len(keys)} blocks")
    # from the call: the handle's clock starts after the keys' lookup
    lead = handle.started_at - t
    first, last = lead + handle.layer_ready_at[0], lead + handle.layer_ready_at[-1]
    return {"first_layer_ms": first * 1e3, "all_layers_ms": last * 1e3, "wall_ms": wall * 1e3,
            "bytes_read": handle.bytes_read, "gib_s": handle.bytes_read / last / 2**30}


def same_cache(a, b, ids_a, ids_b) -> bool:
    import torch

    ia, ib = torch.as_tensor(ids_a), torch.as_tensor(ids_b)
    return all(torch.equal(x.view(torch.int16)[:, ia], y.view(torch.int16)[:, ib])
               for x, y in zip(a, b))


# ---------------------------------------------------------------------- copies alone
class _Sink:
    """save_blocks' store without the store: its gather buffer is the
    preallocated (already touched) ``staging``; put_run only notes the time."""

    def __init__(self, g, staging):
        from kvblock.store.inflight import InFlight

        self.geometry = g
        self.staging = staging
        self.done_at = None
        self._inflight = InFlight("the sink is closed")   # save_blocks counts itself in

    def _stored_whole(self, keys):
        return False          # (save_blocks skips the gather of a run stored whole)

    def _staging(self, nbytes, purpose="staging"):
        if nbytes > self.staging.nbytes:
            raise ValueError(f"staging of {nbytes} bytes > preallocated {self.staging.nbytes}")
        return self.staging

    def put_run(self, keys, data):
        self.done_at = time.perf_counter()
        return len(keys)


def time_gather(g, keys, src, ids, staging) -> float:
    """Seconds of save_blocks' gather (cache pages -> staging), nothing else."""
    from kvblock.tensors import VLLMLayout, transfer

    sink = _Sink(g, staging)
    t = time.perf_counter()
    transfer.save_blocks(sink, keys, VLLMLayout(src), ids)
    return sink.done_at - t


def time_scatter(g, staging, dst, ids, run_blocks: int) -> float:
    """Seconds of the loader's scatter alone: every layer, run by run (runs of
    ``run_blocks`` blocks, as the store cut them), from ``staging`` holding
    [layer][block][kv][token][head][dim] into the cache."""
    from kvblock.tensors import VLLMLayout
    from kvblock.tensors.transfer import _NP_INT, _scatter_pages

    n = len(ids)
    layout = VLLMLayout(dst)
    data = staging.array[:n * g.block_bytes].view(_NP_INT[g.itemsize]).reshape(
        g.num_layers, 1, n, g.kv_parts, g.block_tokens, g.num_kv_heads, g.head_dim)
    t = time.perf_counter()
    for layer in range(g.num_layers):
        views = layout.layer_views(layer)
        for a in range(0, n, run_blocks):
            b = min(n, a + run_blocks)
            _scatter_pages(views, data[layer, :, a:b], ids[a:b], 0, g.num_kv_heads, g.itemsize)
    return time.perf_counter() - t


# ---------------------------------------------------------------------- the benchmark
def run_target(target: str, dev: str, g, args, src, dst, keys, src_ids, dst_ids,
               staging) -> dict:
    from kvblock import KVStore

    kv_bytes = len(keys) * g.block_bytes
    save_s, plan = save(dev, g, keys, src, src_ids, args.qd, args.region_size)
    log(f"  saved {kv_bytes / 2**30:.2f} GiB in {save_s:.2f} s; per layer {plan['runs']} runs, "
        f"{plan['pieces_per_layer']} I/Os of {'/'.join(human(s) for s in plan['io_sizes'])}")
    # One store for every restore: a store opened per restore made its load
    # staging inside every timed load (see load()); the untimed first one
    # makes it here.  fio only reads the device between them.
    with KVStore.open([dev], geometry=g, verify="always", queue_depth=args.qd) as store:
        load(store, keys, dst, dst_ids)
        if not same_cache(src, dst, src_ids, dst_ids):
            raise RuntimeError("restored KV differs from the saved KV")
        rounds = run_rounds(target, dev, g, args, store, src, dst, keys, src_ids, dst_ids,
                            staging, plan, kv_bytes)
    return summarize(target, g, args, plan, kv_bytes, save_s, rounds)


def run_rounds(target, dev, g, args, store, src, dst, keys, src_ids, dst_ids, staging,
               plan, kv_bytes) -> list[dict]:
    total = plan["layer_bytes"] * g.num_layers
    rounds = []
    for r in range(args.rounds):
        got = {}
        steps = ["fio_read", "always", "never"]
        if target == "shm" and not args.no_copy:
            steps += ["gather", "scatter"]
        if r % 2:
            steps.reverse()
        for step in steps:
            if step == "fio_read":
                fs.drop_caches()
                got[step] = fs.run_fio(dev, "read", plan["io_size"], plan["in_flight"],
                                       size=args.device_bytes, io_size=total,
                                       extra=args.fio_args)
            elif step in ("always", "never"):
                for t in dst:              # untimed: so a restore that lands nothing fails
                    t.zero_()
                store.verify = step
                got[step] = load(store, keys, dst, dst_ids)
                if not same_cache(src, dst, src_ids, dst_ids):
                    raise RuntimeError(f"restored KV differs from the saved KV (verify={step})")
            elif step == "gather":
                got[step] = kv_bytes / time_gather(g, keys, src, src_ids, staging) / 2**30
            else:
                got[step] = kv_bytes / time_scatter(g, staging, dst, dst_ids,
                                                    plan["run_blocks"]) / 2**30
        msg = (f"    round {r + 1}/{args.rounds}: fio read {got['fio_read']['gib_s']:.3f}, "
               f"restore verify {got['always']['gib_s']:.3f} / no verify "
               f"{got['never']['gib_s']:.3f} GiB/s, first layer "
               f"{got['always']['first_layer_ms']:.0f} / {got['never']['first_layer_ms']:.0f} ms")
        if "gather" in got:
            msg += f"; gather {got['gather']:.2f}, scatter {got['scatter']:.2f} GiB/s"
        log(msg)
        rounds.append(got)
    return rounds


def summarize(target, g, args, plan, kv_bytes, save_s, rounds) -> dict:
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    fio_read = med(lambda r: r["fio_read"]["gib_s"])
    out = {"target": target, "tokens": args.tokens, "kv_bytes": kv_bytes,
           "geometry": g.as_dict(), "pages": args.pages, "save_s": round(save_s, 3),
           "runs_per_layer": plan["runs"], "io_size": plan["io_size"],
           "io_sizes": plan["io_sizes"], "in_flight": plan["in_flight"],
           "fio_read_gib_s": round(fio_read, 4), "rounds": len(rounds), "restore": {}}
    for verify in ("always", "never"):
        gib = med(lambda r: r[verify]["gib_s"])
        paired = med(lambda r: r[verify]["gib_s"] / r["fio_read"]["gib_s"])
        out["restore"][verify] = {
            "gib_s": round(gib, 4), "ratio": round(gib / fio_read, 4),
            "paired_ratio": round(paired, 4), "bar": RESTORE_BAR, "ok": paired >= RESTORE_BAR,
            "first_layer_ms": round(med(lambda r: r[verify]["first_layer_ms"]), 1),
            "all_layers_ms": round(med(lambda r: r[verify]["all_layers_ms"]), 1),
            "wall_ms": round(med(lambda r: r[verify]["wall_ms"]), 1),
            "rounds_gib_s": [round(r[verify]["gib_s"], 4) for r in rounds]}
    out["fio_read_rounds_gib_s"] = [round(r["fio_read"]["gib_s"], 4) for r in rounds]
    if "gather" in rounds[0]:
        out["copy"] = {}
        for step in ("gather", "scatter"):
            gib = med(lambda r: r[step])
            paired = med(lambda r: r[step] / r["fio_read"]["gib_s"])
            out["copy"][step] = {
                "gib_s": round(gib, 4), "device_gib_s": round(fio_read, 4),
                "ratio": round(gib / fio_read, 4), "paired_ratio": round(paired, 4),
                "bar": COPY_BAR, "ok": paired >= COPY_BAR,
                "rounds_gib_s": [round(r[step], 4) for r in rounds]}
    return out


def print_report(results: list[dict], args, g) -> None:
    r0 = results[0]
    print(f"layer-wise restore: {g.describe()}; {args.tokens} tokens = "
          f"{r0['kv_bytes'] / 2**30:.3f} GiB of KV ({r0['kv_bytes']} bytes), "
          f"{args.pages} page ids; medians of {args.rounds} alternating rounds; "
          f"engine qd {args.qd}")
    head = ("target", "verify", "I/O size", "in flight", "fio read GiB/s", "restore GiB/s",
            "kvb/fio", "paired", "bar", "first layer ms", "all layers ms")
    rows = []
    for r in results:
        for verify, x in r["restore"].items():
            rows.append((r["target"], verify, human(r["io_size"]), str(r["in_flight"]),
                         f"{r['fio_read_gib_s']:.3f}", f"{x['gib_s']:.3f}", f"{x['ratio']:.3f}",
                         f"{x['paired_ratio']:.3f}",
                         f">={x['bar']:.2f} {'ok' if x['ok'] else 'LOW'}",
                         f"{x['first_layer_ms']:.1f}", f"{x['all_layers_ms']:.1f}"))
    _table(head, rows)
    for r in results:
        print(f"  {r['target']}: save_blocks {r['save_s']:.2f} s; {r['runs_per_layer']} runs per "
              f"layer, I/O sizes {', '.join(human(s) for s in r['io_sizes'])}")
    copies = [r for r in results if "copy" in r]
    if copies:
        print()
        print("paged-layout copies alone (CPU; gather on up to 2 threads as save_blocks, "
              "scatter on 1 as the loader) vs the /dev/shm loop device's "
              "bandwidth (fio read, above)")
        head = ("copy", "GiB/s", "device GiB/s", "copy/device", "paired", "bar")
        rows = []
        for r in copies:
            for step, x in r["copy"].items():
                rows.append((step, f"{x['gib_s']:.3f}", f"{x['device_gib_s']:.3f}",
                             f"{x['ratio']:.2f}", f"{x['paired_ratio']:.2f}",
                             f">={x['bar']:.1f} {'ok' if x['ok'] else 'LOW'}"))
        _table(head, rows)
    print("kvb/fio, copy/device: ratio of the medians; paired: median of the per-round "
          "ratios (the bars use it)")


def _table(head, rows) -> None:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(head))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192,
                   help="prompt tokens (default 8192 = 1.94 GiB of KV)")
    p.add_argument("--layers", type=int, default=62)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--pages", choices=("consecutive", "random"), default="consecutive",
                   help="cache page ids of the prefix (default consecutive; random: a "
                        "permutation, as in a long-running engine)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--qd", type=int, default=32, help="engine queue depth (default 32)")
    p.add_argument("--region-size", type=parse_size, default=REGION,
                   help="store region size (default 256M: runs of 66 blocks, 4224 KiB per "
                        "layer and run, as on a production-size device)")
    p.add_argument("--targets", default="shm,disk",
                   help="comma list of shm (file in /dev/shm) and disk (default shm,disk)")
    p.add_argument("--disk-dir", type=Path, default=fs.DISK_DIR)
    p.add_argument("--no-copy", action="store_true", help="skip the gather/scatter copies")
    p.add_argument("--fio-args", type=shlex.split, default=(),
                   help="extra fio options, given with '=': --fio-args='--fixedbufs' "
                        "(default: none, fio's io_uring defaults)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        p.error(f"--targets: choose from {', '.join(TARGETS)}")
    g = geometry(args.layers, args.kv_heads, args.head_dim, args.block_tokens)
    if args.tokens < g.block_tokens or args.rounds < 1:
        p.error("--tokens must hold at least one block and --rounds be positive")
    ok, why = fs.prerequisites()
    if not ok:
        print(f"layerwise_restore: {why}", file=sys.stderr)
        return 2

    from kvblock.memory import HostBuffer

    n = args.tokens // g.block_tokens
    pages = n if args.pages == "consecutive" else 2 * n
    args.device_bytes = store_size(g, n, args.region_size)
    keys = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    t0 = time.monotonic()
    log(f"allocating and touching caches: 2 x {pages * g.block_bytes / 2**30:.2f} GiB "
        f"+ staging {n * g.block_bytes / 2**30:.2f} GiB ...")
    src = make_cache(g, pages, "random")
    dst = make_cache(g, pages)
    src_ids = page_ids(n, args.pages, pages)
    dst_ids = page_ids(n, args.pages, pages)[::-1].copy() if args.pages == "random" \
        else src_ids
    results = []
    dirs = {"shm": fs.SHM, "disk": args.disk_dir}
    def body():
        with contextlib.ExitStack() as stack:
            staging = stack.enter_context(HostBuffer(n * g.block_bytes, register=False)) \
                if "shm" in targets and not args.no_copy else None
            for target, dev in fs.attached_targets(targets, dirs, args.device_bytes):
                results.append(run_target(target, dev, g, args, src, dst, keys, src_ids,
                                          dst_ids, staging if target == "shm" else None))

    rc = fs.run_guarded("layerwise_restore", body)
    if rc is not None:
        return rc
    log(f"done in {time.monotonic() - t0:.0f} s")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_report(results, args, g)
    if args.check:
        oks = [x["ok"] for r in results for x in r["restore"].values()]
        oks += [x["ok"] for r in results for x in r.get("copy", {}).values()]
        if not all(oks):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
