"""Open a store, or format one, the way engine integrations are configured.

Engines start with a device path in their config and no operator at hand:
``open_or_format`` opens the store there (checking geometry and model) and,
per ``format``, formats one when there is none: "if-empty" (default) formats
only devices that hold no kvblock store, and never a block device on which
util-linux's blkid finds a filesystem, partition table or RAID/LVM signature;
"never" only opens; "force" formats every time.
"""

from __future__ import annotations

import logging
import os
import stat

from kvblock.devices.device import new_file, refuse_one_path, remove_made
from kvblock.errors import (
    ConfigError,
    GeometryMismatchError,
    NotAStoreError,
    UnsafeTargetError,
)
from kvblock.layout import Geometry
from kvblock.store.store import KVStore
from kvblock.units import int_setting

FORMAT_MODES = ("if-empty", "never", "force")
logger = logging.getLogger("kvblock")


def open_or_format(devices: list[str], geometry: Geometry, model: str | None = None, *,
                   format: str = "if-empty", size: int | None = None,
                   region_size: int | None = None, owner: str = "kvblock",
                   force_hint: str = 'set format to "force"', made: list | None = None,
                   **options) -> KVStore:
    """The store on ``devices``.  ``size``: create missing backing files of this
    size.  ``owner`` and ``force_hint`` name the integration and its setting
    in error messages.  ``made``: a list that receives what was made for
    them (new_file's lists), for a caller whose later step may fail to
    remove (remove_made); what a failure here made is removed here."""
    if format not in FORMAT_MODES:
        raise ConfigError(f"{owner}: format must be one of {FORMAT_MODES}, got {format!r}")
    devices = _device_list(devices, owner)
    created = made if made is not None else []
    try:
        if size is not None:
            for path in devices:
                # (None: another process (a sibling rank) made it meanwhile;
                # it is theirs, never removed here)
                made = new_file(path, size) if not os.path.exists(path) else None
                if made is not None:
                    created.append(made)                 # the file, the folders made
                else:
                    _warn_size(path, size, owner)
        return _open_or_format(devices, geometry, model, format, region_size, owner,
                               force_hint, options)
    except BaseException:
        for files in created:       # a start that failed leaves nothing it made behind
            remove_made(files)
        created.clear()
        raise


def _device_list(devices, owner: str) -> list:
    """``devices`` as a list, taken once: they are gone through more than
    once (files made, the open, the format, the served store's check), and
    a generator (which KVStore.open and format take) was used up by the
    first of them.  One path is refused by name, not gone through as its
    characters."""
    refuse_one_path(devices)
    try:
        return list(devices)
    except TypeError:
        raise ConfigError(f"{owner}: devices must be a list of paths, got {devices!r}") \
            from None


def _open_or_format(devices, geometry, model, format, region_size, owner, force_hint,
                    options) -> KVStore:
    if format == "force":
        return KVStore.format(devices, geometry, model=model, region_size=region_size,
                              force=True, **options)
    try:
        store = KVStore.open(devices, geometry=geometry, model=model, **options)
    except NotAStoreError as e:
        if format == "never":
            raise
        why = e
    except GeometryMismatchError as e:
        # Another model's or geometry's store (an engine restarted with
        # another model or page size): refused, and the fix is the
        # integration's setting, not KVStore's "format a new store".
        raise GeometryMismatchError(f"{e}; {owner} will not format over it (its KV "
                                    f"would be lost). Give it other devices, or {force_hint}",
                                    e.path, e.offset) from None
    else:
        _warn_region_size(devices, store.sb.region_size, region_size, owner)
        return store
    for path in devices:
        # A store that did not open (a device of it blank or replaced, its
        # superblocks damaged) is not empty: KVStore.format would refuse it
        # too, but naming its own force=True, not the integration's setting.
        held = store_held(path)
        if held is not None:
            raise UnsafeTargetError(f"{path} holds {held}, which cannot be opened on "
                                    f"{', '.join(map(str, devices))} ({why}); {owner} will not "
                                    f"format over it. Give every device of that store, or "
                                    f"{force_hint}")
        if _is_block_device(path):
            from kvblock.devices.probe import describe, signatures

            found = signatures(path)
            if found:
                raise UnsafeTargetError(f"{path} holds {describe(found)}; {owner} will not "
                                        f"format it. Wipe it, or {force_hint}")
    logger.info("kvblock: formatting a new store on %s (%s)", devices, geometry.describe())
    return KVStore.format(devices, geometry, model=model, region_size=region_size, **options)


