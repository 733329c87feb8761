"""README.md's Python examples, run as written.

The first thing a new user copies is the "Using the store" example; a
rename or a changed signature must fail here, not in their shell.  The
examples run in a fresh directory (they create ``kv.img`` there).
"""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def python_block_after(heading: str) -> str:
    """The first ```python block after ``heading`` in README.md."""
    start = README.index(heading)
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(README, start)
    assert match, f"no python example after {heading!r} in README.md"
    return match.group(1)


def test_using_the_store_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(python_block_after("## Using the store"), "README.md", "exec"), scope)
    assert (tmp_path / "kv.img").stat().st_size == 1 << 30
    assert scope["n"] == len(scope["keys"]) == 10     # the comment's "longest stored prefix: 10"


def test_engine_report_example_answers_as_its_comment_says():
    block = python_block_after("## I/O engines")
    scope: dict = {}
    exec(compile(block.replace("kvblock.engine_report()", "report = kvblock.engine_report()"),
                 "README.md", "exec"), scope)
    shown = eval(re.search(r"# (\{.*\})", block).group(1))   # the dict in the comment
    assert set(scope["report"]) >= set(shown)
    assert scope["report"]["engine"] in ("uring", "threads")


def test_exit_code_list_matches_the_cli():
    """README's "Exit codes:" sentence names each code kvblock/cli/main.py uses."""
    from kvblock.cli.main import _OS_EXIT, EXIT_CODES, EXIT_INTERRUPTED

    text = README[README.index("Exit codes: "):]
    text = text[:text.index("\n\n")]
    listed = {int(n) for n in re.findall(r"(\d+) [a-zA-Z]", text)}
    used = {code for _, code in EXIT_CODES} | set(_OS_EXIT.values()) | {2, EXIT_INTERRUPTED}
    assert listed == used


def test_command_table_options_exist():
    """Each option the README's `kvblock` command table shows is one the command takes."""
    from kvblock.cli.main import cli

    rows = re.findall(r"^\| `kvblock (\w+) ([^`]*)` \|", README, re.MULTILINE)
    assert len(rows) >= 9
    for name, usage in rows:
        cmd = cli.commands[name]
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        for opt in re.findall(r"--[a-z][a-z-]*", usage):
            assert opt in opts, f"README shows kvblock {name} {opt}, which it does not take"


def test_every_environment_variable_kvblock_reads_is_in_the_readme():
    """Each KVBLOCK_* setting the package reads (os.environ) is named in
    README.md, and each the README names is read somewhere (the package,
    the tests, perf/ or the Makefile): a user cannot set what is not there,
    and a setting nobody reads any more would be set in vain."""
    root = Path(__file__).resolve().parents[1]
    read = set()
    for path in (root / "kvblock").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get)?[(\[]\s*\"(KVBLOCK_\w+)\"", path.read_text()))
        read |= set(re.findall(r"_SETTING = \"(KVBLOCK_\w+)\"", path.read_text()))
    assert {"KVBLOCK_IO_ENGINE", "KVBLOCK_MAPPED_READS"} <= read
    documented = set(re.findall(r"KVBLOCK_[A-Z_]+[A-Z]", README))
    assert read - documented == set(), "read by kvblock/, not in README.md"
    elsewhere = "".join(p.read_text() for d in ("kvblock", "tests", "perf")
                        for p in (root / d).rglob("*.py") if p.name != Path(__file__).name)
    elsewhere += (root / "Makefile").read_text()
    assert {v for v in documented if v not in elsewhere} == set(), \
        "named in README.md, read nowhere"


def test_every_knob_the_tests_and_benchmarks_read_is_in_the_readme():
    """The suite's own KVBLOCK_* settings (longer hunts: more examples, more
    kill rounds) are named in README.md too, or nobody finds the knob:
    KVBLOCK_SERVE_KILL_ROUNDS, beside the documented KVBLOCK_KILL_ROUNDS,
    was not."""
    root = Path(__file__).resolve().parents[1]
    read = set()
    for d in ("tests", "perf"):
        for path in (root / d).rglob("*.py"):
            read |= set(re.findall(r"environ(?:\.get)?[(\[]\s*\"(KVBLOCK_\w+)\"",
                                   path.read_text()))
    assert {"KVBLOCK_KILL_ROUNDS", "KVBLOCK_MODEL_EXAMPLES"} <= read
    documented = set(re.findall(r"KVBLOCK_[A-Z_]+[A-Z]", README))
    assert read - documented == set(), "read by tests/ or perf/, not in README.md"


