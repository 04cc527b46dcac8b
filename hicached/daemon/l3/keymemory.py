"""``KeyMemory``: what the daemon remembers about (table, key) pairs it does not hold in L2, such
as "stored in L3" or "L3 lacked it until then" (``tier.py``).

An exists of a hybrid model asks about a thousand keys of each pool per request, on the control
loop. Looking each up as a ``(table, key)`` tuple costs building and hashing the tuple every time
(~0.2 µs a key); here a lookup goes through the table's own dict, and hashes only the key string,
whose hash Python has cached since the request was decoded (~0.07 µs a key). The memory is
bounded: past ``limit`` entries the one remembered (or refreshed) longest ago is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hicached.daemon.index import TableId

_NONE: dict[str, Any] = {}


class KeyMemory:
    """(table, key) -> value, bounded to ``limit`` entries (the oldest go first)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._tables: dict[TableId, dict[str, Any]] = {}
        self._order: OrderedDict[tuple[TableId, str], None] = OrderedDict()

    def of(self, table: TableId) -> dict[str, Any]:
        """The keys of ``table`` remembered, with their values (read it, do not change it)."""
        return self._tables.get(table, _NONE)

    def __setitem__(self, table_key: tuple[TableId, str], value: Any) -> None:
        table, key = table_key
        self._tables.setdefault(table, {})[key] = value
        order = self._order
        order[table_key] = None
        order.move_to_end(table_key)
        while len(order) > self.limit:
            (old_table, old_key), _ = order.popitem(last=False)
            self._forget(old_table, old_key)

    def pop(self, table_key: tuple[TableId, str], default: Any = None) -> Any:
        table, key = table_key
        keys = self._tables.get(table)
        if keys is None or key not in keys:
            return default
        self._order.pop(table_key, None)
        value = keys.pop(key)
        if not keys:
            del self._tables[table]
        return value

    def _forget(self, table: TableId, key: str) -> None:
        keys = self._tables[table]
        del keys[key]
        if not keys:
            del self._tables[table]

    def __contains__(self, table_key: tuple[TableId, str]) -> bool:
        table, key = table_key
        return key in self._tables.get(table, _NONE)

    def __len__(self) -> int:
        return len(self._order)

    def clear(self) -> None:
        self._tables.clear()
        self._order.clear()

    def forget_namespace(self, ns: str) -> None:
        """Forget every key of the tables of namespace digest ``ns`` (a namespace's flush)."""
        for table in [t for t in self._tables if t[0] == ns]:
            for key in self._tables.pop(table):
                del self._order[(table, key)]
