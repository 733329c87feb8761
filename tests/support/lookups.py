"""Counting the keys a store's key table is asked for (a test that a path
looks up O(keys) of them, not O(keys^2), without timing it)."""

from __future__ import annotations

from kvblock.index.table import KeyTable


def count_key_lookups(monkeypatch) -> list[int]:
    """Patch KeyTable's lookups so each call appends how many keys it asked
    for to the list returned (monkeypatch.undo() ends the count)."""
    looked: list[int] = []
    real_get, real_few = KeyTable.get, KeyTable.get_few

    def get(self, lo, hi):
        looked.append(lo.size)
        return real_get(self, lo, hi)

    def get_few(self, ks):
        looked.append(len(ks))
        return real_few(self, ks)
    monkeypatch.setattr(KeyTable, "get", get)
    monkeypatch.setattr(KeyTable, "get_few", get_few)
    return looked
