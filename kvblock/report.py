"""``kvblock report BENCH.json``: pytest-benchmark JSON -> a markdown table and
PNG plots.

Every benchmark's ``extra_info`` may carry:
- ``ratio`` and ``reference`` (what it was compared with, e.g. fio), shown in
  the table;
- ``points``: a list of ``{"figure", "series", "x", "y", "xlabel", "ylabel"}``;
  points sharing a figure become one PNG with one line per series (kvblock vs
  fio, restore vs recompute, one line per eviction policy...).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from kvblock.errors import ConfigError


def load(path: str | Path) -> dict:
    # Errors name the argument (kvblock report BENCH_JSON), as --out's and
    # --markdown's name theirs.
    where = f"BENCH_JSON {path}"
    # a device (/dev/zero, a disk given by mistake) would be read without end
    if Path(path).is_char_device() or Path(path).is_block_device():
        raise ConfigError(f"{where}: a device, not a pytest-benchmark JSON file; write one "
                          "with `pytest perf/ --benchmark-only --benchmark-json BENCH.json`")
    try:
        # bytes: JSON's own encodings, whatever the locale's
        data = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; write one with "
                          "`pytest perf/ --benchmark-only --benchmark-json BENCH.json`") from None
    except ValueError as e:    # bad JSON, or bytes no text (UnicodeDecodeError)
        raise ConfigError(f"{where}: not JSON ({e}); give the pytest-benchmark JSON file "
                          "(--benchmark-json BENCH.json)") from None
    except OSError as e:       # a folder, a file this user may not read
        raise ConfigError(f"{where}: cannot read it ({(e.strerror or str(e)).lower()}); give "
                          "the pytest-benchmark JSON file (--benchmark-json BENCH.json)") \
            from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ConfigError(f"{where}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    # the table's header reads machine_info.node and .cpu.brand_raw
    machine = data.get("machine_info", {})
    if not isinstance(machine, dict) or not isinstance(machine.get("cpu", {}), dict):
        raise ConfigError(f"{where}: machine_info (and its cpu) must be objects, as "
                          "pytest-benchmark writes them; not a pytest-benchmark JSON file")
    for i, b in enumerate(data["benchmarks"]):
        b = b if isinstance(b, dict) else {}
        stats, info = b.get("stats"), b.get("extra_info") or {}
        if not isinstance(b.get("name"), str) or not isinstance(stats, dict) or \
                not isinstance(stats.get("median"), (int, float)) or not isinstance(info, dict):
            raise ConfigError(f"{where}: benchmark {i} has no name, stats.median or "
                              "extra_info dict; not a pytest-benchmark JSON file")
        points = info.get("points", [])
        if not isinstance(points, list):    # figures() iterates it as a list
            raise ConfigError(f"{where}: benchmark {b['name']}: points must be a list of "
                              f"points, got {type(points).__name__}")
        for p in points:
            if not isinstance(p, dict) or not {"figure", "series", "x", "y"} <= p.keys():
                raise ConfigError(f"{where}: benchmark {b['name']}: a point needs figure, "
                                  f"series, x and y, got {p!r}")
            at = f"{where}: benchmark {b['name']}, figure {p['figure']!r}"
            for field in ("figure", "series"):     # keys of figures() and plot labels
                if not isinstance(p[field], (str, int, float)) or isinstance(p[field], bool):
                    raise ConfigError(f"{at}: {field} must be a string or a number, "
                                      f"got {p[field]!r}")
            if _kind(p["x"]) is None:
                raise ConfigError(f"{at}: x must be a number or a string, got {p['x']!r}")
            if _kind(p["y"]) != "number":
                raise ConfigError(f"{at}: y must be a number, got {p['y']!r}")
    # one axis: plotted as numbers or as categories, not both
    kinds: dict = defaultdict(dict)
    for b in data["benchmarks"]:
        for p in (b.get("extra_info") or {}).get("points", []):
            kinds[p["figure"]].setdefault(_kind(p["x"]), (b["name"], p["x"]))
    for figure, seen in kinds.items():
        if len(seen) > 1:
            (nb, nx), (sb, sx) = seen["number"], seen["string"]
            raise ConfigError(f"{where}: benchmark {sb}, figure {figure!r}: its x values mix "
                              f"numbers and strings ({nx!r} in benchmark {nb}, {sx!r} in "
                              f"benchmark {sb}); give every point of a figure the same kind of x")
    return data


def _kind(v) -> str | None:
    """"number", "string" or None (what a point's x or y cannot be)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return "number"
    return "string" if isinstance(v, str) else None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(data: dict) -> str:
    rows = ["| group | benchmark | median s | ratio | reference | details |",
            "|---|---|---|---|---|---|"]
    for b in data["benchmarks"]:
        info = dict(b.get("extra_info") or {})
        info.pop("points", None)
        ratio = info.pop("ratio", "")
        ref = info.pop("reference", "")
        details = ", ".join(f"{k}={_fmt(v)}" for k, v in info.items()
                            if not isinstance(v, (list, dict)))
        rows.append(f"| {b.get('group') or ''} | {b['name']} | {b['stats']['median']:.4g} | "
                    f"{_fmt(ratio)} | {ref} | {details} |")
    machine = data.get("machine_info", {})
    head = (f"Benchmarks from {data.get('datetime', '?')} on {machine.get('node', '?')} "
            f"({machine.get('cpu', {}).get('brand_raw', machine.get('processor', '?'))}).\n\n")
    return head + "\n".join(rows) + "\n"


def figures(data: dict) -> dict:
    figs: dict = defaultdict(lambda: {"series": defaultdict(list), "xlabel": "", "ylabel": ""})
    for b in data["benchmarks"]:
        for p in (b.get("extra_info") or {}).get("points", []):
            f = figs[p["figure"]]
            f["series"][p["series"]].append((p["x"], p["y"]))
            f["xlabel"] = p.get("xlabel", f["xlabel"])
            f["ylabel"] = p.get("ylabel", f["ylabel"])
    return figs


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:80]


