"""Admin subcommands for stores on raw devices: format, info, ls, fsck, stats,
evict, trim.  Safe by default: format refuses anything that holds data."""

from __future__ import annotations

import math
import os
import sys
import threading
import time

import click

from kvblock.cli.main import SIZE, _emit, cli
from kvblock.cli.units import FiniteFloatRange
from kvblock.errors import ConfigError, DeviceBusyError, KVBlockError, UnsafeTargetError

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _store(devices, readonly=True, model=None):
    from kvblock.errors import NotAStoreError
    from kvblock.store import KVStore

    try:
        return KVStore.open(list(devices), readonly=readonly, model=model)
    except NotAStoreError as e:
        raise _not_a_store(e) from None


def _not_a_store(e):
    """``e`` (no kvblock superblock on a device) saying what the device holds
    instead, when blkid finds a filesystem, partition table or RAID member
    there: "not formatted" would read as an empty device; for a device
    blkid finds nothing on, with the fix."""
    from kvblock.devices.probe import describe, signatures
    from kvblock.errors import NotAStoreError

    if e.path is None or "no kvblock superblock" not in str(e):
        return e
    try:
        found = signatures(e.path)
    except KVBlockError:
        return e
    if not found:
        # blank (or holding what blkid knows no name for): the fix too
        return NotAStoreError(f"{e}; give the store's device, or format this one (kvblock "
                              f"format {e.path} --layers L ...)", e.path, e.offset)
    return NotAStoreError(f"{e.path}: not a kvblock store: it holds {describe(found)}; give "
                          "the store's device, or format another one", e.path, e.offset)


def _claim(devices, writable: bool) -> list:
    """DEVICES opened exclusively (O_EXCL / flock, as a store that writes
    them), read-only unless ``writable``: a store in use is refused
    (DeviceBusyError), and none can open it while they are held."""
    from kvblock.devices import Device, check_distinct

    check_distinct(devices)
    opened = []
    try:
        for path in devices:
            opened.append(Device(path, writable=writable))
    except BaseException:
        for d in opened:
            d.close()
        raise
    return opened


def _held_by_kernel(e: DeviceBusyError) -> bool:
    """Is ``e``'s device one the kernel holds (mounted, or under a dm/md
    device; a file under such a loop device too, as Device found it)?  Its
    own advice, "unmount it", is the fix then: no store server or program
    is there to stop."""
    import stat

    from kvblock.devices.device import _claimed_by_kernel

    if getattr(e, "kernel_held", False):
        return True
    try:
        st = os.stat(e.path)
        return stat.S_ISBLK(st.st_mode) and _claimed_by_kernel(st.st_rdev)
    except (OSError, TypeError):
        return False


def _in_use(e: DeviceBusyError, why: str, command: str) -> DeviceBusyError:
    """``e`` (a device another process holds) with the fix for ``command``:
    the device's own ("open it read-only") is none for a command that needs
    the store to itself.  A mounted device keeps its own ("unmount it")."""
    if _held_by_kernel(e):
        return e
    return DeviceBusyError(
        f"{_without_advice(e)}; {why}: stop the store server (kvblock serve) or the "
        f"program that holds it, then run {command} again; kvblock info and stats read a "
        "store in use", e.path, e.errno)


# How the device layer's busy messages begin their advice (after "; "):
# "stop the other process[ or open it read-only]", "unmount it or stop the
# other user", "unmount it first (umount MOUNT POINTS)", "release it there
# first (...)" (kvblock.devices.device: Device, _busy).
_ADVICE = ("; stop the other process", "; unmount it", "; release it there first")


def _without_advice(e: DeviceBusyError) -> str:
    """``e``'s message without its advice: from the last place one of the
    device layer's advice begins (not the first "; ": the processes named
    before it, which have the device open, are joined with "; " too, and a
    command line may hold one; nor the last: a path named in or after the
    advice, a mount point to unmount or a stopping server's socket, may
    hold one).  A message with none of that advice is kept whole."""
    msg = str(e)
    cut = max(msg.rfind(advice) for advice in _ADVICE)
    return msg if cut < 0 else msg[:cut]


def _writer_busy(e: DeviceBusyError, why: str, command: str) -> DeviceBusyError:
    """``e`` for a command that writes the store: a store file's own fix,
    "open it read-only", is none for it (a block device's "unmount it" is)."""
    return _in_use(e, why, command) if "open it read-only" in str(e) else e


def _is_file(path) -> bool:
    import stat

    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _model_name(ctx, param, value):
    """--model: an empty name (``--model "$MODEL"`` with MODEL unset) is a
    model of its own, which every later open naming the real one refuses
    (exit 13): refused here instead."""
    if value is not None and not value.strip():
        raise click.BadParameter("is empty; name the model (e.g. meta-llama/Llama-3.1-8B@rev) "
                                 "or leave --model out")
    if value is not None:
        try:
            value.encode("utf-8")   # what the model fingerprint hashes
        except UnicodeEncodeError:
            # bytes of another locale (Latin-1) reach Python as surrogates
            raise click.BadParameter(f"{value!r} is not valid UTF-8; give the model's name "
                                     "in UTF-8, as the engines name it") from None
    return value


