"""kvblock report: a pytest-benchmark JSON becomes a markdown table and PNGs."""

import json
import os

from click.testing import CliRunner

from kvblock.cli.main import cli

BENCH = {
    "datetime": "2026-11-30T00:00:00", "machine_info": {"node": "ci", "cpu": {"brand_raw": "x"}},
    "benchmarks": [
        {"group": "raw-io", "name": "test_raw[read-1M]", "stats": {"median": 0.5},
         "extra_info": {"ratio": 1.2, "reference": "fio", "bs": 1048576, "points": [
             {"figure": "Seq read vs I/O size", "series": "kvblock", "x": 1024, "y": 2.0,
              "xlabel": "KiB", "ylabel": "GiB/s"},
             {"figure": "Seq read vs I/O size", "series": "fio", "x": 1024, "y": 1.7}]}},
        {"group": "raw-io", "name": "test_raw[read-64K]", "stats": {"median": 0.7},
         "extra_info": {"ratio": 1.1, "reference": "fio", "points": [
             {"figure": "Seq read vs I/O size", "series": "kvblock", "x": 64, "y": 1.5},
             {"figure": "Seq read vs I/O size", "series": "fio", "x": 64, "y": 1.3}]}},
    ]}


def test_report_table_and_plots(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    out = tmp_path / "plots"
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(out), "--markdown",
                                   str(tmp_path / "r.md")])
    assert res.exit_code == 0, res.output
    assert "| raw-io | test_raw[read-1M] | 0.5 | 1.2 | fio | bs=1048576 |" in res.output
    png = out / "seq-read-vs-i-o-size.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # links are relative to the markdown file's folder
    assert "![seq-read-vs-i-o-size](plots/seq-read-vs-i-o-size.png)" in (tmp_path / "r.md").read_text()


def test_report_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.splitlines()[0])
    assert "| raw-io | test_raw[read-1M] |" in out["markdown"]
    assert [os.path.basename(p) for p in out["plots"]] == ["seq-read-vs-i-o-size.png"]


def test_report_bad_input(tmp_path):
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "missing.json")])
    assert res.exit_code == 8 and "no such file" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = CliRunner().invoke(cli, ["report", str(bad)])
    assert res.exit_code == 8 and "not a pytest-benchmark JSON" in res.output
    # shapes that used to end in a traceback (KeyError, AttributeError)
    for data in ({"benchmarks": "x"}, {"benchmarks": [{"name": "x"}]},
                 {"benchmarks": [{"name": "x", "stats": {"median": 1.0},
                                  "extra_info": {"points": [{"x": 1, "y": 2}]}}]},
                 # one point not in a list: passed the check, then a TypeError
                 {"benchmarks": [{"name": "x", "stats": {"median": 1.0},
                                  "extra_info": {"points": {"figure": "f", "series": "s",
                                                            "x": 1, "y": 2}}}]}):
        bad.write_text(json.dumps(data))
        res = CliRunner().invoke(cli, ["report", str(bad)])
        assert res.exit_code == 8 and "kvblock: error:" in res.output, res.output


def test_a_device_given_for_the_json_is_refused_not_read_without_end():
    """`kvblock report /dev/zero` read the endless device into memory."""
    res = CliRunner().invoke(cli, ["report", "/dev/zero"])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith("kvblock: error: BENCH_JSON /dev/zero: a device"), res.output


def test_a_file_that_is_not_text_is_a_clear_error_not_a_traceback(tmp_path):
    """A binary file (a PNG given for the JSON) is no JSON: exit 8, one line."""
    bad = tmp_path / "plot.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    res = CliRunner().invoke(cli, ["report", str(bad), "--out", str(tmp_path / "p")])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith("kvblock: error: ") and "not JSON" in res.output, res.output
    assert not (tmp_path / "p").exists()


