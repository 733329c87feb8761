"""Planning a store before its format: the plan a format would make over
devices (real ones, or stand-ins of a size), whether a run of so many
blocks would fit it, and the least size that holds one.

The commands that format a store (``kvblock format``, the store bench, the
demo) check these first, before the format wipes what the devices held,
and refuse in their own terms with the least size that would do.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from kvblock.errors import ConfigError, DeviceTooSmallError, StoreFullError
from kvblock.layout.geometry import Geometry, RunLayout
from kvblock.store.store import (
    DEFAULT_REGION_MAX, DEFAULT_REGION_SHARE, MIB, _blocks_too_small, _max_run_blocks, _plan)
from kvblock.store.writes import check_run_fits

# the largest size least_size tries
MAX_SIZE = 1 << 60


class StandIn(NamedTuple):
    """A device as a format plans it: its path, block size and capacity.
    A capacity of None is the size probed (plan_for's ``size``)."""

    path: str
    block_size: int
    capacity: int | None = None


def plan_for(devices: Sequence, geometry: Geometry, region_size: int | None = None, *,
             size: int | None = None) -> dict:
    """The plan (KVStore.format's: where everything goes on each device) of
    a store formatted over ``devices``, each a Device or a StandIn, with
    ``region_size`` (None: the format's default) and the journal's default
    size.  A StandIn of no capacity is taken as ``size`` bytes, in whole
    blocks of its own (as a Device sees a file of that size).  Raises as the
    format would: DeviceTooSmallError, ConfigError."""
    devs = [d if d.capacity is not None else
            d._replace(capacity=size // d.block_size * d.block_size) for d in devices]
    return _plan(devs, geometry, region_size, None)


def check_fits(plan: dict, geometry: Geometry, nblocks: int) -> None:
    """The store a format with ``plan`` (plan_for's) makes must hold a run
    of ``nblocks`` blocks at once: else StoreFullError, as its put would
    raise."""
    alignment, region_size = plan["alignment"], plan["region_size"]
    check_run_fits(nblocks, geometry,
                   _max_run_blocks(geometry, alignment, region_size, plan["journal_bytes"]),
                   plan["region_count"], region_size,
                   lambda n: RunLayout(geometry, n, alignment))


def plan_or_none(devices: Sequence, geometry: Geometry, region_size: int | None = None, *,
                 size: int | None = None, run_blocks: int | None = None) -> dict | None:
    """plan_for's plan, or None where the format would refuse the devices
    (DeviceTooSmallError, ConfigError) or, given ``run_blocks``, its store
    could not hold a run of that many blocks at once (check_fits)."""
    try:
        plan = plan_for(devices, geometry, region_size, size=size)
        if run_blocks is not None:
            check_fits(plan, geometry, run_blocks)
    except (DeviceTooSmallError, ConfigError, StoreFullError):
        return None
    return plan


def _least_capacity(plan_at, block: int = 4096, *, low: int = 0,
                    high: int | None = None) -> int | None:
    """The least whole number of ``block``-byte blocks for which
    ``plan_at(nbytes)`` (a plan over devices of that size, None where it
    refuses them) plans a store; None when none up to MAX_SIZE bytes does.
    (Taken as monotonic: a size that plans one, any larger does too.)
    ``low``: a size known to plan none (a multiple of ``block``); ``high``:
    one known to plan one."""
    if high is None:
        start, high = low, low + block
        while plan_at(high) is None:
            low, high = high, start + 2 * (high - start)
            if high > MAX_SIZE:
                return None
    while high - low > block:
        mid = (low + high) // 2 // block * block
        low, high = (low, mid) if plan_at(mid) is not None else (mid, high)
    return high


def least_size(devices: Sequence[StandIn], geometry: Geometry,
               region_size: int | None = None, *, run_blocks: int | None = None) -> int | None:
    """The least size, in whole blocks of the devices' largest block size,
    that the stand-ins of no capacity in ``devices`` must each have for a
    format with ``region_size`` to plan a store over them (one that holds a
    run of ``run_blocks`` blocks, given it): None when none up to MAX_SIZE
    bytes does."""
    block = max(d.block_size for d in devices)
    return _least_capacity(lambda nbytes: plan_or_none(devices, geometry, region_size,
                                                      size=nbytes, run_blocks=run_blocks),
                          block)


def regions_for_runs(plan: dict, geometry: Geometry, nblocks: int, runs: int) -> int | None:
    """The regions ``runs`` puts of ``nblocks`` blocks each take when written
    one after another into a new store formatted with ``plan`` (plan_for's):
    each cut into pieces of at most the store's most blocks per run, each
    piece appended to the open region, or to a new one where it does not
    fit (RegionAllocator.allocate).  None when one such put does not fit
    the store at all (check_fits)."""
    try:
        check_fits(plan, geometry, nblocks)
    except StoreFullError:
        return None
    alignment, region_size = plan["alignment"], plan["region_size"]
    step = _max_run_blocks(geometry, alignment, region_size, plan["journal_bytes"])
    full, rest = divmod(nblocks, step)
    piece = RunLayout(geometry, step, alignment).run_bytes if full else 0
    rest_bytes = RunLayout(geometry, rest, alignment).run_bytes if rest else 0

    def put(fill: int) -> tuple[int, int]:
        """(regions opened, the open region's fill after) for one put
        starting with the open region ``fill`` bytes full."""
        opened = 0
        if full:
            per_region = region_size // piece
            room = (region_size - fill) // piece
            if full <= room:
                fill += full * piece
            else:
                left = full - room
                opened += -(-left // per_region)
                fill = (left - (opened - 1) * per_region) * piece
        if rest:
            if fill + rest_bytes > region_size:
                opened, fill = opened + 1, 0
            fill += rest_bytes
        return opened, fill

    # The fill at each put's start repeats: skip whole cycles of puts.
    regions, fill, seen, done = 0, region_size, {}, 0
    while done < runs:
        if fill in seen:
            at, regions_at = seen.pop(fill)
            cycles = (runs - done) // (done - at)
            regions += cycles * (regions - regions_at)
            done += cycles * (done - at)
            seen.clear()
            if done == runs:
                break
        seen[fill] = (done, regions)
        opened, fill = put(fill)
        regions, done = regions + opened, done + 1
    return regions


def least_size_for_runs(devices: Sequence[StandIn], geometry: Geometry, nblocks: int,
                        runs: int) -> int | None:
    """The least size (as least_size's) the stand-ins in ``devices`` must
    each have for a format with the default region size to make a store that
    holds ``runs`` puts of ``nblocks`` blocks at once, none evicted: None
    when none up to MAX_SIZE bytes does.

    The default region size grows with the devices (1/16 of the store's
    space in whole MiB, up to 256 MiB), and larger regions may hold fewer
    such puts (more slack past each region's last piece): what holds is
    monotonic only among sizes of one region size.  Each band of one
    region size is tried in turn, from the smallest, up to its largest
    size; the least size of the first that holds it is the answer."""
    def plan_at(nbytes: int) -> dict | None:
        plan = plan_or_none(devices, geometry, size=nbytes)
        if plan is None:
            return None
        need = regions_for_runs(plan, geometry, nblocks, runs)
        return plan if need is not None and need <= plan["region_count"] else None

    block = max(d.block_size for d in devices)
    count = len(devices)
    low = 0                     # no size up to it holds them
    for mib in range(2, DEFAULT_REGION_MAX // MIB + 1):
        # the band's largest size: one block short of a store whose share
        # is ``mib`` MiB (store.py's default region size)
        top = -(-(DEFAULT_REGION_SHARE * mib * MIB) // (count * block)) * block - block
        if top > low and plan_at(top) is not None:
            return _least_capacity(plan_at, block, low=low, high=top)
        low = max(low, top)
    return _least_capacity(plan_at, block, low=low)


def no_store_holds(geometry: Geometry, blocks: list[int], *,
                   smaller: str = "format for a smaller model (fewer --layers or "
                                  "--head-groups)") -> ConfigError | None:
    """The refusal of a model no devices of these block sizes (one per
    device) hold a store for, however large (blocks too small for any
    store's checkpoint, or a run's journal record of one block larger than a
    store's journal can be); None when large enough devices would hold one.
    ``smaller``: the fix for the latter, in the caller's options."""
    too_small = _blocks_too_small([StandIn("", b) for b in blocks], geometry)
    if too_small is not None:
        return too_small
    try:
        plan_for([StandIn("", max(blocks), MAX_SIZE)], geometry)
    except ConfigError:
        return ConfigError(f"no device can hold a store for {geometry.describe()}: a run's "
                           "journal record of one block is larger than a store's journal can "
                           f"be (64 MiB); {smaller}")
    return None