def _check_new_size(devices, geometry, region_size, size: int) -> None:
    """The store files ``format --size`` makes must hold the store: else a
    DeviceTooSmallError that names the --size asked and the least that does.
    (Devices that exist are taken as large enough: one that is not is
    refused by the format itself, by name.)"""
    from kvblock.devices.device import FILE_BLOCK_SIZE
    from kvblock.errors import DeviceTooSmallError
    from kvblock.store.planning import (
        MAX_SIZE, StandIn, least_size, no_store_holds, plan_for, plan_or_none)

    # (exists: a dangling symlink names a file to make, at its target, as
    # new_file makes it)
    new = [not os.path.exists(path) for path in devices]
    if not any(new):
        return
    # the new files at the size probed (a capacity of None), the others as
    # large as any
    devs = [StandIn(os.fspath(path), FILE_BLOCK_SIZE, None if made else MAX_SIZE)
            for path, made in zip(devices, new)]
    # (refused as too small, or as a journal too small: it follows the size too)
    if plan_or_none(devs, geometry, region_size, size=size) is not None:
        return
    high = least_size(devs, geometry, region_size)     # the least --size that holds the store
    if high is None:
        no_store = no_store_holds(geometry, [d.block_size for d in devs])
        if no_store is not None:
            raise no_store
        try:
            plan_for(devs, geometry, region_size, size=size)
        except (DeviceTooSmallError, ConfigError) as e:
            # none does, whatever the --size: the --region-size
            raise _region_refusal(e, geometry, region_size, FILE_BLOCK_SIZE) from None
        return
    least_region = _least_region(geometry, FILE_BLOCK_SIZE)
    regions = plan_or_none(devs, geometry, region_size, size=high)["region_size"]
    path = os.fspath(devices[new.index(True)])
    raise DeviceTooSmallError(
        f"{path}: --size {size} is too small for a store for {geometry.describe()}: "
        f"{'each new file' if sum(new) > 1 else 'the new file'} needs at least {high} bytes "
        f"(metadata and regions of {regions} bytes); give --size {high} or more"
        + (", or a smaller --region-size" if regions > least_region else ""), path)


def _region_refusal(refused, geometry, region_size, block: int) -> ConfigError:
    """The format's refusal, ``refused``, of a --region-size no size of the
    devices takes (the model being one a store holds): one not a multiple
    of the alignment or not holding a block (its own ConfigError), or too
    large for any device to hold two of (the DeviceTooSmallError of a
    device, whose "a larger device" none is)."""
    if isinstance(refused, ConfigError):
        return ConfigError(str(refused).replace("region_size", "--region-size", 1))
    least_region = _least_region(geometry, block)
    return ConfigError(f"--region-size {region_size} is too large for any device: a store "
                       "needs two regions (one on each of several devices) besides its "
                       f"metadata; give a smaller --region-size (the least is {least_region}), "
                       "or none (the default follows the devices' size)")


def _least_region(geometry, block: int) -> int:
    """The least region size a format takes for ``geometry`` over devices
    of ``block``-byte blocks: one block's run, in whole alignments."""
    from kvblock.layout.geometry import RunLayout, round_up

    alignment = max(4096, block)
    return round_up(RunLayout(geometry, 1, alignment).run_bytes, alignment)


def _check_plan(devs, geometry, region_size) -> None:
    """The store the format makes on the opened ``devs`` must fit them:
    refused here, before the prompt, in the command's terms.  The store's
    own refusal advises its arguments ("a smaller region_size", a too small
    "journal_bytes", which follows the store's size): settings this
    command does not take."""
    from kvblock.devices.device import said_size
    from kvblock.errors import DeviceTooSmallError
    from kvblock.store.planning import (
        StandIn, least_size, no_store_holds, plan_for, plan_or_none)

    try:
        plan_for(devs, geometry, region_size)
        return
    except (DeviceTooSmallError, ConfigError) as e:
        refused = e
    block = max(d.block_size for d in devs)
    no_store = no_store_holds(geometry, [d.block_size for d in devs])
    if no_store is not None:
        raise no_store from None

    # each device's least size
    least = least_size([StandIn(d.path, d.block_size) for d in devs], geometry, region_size)
    if least is None:
        raise _region_refusal(refused, geometry, region_size, block) from None
    larger = (f"use a larger device (at least {least} bytes)" if len(devs) == 1 else
              f"use larger devices ({least} bytes each holds the store)")
    if isinstance(refused, DeviceTooSmallError):
        head = str(refused).split("; use a larger device")[0]
        least_region = _least_region(geometry, block)
        smaller = (f", or a smaller --region-size (the least is {least_region})"
                   if plan_or_none(devs, geometry, least_region) is not None else "")
        raise DeviceTooSmallError(f"{head}; {larger}{smaller}", refused.path) from None
    # the journal (1/128 of the store's space) cannot hold a run's record
    short = min(devs, key=lambda d: d.capacity)
    raise DeviceTooSmallError(
        f"{short.path}: {said_size(short)} is too small for a store for "
        f"{geometry.describe()}: a run's journal record of one block needs a larger journal "
        "than a store of this size has (1/128 of its space); " + larger
        + ", or format for a smaller model (fewer --layers or --head-groups)",
        short.path) from None


