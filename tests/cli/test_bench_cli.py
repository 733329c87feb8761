import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvblock.cli.main import cli

FIELDS = {"workload", "engine", "bs", "qd", "bytes", "seconds", "gib_per_s", "iops",
          "p50_us", "p99_us"}


@pytest.mark.parametrize("workload", ["write", "read", "randwrite", "randread"])
def test_bench_json(workload, target):
    path = target(16 << 20)
    res = CliRunner().invoke(cli, ["bench", path, "--workload", workload, "--bs", "64K",
                                   "--qd", "8", "--seconds", "0.2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert FIELDS <= out.keys()
    assert out["workload"] == workload and out["bs"] == 65536 and out["qd"] == 8
    assert out["bytes"] > 0 and out["bytes"] % 65536 == 0
    assert out["gib_per_s"] > 0 and out["p99_us"] >= out["p50_us"] > 0


def test_bench_engine_option(file_target):
    res = CliRunner().invoke(cli, ["bench", file_target(4 << 20), "--engine", "threads",
                                   "--seconds", "0.1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["engine"] == "threads"


def test_bench_creates_file_with_size(tmp_path):
    path = tmp_path / "new.img"
    res = CliRunner().invoke(cli, ["bench", str(path), "--workload", "write", "--size", "8M",
                                   "--seconds", "0.1", "--json"])
    assert res.exit_code == 0, res.output
    assert os.path.getsize(path) == 8 << 20


def test_bench_missing_target_exit_code(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvblock", "bench",
                          str(tmp_path / "missing.img"), "--seconds", "0.1"],
                         capture_output=True, text=True)
    assert res.returncode == 3
    assert res.stderr.startswith("kvblock: error: ") and "no such device" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_bench_unaligned_bs(file_target):
    res = CliRunner().invoke(cli, ["bench", file_target(1 << 20), "--bs", "1000",
                                   "--seconds", "0.1"])
    assert res.exit_code == 8
    assert "not a multiple of" in res.output


def test_bad_size_argument(file_target):
    res = CliRunner().invoke(cli, ["bench", file_target(1 << 20), "--bs", "lots"])
    assert res.exit_code == 2 and "is not a size" in res.output
