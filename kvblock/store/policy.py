"""Admission control: which offered runs are worth writing to flash.

``admit_after=1`` writes everything; ``admit_after=2`` writes a run only the
second time its first key is offered (one-hit prefixes never cost flash
endurance).  The offer counts live in a bounded LRU table.
"""

from __future__ import annotations

from collections import OrderedDict

from kvblock.errors import ConfigError
from kvblock.units import is_whole


class Admission:
    def __init__(self, admit_after: int = 1, table_size: int = 1 << 16):
        # (a str or None would fail the comparison as a TypeError, and 1.5
        # would mean "the second offer" unsaid)
        if not is_whole(admit_after):
            raise ConfigError(f"admit_after must be a whole number of offers (1: write every "
                              f"run), got {admit_after!r}")
        if admit_after < 1:
            raise ConfigError(f"admit_after must be >= 1, got {admit_after}")
        self.admit_after = int(admit_after)
        self.table_size = table_size
        self._offers: OrderedDict[bytes, int] = OrderedDict()

    def admit(self, key: bytes, record: list | None = None) -> bool:
        """Count an offer of the run whose first key is ``key``; whether it
        is admitted (to be written).  ``record``: a list the offer is added
        to, (key, admitted), in the same step as it is counted (one line
        with no call in it): a KeyboardInterrupt landing as this returns
        (or in a caller before it could note the offer) finds it noted, for
        :meth:`give_back` to undo if the put stores nothing."""
        into = [] if record is None else record
        n = len(into)
        if self.admit_after == 1:
            into[n:n] = ((key, True),)        # (give_back: nothing to undo)
            return True
        count = self._offers.get(key, 0) + 1
        if count >= self.admit_after:
            # Noted first, then used up: cut between the two, giving it back
            # sets the count it had (admit_after - 1, the only count that
            # admits on the next offer) again.
            into[n:n] = ((key, True),)
            del self._offers[key]
            return True
        # counted and noted in one line, no call in it
        self._offers[key], into[n:n] = count, ((key, False),)
        self._offers.move_to_end(key)
        if len(self._offers) > self.table_size:
            self._offers.popitem(last=False)
        return False

    def give_back(self, key: bytes, admitted: bool) -> None:
        """Undo an offer :meth:`admit` counted (answered ``admitted``) for a
        put that stored nothing: an admitted one (its count used up) lets
        the next offer admit; a declined one counts one offer less."""
        if self.admit_after == 1:
            return
        if admitted:
            self._offers[key] = self.admit_after - 1
            self._offers.move_to_end(key)
            if len(self._offers) > self.table_size:
                self._offers.popitem(last=False)
            return
        count = self._offers.get(key)
        if count is None:
            return
        if count <= 1:
            del self._offers[key]
        else:
            self._offers[key] = count - 1


EVICTION_POLICIES = ("fifo", "lru")
VERIFY_MODES = ("always", "never")