@cli.command()
@click.argument("devices", nargs=-1, required=True)
@click.option("--layers", type=click.IntRange(1), required=True, help="Model layers.")
@click.option("--kv-heads", type=click.IntRange(1), required=True, help="KV heads per layer.")
@click.option("--head-dim", type=click.IntRange(1), required=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--block-tokens", type=click.IntRange(1), required=True, help="Tokens per block.")
@click.option("--head-groups", type=click.IntRange(1), default=1, show_default=True,
              help="Tensor-parallel degree the layout is cut for.")
@click.option("--kv-parts", type=click.IntRange(1, 2), default=2, show_default=True,
              help="2 for K and V, 1 for MLA latent.")
@click.option("--model", default=None, callback=_model_name,
              help="Model identity; the store refuses other models.")
@click.option("--region-size", type=SIZE, default=None, help="Allocation region size.")
@click.option("--size", type=SIZE, default=None,
              help="Create the store files that do not exist yet, of this size (space "
                   "reserved up front); existing files keep theirs.")
@click.option("--force", is_flag=True, help="Overwrite filesystems, partition tables or stores.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True)
def format(devices, layers, kv_heads, head_dim, dtype, block_tokens, head_groups, kv_parts,
           model, region_size, size, force, yes, as_json):
    """Format DEVICES as one kvblock store (ALL DATA ON THEM IS LOST).

    Refuses a device that is mounted or in use (--force or not; a loop
    device and its backing file count as one), and, unless --force, one that
    carries a filesystem, partition table or RAID/LVM signature, or already
    holds a kvblock store.  Block devices need --yes (or a confirmation at
    the prompt).
    With --size, missing DEVICES are created as store files; a format that
    fails removes the files it created.
    """
    from kvblock.devices import Device, check_distinct
    from kvblock.devices.device import new_file, remove_made
    from kvblock.layout import Geometry
    from kvblock.store import KVStore
    from kvblock.store.store import _store_on
    from kvblock.devices.probe import describe, how_to_free, signatures
    from kvblock.io import open_engine
    from kvblock.store.storeio import StoreIO

    geometry = Geometry(layers, kv_heads, head_dim, dtype, block_tokens, kv_parts, head_groups)
    opened, created = [], []
    try:
        if size is not None:
            # refused before a file is made, in the command's terms: the
            # store's own refusal named the size rounded down to whole blocks
            # (--size 100: "0 bytes"), or create_file's (--size 0)
            _check_new_size(devices, geometry, region_size, size)
            for path in devices:
                if not os.path.exists(path):       # (a dangling link's target too)
                    created.append(new_file(path, size))
        # After creating: a file to create named twice is then one device
        # given twice, not one busy with "another" store at its second open.
        check_distinct(devices)
        for path in devices:
            try:
                dev = Device(path, busy_timeout=0.2)  # O_EXCL: refuses mounted/in-use devices
            except DeviceBusyError as e:
                raise _writer_busy(e, "format overwrites the whole store", "format") from None
            opened.append(dev)
        if not force:
            io = StoreIO(opened, open_engine(opened))
            try:
                for i, dev in enumerate(opened):
                    found = signatures(dev.path)
                    if found:
                        raise UnsafeTargetError(
                            f"{dev.path} holds {describe(found)}; refusing to format it "
                            f"({how_to_free(found)} to overwrite)")
                    existing = _store_on(io, i)
                    if existing is not None:
                        raise UnsafeTargetError(f"{dev.path} already holds {existing}; pass "
                                                "--force to overwrite it")
            finally:
                io.engine.close()
        _check_plan(opened, geometry, region_size)
        total = sum(d.capacity for d in opened)
        plan = (f"format {len(opened)} device(s) ({', '.join(d.path for d in opened)}; "
                f"{_digits(total / 2**30, 2)} GiB) as a kvblock store for {geometry.describe()}"
                + (f", model {model!r}" if model else ""))
        if not as_json:
            click.echo(plan, err=True)
        smallest = min(d.capacity for d in opened)
        if smallest != max(d.capacity for d in opened):
            # regions are striped across the devices, so each holds as many
            # (sizes as plan says them: a few MiB is not "0.00 GiB")
            click.echo(f"kvblock: note: the devices differ in size; regions stripe across "
                       f"them, so the store uses about {_digits(smallest / 2**30, 2)} GiB of "
                       f"each ({_digits(len(opened) * smallest / 2**30, 2)} GiB in all)",
                       err=True)
        needs_yes = any(d.kind == "block" for d in opened)
        if needs_yes and not yes:
            if not sys.stdin.isatty():
                raise click.UsageError("formatting block devices needs --yes "
                                       "(no terminal to confirm on)")
            try:
                go = click.confirm("All data on these devices will be lost. Continue?",
                                   err=True)
            except click.Abort:                 # Ctrl-C or end of input at the prompt
                raise KeyboardInterrupt from None
            if not go:
                click.echo("kvblock: not formatted", err=True)
                sys.exit(1)
        store = KVStore.format(opened, geometry, model=model, region_size=region_size,
                               force=True)
        with store:
            info = _info(store)
        # close() wrote one more checkpoint: the generation the device holds
        info["checkpoint_generation"] = store._generation
        created = []                           # formatted: they stay
    finally:
        for d in opened:
            d.close()
        for made in created:                   # a format that failed leaves nothing behind
            remove_made(made)
    _emit(info, as_json, "kvblock store formatted")


def _reads(store) -> tuple[str, list[str]]:
    """How each device is read ("mapped" or the engine's name), and hints for
    devices a faster path exists for."""
    from kvblock.io.mapped import loop_advice

    engine, hints, ways = store.io.engine, [], []
    for i, d in enumerate(store.io.devices):
        # (info opens read-only: a store opened to write maps its writes too)
        ways.append(f"#{i} " + ("mapped (tmpfs file)" if engine.mapped(i) else
                                f"{engine.name}, direct I/O"))
        advice = loop_advice(d)
        if advice is not None:
            hints.append(f"{d.path} is {advice}")     # the words the store logs
    return ", ".join(ways), hints


# What a device's reported cache mode means for the store's commits (each
# flushes the data devices, then the journal's).
_CACHE_MODES = {
    "write back": "write back (volatile: every commit waits for it to flush)",
    "write through": "write through (flushes complete at once)",
    "": "none reported",
}


def _write_caches(store) -> str:
    """Each device's write cache as the kernel reports it (for a store file:
    its filesystem's device)."""
    return ", ".join(f"#{i} " + _CACHE_MODES.get(d.info.write_cache, d.info.write_cache)
                     for i, d in enumerate(store.io.devices))


def _info(store) -> dict:
    s = store.stats()
    sb = store.sb
    reads, hints = _reads(store)
    return {
        "uuid": s["uuid"], "format_version": sb.version,
        "devices": ", ".join(f"#{i} {d.path} ({d.info.kind}, {d.capacity} bytes)"
                             for i, d in enumerate(store.io.devices)),
        "reads": reads,
        "write_cache": _write_caches(store),
        **({"hint": "; ".join(hints)} if hints else {}),
        "geometry": store.geometry.describe(), "block_bytes": store.geometry.block_bytes,
        "model_fingerprint": sb.fingerprint.hex()[:16], "alignment": sb.alignment,
        "region_size": sb.region_size, "regions": s["regions"],
        "regions_free": s["regions_free"], "regions_sealed": s["regions_sealed"],
        "capacity_bytes": s["capacity_bytes"], "used_bytes": s["used_bytes"],
        "runs": s["runs"], "blocks": s["blocks"],
        "state": "clean" if store.clean_at_open else
                 f"dirty ({s['replayed_records']} journal records replayed)",
        "checkpoint_generation": s["checkpoint_generation"],
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sb.created_ns / 1e9)),
    }