def test_plots_without_matplotlib_are_a_clear_error_naming_the_extra(tmp_path, monkeypatch):
    """matplotlib is the report extra: without it, plotting ended in a
    ModuleNotFoundError traceback instead of saying what to install."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)    # as if not installed
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "p")])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith("kvblock: error: ") and "kvblock[report]" in res.output


def test_figures_whose_names_slug_alike_get_a_plot_each(tmp_path):
    """"Read GiB/s" and "read (GiB/s)" both slug to read-gib-s: the second
    plot was written over the first, and the markdown linked that one file
    twice, so a figure was lost without a word."""
    data = {"benchmarks": [{"name": "a", "stats": {"median": 1.0}, "extra_info": {"points": [
        {"figure": "Read GiB/s", "series": "kvblock", "x": 1, "y": 2},
        {"figure": "read (GiB/s)", "series": "fio", "x": 1, "y": 3},
        {"figure": "???", "series": "fio", "x": 1, "y": 3}]}}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    plots = json.loads(res.output.splitlines()[0])["plots"]
    assert len(plots) == 3 and len(set(plots)) == 3, plots
    assert all(os.path.isfile(p) and not os.path.basename(p).startswith(".") for p in plots)
    assert sorted(os.listdir(tmp_path / "p")) == sorted(os.path.basename(p) for p in plots)


def test_points_whose_x_or_y_values_cannot_be_plotted_are_a_clear_error(tmp_path):
    """A figure whose x values mix numbers with strings or null (or whose y
    is no number) ended in a TypeError traceback from sorted(); it is a
    one-line error naming the benchmark, the figure and the values.  Series
    named by a number and a string, and a figure of string x values only
    (categories), crashed in plot() too; they are plotted."""
    def bench(*points):
        return {"benchmarks": [{"name": "b", "stats": {"median": 1.0}, "extra_info": {
            "points": [{"figure": "f", "series": s, "x": x, "y": y} for s, x, y in points]}}]}

    path = tmp_path / "bench.json"
    for data, says in ((bench(("s", 1, 2.0), ("s", "64K", 3.0)), "mix numbers and strings"),
                       (bench(("s", 1, 2.0), ("fio", "64K", 3.0)), "mix numbers and strings"),
                       (bench(("s", 1, 2.0), ("s", None, 3.0)), "x must be a number or a string"),
                       (bench(("s", 1, 2.0), ("s", 1, None)), "y must be a number"),
                       (bench(("s", 1, 2.0), ("s", 2, "fast")), "y must be a number"),
                       (bench((4, 1, 2.0), ("fio", 2, 3.0)), None)):
        path.write_text(json.dumps(data))
        res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "p"),
                                       "--json"])
        if says is None:             # series named by a number and by a string: both plotted
            assert res.exit_code == 0, res.output
            continue
        assert res.exit_code == 8, res.output
        assert res.output.startswith("kvblock: error:") and says in res.output, res.output
        assert "benchmark b" in res.output and "figure 'f'" in res.output, res.output
    # all strings (categories) keep working
    path.write_text(json.dumps(bench(("s", "64K", 2.0), ("s", "1M", 3.0))))
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output


def test_a_machine_info_that_is_no_object_is_a_clear_error_not_a_traceback(tmp_path):
    """machine_info (or its cpu) of another shape than pytest-benchmark's
    object passed the checks, then the table's header ended in an
    AttributeError traceback ('NoneType' object has no attribute 'get')."""
    bad = tmp_path / "bench.json"
    for machine in (None, "ci", [1], {"cpu": "x86_64"}, {"cpu": None}):
        bad.write_text(json.dumps({**BENCH, "machine_info": machine}))
        res = CliRunner().invoke(cli, ["report", str(bad), "--out", str(tmp_path / "p")])
        assert res.exit_code == 8, (machine, res.output, res.exception)
        assert res.output.startswith("kvblock: error: ") and "machine_info" in res.output, \
            res.output


def test_paths_that_cannot_be_read_or_written_are_bad_arguments_naming_the_option(tmp_path):
    """A folder given for the JSON, a file for --out and a folder for
    --markdown came out as bare OSErrors ("Is a directory", "File exists"):
    exit 1, or 3 (device not found) for a --out under a path that cannot be
    made, and no word of which argument was wrong.  They are bad arguments
    (exit 8, as a JSON file that is missing), each naming its option."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    res = CliRunner().invoke(cli, ["report", str(tmp_path), "--out", str(tmp_path / "p")])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith(f"kvblock: error: BENCH_JSON {tmp_path}: ") and \
        "directory" in res.output
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(path)])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith("kvblock: error: ") and "--out" in res.output, res.output
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(path / "under")])
    assert res.exit_code == 8 and "--out" in res.output, (res.output, res.exception)
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "p"),
                                   "--markdown", str(tmp_path)])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith("kvblock: error: ") and "--markdown" in res.output, res.output


def test_plots_that_cannot_be_written_are_a_bad_out_folder_not_a_bare_oserror(tmp_path,
                                                                              monkeypatch):
    """An --out folder the plots cannot be written in (a folder in the
    place of a plot, a read-only filesystem) ended in matplotlib's bare
    OSError: exit 1 (17, a read-only store, for EROFS) and no word of --out.
    It is a bad --out (exit 8) naming the path and the fix, as a folder
    that cannot be made is."""
    import errno

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    out = tmp_path / "p"
    (out / "seq-read-vs-i-o-size.png").mkdir(parents=True)     # a folder where the plot goes
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(out)])
    assert res.exit_code == 8, (res.output, res.exception)
    assert res.output.startswith(f"kvblock: error: --out {out}: ") and \
        "seq-read-vs-i-o-size.png" in res.output and "writable folder" in res.output, res.output
    import matplotlib.figure

    def refused(self, fname, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(fname))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refused)
    res = CliRunner().invoke(cli, ["report", str(path), "--out", str(tmp_path / "q")])
    assert res.exit_code == 8, (res.output, res.exception)
    assert f"--out {tmp_path / 'q'}: " in res.output and "read-only file system" in res.output


def test_a_bench_json_that_cannot_be_used_is_named_as_the_bench_json(tmp_path):
    """load()'s errors named a path only ("x.json: not JSON (...)"), with
    no word of which argument it was, and "not JSON" with no fix: they name
    BENCH_JSON, as --out and --markdown name theirs, and say what to give."""
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "missing.json")])
    assert res.exit_code == 8
    assert res.output.startswith(f"kvblock: error: BENCH_JSON {tmp_path / 'missing.json'}: "
                                 "no such file"), res.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(cli, ["report", str(bad)])
    assert res.exit_code == 8
    assert res.output.startswith(f"kvblock: error: BENCH_JSON {bad}: not JSON"), res.output
    assert "--benchmark-json" in res.output, res.output
    bad.write_text("{}")
    res = CliRunner().invoke(cli, ["report", str(bad)])
    assert res.exit_code == 8 and res.output.startswith(f"kvblock: error: BENCH_JSON {bad}: ")
