#!/usr/bin/env python3
"""kvblock layer-wise load into GPU memory vs kvikio's raw pread of the same bytes.

    python perf/gpu_bandwidth.py [--path /dev/shm/kvblock-gpu.img] [--tokens 8192]

Prints GiB/s for: kvikio pread of the whole store data area into HBM (the
reference), kvblock load_blocks into a CUDA vLLM-layout cache through each GPU
path, and the ratios; the same prefix loaded from a DRAM tier holding it
(``kvblock_dram_hits_gib_s``, one figure per round).  Then a layer-wise restore beside a model's work: each
layer's "compute" (matmuls on the default stream, the same amount for both
paths: about as long in all as the slower path's load) starts once
wait_layer() hands the layer over; ``overlap_<path>`` has the medians of 3
rounds of each alone and both (``both_s``: the restore's time to its last
layer computed, comparable across paths), and ``ratio``: both's time over
the longer of the two alone (1.0: the load hid entirely behind the compute;
2.0: the two ran one after the other).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvblock import Geometry, KVStore, create_file
from kvblock.tensors import VLLMLayout, load_blocks, save_blocks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="/dev/shm/kvblock-gpu.img")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    g = Geometry(32, 8, 128, "bfloat16", 16)
    blocks = args.tokens // 16
    size = blocks * g.block_bytes * 2 + (512 << 20)
    if os.path.exists(args.path):
        os.unlink(args.path)
    create_file(args.path, size)
    src = [torch.randn(2, blocks, 16, 8, 128).to(torch.bfloat16) for _ in range(g.num_layers)]
    keys = [f"b{i}".encode() for i in range(blocks)]
    results = {}
    try:
        with KVStore.format([args.path], g, verify="never", force=True) as store:
            save_blocks(store, keys, VLLMLayout(src), list(range(blocks)))
            nbytes = blocks * g.block_bytes
            dst = [torch.zeros(2, blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
                   for _ in range(g.num_layers)]
            reader = store._kvikio_reader()
            raw = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dev, off = store.regions.address(0)
            reader.read(dev, off, raw, min(nbytes, store.regions.size)).get()
            torch.cuda.synchronize()
            t = time.perf_counter()
            done = 0
            for region in range(store.regions.count):
                if done >= nbytes:
                    break
                dev, off = store.regions.address(region)
                n = min(store.regions.size, nbytes - done)
                reader.read(dev, off, raw[done:done + n], n).get()
                done += n
            torch.cuda.synchronize()
            results["kvikio_raw_gib_s"] = round(nbytes / (time.perf_counter() - t) / 2**30, 2)
            results["kvikio_mode"] = reader.mode
            identical = {}
            for path in ("kvikio", "host"):
                os.environ["KVBLOCK_GPU_PATH"] = path
                store._gpu_path = None
                for d in dst:       # each path's bytes checked on their own (not the last one's)
                    d.zero_()
                torch.cuda.synchronize()
                t = time.perf_counter()
                h = load_blocks(store, keys, VLLMLayout(dst), list(range(blocks)))
                h.wait()
                torch.cuda.synchronize()
                s = time.perf_counter() - t
                results[f"kvblock_{path}_gib_s"] = round(nbytes / s / 2**30, 2)
                results[f"kvblock_{path}_first_layer_ms"] = round(h.layer_ready_at[0] * 1e3, 2)
                results[f"ratio_{path}_vs_kvikio_raw"] = round(
                    results[f"kvblock_{path}_gib_s"] / results["kvikio_raw_gib_s"], 3)
                results[f"{path}_path_taken"] = store.stats()["gpu_path"]
                identical[path] = all(torch.equal(d.cpu().view(torch.int16),
                                                  want.view(torch.int16))
                                      for d, want in zip(dst, src))
            # One amount of compute for both paths, about the slower one's
            # load: sized to each path's own load, a faster load met less
            # compute, and its ratio read worse though its restore was not.
            compute_s = max(nbytes / 2**30 / results[f"kvblock_{path}_gib_s"]
                            for path in ("kvikio", "host"))
            for path in ("kvikio", "host"):
                os.environ["KVBLOCK_GPU_PATH"] = path
                store._gpu_path = None
                results[f"overlap_{path}"] = _overlap(store, keys, dst, compute_s)
        results.update(_dram_hits(args.path + ".dram", g, keys, src, dst))
        identical["dram"] = results.pop("dram_bytes_identical")
        results["bytes_identical"] = all(identical.values())
        results["bytes_identical_per_path"] = identical
        results["kv_bytes"] = nbytes
    finally:
        os.unlink(args.path)
    print(json.dumps(results, indent=1))


def _dram_hits(path: str, g, keys, src, dst, rounds: int = 3) -> dict:
    """The same prefix loaded from a DRAM tier that holds all of it (no
    device read): GiB/s of each round after a first untimed one, and
    whether the bytes came back identical."""
    nbytes = len(keys) * g.block_bytes
    create_file(path, nbytes * 2 + (512 << 20))
    try:
        with KVStore.format([path], g, verify="never", force=True,
                            host_cache_bytes=nbytes + 8 * g.block_bytes) as store:
            save_blocks(store, keys, VLLMLayout(src), list(range(len(keys))))
            rates = []
            for r in range(rounds + 1):
                for d in dst:
                    d.zero_()
                torch.cuda.synchronize()
                t = time.perf_counter()
                load_blocks(store, keys, VLLMLayout(dst), list(range(len(keys)))).wait()
                torch.cuda.synchronize()
                if r:
                    rates.append(round(nbytes / (time.perf_counter() - t) / 2**30, 2))
            device_reads = store.stats()["device_hit_blocks"]
            identical = all(torch.equal(d.cpu().view(torch.int16), want.view(torch.int16))
                            for d, want in zip(dst, src))
    finally:
        os.unlink(path)
    return {"kvblock_dram_hits_gib_s": rates, "dram_hits_device_reads": device_reads,
            "dram_bytes_identical": identical}


def _overlap(store, keys, dst, compute_s: float, rounds: int = 3) -> dict:
    """A restore beside compute: layer l's matmuls (default stream, about
    ``compute_s`` in all) queued once wait_layer(l) returns.  Medians of
    ``rounds`` of: the load alone, the compute alone, both; ``ratio`` is
    both over the longer alone."""
    layers, ids = len(dst), list(range(len(keys)))
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):       # (cuBLAS's first call sets up: not timed)
        x @ x
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(8):
        x @ x
    torch.cuda.synchronize()
    reps = max(1, round(compute_s / layers / ((time.perf_counter() - t) / 8)))

    def timed(load: bool, compute: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = load_blocks(store, keys, VLLMLayout(dst), ids) if load else None
        for layer in range(layers):
            if h is not None:
                h.wait_layer(layer)
            for _ in range(reps if compute else 0):
                x @ x
        if h is not None:
            h.wait()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    runs = {"load_s": [], "compute_s": [], "both_s": []}
    for _ in range(rounds):
        runs["load_s"].append(timed(True, False))
        runs["compute_s"].append(timed(False, True))
        runs["both_s"].append(timed(True, True))
    out = {k: round(sorted(v)[len(v) // 2], 4) for k, v in runs.items()}
    out["ratio"] = round(out["both_s"] / max(out["load_s"], out["compute_s"]), 3)
    return out


if __name__ == "__main__":
    main()
