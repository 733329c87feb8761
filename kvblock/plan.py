"""Deployment arithmetic (``kvblock plan``): KV bytes, store capacity, restore
time and the break-even against recomputing the prefix.

Units: bytes; device bandwidth in GB/s (10^9 bytes/s, as drives are rated);
prefill throughput in tokens/s.  Recompute time is either given as measured
prefill throughput, or estimated as 2 x params x tokens FLOPs at a model FLOP
utilisation of the GPUs' peak.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, replace

from kvblock.errors import ConfigError
from kvblock.layout.geometry import DTYPES, Geometry
from kvblock.units import is_whole

GB = 1e9


@dataclass(frozen=True)
class Plan:
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    kv_bytes_per_rank: int
    store_capacity_bytes: int
    store_capacity_per_device_bytes: int
    array_gbps: float
    restore_s_single: float            # one request alone on the array
    restore_s_concurrent: float        # every concurrent request restoring at once
    recompute_s: float | None
    speedup_single: float | None
    break_even_array_gbps: float | None  # array bandwidth at which restore == recompute
    # The store a format makes (KVStore.format, default region size, 4 KiB
    # blocks) that holds every session's request at once, none evicted:
    block_tokens: int = 16
    blocks_per_request: int = 0        # ceil(tokens / block_tokens): whole blocks
    device_bytes: int = 0              # the least size of each device (store file)
    region_bytes: int = 0              # its regions' size
    region_count: int = 0              # and count, over every device

    def as_dict(self) -> dict:
        return asdict(self)


def plan(*, layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
         kv_parts: int = 2, block_tokens: int = 16, tokens: int, concurrency: int = 1,
         devices: int = 1,
         device_gbps: float, tp: int = 1, sessions: int | None = None,
         prefill_tokens_per_s: float | None = None, model_params: float | None = None,
         gpu_tflops: float | None = None, gpus: int | None = None, mfu: float = 0.4) -> Plan:
    """``sessions``: contexts kept in the store (default: ``concurrency``);
    ``block_tokens``: tokens per block of the store (format's --block-tokens).
    The device size is the least that ``devices`` store files (4 KiB blocks)
    must each have for KVStore.format (default region size) to make a store
    that holds ``sessions`` requests of ``tokens`` at once: ConfigError
    when no store holds this model's blocks (as the format refuses them) or
    none of devices up to 2**60 bytes holds the sessions.  (A larger device
    gets larger default regions, which may hold fewer requests: it holds
    them formatted with the plan's ``region_bytes`` as its region size.)"""
    for name, value in (("layers", layers), ("block_tokens", block_tokens),
                        ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("tokens", tokens), ("concurrency", concurrency), ("devices", devices),
                        ("tp", tp), ("sessions", sessions), ("gpus", gpus),
                        ("kv_parts", kv_parts)):
        # counts, as the CLI's ints: tokens=2.5 planned 1.0 blocks, devices=2.5
        # was a bare TypeError from range()
        if value is not None and not is_whole(value):
            raise ConfigError(f"plan: {name} must be a whole number (an int), got {value!r}")
        if value is not None and value < 1 and name != "kv_parts":
            raise ConfigError(f"plan: {name} must be >= 1, got {value}")
    # numpy's integers as Python's: their products would wrap at 2**63
    layers, kv_heads, head_dim, kv_parts, block_tokens, tokens, concurrency, devices, tp = map(
        int, (layers, kv_heads, head_dim, kv_parts, block_tokens, tokens, concurrency, devices,
              tp))
    sessions, gpus = (None if v is None else int(v) for v in (sessions, gpus))
    if kv_parts not in (1, 2):
        raise ConfigError(f"plan: kv_parts must be 2 (K and V) or 1 (MLA latent), "
                          f"got {kv_parts!r}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"plan: mfu must be a fraction in (0, 1], got {mfu}")
    for name, value in (("device_gbps", device_gbps), ("prefill_tokens_per_s", prefill_tokens_per_s),
                        ("model_params", model_params), ("gpu_tflops", gpu_tflops)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"plan: {name} must be a finite number > 0, got {value}")
    # The recompute time comes from one source: measured prefill, or FLOPs
    # from both model_params and gpu_tflops.  Half of the pair, or both
    # sources, would be ignored without a word (no recompute time, or the
    # other one).
    if (model_params is None) != (gpu_tflops is None):
        raise ConfigError("plan: model_params and gpu_tflops go together (the recompute is "
                          "estimated from both); give both, or prefill_tokens_per_s")
    if prefill_tokens_per_s is not None and model_params is not None:
        raise ConfigError("plan: give prefill_tokens_per_s or model_params with gpu_tflops, "
                          "not both (each is a recompute time)")
    # K and V heads split over the TP ranks as the engines split them: heads
    # / tp a rank, or past tp = heads each head on tp / heads ranks
    # (replicated).  vLLM and SGLang refuse any other tp (8 heads at tp 3
    # is no deployment: ranks of 3, 3 and 2 heads were planned).  MLA's
    # latent is whole on every rank.
    if kv_parts == 2 and (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
        raise ConfigError(
            f"plan: {kv_heads} KV heads (--kv-heads) do not split over tp {tp} (--tp {tp}): "
            "vLLM and SGLang give each rank kv_heads / tp heads, or, at a tp past the "
            "heads, each head to tp / kv_heads ranks, and refuse any other tp; give a --tp "
            f"that divides {kv_heads} or is a multiple of it")
    if dtype not in DTYPES:
        raise ConfigError(f"plan: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    try:
        p = _plan(layers, kv_heads, head_dim, dtype, kv_parts, tokens, concurrency, devices,
                  device_gbps, tp, sessions, prefill_tokens_per_s, model_params, gpu_tflops,
                  gpus, mfu)
    except (OverflowError, ZeroDivisionError):   # an int past a float; a time that is 0
        p = None
    # Finite, positive inputs can still overflow (1e-320 GB/s: a restore of
    # inf s) or underflow (a restore or recompute of 0 s): --json cannot print
    # inf (a traceback) and the table printed "inf s"; refuse them as bad input.
    bad = p is None or not all(math.isfinite(v) for v in asdict(p).values()
                               if isinstance(v, float)) \
        or p.restore_s_single == 0 or p.recompute_s == 0
    if bad:
        raise ConfigError("plan: the numbers given are out of range (a result overflows or "
                          "comes out 0); check their units")
    return replace(p, **_store(layers, kv_heads, head_dim, dtype, kv_parts, block_tokens,
                               tokens, devices, sessions or concurrency))


def _store(layers, kv_heads, head_dim, dtype, kv_parts, block_tokens, tokens, devices,
           sessions) -> dict:
    """The store a format makes for the plan (Plan's last fields), from the
    format's own planning (kvblock/store/planning.py)."""
    from kvblock.devices.device import FILE_BLOCK_SIZE
    from kvblock.format.superblock import MAX_DEVICES
    from kvblock.store.planning import (
        StandIn, least_size_for_runs, no_store_holds, plan_for)

    if devices > MAX_DEVICES:
        raise ConfigError(f"plan: a store spans at most {MAX_DEVICES} devices, got {devices}")
    try:
        geometry = Geometry(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                            dtype=dtype, block_tokens=block_tokens, kv_parts=kv_parts)
    except ConfigError as e:      # a count past what a store records (2**31 - 1)
        raise ConfigError(f"plan: {e}") from None
    nblocks = -(-tokens // block_tokens)
    devs = [StandIn(f"device {i}", FILE_BLOCK_SIZE) for i in range(devices)]
    # (plan's own options: its layers are --model-layers, one head group)
    refused = no_store_holds(geometry, [d.block_size for d in devs],
                             smaller="plan for a smaller model (fewer --model-layers)")
    if refused is not None:
        raise ConfigError(f"plan: {refused}")
    size = least_size_for_runs(devs, geometry, nblocks, sessions)
    if size is None:
        raise ConfigError(
            f"plan: no store over {devices} device(s) of up to 2**60 bytes each holds "
            f"{sessions} request(s) of {tokens} tokens ({nblocks} blocks of "
            f"{geometry.block_bytes} bytes each) at once: use more devices, fewer sessions "
            "or shorter contexts")
    layout = plan_for(devs, geometry, size=size)
    return {"block_tokens": block_tokens, "blocks_per_request": nblocks,
            "device_bytes": size, "region_bytes": layout["region_size"],
            "region_count": layout["region_count"]}


def _plan(layers, kv_heads, head_dim, dtype, kv_parts, tokens, concurrency, devices,
          device_gbps, tp, sessions, prefill_tokens_per_s, model_params, gpu_tflops, gpus,
          mfu) -> Plan:
    per_token = kv_parts * layers * kv_heads * head_dim * DTYPES[dtype][1]
    per_request = per_token * tokens
    # A rank holds its share of the KV heads, at least one (past tp = heads
    # they are replicated); MLA's latent (kv_parts 1) is whole on every rank.
    per_rank = per_request if kv_parts == 1 else \
        per_request // kv_heads * -(-kv_heads // tp)
    capacity = per_request * (sessions or concurrency)
    array_gbps = devices * device_gbps
    restore_single = per_request / (array_gbps * GB)
    restore_concurrent = restore_single * concurrency
    recompute = None
    if prefill_tokens_per_s:
        recompute = tokens / prefill_tokens_per_s
    elif model_params and gpu_tflops:
        flops = 2.0 * model_params * tokens
        recompute = flops / ((gpus or tp) * gpu_tflops * 1e12 * mfu)
    return Plan(
        kv_bytes_per_token=per_token, kv_bytes_per_request=per_request,
        kv_bytes_per_rank=per_rank, store_capacity_bytes=capacity,
        store_capacity_per_device_bytes=-(-capacity // devices), array_gbps=array_gbps,
        restore_s_single=restore_single, restore_s_concurrent=restore_concurrent,
        recompute_s=recompute,
        speedup_single=(recompute / restore_single) if recompute else None,
        break_even_array_gbps=(per_request / recompute / GB) if recompute else None)
