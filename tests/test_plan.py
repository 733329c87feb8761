"""kvblock plan's arithmetic against hand-computed cases."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvblock.cli.main import cli
from kvblock.errors import ConfigError
from kvblock.plan import plan


def test_large_model_tp8_on_an_eight_drive_array():
    # 62 layers x 8 kv heads x 128 x bf16, K and V: 2*62*8*128*2 = 253,952 B/token
    p = plan(layers=62, kv_heads=8, head_dim=128, dtype="bfloat16", tokens=32768,
             concurrency=16, devices=8, device_gbps=6.0, tp=8, sessions=1000)
    assert p.kv_bytes_per_token == 253_952
    assert p.kv_bytes_per_request == 253_952 * 32768 == 8_321_499_136
    assert p.kv_bytes_per_rank == 8_321_499_136 // 8
    assert p.store_capacity_bytes == 8_321_499_136_000
    assert p.store_capacity_per_device_bytes == 1_040_187_392_000
    assert p.array_gbps == 48.0
    assert p.restore_s_single == pytest.approx(8.321499136 / 48.0)      # 0.1734 s
    assert p.restore_s_concurrent == pytest.approx(16 * 8.321499136 / 48.0)
    assert p.recompute_s is None and p.break_even_array_gbps is None


def test_per_rank_bytes_past_the_head_count_and_for_mla():
    # 8 kv heads at tp 16: each rank holds one head (replicated), 1/8 not 1/16
    p = plan(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0, tp=16)
    assert p.kv_bytes_per_rank == p.kv_bytes_per_request // 8
    # 8 heads at tp 4: two heads a rank
    p = plan(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0, tp=4)
    assert p.kv_bytes_per_rank == p.kv_bytes_per_request // 4
    # MLA's latent is whole on every rank
    p = plan(layers=61, kv_heads=1, head_dim=576, kv_parts=1, tokens=1000, device_gbps=2.0,
             tp=8)
    assert p.kv_bytes_per_rank == p.kv_bytes_per_request


def test_recompute_from_measured_prefill_and_from_flops():
    p = plan(layers=32, kv_heads=8, head_dim=128, tokens=10_000, device_gbps=2.0,
             prefill_tokens_per_s=5_000)
    # 2*32*8*128*2 = 131,072 B/token -> 1,310,720,000 B; restore 0.65536 s; recompute 2 s
    assert p.kv_bytes_per_request == 1_310_720_000
    assert p.restore_s_single == pytest.approx(0.65536)
    assert p.recompute_s == pytest.approx(2.0)
    assert p.speedup_single == pytest.approx(2.0 / 0.65536)
    assert p.break_even_array_gbps == pytest.approx(0.65536)   # 1.31072 GB / 2 s
    q = plan(layers=32, kv_heads=8, head_dim=128, tokens=10_000, device_gbps=2.0,
             model_params=8e9, gpu_tflops=1000, gpus=1, mfu=0.5)
    # 2 * 8e9 * 1e4 = 1.6e14 FLOP at 5e14 FLOP/s = 0.32 s
    assert q.recompute_s == pytest.approx(0.32)


def test_mla_and_fp8():
    p = plan(layers=61, kv_heads=1, head_dim=576, dtype="float8_e4m3fn", kv_parts=1,
             tokens=1000, device_gbps=1.0)
    assert p.kv_bytes_per_token == 61 * 576


def test_bad_input():
    with pytest.raises(ConfigError, match="unknown dtype"):
        plan(layers=1, kv_heads=1, head_dim=1, dtype="fp7", tokens=1, device_gbps=1)
    with pytest.raises(ConfigError, match="tokens must be >= 1"):
        plan(layers=1, kv_heads=1, head_dim=1, tokens=0, device_gbps=1)
    for name in ("device_gbps", "model_params", "gpu_tflops", "prefill_tokens_per_s"):
        for value in (float("nan"), float("inf"), 0.0):
            kw = {"device_gbps": 1.0, name: value}
            with pytest.raises(ConfigError, match=f"{name} must be a finite number"):
                plan(layers=1, kv_heads=1, head_dim=1, tokens=1, **kw)


def test_bad_input_the_cli_refuses_is_refused_by_plan_too():
    base = dict(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0,
                model_params=8e9, gpu_tflops=1000)
    # kv_parts 0 or mfu 0 divided by zero; 3 parts, 0 sessions or 0 gpus
    # answered for another deployment (sessions 0 planned for --concurrency)
    for bad, match in (({"kv_parts": 0}, "kv_parts must be 2"), ({"kv_parts": 3}, "kv_parts"),
                       ({"mfu": 0.0}, "mfu must be"), ({"mfu": 1.5}, "mfu must be"),
                       ({"mfu": float("nan")}, "mfu must be"),
                       ({"sessions": 0}, "sessions must be >= 1"),
                       ({"gpus": 0}, "gpus must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            plan(**dict(base, **bad))


@pytest.mark.parametrize("flag", ["--device-gbps", "--model-params", "--prefill-tokens-per-s"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_cli_plan_refuses_what_is_not_a_finite_number(flag, value):
    args = ["plan", "--model-layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--tokens", "8192", "--device-gbps", "2", flag, value, "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and "not a finite number" in res.output, res.output


def test_cli_plan_json_and_table():
    args = ["plan", "--model-layers", "62", "--kv-heads", "8", "--head-dim", "128",
            "--tokens", "32768", "--concurrency", "16", "--devices", "8", "--device-gbps", "6",
            "--tp", "8", "--prefill-tokens-per-s", "2000"]
    res = CliRunner().invoke(cli, args + ["--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["kv_bytes_per_token"] == 253_952
    assert out["recompute_s"] == pytest.approx(16.384)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0 and "break-even array bandwidth" in res.output


def test_cli_plan_table_shows_small_numbers_not_zeros():
    """A plan of 32 tokens on a slow device: 4 MiB per request, 0.04 GB/s,
    32 us to recompute.  The table shows each with significant digits, as
    the JSON has them, not 0.00 GiB, 0.0 GB/s, 0.00 s or 0.0x."""
    args = ["plan", "--model-layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--tokens", "32", "--device-gbps", "0.04", "--prefill-tokens-per-s", "1e6"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    for shown in ("0.00391 GiB", "0.0400 GB/s", "0.105 s", "0.0000320 s", "0.000305x",
                  "131.07 GB/s"):
        assert shown in res.output, (shown, res.output)
    for zero in ("0.00 GiB", "0.0 GB/s", "0.00 s", "0.0x"):
        assert f" {zero} " not in res.output, (zero, res.output)
    big = CliRunner().invoke(cli, ["plan", "--model-layers", "62", "--kv-heads", "8",
                                   "--head-dim", "128", "--tokens", "32768", "--sessions",
                                   "4096", "--device-gbps", "6"])
    assert "31744.00 GiB" in big.output, big.output       # big ones as before


@pytest.mark.parametrize("extra", [
    ["--device-gbps", "1e-320"],                                   # restore time: inf
    ["--device-gbps", "1e308", "--devices", "2"],                  # array bandwidth: inf
    ["--device-gbps", "5", "--prefill-tokens-per-s", "1e-320"],    # recompute: inf
    ["--device-gbps", "5", "--model-params", "1e-300", "--gpu-tflops", "1e300"],  # 0 s
    ["--device-gbps", "5", "--tokens", "1" + "0" * 400],           # int past a float
    ["--device-gbps", "1e300", "--prefill-tokens-per-s", "1000"],  # restore 0 s: x / 0
])
def test_cli_plan_refuses_numbers_whose_plan_is_out_of_range(extra):
    """Finite, positive inputs whose arithmetic overflows (inf, or an int too
    large for a float) or underflows (a restore or recompute of 0 s) made
    --json fail with a ValueError/OverflowError/ZeroDivisionError traceback,
    and the table print "inf s" and "infx" (or ask for the --model-params it
    was given): a ConfigError (exit 8) naming the problem instead."""
    args = ["plan", "--model-layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--tokens", "8192", *extra]
    for fmt in (["--json"], []):
        res = CliRunner().invoke(cli, args + fmt)
        assert res.exit_code == 8, (res.exit_code, res.output, res.exception)
        assert "out of range" in res.output, res.output
        assert "inf" not in res.output, res.output
    with pytest.raises(ConfigError, match="out of range"):
        plan(layers=32, kv_heads=8, head_dim=128, tokens=8192, device_gbps=1e-320)


@pytest.mark.parametrize("extra", [
    ["--model-params", "8e9"],                                   # no --gpu-tflops
    ["--gpu-tflops", "900"],                                     # no --model-params
    ["--prefill-tokens-per-s", "1e4", "--model-params", "8e9", "--gpu-tflops", "900"],
    ["--mfu", "0.5"],                                            # no FLOPs estimate
    ["--prefill-tokens-per-s", "1e4", "--mfu", "0.5"],
])
def test_cli_plan_refuses_recompute_options_it_would_ignore(extra):
    """--model-params without --gpu-tflops (or the reverse), both ways of
    timing the recompute at once (README: --prefill-tokens-per-s R |
    --model-params P --gpu-tflops T), or --mfu with no FLOPs estimate were
    accepted and silently ignored: the plan had no recompute time, or the
    other one.  A usage error names what goes together instead."""
    args = ["plan", "--model-layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--tokens", "8192", "--device-gbps", "6", *extra]
    for fmt in (["--json"], []):
        res = CliRunner().invoke(cli, args + fmt)
        assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
        assert "--model-params" in res.output and "--gpu-tflops" in res.output, res.output


def test_plan_refuses_recompute_inputs_it_would_ignore():
    base = dict(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0)
    for extra in ({"model_params": 8e9}, {"gpu_tflops": 900.0},
                  {"prefill_tokens_per_s": 1e4, "model_params": 8e9, "gpu_tflops": 900.0}):
        with pytest.raises(ConfigError, match="model_params"):
            plan(**base, **extra)


def _fill_planned_store(tmp_path, p, geometry, devices, sessions, less=0):
    """Format ``devices`` store files of the plan's device size (``less``
    bytes less) and put
    ``sessions`` requests of its blocks one after another: the keys still
    stored and whether each request reads back as written."""
    import numpy as np

    from kvblock import KVStore, aligned_empty, create_file

    tmp_path.mkdir(exist_ok=True)
    paths = [str(tmp_path / f"d{i}.img") for i in range(devices)]
    for path in paths:
        create_file(path, p.device_bytes - less)
    n = p.blocks_per_request
    keys = [[f"s{s}-b{j}".encode() for j in range(n)] for s in range(sessions)]
    data = [np.random.default_rng(s).integers(0, 256, n * geometry.block_bytes, np.uint8)
            for s in range(sessions)]
    with KVStore.format(paths, geometry) as store:
        if not less:
            assert (store.regions.count, store.regions.size) == (p.region_count, p.region_bytes)
        for k, d in zip(keys, data):
            store.put_run(k, d)
        stored = [store.lookup(k) for k in keys]
        same = []
        for k, d in zip(keys, data):
            out = aligned_empty(d.nbytes)
            same.append(store.get_run(k, out) == n and bytes(out) == d.tobytes())
    return stored, same


@pytest.mark.parametrize("devices,tokens,sessions", [(1, 1000, 6), (2, 1000, 6), (1, 4000, 3),
                                                     (3, 700, 11)])
def test_a_format_of_the_planned_device_size_holds_every_session(tmp_path, devices, tokens,
                                                                  sessions):
    """The plan's per-device figure was the KV bytes alone (sessions x
    request / devices): a file of that size was refused by the format
    (3,072,000 bytes cannot hold metadata and two regions) or held fewer
    requests than planned.  The plan now gives the device size the format
    needs, from the format's own planning, and a store of it holds every
    session's request, bytes as written."""
    from kvblock import Geometry

    p = plan(layers=2, kv_heads=2, head_dim=32, dtype="float16", block_tokens=16,
             tokens=tokens, sessions=sessions, devices=devices, device_gbps=1.0)
    geometry = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                        block_tokens=16)
    assert p.blocks_per_request == -(-tokens // 16)
    assert p.device_bytes * devices > p.store_capacity_bytes
    stored, same = _fill_planned_store(tmp_path, p, geometry, devices, sessions)
    assert stored == [p.blocks_per_request] * sessions and all(same)
    # and it is the least: a block less, and the first requests are evicted
    stored, _ = _fill_planned_store(tmp_path / "less", p, geometry, devices, sessions,
                                    less=4096)
    assert stored[0] == 0 and stored[-1] == p.blocks_per_request


def test_plan_refuses_blocks_no_store_holds_as_the_format_does():
    """Blocks of 4 bytes (1 layer, 1 head of 1 float16, 1 token): no store
    of any size holds them (store._blocks_too_small), and the format says
    so; plan gave a capacity of a few bytes.  It now refuses them with the
    format's reason."""
    from kvblock import Geometry
    from kvblock.store.planning import StandIn
    from kvblock.store.store import _blocks_too_small

    tiny = dict(layers=1, kv_heads=1, head_dim=1, dtype="float16", block_tokens=1)
    why = _blocks_too_small([StandIn("", 4096)], Geometry(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16", block_tokens=1))
    assert why is not None
    with pytest.raises(ConfigError, match="too small for any store") as e:
        plan(**tiny, tokens=100, device_gbps=1.0)
    assert str(why) in str(e.value)
    res = CliRunner().invoke(cli, ["plan", "--model-layers", "1", "--kv-heads", "1",
                                   "--head-dim", "1", "--dtype", "float16", "--block-tokens",
                                   "1", "--tokens", "100", "--device-gbps", "1", "--json"])
    assert res.exit_code == 8 and "too small for any store" in res.output, res.output


def test_plan_refuses_what_no_store_holds():
    # a count a store cannot record, more devices than a store spans, more
    # sessions than any devices hold
    base = dict(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0)
    with pytest.raises(ConfigError, match="plan: geometry: num_layers"):
        plan(**dict(base, layers=1 << 31))
    with pytest.raises(ConfigError, match="at most 32 devices"):
        plan(**base, devices=33)
    with pytest.raises(ConfigError, match="up to 2\\*\\*60 bytes"):
        plan(**base, sessions=10 ** 13)


def test_cli_plan_json_has_the_store_a_format_makes():
    args = ["plan", "--model-layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--tokens", "32768", "--sessions", "100", "--devices", "4", "--device-gbps", "6",
            "--block-tokens", "32"]
    res = CliRunner().invoke(cli, args + ["--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["block_tokens"] == 32 and out["blocks_per_request"] == 1024
    assert out["device_bytes"] * 4 > out["store_capacity_bytes"]
    from kvblock import Geometry
    from kvblock.store.planning import StandIn, plan_for, regions_for_runs
    g = Geometry(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=32)
    layout = plan_for([StandIn(str(i), 4096) for i in range(4)], g, size=out["device_bytes"])
    assert (layout["region_count"], layout["region_size"]) == (out["region_count"],
                                                             out["region_bytes"])
    assert regions_for_runs(layout, g, 1024, 100) <= layout["region_count"]
    smaller = plan_for([StandIn(str(i), 4096) for i in range(4)], g,
                       size=out["device_bytes"] - 4096)
    assert regions_for_runs(smaller, g, 1024, 100) > smaller["region_count"]
    table = CliRunner().invoke(cli, args)
    assert f"{out['device_bytes']} bytes each" in table.output, table.output


def test_the_planned_device_size_is_the_least_though_larger_regions_hold_fewer(tmp_path):
    """The format's default region size grows with the devices (1/16 of the
    store's space, in whole MiB), so a larger device may hold fewer
    requests than a smaller one: the plan's search, taking "holds" as
    monotonic in the size, gave 59,604,992 bytes for 9 requests of 500
    tokens of this model, where a store file of 50,315,264 bytes (22
    regions of 2 MiB) holds them all.  The size is now the least over every
    region size the format picks."""
    from kvblock import Geometry
    from kvblock.store.planning import StandIn, plan_or_none, regions_for_runs

    shape = dict(layers=8, kv_heads=2, head_dim=128, dtype="float16", block_tokens=16)
    geometry = Geometry(num_layers=8, num_kv_heads=2, head_dim=128, dtype="float16",
                        block_tokens=16)
    p = plan(**shape, tokens=500, sessions=9, device_gbps=1.0)
    smaller = 50_315_264
    stored, same = _fill_planned_store(tmp_path, p, geometry, 1, 9,
                                       less=p.device_bytes - smaller)
    assert stored == [p.blocks_per_request] * 9 and all(same)
    assert p.device_bytes <= smaller
    stored, same = _fill_planned_store(tmp_path / "planned", p, geometry, 1, 9)
    assert stored == [p.blocks_per_request] * 9 and all(same)
    # no size below it holds them (every MiB down, and the 4 KiB just below)
    devs = [StandIn("d", 4096)]

    def holds(size):
        layout = plan_or_none(devs, geometry, size=size)
        need = None if layout is None else regions_for_runs(layout, geometry,
                                                            p.blocks_per_request, 9)
        return need is not None and need <= layout["region_count"]
    assert not any(holds(size) for size in
                   [p.device_bytes - 4096, *range(p.device_bytes // (1 << 20) << 20, 0, -(1 << 20))])


def test_plan_refusing_a_model_no_journal_holds_names_its_own_options():
    """A model whose one-block journal record outgrows any store's journal
    (3,000,000 layers) was refused by kvblock plan with the format's fix,
    "fewer --layers or --head-groups": options plan does not have (its
    layers are --model-layers, and it plans one head group)."""
    res = CliRunner().invoke(cli, ["plan", "--model-layers", "3000000", "--kv-heads", "1",
                                   "--head-dim", "1", "--tokens", "16", "--device-gbps", "1"])
    assert res.exit_code == 8, res.output
    assert "journal record of one block" in res.output, res.output
    assert "--model-layers" in res.output, res.output
    assert "--head-groups" not in res.output and "--layers" not in res.output.replace(
        "--model-layers", ""), res.output


def test_the_planned_device_size_is_the_least_though_the_metadata_steps_by_a_mib(tmp_path):
    """The first region starts at the metadata's end rounded up to a whole
    MiB, and the checkpoint grows with the device: one 4 KiB larger can
    start the regions a MiB later and hold one region fewer.  The search
    took "holds" as changing once within a region size, and plan said
    46,727,168 bytes for 2 requests of 70,000 blocks of this model, where
    45,678,592 bytes (18 regions) already hold both (45,895,680 holds 17).
    It is now the least size for which the format's own plan holds them."""
    from kvblock import Geometry
    from kvblock.store.planning import StandIn, plan_or_none, regions_for_runs

    shape = dict(layers=1, kv_heads=1, head_dim=64, dtype="float16", block_tokens=1)
    geometry = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16",
                        block_tokens=1)
    p = plan(**shape, tokens=70000, sessions=2, device_gbps=1.0)
    devs = [StandIn("d", 4096)]

    def holds(size):
        layout = plan_or_none(devs, geometry, size=size)
        need = None if layout is None else regions_for_runs(layout, geometry, 70000, 2)
        return need is not None and need <= layout["region_count"]
    assert holds(45_678_592) and not holds(45_895_680)
    assert p.device_bytes == 45_678_592 and (p.region_count, p.region_bytes) == (18, 2_129_920)
    # no size below it holds them, in the format's granularity (4 KiB) over
    # the 8 MiB below (4 regions), every MiB further down
    assert not any(holds(size) for size in [*range(p.device_bytes - (8 << 20), p.device_bytes,
                                                   4096),
                                            *range(p.device_bytes >> 20 << 20, 0, -(1 << 20))])
    # and a store file of that size holds both, bytes as written
    stored, same = _fill_planned_store(tmp_path, p, geometry, 1, 2)
    assert stored == [70000, 70000] and all(same)


def test_kv_heads_that_do_not_split_evenly_over_tp_are_refused():
    """8 KV heads at --tp 3 were planned as ranks of 3, 3 and 2 heads, a
    deployment no engine runs: vLLM and SGLang split the KV heads evenly
    over the ranks (heads % tp == 0) or, at a tp past the heads, replicate
    each on tp / heads ranks (tp % heads == 0), and refuse any other tp.
    A ConfigError (exit 8) naming both numbers; MLA's latent (kv_parts 1,
    whole on every rank) takes any tp."""
    for tp in (3, 5, 12):
        with pytest.raises(ConfigError, match=rf"8 KV heads .*tp {tp}"):
            plan(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0, tp=tp)
    for tp in (1, 2, 4, 8, 16, 32):
        plan(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0, tp=tp)
    plan(layers=61, kv_heads=1, head_dim=576, kv_parts=1, tokens=1000, device_gbps=2.0, tp=3)
    res = CliRunner().invoke(cli, ["plan", "--model-layers", "32", "--kv-heads", "8",
                                   "--head-dim", "128", "--tokens", "1000",
                                   "--device-gbps", "2", "--tp", "3"])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith("kvblock: error: plan: 8 KV heads (--kv-heads)") and \
        "--tp 3" in res.output, res.output


@pytest.mark.parametrize("name", ["tokens", "devices", "concurrency", "sessions", "tp", "gpus",
                                  "block_tokens", "layers", "kv_heads", "head_dim", "kv_parts"])
@pytest.mark.parametrize("bad", [2.5, 2.0, "8", True])
def test_counts_that_are_no_whole_numbers_are_refused(name, bad):
    """The Python API took counts the CLI's ints never are: tokens=2.5
    planned a float block count (1.0 blocks) and 2.5 x the bytes, devices=2.5
    failed with a bare TypeError from range(), "8" with one from '<'.  Each is
    a ConfigError naming the argument and asking for a whole number.  A
    numpy integer is one: planned in Python ints (the plan's counts were
    int64s, which wrap past 2**63 and are no JSON)."""
    base = dict(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0,
                model_params=8e9, gpu_tflops=1000)
    with pytest.raises(ConfigError, match=rf"plan: {name} must be a whole number"):
        plan(**dict(base, **{name: bad}))
    # numpy's integers are taken, planned as Python's (an int64 would wrap)
    p = plan(**dict(base, **{name: np.int64(base.get(name, 2 if name == "kv_parts" else 1))}))
    assert p.blocks_per_request == -(-1000 // p.block_tokens) and \
        isinstance(p.blocks_per_request, int)