def plot(figs: dict, outdir: Path, dpi: int = 80) -> list[Path]:
    try:
        import matplotlib
    except ImportError as e:   # matplotlib is the report extra
        raise ConfigError(f"plotting needs matplotlib ({e}); pip install 'kvblock[report]'") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {outdir}: cannot make the folder for the plots "
                          f"({(e.strerror or str(e)).lower()}); give a folder, or a path "
                          "where one can be made") from None
    written, used = [], set()
    for name, f in figs.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for series, pts in sorted(f["series"].items(), key=lambda kv: str(kv[0])):
            pts = sorted(pts)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=series)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(f["xlabel"])
        ax.set_ylabel(f["ylabel"])
        xs = [x for pts in f["series"].values() for x, _ in pts]
        if xs and _kind(xs[0]) == "number" and min(xs) > 0 and max(xs) / min(xs) >= 16:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        # one file per figure: names that slug alike ("Read GiB/s", "read
        # (GiB/s)") or to nothing ("???") get a number, not one another's file
        base = slug(str(name)) or "figure"
        stem, n = base, 1
        while stem in used:
            n += 1
            stem = f"{base}-{n}"
        used.add(stem)
        path = outdir / f"{stem}.png"
        try:
            fig.savefig(path, dpi=dpi)
        except OSError as e:
            # (a folder in the plot's place, a read-only filesystem, no space):
            # matplotlib's bare OSError named no option, and EROFS read as a
            # read-only store (exit 17)
            raise ConfigError(f"--out {outdir}: cannot write the plot {path} "
                              f"({(e.strerror or str(e)).lower()}); give a writable folder "
                              "(--out DIR)") from None
        finally:
            plt.close(fig)
        written.append(path)
    return written


def report(path: str, outdir: str | Path = "docs/bench",
           relative_to: str | Path | None = None) -> tuple[str, list[Path]]:
    """(markdown, PNG paths).  Image links are relative to ``relative_to`` (the
    folder the markdown is written to), else as given."""
    import os

    data = load(path)
    outdir = Path(outdir)
    pngs = plot(figures(data), outdir)
    md = table(data)
    if pngs:
        base = Path(relative_to) if relative_to is not None else None
        links = [Path(os.path.relpath(p, base)) if base is not None else p for p in pngs]
        md += "\n" + "\n".join(f"![{p.stem}]({link.as_posix()})"
                                for p, link in zip(pngs, links)) + "\n"
    return md, pngs
