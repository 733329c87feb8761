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

    def admit(self, key: bytes) -> bool:
        if self.admit_after == 1:
            return True
        count = self._offers.pop(key, 0) + 1
        if count >= self.admit_after:
            return True
        self._offers[key] = count
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