@cli.command()
@click.argument("devices", nargs=-1, required=True)
@click.option("--model", default=None, callback=_model_name,
              help="Check the store serves this model.")
@click.option("--json", "as_json", is_flag=True)
def info(devices, model, as_json):
    """Superblock, geometry, devices, capacity, usage and clean/dirty state (read-only)."""
    with _store(devices, model=model) as store:
        _emit(_info(store), as_json, f"kvblock store {devices[0]}")


@cli.command()
@click.argument("devices", nargs=-1, required=True)
@click.option("--limit", type=click.IntRange(0), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def ls(devices, limit, as_json):
    """List runs: blocks (live: still served), bytes, where, age of their region, the
    first key each still serves (read-only).

    No hits or pins: they live in the process that holds the store (and are
    not written down), so a read of the devices would show every one as 0."""
    import json as _json

    now = time.time()
    rows = []
    with _store(devices) as store:
        runs = sorted(store.index.runs.values(), key=lambda r: r.run_id)
        for run in runs[:limit]:
            dev, off = store.regions.address(run.region, run.offset)
            sealed = int(store.regions.sealed_at[run.region])
            # blocks: the run's positions (its bytes on the device); live:
            # those whose key still points here (a newer run holds the rest)
            rows.append({"run": run.run_id, "blocks": run.nblocks, "live": run.live,
                         "bytes": store.layout(run.nblocks).run_bytes,
                         "device": store.io.devices[dev].path, "offset": off,
                         "region": run.region,
                         "age_s": round(now - sealed) if sealed else None,
                         # the first key it still serves: a checkpoint zeroes
                         # the positions a newer run took over
                         "first_key": next(iter(store.index.live_keys([run])), b"").hex()
                         or None})
        total = len(runs)
    if as_json:
        click.echo(_json.dumps({"runs": rows, "total_runs": total}))
        return
    from kvblock.cli.main import console
    from rich.table import Table

    table = Table(title=f"{total} run(s) in {devices[0]}" + (f" (first {limit})"
                                                              if total > limit else ""))
    for col in ("run", "blocks", "live", "bytes", "device", "offset", "region", "age_s",
                "first_key"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row[c]) if row[c] is not None else "-" for c in row))
    console().print(table)


@cli.command()
@click.argument("devices", nargs=-1, required=True)
@click.option("--repair", is_flag=True, help="Drop what is inconsistent; rewrite bad copies.")
@click.option("--deep", is_flag=True, help="Also verify every data checksum.")
@click.option("--json", "as_json", is_flag=True)
def fsck(devices, repair, deep, as_json):
    """Check superblocks, checkpoints, journal, index vs allocation (and data with --deep).

    Refuses a store another process holds (exit 5: stop its server first).
    Exit 0 clean, 1 problems found (repaired with --repair); a store that
    cannot be opened is "unusable" with the exit code of its error (11 not
    a store or corrupt, 12 other format version, 13 geometry or model, 14 a
    device missing, 7 device too small, 9 an I/O error reading it...).
    """
    from kvblock.cli.main import exit_code_for
    from kvblock.errors import DeviceTooSmallError, FormatError, IOFailedError
    from kvblock.store.fsck import FsckReport, fsck as run_fsck

    try:
        claimed = _claim(devices, writable=repair)
        try:
            store = _store(claimed, readonly=not repair)
        except BaseException:
            for d in claimed:       # a failed open leaves the Devices passed to their owner
                d.close()
            raise
    except DeviceBusyError as e:
        raise _in_use(e, "fsck checks a store no process is using (in use, runs evicted and "
                         "checkpoints rewritten during the check read as damaged)",
                      "fsck") from None
    # what is there is no usable store (or none the device lets us read: an
    # I/O error reading its superblocks or checkpoints)
    except (FormatError, DeviceTooSmallError, IOFailedError) as e:
        if as_json:
            _emit(FsckReport(problems=[str(e)], unusable=True).as_dict(), True, "")
        else:
            click.echo(f"kvblock fsck {devices[0]}: unusable")
            click.echo(f"  problem: {e}")
        sys.exit(exit_code_for(e))
    with store:
        if deep and not as_json and sys.stderr.isatty():
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("verifying data", total=len(store.index.runs))
                report = run_fsck(store, repair=repair, deep=deep,
                                  progress=lambda done, total: bar.update(task, completed=done))
        else:
            report = run_fsck(store, repair=repair, deep=deep)
    out = report.as_dict()
    if as_json:
        _emit(out, True, "")
    else:
        click.echo(f"kvblock fsck {devices[0]}: {report.status}; {report.runs_checked} runs"
                   + (f", {report.bytes_verified} bytes verified" if deep else ""))
        for p in report.problems:
            click.echo(f"  problem: {p}")
        for r in report.repaired:
            click.echo(f"  repaired: {r}")
    sys.exit(0 if report.status == "clean" else 1)


