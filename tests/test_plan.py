"""kvblock plan's arithmetic against hand-computed cases."""

import json

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
    # 8 heads at tp 3: ranks hold 3, 3 and 2 heads; the largest share is per rank
    p = plan(layers=32, kv_heads=8, head_dim=128, tokens=1000, device_gbps=2.0, tp=3)
    assert p.kv_bytes_per_rank == p.kv_bytes_per_request // 8 * 3
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
