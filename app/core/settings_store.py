"""The settings' key-values in the data folder's database: what Settings, the window's layout
and the chats' defaults keep, each a JSON value under its key (the `settings` table, beside the
conversations in store.py, written in the same transactions' way: a failed write is a
StoreError that says so)."""
from __future__ import annotations

import json
import sqlite3
from typing import Any, Callable, ContextManager


class SettingsStore:
    def __init__(self, db: Callable[[], sqlite3.Connection],
                 writing: Callable[[str], ContextManager[None]]) -> None:
        self._db = db  # the store's connection (it may be reopened in memory)
        self._writing = writing

    def get(self, key: str, default: Any = None) -> Any:
        row = self._db().execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set(self, key: str, value: Any) -> None:
        with self._writing("the setting"):
            self._db().execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?,?)",
                               (key, json.dumps(value)))
