"""Deployment arithmetic (``kvblock plan``): KV bytes, store capacity, restore
time and the break-even against recomputing the prefix.

Units: bytes; device bandwidth in GB/s (10^9 bytes/s, as drives are rated);
prefill throughput in tokens/s.  Recompute time is either given as measured
prefill throughput, or estimated as 2 x params x tokens FLOPs at a model FLOP
utilisation of the GPUs' peak.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass

from kvblock.errors import ConfigError
from kvblock.layout.geometry import DTYPES

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

    def as_dict(self) -> dict:
        return asdict(self)


def plan(*, layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
         kv_parts: int = 2, tokens: int, concurrency: int = 1, devices: int = 1,
         device_gbps: float, tp: int = 1, sessions: int | None = None,
         prefill_tokens_per_s: float | None = None, model_params: float | None = None,
         gpu_tflops: float | None = None, gpus: int | None = None, mfu: float = 0.4) -> Plan:
    """``sessions``: contexts kept in the store (default: ``concurrency``)."""
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("tokens", tokens), ("concurrency", concurrency), ("devices", devices),
                        ("tp", tp), ("sessions", sessions), ("gpus", gpus)):
        if value is not None and value < 1:
            raise ConfigError(f"plan: {name} must be >= 1, got {value}")
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
    return p


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