@cli.command()
@click.argument("devices", nargs=-1)
@click.option("--socket", "socket_path", default=None,
              help="Ask the store server on this socket (kvblock serve) instead: live "
                   "counters of all its clients' puts, lookups and evictions, and gauges "
                   "(each client reads the devices itself: its reads are in its own stats).")
@click.option("--prometheus", "port", type=click.IntRange(1, 65535), default=None,
              help="Serve the store's metrics on this port (Ctrl-C to stop).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="With --prometheus: the address to listen on (0.0.0.0 or :: for every "
                   "interface, so that another host's Prometheus can scrape).")
@click.option("--interval", type=FiniteFloatRange(0.1), default=5.0, show_default=True,
              help="With --prometheus: re-read the store at most this often (from DEVICES "
                   "each read is a read-only recovery: 0.6-0.7 s for a store of 100,000 runs here).")
@click.option("--json", "as_json", is_flag=True)
def stats(devices, socket_path, port, address, interval, as_json):
    """Counters and gauges of the store (read-only); --prometheus PORT serves them.

    From DEVICES the gauges (runs, blocks, used bytes, regions) are read from
    the devices, so they follow a store another process is using; the
    counters of puts and hits live in that process: give --socket to read
    them from a store server."""
    from kvblock.metrics import StoreCollector

    if bool(devices) == bool(socket_path):
        raise click.UsageError("give either DEVICES or --socket")
    if port is None:
        # they shape the exporter only: taken without it, they did nothing
        ctx = click.get_current_context()
        given = [f"--{name}" for name in ("interval", "address")
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given)} goes with --prometheus PORT (without "
                                   "it stats prints the numbers once)")
    read = (lambda: _server_stats(socket_path)) if socket_path else \
        (lambda: _device_stats(devices))
    if port is None:
        s = read()
        _emit(s, as_json, f"kvblock stats {socket_path or devices[0]}")
        return
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY

    cached = _Cached(read, interval)
    cached()          # fail here, not in the first scrape; which serves these numbers
    collector = StoreCollector(cached, counters=bool(socket_path))
    REGISTRY.register(collector)
    host = f"[{address}]" if ":" in address else address
    try:
        served = start_http_server(port, addr=address)
    except (OSError, UnicodeError) as e:
        # not served: off the process's registry again (a caller that goes
        # on, e.g. a second try on another port, would collide with it).
        # UnicodeError: the socket module's IDNA encoding of the host name
        # (an empty label, "10.0..1"; one over 63 characters; no text)
        REGISTRY.unregister(collector)
        why = ("not a host name or address" if isinstance(e, UnicodeError)
               else e.strerror or e)
        raise ConfigError(f"cannot serve metrics on port {port} of {address}: "
                          f"{why}; choose another --prometheus port "
                          "(or --address)") from None
    url = f"http://{host}:{port}/metrics"
    if as_json:
        # one JSON line once serving, as kvblock serve --json prints: --json
        # printed nothing here, the one thing said being the line on stderr
        import json as _json

        click.echo(_json.dumps({"metrics": url, "store": socket_path or ", ".join(devices),
                                "interval": interval, "pid": os.getpid()}))
    click.echo(f"serving metrics of {socket_path or devices[0]} on {url} (Ctrl-C to stop)",
               err=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        # Ctrl-C stops the serving too: left running, a process that goes on
        # (the CLI called in-process) kept the port and the registered
        # collector (a second --prometheus: DuplicateTimeseries).
        if isinstance(served, tuple) and served:     # (server, thread) here
            served[0].shutdown()
            served[0].server_close()
            served[1].join(5)
        REGISTRY.unregister(collector)


# What a read-only open's own recovery found: the only counters of
# ``kvblock stats DEV`` (puts and hits live in the process that made them).
RECOVERY_COUNTERS = ("replayed_records", "recovery_us", "stale_checkpoint_runs_dropped")


def _device_stats(devices) -> dict:
    """The store's state as on the devices now (a read-only open)."""
    from kvblock.store.store import COUNTERS

    with _store(devices) as store:
        s = store.stats()
    for name in set(COUNTERS) - set(RECOVERY_COUNTERS):
        s.pop(name, None)
    s.pop("geometry", None)
    s["devices"] = ", ".join(s["devices"])
    return s


def _server_stats(socket_path) -> dict:
    from kvblock.store.client import READ_COUNTERS, RemoteStore

    with RemoteStore(socket_path, timeout=30) as remote:
        s = remote.stats()
    s.pop("geometry", None)
    s.pop("client", None)           # this short connection's own counters
    for name in ("clients", "connections_total"):   # ... and no client of the server's:
        if name in s:                                  # it counted it
            s[name] -= 1
    for name in READ_COUNTERS:      # the server does none of its clients' reads: not 0s
        # ... but it counts the runs its clients dropped after a device
        # error (drop_runs, as checksum_failures): a failing device shows.
        if name != "read_errors":
            s.pop(name, None)
    if isinstance(s.get("devices"), list):
        s["devices"] = ", ".join(s["devices"])
    return s


class _Cached:
    """read(), called again only once ``interval`` seconds have passed.  A
    read that fails (the store briefly unreadable, a server restarting)
    keeps the last numbers and is said once on stderr, not a failed scrape
    and a traceback each time."""

    def __init__(self, read, interval: float):
        self.read, self.interval = read, interval
        self._at, self._value = -float("inf"), None
        self._lock = threading.Lock()
        self._failing: str | None = None

    def __call__(self) -> dict:
        with self._lock:
            if time.monotonic() - self._at >= self.interval:
                self._at = time.monotonic()
                try:
                    self._value = self.read()
                    self._failing = None
                except (KVBlockError, OSError) as e:
                    if self._value is None:
                        raise
                    if str(e) != self._failing:
                        click.echo(f"kvblock stats: {e} (serving the last numbers)", err=True)
                        self._failing = str(e)
            return self._value


def _duration(text: str) -> float:
    given = text
    text = text.strip()
    if text.endswith("M"):
        # M is a month to systemd and a MiB to --bytes in this very command:
        # taken for minutes, "1M" evicted all but the last minute's regions
        raise click.BadParameter(f"{given!r} is ambiguous (M: minutes or months?); "
                                 "use 30m for minutes, or days for months (30d)")
    text = text.lower()
    try:
        if text[-1] in DURATION_UNITS:
            seconds = float(text[:-1]) * DURATION_UNITS[text[-1]]
        else:
            seconds = float(text)
    except (ValueError, IndexError):
        seconds = math.nan
    # a negative age would reclaim everything; nan and inf nothing
    if not (math.isfinite(seconds) and seconds >= 0):
        raise click.BadParameter(f"{text!r} is not a duration; use e.g. 90s, 30m, 12h, 7d")
    return seconds


class _Duration(click.ParamType):
    """Seconds from 90s, 30m, 12h, 7d; parsed with the option, so a bad value's
    message names it."""
    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return _duration(value)
        except click.BadParameter as e:
            self.fail(e.message, param, ctx)


@cli.command()
@click.argument("devices", nargs=-1)
@click.option("--socket", "socket_path", default=None,
              help="Ask the store server on this socket (kvblock serve) to evict, instead of "
                   "opening DEVICES (which the server holds).")
@click.option("--bytes", "nbytes", type=SIZE, default=None, help="Reclaim until at least this much is free, or no unpinned region is "
                   "left (free_bytes in the output says which).")
@click.option("--older-than", type=_Duration(), default=None, help="Reclaim regions sealed longer ago: seconds, or s, m (minutes), h, d "
                   "(90s, 30m, 12h, 7d); an upper-case M is refused (minutes or months?).")
@click.option("--all", "everything", is_flag=True, help="Reclaim every unpinned region.")
@click.option("--json", "as_json", is_flag=True)
def evict(devices, socket_path, nbytes, older_than, everything, as_json):
    """Reclaim regions by the store's policy (exactly one of --bytes, --older-than, --all),
    on DEVICES or through the store server on --socket."""
    chosen = [x for x in (nbytes, older_than, everything or None) if x is not None]
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --bytes, --older-than, --all")
    if bool(devices) == bool(socket_path):
        raise click.UsageError("give either DEVICES or --socket")
    cutoff = time.time() - older_than if older_than is not None else None
    if socket_path:
        from kvblock.store.client import RemoteStore

        opened = RemoteStore(socket_path, timeout=60)
    else:
        try:
            opened = _store(devices, readonly=False)
        except DeviceBusyError as e:
            if _held_by_kernel(e):           # mounted: "unmount it" is the fix
                raise
            raise DeviceBusyError(
                f"{_without_advice(e)}; stop the program that holds it, or if a store "
                "server (kvblock serve) holds it, evict through it: kvblock evict --socket "
                "PATH ...", e.path, e.errno) from None
    with opened as store:
        before = store.stats()
        if cutoff is not None:
            reclaimed = store.evict_older_than(cutoff)
        else:
            reclaimed = store.evict(nbytes, all=everything)
        after = store.stats()
    # The eviction counters, not the run count: through --socket other
    # clients' puts between the two stats() change the count, not these.
    _emit({"regions_reclaimed": reclaimed,
           "runs_evicted": after["evicted_runs"] - before["evicted_runs"],
           "blocks_evicted": after["evicted_blocks"] - before["evicted_blocks"],
           "free_bytes": after["regions_free"] * after["capacity_bytes"] // after["regions"]},
          as_json, "kvblock evict")


@cli.command()
@click.argument("devices", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True)
def trim(devices, as_json):
    """Discard (TRIM) every free region so the drive can reuse its flash."""
    try:
        opened = _store(devices, readonly=False)
    except DeviceBusyError as e:
        raise _in_use(e, "trim discards free regions, which only the process that holds "
                         "the store knows", "trim") from None
    with opened as store:
        done, regions = store.trim_free()
        mapped = store.stats()["mapped_reads"]
        # No free region (a full cache store), none tried: 0 == 0 said
        # supported on any device; say what each device would do instead.
        would = all(not store.io.engine.mapped(i) and d.discard_supported()
                    for i, d in enumerate(store.io.devices))
    # Supported only if every free region went: on a striped store one
    # device may discard while another (mapped, or without TRIM) cannot.
    supported = done == regions if regions else would
    out = {"regions_trimmed": done, "free_regions": regions, "supported": supported}
    if mapped and not supported:
        out["note"] = (f"{', '.join(mapped)}: a store file on tmpfs read through a mapping keeps "
                       "its space allocated; run KVBLOCK_MAPPED_READS=never kvblock trim ... "
                       "to release it (later opens then read and write it through the engine, "
                       "until fallocate -l SIZE FILE allocates it again)")
    _emit(out, as_json, "kvblock trim")


@cli.command()
@click.option("--model-layers", "layers", type=click.IntRange(1), required=True)
@click.option("--kv-heads", type=click.IntRange(1), required=True)
@click.option("--head-dim", type=click.IntRange(1), required=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--kv-parts", type=click.IntRange(1, 2), default=2, show_default=True,
              help="2 for K and V, 1 for MLA.")
@click.option("--block-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="Tokens per block of the store (format's --block-tokens).")
@click.option("--tokens", type=click.IntRange(1), required=True, help="Context per request.")
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True,
              help="Requests restoring at the same time.")
@click.option("--sessions", type=click.IntRange(1), default=None,
              help="Contexts kept in the store (default: --concurrency).")
@click.option("--devices", type=click.IntRange(1), default=1, show_default=True)
@click.option("--device-gbps", type=FiniteFloatRange(min=0, min_open=True), required=True,
              help="Read bandwidth of one device, GB/s.")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True,
              help="Tensor-parallel degree.")
@click.option("--prefill-tokens-per-s", type=FiniteFloatRange(min=0, min_open=True),
              default=None, help="Measured prefill throughput (for the recompute time).")
@click.option("--model-params", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="Active parameters (e.g. 35e9), to estimate recompute from FLOPs.")
@click.option("--gpu-tflops", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="Peak dense TFLOP/s of one GPU (with --model-params).")
@click.option("--mfu", type=FiniteFloatRange(0.01, 1.0), default=0.4, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def plan(layers, kv_heads, head_dim, dtype, kv_parts, block_tokens, tokens, concurrency, sessions, devices,
         device_gbps, tp, prefill_tokens_per_s, model_params, gpu_tflops, mfu, as_json):
    """KV bytes per token, store capacity, restore time per request and the
    break-even against recompute, for a deployment larger than this machine."""
    from kvblock.plan import plan as make_plan

    # Options that would be ignored are refused: the recompute time comes
    # from --prefill-tokens-per-s, or from --model-params with --gpu-tflops
    # (at --mfu), not from half of the pair nor from both.
    why = None
    if (model_params is None) != (gpu_tflops is None):
        why = "--model-params and --gpu-tflops go together"
    elif prefill_tokens_per_s is not None and model_params is not None:
        why = ("give --prefill-tokens-per-s or --model-params with --gpu-tflops, not both")
    elif model_params is None and click.get_current_context().get_parameter_source("mfu") \
            is not click.core.ParameterSource.DEFAULT:
        why = "--mfu applies to --model-params with --gpu-tflops only"
    if why:
        raise click.UsageError(f"{why} (the recompute time: --prefill-tokens-per-s R, or "
                               "--model-params P --gpu-tflops T [--mfu F])")
    p = make_plan(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  kv_parts=kv_parts, block_tokens=block_tokens, tokens=tokens,
                  concurrency=concurrency, devices=devices,
                  device_gbps=device_gbps, tp=tp, sessions=sessions,
                  prefill_tokens_per_s=prefill_tokens_per_s, model_params=model_params,
                  gpu_tflops=gpu_tflops, mfu=mfu)
    out = p.as_dict()
    if not as_json:
        gib = lambda b: f"{_digits(b / 2**30, 2)} GiB"  # noqa: E731
        out = {"KV per token": f"{p.kv_bytes_per_token} bytes",
               "KV per request": gib(p.kv_bytes_per_request),
               "KV per TP rank": gib(p.kv_bytes_per_rank),
               "store capacity": gib(p.store_capacity_bytes),
               "KV per device": gib(p.store_capacity_per_device_bytes),
               "device size (format)": f"{p.device_bytes} bytes each "
               f"({gib(p.device_bytes)}: {p.region_count} regions of {p.region_bytes} bytes "
               f"and metadata hold {concurrency if sessions is None else sessions} "
               f"request(s) of {p.blocks_per_request} blocks)",
               "array bandwidth": f"{_digits(p.array_gbps, 1)} GB/s",
               "restore, one request": f"{_digits(p.restore_s_single, 3)} s",
               f"restore, {concurrency} at once":
               f"{_digits(p.restore_s_concurrent, 3)} s each",
               "recompute": f"{_digits(p.recompute_s, 2)} s" if p.recompute_s else
               "(give --prefill-tokens-per-s or --model-params and --gpu-tflops)",
               "speed-up": f"{_digits(p.speedup_single, 1)}x" if p.speedup_single else "-",
               "break-even array bandwidth": f"{_digits(p.break_even_array_gbps, 2)} GB/s"
               if p.break_even_array_gbps else "-"}
    _emit(out, as_json, "kvblock plan")


def _digits(x: float, decimals: int, significant: int = 3) -> str:
    """``x`` with ``decimals`` decimals, more where it needs them for
    ``significant`` digits: a small plan's 4 MiB is 0.00391 GiB, not 0.00."""
    if x and math.isfinite(x):
        decimals = max(decimals, significant - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


@cli.command()
@click.argument("bench_json")
@click.option("--out", default="docs/bench", show_default=True, help="Folder for the PNG plots.")
@click.option("--markdown", "md_path", default=None, help="Also write the markdown here.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {\"markdown\": ..., \"plots\": [paths]} instead of the markdown.")
def report(bench_json, out, md_path, as_json):
    """Turn pytest-benchmark JSON (make bench) into a markdown table and PNG plots."""
    import json as _json

    from kvblock.report import report as make_report

    md, pngs = make_report(bench_json, out,
                           relative_to=os.path.dirname(os.path.abspath(md_path)) if md_path
                           else None)
    if md_path:
        try:
            with open(md_path, "w") as f:
                f.write(md)
        except OSError as e:
            raise ConfigError(f"--markdown {md_path}: cannot write it "
                              f"({(e.strerror or str(e)).lower()}); give a file path in a "
                              "writable folder") from None
    if as_json:
        click.echo(_json.dumps({"markdown": md, "plots": [str(p) for p in pngs]}))
        return
    click.echo(md)
    click.echo(f"{len(pngs)} plot(s) in {out}", err=True)


@cli.command()
@click.argument("devices", nargs=-1, required=True)
@click.option("--socket", "socket_path", required=True,
              help="Unix socket the rank processes connect to.")
@click.option("--model", default=None, callback=_model_name,
              help="Check the store serves this model.")
@click.option("--eviction", type=click.Choice(["lru", "fifo"]), default="lru", show_default=True)
@click.option("--admit-after", type=click.IntRange(1), default=1, show_default=True,
              help="Write a run to flash only at its N-th offer.")
@click.option("--engine", type=click.Choice(["uring", "threads"]), default=None,
              help="I/O engine (default: KVBLOCK_IO_ENGINE, else the best available).")
@click.option("--verify", type=click.Choice(["always", "never"]), default="always",
              show_default=True, help="Clients' default for checking data checksums.")
@click.option("--idle-exit", type=FiniteFloatRange(0), default=None,
              help="Stop (cleanly) after this many seconds without a client. 0: never.")
@click.option("--pin-lease", type=FiniteFloatRange(0), default=60.0, show_default=True,
              help="Drop a client that holds pins and sends nothing for this many seconds "
                   "(a stopped process); clients ping while they hold pins. 0: never.")
@click.option("--hello-timeout", type=FiniteFloatRange(0), default=10.0, show_default=True,
              help="Close a connection that has not said hello this many seconds after "
                   "connecting (clients say it at once). 0: never.")
@click.option("--max-clients", type=click.IntRange(0), default=512, show_default=True,
              help="Connections served at once; more are refused (ServerBusyError). "
                   "0: no limit.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line once listening.")
def serve(devices, socket_path, model, eviction, admit_after, engine, verify, idle_exit,
          pin_lease, hello_timeout, max_clients, as_json):
    """Own a store's metadata and serve it to rank processes on a Unix socket.

    Opens DEVICES exclusively, recovers the store and answers RemoteStore
    clients (kvblock.store.client) on --socket: index, allocation, journal,
    checkpoints and eviction live here, each client reads and writes the data
    on the devices itself.  A client's pins are released when it disconnects.
    SIGTERM or Ctrl-C stop it cleanly (checkpoint); after a crash the next
    open recovers the store.
    """
    import json as _json

    from kvblock.errors import NotAStoreError
    from kvblock.store.server import open_server, run_forever, stop_signals

    with stop_signals() as stop:
        try:
            server = open_server(list(devices), socket_path, model=model, eviction=eviction,
                                 admit_after=admit_after, engine=engine, verify=verify,
                                 idle_exit=idle_exit, pin_lease=pin_lease,
                                 hello_timeout=hello_timeout, max_clients=max_clients,
                                 stop=stop)   # a signal ends a wait for a stopping server
        except DeviceBusyError as e:
            raise _writer_busy(e, "one process serves a store", "serve") from None
        except NotAStoreError as e:     # what the device holds instead, as info says
            raise _not_a_store(e) from None
        try:
            s = server.store.stats()
            ready = {"socket": socket_path, "pid": os.getpid(), "uuid": s["uuid"],
                     "devices": s["devices"], "runs": s["runs"], "blocks": s["blocks"]}
            if as_json:
                click.echo(_json.dumps(ready))
            click.echo(f"kvblock serve: store {s['uuid']} ({', '.join(s['devices'])}; "
                       f"{s['runs']} runs) on {socket_path}, pid {os.getpid()}", err=True)
        except BaseException:
            # (stdout full or its reader gone) the server is open: stop it,
            # or its socket is left behind and the store never closed
            server.stop()
            click.echo("kvblock serve: stopped", err=True)
            raise
        status = run_forever(server, stop)
    how = f"store failed: {server.failed}" if status else "clean"
    click.echo(f"kvblock serve: stopped ({how})", err=True)
    sys.exit(status)