def test_stats_row_puts_interval_and_address_under_prometheus():
    """--interval and --address shape the --prometheus exporter alone
    (without it, kvblock stats refuses them: exit 2), but README's row showed
    no --interval and said the device gauges are "re-read every --interval",
    as if a plain `kvblock stats DEV --interval 1` refreshed."""
    from click.testing import CliRunner

    from kvblock.cli.main import cli

    row = re.search(r"^\| `kvblock stats ([^`]*)` \| ([^\n]*)", README, re.MULTILINE)
    usage, what = row.groups()
    exporter = usage[usage.index("[--prometheus"):]
    for opt in ("--interval", "--address"):
        assert opt in exporter, f"README's stats row shows {opt} outside --prometheus"
        res = CliRunner().invoke(cli, ["stats", "/nonexistent.img", opt, "1"])
        assert res.exit_code == 2 and "--prometheus" in res.output, res.output
    before = what[:what.index("Prometheus")]
    assert "--interval" not in before, "the row ties --interval to the one-shot read"


def test_tensors_layouts_sentence_names_only_layouts_sglang_host_layout_takes():
    """The "KV tensors" section lists the layouts kvblock.tensors pages
    (save_blocks / load_blocks, the transfer model test's "every layout
    above").  It named `page_unified` among SGLangHostLayout's pools, which
    SGLangHostLayout refuses (ConfigError): only the SGLang backend serves
    such a pool, as a page_first_direct view of it."""
    from kvblock.tensors import SGLangHostLayout

    text = README[README.index("\nLayouts: vLLM"):]
    text = text[:text.index("Hugging Face")]
    named = re.findall(r"`(\w+)`", text[text.index("SGLang host"):])
    assert {"layer_first", "page_first", "page_first_direct"} <= set(named)
    assert set(named) <= set(SGLangHostLayout.LAYOUTS), \
        f"README names {sorted(set(named) - set(SGLangHostLayout.LAYOUTS))} as " \
        "kvblock.tensors SGLang layouts; SGLangHostLayout takes " \
        f"{SGLangHostLayout.LAYOUTS}"


def test_readme_says_what_a_put_of_keys_all_stored_does(tmp_path):
    """README said a key stored again names the newest copy, with no
    exception: but a run whose keys the store holds all already is a
    duplicate, written by none (stats()["put_duplicate_runs"]), and its
    keys keep naming the stored copy, whatever bytes the second put
    carried.  The user who stores other KV under the same keys (a weight
    update without a clear()) must read that in the README."""
    import numpy as np

    from kvblock import Geometry, KVStore, chain_keys, create_file

    geom = Geometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16", block_tokens=16)
    path = str(tmp_path / "kv.img")
    create_file(path, 64 << 20)
    keys = chain_keys(list(range(32)), geom.block_tokens)
    first = np.full(len(keys) * geom.block_bytes, 1, np.uint8)
    with KVStore.format([path], geom) as store:
        assert store.put_run(keys, first) == len(keys)
        assert store.put_run(keys, np.full_like(first, 2)) == len(keys)
        out = np.empty_like(first)
        assert store.get_run(keys, out) == len(keys)
        assert np.array_equal(out, first)              # the stored copy, not the second put's
        assert store.stats()["put_duplicate_runs"] == 1
    bullet = README[README.index("- A key stored again"):]
    bullet = bullet[:bullet.index("\n- ")]
    assert "put_duplicate_runs" in bullet, \
        "README's bullet on keys stored again says nothing of a put of keys all stored"


def test_every_error_the_errors_section_names_imports_from_where_it_says():
    """The Errors section names ~20 classes; only KVBlockError is in the
    top-level package, so `from kvblock import StoreFullError` failed with
    nothing in README to say where they are: each one named plainly must
    be in kvblock.errors, one named with its module importable from there."""
    import builtins
    import importlib

    import kvblock.errors

    section = README[README.index("## Errors"):README.index("## Benchmarks")]
    assert "`kvblock.errors`" in section
    names = re.findall(r"`((?:[a-z_]+\.)*[A-Z]\w*Error)`", section)
    assert len(names) >= 20
    for name in names:
        module, _, cls = name.rpartition(".")
        if not module and hasattr(builtins, cls):      # OSError, TimeoutError, ...
            continue
        where = importlib.import_module(module) if module else kvblock.errors
        assert isinstance(getattr(where, cls, None), type), f"{name} not in {where.__name__}"
        assert issubclass(getattr(where, cls), kvblock.KVBlockError), name


