"""SpareBuffers: idle host buffers kept for the next caller, within a byte limit."""

from __future__ import annotations

from kvblock.memory.spares import STEP, SpareBuffers


def test_take_reuses_the_smallest_fitting_buffer():
    s = SpareBuffers(64 * STEP)
    a, b = s.take(3 * STEP), s.take(STEP + 1)
    assert a.nbytes >= 3 * STEP and b.nbytes == 2 * STEP      # sized in whole steps
    a.array[:] = 1                                             # usable memory
    s.give(a)
    s.give(b)
    assert s.idle_bytes == a.nbytes + b.nbytes
    assert s.take(STEP) is b                                   # smallest that fits
    assert s.take(STEP) is a
    c = s.take(STEP)                                           # none idle: a new one
    assert c is not a and c is not b
    for x in (a, b, c):
        x.close()


def test_keeps_at_most_keep_bytes():
    s = SpareBuffers(4 * STEP)
    big = s.take(5 * STEP)
    s.give(big)                              # over the limit alone: freed
    assert s.idle_bytes == 0 and big.closed
    x, y, z = s.take(STEP), s.take(2 * STEP), s.take(2 * STEP)
    for buf in (x, y, z):
        s.give(buf)
    assert s.idle_bytes == 4 * STEP          # the smallest one went
    assert x.closed and not y.closed and not z.closed
    s.close()
    assert s.idle_bytes == 0 and y.closed and z.closed


def test_a_buffer_given_back_after_close_is_freed_not_kept():
    """close() freed the idle buffers, but one given back after it (a load's
    last stage ending after its store's close: transfer.py's failed reader
    start leaves the store's in-flight count before it gives its buffers)
    was kept idle for good: up to keep_bytes mapped while the closed store
    was referenced, none to free them."""
    s = SpareBuffers(4 * STEP)
    a = s.take(STEP)
    s.close()
    s.give(a)
    assert a.closed and s.idle_bytes == 0
    b = s.take(STEP)                      # still usable: a new buffer, the caller's own
    assert not b.closed
    b.close()
