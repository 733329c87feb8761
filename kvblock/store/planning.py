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
from kvblock.layout.geometry import Geometry, RunLayout, round_up
from kvblock.store.store import (
    DEFAULT_REGION_MAX, DEFAULT_REGION_SHARE, JOURNAL_MAX, JOURNAL_SHARE, MIB,
    _blocks_too_small, _max_run_blocks, _plan)
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


def _least_count(holds, most: int) -> int | None:
    """The least region count ``n`` (1 to ``most``) for which ``holds(n)``,
    taken as monotonic in ``n``; None when not even ``most`` does."""
    if not holds(most):
        return None
    low, high = 0, 1
    while not holds(high):
        low, high = high, min(most, 2 * high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid, high)
    return high


def _least(devices: Sequence[StandIn], geometry: Geometry, region_size: int | None,
           need, lower=None) -> int | None:
    """The least size (as least_size's) for which the format's plan over
    ``devices`` has at least ``need(plan)`` regions: the least region count
    with which a store of that plan's region size, alignment and journal
    holds what is asked (None: none does).  None when no size up to
    MAX_SIZE bytes does.

    What a plan holds is not monotonic in the size: the default region size
    grows with it (larger regions may hold fewer runs), the journal grows
    (and with it the most blocks of a run's piece), and the regions start
    after the metadata rounded up to a whole MiB, which the checkpoint's
    growth moves a MiB later at a time (a region fewer, 4 KiB on).  Sizes
    whose plans share a region size and a piece size (``need`` depends on
    nothing else) make runs of sizes; in one, only the region count
    changes, by the size less the data's offset: the least size there with
    enough is found from where the data starts, again until it stays.
    ``lower(region_size)``: if given, a count ``need`` is at least for any
    plan of that region size (to pass sizes that cannot hold it quickly)."""
    block = max(d.block_size for d in devices)
    count = len(devices)
    least = 2 if count == 1 else 1            # regions per device a store needs
    most = MAX_SIZE // block * block

    def layout(nbytes: int) -> dict | None:
        """The plan at ``nbytes``, of devices too small for their regions
        too (short); None where the format refuses it for another reason."""
        devs = [d if d.capacity is not None else
                d._replace(capacity=nbytes // d.block_size * d.block_size) for d in devices]
        try:
            return _plan(devs, geometry, region_size, None, short=True)
        except (DeviceTooSmallError, ConfigError):
            return None

    steps: dict[tuple[int, int, int], int] = {}

    def key(plan: dict) -> tuple[int, int]:
        """What ``need`` depends on: the region size and a piece's most blocks."""
        sizes = (plan["alignment"], plan["region_size"], plan["journal_bytes"])
        if sizes not in steps:
            steps[sizes] = _max_run_blocks(geometry, *sizes)
        return plan["region_size"], steps[sizes]

    def hints(size: int) -> list[int]:
        """Sizes where the plan's key may change next, farthest first (each
        the last size before it, as the format's defaults compute it; only
        tried, a wrong one costs a bisection): the largest size, the end of
        the default region size's band and of the journal's growth, its
        next step."""
        found = [most]
        caps = [d.capacity if d.capacity is not None else size // d.block_size * d.block_size
                for d in devices]
        total = min(caps) * count

        def last_below(total_at: int) -> int:
            return -(-total_at // count // block) * block - block

        if region_size is None and total // DEFAULT_REGION_SHARE < DEFAULT_REGION_MAX:
            found.append(last_below(DEFAULT_REGION_SHARE * DEFAULT_REGION_MAX))
            found.append(last_below(DEFAULT_REGION_SHARE * (total // DEFAULT_REGION_SHARE
                                                            // MIB + 1) * MIB))
        plan = layout(size)
        if plan["journal_bytes"] < JOURNAL_MAX:
            found.append(last_below(JOURNAL_SHARE * JOURNAL_MAX))
            found.append(last_below(JOURNAL_SHARE * (plan["journal_bytes"] + 1)))
        return sorted(set(found), reverse=True)

    def last_of(size: int, same, beyond: int | None) -> int:
        """The largest size whose plan is ``same`` as ``size``'s (a property
        monotonic in the size: true up to some size, false after);
        ``beyond``: a larger one known not to be, if any."""
        moved = True
        while moved:
            moved = False
            for h in hints(size):
                if h <= size or (beyond is not None and h >= beyond):
                    continue
                if not same(layout(h)):
                    beyond = h
                    continue
                if h == most or not same(layout(h + block)):
                    return h
                size, moved = h + block, True
                break
        if beyond is None:
            step, low = block, size
            while True:
                high = min(most, low + step)
                if not same(layout(high)):
                    beyond = high
                    break
                if high == most:
                    return most
                low, step = high, 2 * step
            size = low
        while beyond - size > block:
            mid = (size + beyond) // 2 // block * block
            size, beyond = (mid, beyond) if same(layout(mid)) else (size, mid)
        return size

    if _blocks_too_small([StandIn(d.path, d.block_size) for d in devices], geometry):
        return None                     # no size holds a store of these blocks
    # the least size planned at all (refused but for its regions' count, as
    # a journal too small for a run's record: that falls as the size grows)
    size = _least_capacity(layout, block)
    needs: dict[tuple[int, int], int | None] = {}
    while size is not None and size <= most:
        plan = layout(size)
        k = key(plan)
        region = plan["region_size"]
        # no size of this region size holds it below the bound's regions
        # after where the data starts here (it starts no earlier past here)
        if lower is not None and any(d.capacity is None for d in devices):
            per = max(least, -(-lower(region) // count))
            at = round_up(max(off for d, off in zip(devices, plan["data_offsets"])
                              if d.capacity is None) + per * region, block)
            if at > size:
                if at > most:
                    return None
                if layout(at)["region_size"] == region:
                    size = at
                else:
                    last = last_of(size, lambda p: p["region_size"] == region, at)
                    size = last + block
                continue
        if k not in needs:
            needs[k] = need(plan)
        n = needs[k]
        beyond = None
        if n is not None:
            per = max(least, -(-n // count))    # regions on each device
            at = size
            while True:
                got = layout(at)
                if key(got) != k:
                    beyond = at
                    break
                short = [i for i, m in enumerate(got["regions_per_device"]) if m < per]
                if not short:
                    return at
                size = at               # of key k, and none up to it holds it
                if any(devices[i].capacity is not None for i in short):
                    break               # a device of its own size: no larger size helps
                # the least size with ``per`` regions after the data's offset
                # there (a larger size may start them later: again)
                at = round_up(max(got["data_offsets"][i] for i in short)
                              + per * got["region_size"], block)
                if at > most:
                    return None
        last = last_of(size, lambda p: key(p) == k, beyond)
        if last >= most:
            return None
        size = last + block
    return None


def least_size(devices: Sequence[StandIn], geometry: Geometry,
               region_size: int | None = None, *, run_blocks: int | None = None) -> int | None:
    """The least size, in whole blocks of the devices' largest block size,
    that the stand-ins of no capacity in ``devices`` must each have for a
    format with ``region_size`` to plan a store over them (one that holds a
    run of ``run_blocks`` blocks, given it): None when none up to MAX_SIZE
    bytes does."""
    if run_blocks is None:
        return _least(devices, geometry, region_size, lambda plan: 0)
    # the run's blocks fill at least so many regions
    run = run_blocks * geometry.block_bytes
    return _least(devices, geometry, region_size,
                  lambda plan: _fits_count(plan, geometry, run_blocks),
                  lambda region: -(-run // region))


def least_size_for_region(devices: Sequence[StandIn], geometry: Geometry,
                          run_blocks: int) -> int | None:
    """The least size (as least_size's) for a format with the default
    region size to make a store whose regions each hold a run of
    ``run_blocks`` whole (the store bench's runs, never cut): None when no
    size up to MAX_SIZE bytes does (the run is larger than the largest
    default region)."""
    def need(plan: dict) -> int | None:
        if RunLayout(geometry, run_blocks, plan["alignment"]).run_bytes > plan["region_size"]:
            return None
        return _fits_count(plan, geometry, run_blocks)

    return _least(devices, geometry, None, need)


def _fits_count(plan: dict, geometry: Geometry, nblocks: int) -> int | None:
    """The least region count with which a store of ``plan``'s layout holds
    a run of ``nblocks`` at once (check_fits); None where none does."""
    def holds(n: int) -> bool:
        try:
            check_fits(dict(plan, region_count=n), geometry, nblocks)
        except StoreFullError:
            return False
        return True
    return _least_count(holds, MAX_SIZE // plan["region_size"] + 1)


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
    such puts (more slack past each region's last piece); the regions start
    a MiB later at some sizes: what holds is not monotonic in the size, and
    _least searches every region size and data offset in turn."""
    def need(plan: dict) -> int | None:
        fits = _fits_count(plan, geometry, nblocks)
        if fits is None:
            return None
        regions = regions_for_runs(dict(plan, region_count=fits), geometry, nblocks, runs)
        return None if regions is None else max(fits, regions)

    # each region holds at most its size of the runs' blocks
    total = runs * nblocks * geometry.block_bytes
    return _least(devices, geometry, None, need, lambda region: -(-total // region))


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
                           f"be ({JOURNAL_MAX // MIB} MiB); {smaller}")
    return None