def test_the_errors_section_names_every_error_class_kvblock_errors_defines():
    """The Errors section is the list a caller writes excepts from: classes
    kvblock.errors defines that it did not name (ConfigError, the bad
    argument; AlignmentError; EngineUnavailableError; UnsafeTargetError,
    the format refused; InternalError...) could only be found in the code."""
    import kvblock.errors

    section = README[README.index("## Errors"):README.index("## Benchmarks")]
    named = set(re.findall(r"`(?:[a-z_]+\.)*(\w+Error)`", section))
    defined = {name for name, cls in vars(kvblock.errors).items()
               if isinstance(cls, type) and issubclass(cls, kvblock.errors.KVBlockError)}
    assert defined - named == set()


def test_metrics_table_names_every_metric_kvblock_exports(tmp_path):
    """README's metrics table lists each gauge and counter kvblock exports
    (an in-process store with a DRAM tier, and ``kvblock stats --socket
    --prometheus`` of a store server: its own numbers; the vLLM tier's are
    these under vLLM's prefix, and its store_failures), each as its kind,
    and nothing else.  Operators had no list: half the counters
    (superseded_runs, cleared_puts, journal_bytes, the server's
    connections_total...) were named nowhere."""
    from kvblock import KVStore
    from kvblock.cli.admin import _server_stats
    from kvblock.metrics import StoreCollector
    from kvblock.store.server import serve_in_background
    from kvblock.store.store import COUNTERS
    from tests.store.workload import small_store

    section = README[README.index("### Metrics"):]
    section = section[:section.index("\n## ")]
    rows = re.findall(r"^\| `(\w+)` \| (gauge|counter) \|", section, re.MULTILINE)
    documented = dict(rows)
    assert len(documented) == len(rows), "a metric listed twice"

    exported = {"store_failures": "counter"}   # the vLLM tier's own (vllm_metrics.py)

    def add(collector):
        for family in collector.collect():
            # (a counter named ..._total is exported as one family without it)
            name = family.name.removeprefix("kvblock_store_")
            if family.type == "counter" and name + "_total" in documented:
                name += "_total"
            exported[name] = family.type

    path = small_store(tmp_path / "kv.img")
    with KVStore.open([path], host_cache_bytes=1 << 20) as store:
        add(StoreCollector(store))
    with serve_in_background([path], str(tmp_path / "kv.sock")):
        add(StoreCollector(lambda: _server_stats(str(tmp_path / "kv.sock"))))
    assert documented == exported
    assert {n for n, kind in documented.items() if kind == "counter"} >= set(COUNTERS)