def _warn_size(path: str, size: int, owner: str) -> None:
    if os.path.isfile(path) and os.path.getsize(path) != size:
        logger.warning("kvblock: %s: %s exists with %d bytes; size %d applies to new "
                       "files only (delete the file to make it anew)", owner, path,
                       os.path.getsize(path), size)


def _warn_region_size(devices, formatted: int, region_size: int | None, owner: str) -> None:
    if region_size is not None and formatted != region_size:
        logger.warning("kvblock: %s: the store on %s was formatted with regions of %d "
                       "bytes; region_size %d applies when a store is formatted",
                       owner, devices, formatted, region_size)


# KVStore options a shared store's server takes (the rest are per client).
_SERVER_OPTIONS = ("eviction", "admit_after", "engine")
# An engine's ranks never wait longer than this for one answer of the store
# server (answers take milliseconds; a commit waits for one journal flush):
# past it the connection is abandoned and a new one is made, so a hung
# server cannot hang an engine.
SHARED_CALL_TIMEOUT_S = 60.0


def _start_ticks(pid) -> int:
    """When process ``pid`` ("self": this one) started, in clock ticks since boot."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _started_before_this_process(pid: int) -> bool:
    """Whether process ``pid`` started before this one (True when unknown:
    no /proc, or a server in another pid namespace)."""
    try:
        return _start_ticks(pid) < _start_ticks("self")
    except (OSError, ValueError, IndexError):
        return True


def open_shared(socket_path: str, devices: list[str], geometry: Geometry, model: str, *,
                format: str = "if-empty", size: int | None = None,
                region_size: int | None = None, owner: str = "kvblock",
                force_hint: str = 'set format to "force"', **options):
    """A RemoteStore on the store server at ``socket_path``, for processes
    (an engine's ranks or workers) that share one store on ``devices``.  The
    first caller to find no server there formats the devices (per
    ``format``, as :func:`open_or_format`) and starts ``kvblock serve``,
    under a lock file beside the socket; the others connect (``owner`` and
    ``force_hint`` name the integration and its setting in errors, as
    there).  The served
    store must have ``geometry`` and be made for ``model``.  When the
    server is lost later (killed, crashed, hung past
    ``SHARED_CALL_TIMEOUT_S``), each process reconnects in the background,
    starting a new server the same way if none answers; calls fail with
    ServerGoneError meanwhile."""
    from kvblock.io import _requested as engine_requested
    from kvblock.store.client import connect
    from kvblock.store.policy import EVICTION_POLICIES, VERIFY_MODES, Admission

    # Checked here, not only by a server this caller starts: with one
    # already running they would be ignored, a misspelling unnoticed.
    if format not in FORMAT_MODES:
        raise ConfigError(f"{owner}: format must be one of {FORMAT_MODES}, got {format!r}")
    devices = _device_list(devices, owner)
    if options.get("eviction") is not None and options["eviction"] not in EVICTION_POLICIES:
        raise ConfigError(f"{owner}: eviction must be one of {EVICTION_POLICIES}, got "
                          f"{options['eviction']!r}")
    if options.get("admit_after") is not None:
        Admission(options["admit_after"])
    # (checked by the client only once connected: after prepare() had
    # formatted the devices and a server, which outlives the caller, started)
    if options.get("verify") is not None and options["verify"] not in VERIFY_MODES:
        raise ConfigError(f"{owner}: verify must be one of {VERIFY_MODES}, got "
                          f"{options['verify']!r}")
    if options.get("engine") is not None:
        engine_requested(options["engine"])
    # (int(... or 32) made 0 the default 32 and 2.5 a 2 unsaid, "deep" a bare ValueError)
    queue_depth = 32 if options.get("queue_depth") is None else \
        int_setting(options["queue_depth"], owner, "queue_depth")
    if options.get("host_cache_bytes"):
        raise ConfigError(f"{owner}: a DRAM tier (host_cache_bytes) cannot be used with a "
                          "shared store server (its clients read the devices themselves)")

    prepared = []

    def prepare():
        prepared.append(True)
        made = []
        open_or_format(devices, geometry, model, format=format, size=size,
                       region_size=region_size, owner=owner, force_hint=force_hint,
                       made=made).close()

        def undo():
            # (ensure_server: no server came up on them) A start that failed
            # leaves no store file it made behind, as without a server.
            for files in made:
                remove_made(files)
        return undo

    server_options = {k: options[k] for k in _SERVER_OPTIONS if options.get(k) is not None}
    store = connect(socket_path, devices, prepare=prepare,
                    server_options=dict(server_options, model=model),
                    verify=options.get("verify"), engine=options.get("engine"),
                    queue_depth=queue_depth,
                    timeout=SHARED_CALL_TIMEOUT_S, reconnect=True,
                    geometry=geometry, model=model)
    if not prepared:
        # A server already served the store: size and region_size (which
        # prepare applies, and says when they do not) were not looked at.
        if size is not None:
            for path in devices:
                _warn_size(path, size, owner)
        _warn_region_size(devices, store.regions.size, region_size, owner)
        if format == "force" and _started_before_this_process(store.server_pid):
            # "force" formats at every start, but only where a caller starts
            # the server: one that outlived the last run (it does: its own
            # session) keeps serving what it holds.  Said, not silent.  (A
            # server younger than this process was started by a sibling
            # (another DP replica) that formatted as this start asked.)
            logger.warning("kvblock: %s: format \"force\" did not apply: the store server at "
                           "%s (pid %d) already serves the store on %s, not formatted; "
                           "stop it (kill -TERM %d) to format anew at the next start",
                           owner, socket_path, store.server_pid, ", ".join(map(str, devices)),
                           store.server_pid)
    # The server's eviction and admission apply to every rank: this caller's
    # differing ones (a server started with other settings) are said, not dropped.
    for name, mine, theirs in (("eviction", options.get("eviction"), store.server_eviction),
                               ("admit_after", options.get("admit_after"),
                                store.server_admit_after)):
        if mine is not None and theirs is not None and mine != theirs:
            logger.warning("kvblock: %s: %s %r does not apply: the store server at %s (pid "
                           "%d) runs with %s %r for every rank; restart it (kill -TERM %d) to "
                           "use %r", owner, name, mine, socket_path, store.server_pid, name,
                           theirs, store.server_pid, mine)
    return store


def holds_data(path: str, allow_model=False) -> tuple[str, str] | None:
    """What writing over ``path`` would destroy, in words, and how to free
    it: a filesystem, partition table, RAID/LVM member, system partition or
    several signatures (blkid -p), or a kvblock store (any release; not one
    made for ``allow_model``).  None when it holds none of these, or does
    not exist."""
    from kvblock.devices.probe import describe, how_to_free, signatures

    if not os.path.exists(path):
        return None
    if not (stat.S_ISREG(mode := os.stat(path).st_mode) or stat.S_ISBLK(mode)):
        # A directory (or a character device...) holds no store: reading
        # its superblock raised a bare IsADirectoryError naming no path.
        # What writes there refuses it next, saying what it is.
        return None
    found = signatures(path)
    if found:
        return describe(found), how_to_free(found)
    store = store_held(path, allow_model)
    return None if store is None else (store, "pass --force")


def store_held(path: str, allow_model=False) -> str | None:
    """store_in() of the superblock copies on ``path`` (read without
    claiming it); None when nothing is there (any more: a start that made
    the file and failed removed it since), which the format that follows
    then names."""
    from kvblock.devices.probe import open_to_check
    from kvblock.format import superblock as sbfmt
    from kvblock.store.store import store_in

    try:
        fd = open_to_check(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        copies = [os.pread(fd, sbfmt.SIZE, off) for off in sbfmt.COPY_OFFSETS]
    finally:
        os.close(fd)
    return store_in(copies, path, allow_model)


def guard_overwrite(path: str, doing: str, *, force: bool = False, yes: bool = False,
                    allow_model=False) -> None:
    """Before ``doing`` writes over ``path``: a block device needs ``yes``
    (ConfigError) and anything holding data needs ``force``
    (UnsafeTargetError), as ``kvblock format`` asks."""
    if _is_block_device(path) and not yes:
        raise ConfigError(f"{doing} writes over the block device {path}; pass --yes to allow it")
    if force:
        return
    held = holds_data(path, allow_model)
    if held is not None:
        what, fix = held
        raise UnsafeTargetError(f"{path} holds {what}; {doing} would overwrite it ({fix})")


def _is_block_device(path: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False
