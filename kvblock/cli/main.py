"""``kvblock``: the operator's command for kvblock devices and stores.

Every subcommand takes ``--json`` for scripts.  Errors print one line on
stderr and exit with a code that names the kind of failure (see EXIT_CODES).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys

import click

from kvblock import errors
from kvblock.cli.units import SIZE, FiniteFloatRange

# Exit codes: one per kind of failure, stable for scripts.  Order matters: the
# first matching class wins, so subclasses come before their bases.
EXIT_CODES: list[tuple[type, int]] = [
    (errors.DeviceNotFoundError, 3),
    (errors.DevicePermissionError, 4),
    (errors.DeviceBusyError, 5),
    (errors.UnsupportedDeviceError, 6),
    (errors.DeviceTooSmallError, 7),
    (errors.ReadOnlyDeviceError, 17),
    (errors.AlignmentError, 8),
    (errors.ConfigError, 8),
    (errors.IOFailedError, 9),
    (errors.EngineUnavailableError, 10),
    (errors.NativeLibraryError, 10),
    (errors.DeviceError, 9),
    (errors.NotAStoreError, 11),
    (errors.UnsupportedVersionError, 12),
    (errors.GeometryMismatchError, 13),
    (errors.MissingDeviceError, 14),
    (errors.FormatError, 11),
    (errors.StoreFullError, 15),
    (errors.UnsafeTargetError, 16),
    (errors.ReadOnlyStoreError, 17),
    (errors.StoreClosedError, 18),   # includes ServerGoneError (store server gone)
    (errors.KVBlockError, 1),
]
EXIT_INTERRUPTED = 130
_OS_EXIT = {errno.ENOENT: 3, errno.EACCES: 4, errno.EPERM: 4, errno.EBUSY: 5, errno.EIO: 9,
            errno.EROFS: 17}


def exit_code_for(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return 1


class KVBlockGroup(click.Group):
    """Turns kvblock errors and Ctrl-C into one-line messages and exit codes."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except errors.KVBlockError as e:
            click.echo(f"kvblock: error: {_said_to(e, ctx.invoked_subcommand)}", err=True)
            sys.exit(exit_code_for(e))
        except OSError as e:   # one the code did not type: still one line, not a traceback
            if isinstance(e, BrokenPipeError) and _stdout_gone():
                sys.exit(1)    # `kvblock ... | head`: the reader has what it wanted
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"kvblock: error: {where}{e.strerror or e}", err=True)
            sys.exit(_OS_EXIT.get(e.errno, 1))
        except KeyboardInterrupt:
            click.echo("kvblock: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)


# The device's own advice for a read-only device or filesystem, which no
# command can take that meets it: those that only read (info, ls, stats, fsck,
# bench's reads) open the store read-only and never see the error.
_OPEN_READ_ONLY = "; open the store read-only, or "


def _said_to(e: errors.KVBlockError, command: str | None) -> str:
    """``e``'s message for the operator of ``command``."""
    text = str(e)
    if isinstance(e, errors.ReadOnlyDeviceError) and _OPEN_READ_ONLY in text:
        head, _, fix = text.partition(_OPEN_READ_ONLY)
        # fsck meets it only with --repair: named as such, not among the
        # commands that read the device as it is
        fsck = command == "fsck"
        return (f"{head}; kvblock {command or '...'}{' --repair' if fsck else ''} writes to "
                f"it: {fix} first (kvblock info, ls, stats and fsck"
                f"{' without --repair' if fsck else ''} read it as it is)")
    return text


def _stdout_gone() -> bool:
    """True when stdout's reader has closed it (a pipe or socket polls as
    an error then); stdout then goes to /dev/null, so the interpreter's
    flush at exit does not fail on it again (Python's docs on SIGPIPE)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):       # no file descriptor (a test's runner)
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return gone


@click.group(cls=KVBlockGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvblock")
def cli():
    """kvblock: KV-cache block storage on raw NVMe devices and files."""


def _emit(obj: dict, as_json: bool, title: str) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=None, sort_keys=False, allow_nan=False))
        return
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for key, value in obj.items():
        table.add_row(str(key), str(value))
    console().print(table)


def console():
    """A rich Console; piped output is not cut to 80 columns (rich's width
    when stdout is no terminal), so paths and offsets stay whole.  No markup
    or emoji codes: the tables show paths and messages as they are ("[red]"
    or ":x:" in a path is part of its name, not a style)."""
    from rich.console import Console

    plain = {"markup": False, "emoji": False}
    return Console(**plain) if sys.stdout.isatty() else Console(width=400, **plain)


# bench's options of the save/restore workloads only (the raw ones ignore them)
STORE_BENCH_OPTIONS = ("layers", "kv_heads", "head_dim", "dtype", "block_tokens", "head_groups",
                       "run_blocks", "jobs", "verify")
# restore's alone: save is one writer, and a put writes its checksums whatever
# the reads' verify mode.
RESTORE_ONLY_OPTIONS = ("jobs", "verify")


@cli.command()
@click.argument("target")
@click.option("--workload",
              type=click.Choice(["read", "write", "randread", "randwrite", "save", "restore"]),
              default="read", show_default=True,
              help="Raw I/O pattern (fio's names), or save/restore runs through the store.")
@click.option("--bs", type=SIZE, default="1M", show_default=True,
              help="Bytes per I/O (raw workloads; save/restore: --run-blocks).")
@click.option("--qd", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="I/Os in flight.")
@click.option("--size", type=SIZE, default=None,
              help="Bytes of the target to use (creates a file TARGET of this size if absent).")
@click.option("--seconds", type=FiniteFloatRange(0.01), default=5.0, show_default=True)
@click.option("--engine", type=click.Choice(["uring", "threads"]), default=None,
              help="I/O engine (default: KVBLOCK_IO_ENGINE, else the best available).")
@click.option("--layers", type=click.IntRange(1), default=32, show_default=True,
              help="save/restore: model layers.")
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-dim", type=click.IntRange(1), default=128, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--block-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--head-groups", type=click.IntRange(1), default=1, show_default=True)
@click.option("--run-blocks", type=click.IntRange(1), default=32, show_default=True,
              help="save/restore: blocks per run.")
@click.option("--jobs", type=click.IntRange(1), default=4, show_default=True,
              help="restore: concurrent readers.")
@click.option("--verify", type=click.Choice(["always", "never"]), default="always",
              show_default=True, help="restore: check data checksums.")
@click.option("--yes", is_flag=True, help="Allow write/save/restore on a block device.")
@click.option("--force", is_flag=True,
              help="Write even over a filesystem, partition table or kvblock store.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(target, workload, bs, qd, size, seconds, engine, layers, kv_heads, head_dim, dtype,
          block_tokens, head_groups, run_blocks, jobs, verify, yes, force, as_json):
    """Measure I/O on TARGET (a block device or file) through kvblock.

    Raw workloads run the I/O engine alone; save/restore format TARGET as a
    store and move runs of KV blocks.  Write, save and restore workloads
    overwrite TARGET's contents: on a block device they need --yes, and over
    data (a filesystem, partition table, a kvblock store other than a bench
    store) they need --force.  Read workloads write nothing.
    """
    # An option of the other kind of workload would be ignored, and the
    # numbers come out for another I/O size or model than asked: refused.
    store_run = workload in ("save", "restore")
    ctx = click.get_current_context()
    not_used = (("bs",) + (RESTORE_ONLY_OPTIONS if workload == "save" else ())
                if store_run else STORE_BENCH_OPTIONS)
    ignored = [f"--{name.replace('_', '-')}"
               for name in not_used
               if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT,
                                                         click.core.ParameterSource.DEFAULT_MAP)]
    if ignored:
        raise click.UsageError(
            f"{', '.join(ignored)}: not an option of --workload {workload} "
            + ("(an I/O of save/restore is one run: give --run-blocks)" if "--bs" in ignored
               else "(they are for --workload restore: save is one writer, and its puts "
               "write checksums either way)" if store_run else
               "(the store's options are for --workload save and restore)"))
    writes = workload in ("write", "randwrite", "save", "restore")
    if writes:
        from kvblock.bench.store_bench import BENCH_MODEL
        from kvblock.store.provision import guard_overwrite

        guard_overwrite(target, f"kvblock bench --workload {workload}", force=force, yes=yes,
                        allow_model=BENCH_MODEL if workload in ("save", "restore") else False)
    with _writes_over(f"bench --workload {workload} writes over the target", "bench") \
            if writes else contextlib.nullcontext():
        if workload in ("save", "restore"):
            from kvblock.bench.store_bench import run_store_bench
            from kvblock.layout import Geometry

            geometry = Geometry(layers, kv_heads, head_dim, dtype, block_tokens, 2, head_groups)
            result = _with_progress(
                lambda progress: run_store_bench(target, workload, geometry, run_blocks,
                                                 seconds, size, engine, verify, jobs, qd,
                                                 progress),
                f"{workload} {run_blocks} blocks/run", seconds, quiet=as_json)
        else:
            from kvblock.bench.raw import as_dict, run_raw

            result = as_dict(_with_progress(
                lambda progress: run_raw(target, workload, bs, qd, seconds, size, engine,
                                         progress),
                f"{workload} {bs}B qd{qd}", seconds, quiet=as_json))
    _emit(result, as_json, f"kvblock bench {target}")


@contextlib.contextmanager
def _writes_over(why: str, command: str):
    """A target another process holds (a store server's file) refused with
    the fix for a command that writes: the device's own "open it read-only"
    is none for it."""
    try:
        yield
    except errors.DeviceBusyError as e:
        from kvblock.cli.admin import _writer_busy

        raise _writer_busy(e, why, command) from None


def _with_progress(fn, label, total, *, quiet):
    if quiet or not sys.stderr.isatty():
        return fn(None)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=total)
        return fn(lambda done, _total: bar.update(task, completed=done))


SELFCHECK_PATH = ".kvblock/selfcheck.img"


@cli.command()
@click.option("--path", default=SELFCHECK_PATH, show_default=True,
              help="Scratch file (or device, with --yes) the check writes over; a file "
                   "it creates there is removed afterwards (the default one is kept).")
@click.option("--size", type=SIZE, default="256M", show_default=True)
@click.option("--yes", is_flag=True, help="Allow writing over a block device.")
@click.option("--force", is_flag=True,
              help="Write even over a filesystem, partition table or kvblock store.")
@click.option("--json", "as_json", is_flag=True)
def selfcheck(path, size, yes, force, as_json):
    """Write random data through every I/O engine, read it back, compare, time it."""
    from kvblock.bench.selfcheck import run_selfcheck
    from kvblock.store.provision import guard_overwrite

    if path != SELFCHECK_PATH:        # the default is kvblock's own scratch file
        guard_overwrite(path, "kvblock selfcheck", force=force, yes=yes)
    # a scratch file made at a path given is removed; the default one is kept for the next run
    with _writes_over("selfcheck writes over the target", "selfcheck"):
        report = run_selfcheck(path, size, keep_created=path == SELFCHECK_PATH)
    _emit(report, as_json, "kvblock selfcheck")


@cli.command()
@click.option("--tokens", type=click.IntRange(32), default=8192, show_default=True,
              help="Prompt length.")
@click.option("--device", default=None,
              help="Raw device, loop device or file to use instead of ./.kvblock/demo.img "
                   "(it is formatted: a block device needs --yes).")
@click.option("--size", type=SIZE, default=None,
              help="Size of the demo's own store file (default: twice the KV plus 256 MiB; "
                   "not with --device).")
@click.option("--yes", is_flag=True, help="Allow formatting a block device as --device.")
@click.option("--force", is_flag=True,
              help="Format --device even over a filesystem, partition table or kvblock "
                   "store (a previous demo's store needs no --force).")
@click.option("--json", "as_json", is_flag=True)
def demo(tokens, device, size, yes, force, as_json):
    """Cold recovery vs recompute on a real transformer architecture.

    Prefills a long prompt with a Llama-architecture model (random weights, built
    in code), saves its KV cache to kvblock, then in a fresh process restores it
    layer by layer while the model runs and produces the first tokens.  Prints
    both times to first token and fails unless tokens and logits are identical.
    """
    if device is not None and size is not None:
        # --size sizes the demo's own store file: with --device it did nothing
        raise click.UsageError("--size is the size of the demo's own store file "
                               "(.kvblock/demo.img); --device is used as it is: leave --size "
                               "out, or make the file first (fallocate -l SIZE FILE)")
    try:
        from kvblock.demo import run_demo
    except ImportError as e:  # torch/transformers are the demo extra
        raise errors.ConfigError(f"the demo needs torch and transformers ({e}); "
                                 "pip install 'kvblock[demo]' or run make demo") from None
    report = run_demo(tokens, device, size, quiet=as_json, yes=yes, force=force)
    _emit(report, as_json, "kvblock demo: cold recovery vs recompute")


def main(argv=None):
    cli.main(args=argv, prog_name="kvblock")


from kvblock.cli import admin  # noqa: E402,F401  (registers the admin subcommands)