def test_kv_tensors_example_runs_with_its_names_filled_in(tmp_path):
    """The "KV tensors" example names what an engine has (its caches, page
    ids, rank); given those, it runs as written: save from the whole cache,
    a rank's layer-wise load of its heads, wait_layer, then wait's count."""
    import torch
    from kvblock import Geometry, KVStore, create_file

    L, H, D, BS, T, r = 3, 4, 16, 16, 2, 1
    create_file(tmp_path / "kv.img", 16 << 20)
    g = Geometry(L, H, D, "bfloat16", BS, 2, T)     # two head groups: a rank's heads
    kv_caches = [torch.randn(2, 6, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    rank_caches = [torch.zeros(2, 6, BS, H // T, D, dtype=torch.bfloat16) for _ in range(L)]
    keys, block_ids = [b"p0", b"p1", b"p2"], [4, 0, 2]
    with KVStore.format([str(tmp_path / "kv.img")], g, region_size=1 << 20) as store:
        scope = dict(store=store, keys=keys, kv_caches=kv_caches, rank_caches=rank_caches,
                     block_ids=block_ids, r=r, T=T)
        exec(compile(python_block_after("## KV tensors"), "README.md", "exec"), scope)
        assert scope["n"] == len(keys)
    heads = slice(r * H // T, (r + 1) * H // T)
    for src, dst in zip(kv_caches, rank_caches):
        assert torch.equal(dst[:, block_ids].view(torch.int16),
                           src[:, block_ids, :, heads].view(torch.int16))


def test_several_processes_example_runs_against_a_store_server(tmp_path):
    """The "Several processes, one store" example: connect() to a server on
    the socket, the byte API and save_blocks through it, bytes read back."""
    import torch
    import numpy as np

    from kvblock import Geometry, KVStore, create_file
    from kvblock.store.server import serve_in_background

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    create_file(dev, 16 << 20)
    g = Geometry(2, 2, 16, "bfloat16", 16)
    KVStore.format([dev], g, region_size=1 << 20).close()
    block = python_block_after("## Several processes, one store")
    block = block.replace("/run/kvblock/kv.sock", sock).replace("/dev/nvme1n1", dev)
    keys, caches_keys = [b"k0", b"k1"], [b"c0", b"c1"]
    kv = np.random.default_rng(0).integers(0, 256, 2 * g.block_bytes, np.uint8)
    out = np.zeros_like(kv)
    caches = [torch.randn(2, 4, 16, 2, 16).to(torch.bfloat16) for _ in range(2)]
    with serve_in_background([dev], sock):
        scope = dict(keys=keys, kv=kv, out=out, caches=caches, block_ids=[3, 1])
        # the example's save_blocks stores the caches' pages under other keys
        block = block.replace("save_blocks(store, keys,", "save_blocks(store, caches_keys,")
        scope["caches_keys"] = caches_keys
        exec(compile(block, "README.md", "exec"), scope)
        store = scope["store"]
        try:
            assert np.array_equal(out, kv)
            assert store.lookup(caches_keys) == 2
        finally:
            store.close()


def test_shell_examples_use_only_options_their_commands_take():
    """Each `kvblock CMD --opt` line of README's ```sh blocks, and each
    perf script run with options there or inline (`perf/x.py --opt`),
    names options that command or script takes: the command table is
    checked above, the worked examples and benchmark lines were not."""
    from kvblock.cli.main import cli

    perf = Path(__file__).resolve().parents[1] / "perf"
    blocks = re.findall(r"```sh\n(.*?)```", README, re.DOTALL)
    lines = [line.split("#")[0] for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    checked = 0
    for line in lines:
        m = re.search(r"(?:^|\s|/)kvblock (\w+) (.*)", line)
        if m and m.group(1) in cli.commands:
            opts = {o for p in cli.commands[m.group(1)].params for o in p.opts}
            for opt in re.findall(r"(?<!\S)(--[a-z][\w-]*)", m.group(2)):
                assert opt in opts, f"README runs kvblock {m.group(1)} {opt}: no such option"
                checked += 1
    runs = [m for line in lines for m in re.findall(r"perf/(\w+)\.py ([^#\n]*)", line)]
    runs += re.findall(r"`(?:\.venv/bin/python )?perf/(\w+)\.py ([^`]*)`", README)
    for script, args in runs:
        source = (perf / f"{script}.py").read_text() + (perf / "fio_support.py").read_text()
        for opt in re.findall(r"(?<!\S)\[?(--[a-z][\w-]*)", args):
            assert f'"{opt}"' in source, f"README runs perf/{script}.py {opt}: no such option"
            checked += 1
    assert checked >= 20


def test_readme_says_what_make_installs_as_the_makefile_does():
    """The opening paragraph lists what `make demo` / `make test` install:
    the Makefile's Debian packages, its torch pin and its engine wheels
    (vLLM, SGLang, LMCache: installed by both, and named nowhere there)."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    opening = README[:README.index("`make demo` runs")]
    apt = re.search(r"^APT_PKGS := (.*)$", makefile, re.MULTILINE).group(1).split()
    torch_pin = re.search(r"^TORCH\s*:= (\S+)$", makefile, re.MULTILINE).group(1)
    engines = re.search(r"^ENGINES := (.*)$", makefile, re.MULTILINE).group(1).split()
    assert f"`{' '.join(apt)}`" in opening
    for pin in [torch_pin, *engines]:
        assert pin in opening, f"README's opening does not say make installs {pin}"


def test_readme_speaks_of_dates_not_of_the_writers_work_sessions():
    """Measurements are dated (and name their script); "this stop",
    "this session's code" or "today" meant something only to whoever
    wrote them, not to a reader of the README."""
    jargon = re.findall(r"\b(?:(?:this|last|that) stop|(?:this|second|one|same) session|"
                        r"today|this day)\b", README, re.IGNORECASE)
    assert jargon == []
