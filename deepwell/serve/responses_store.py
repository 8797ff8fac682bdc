"""Stored Responses (`store: true`) in an embedded SQLite database.

One row a response: the response object as last answered, and the input items of the
conversation up to it (a `previous_response_id` chain flattened, instructions excluded, as
OpenAI does not carry them over). One file in WAL mode, so several HTTP processes and
restarts share it; rows older than the TTL read as absent and are deleted, and beyond the
size bound the oldest go first. Each row names the process that wrote it: a background turn
whose process died reads as failed, not as running forever.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEME = "sqlite:///"
IN_MEMORY = SCHEME + ":memory:"
DEFAULT_URL = SCHEME + "~/.cache/deepwell/responses.sqlite3"
# The statuses a response can still change from, while the process running it lives.
RUNNING = ("queued", "in_progress")
# This process, as rows name their writer.
_OWNER = f"{socket.gethostname()}:{os.getpid()}"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    created: float
    # queued, in_progress, completed, incomplete, failed or cancelled.
    status: str
    # The response object's JSON text, as the client last got it.
    response: str
    input_items: list[dict[str, Any]]

    @property
    def output_items(self) -> list[dict[str, Any]]:
        return json.loads(self.response)["output"]


class ResponseStore:
    """The responses kept for `previous_response_id`, retrieval and background polling."""

    def __init__(self, url: str, ttl_seconds: float, max_responses: int) -> None:
        if not url.startswith(SCHEME):
            raise ValueError(f"--responses-store takes {SCHEME}PATH, got {url!r}")
        path = url[len(SCHEME) :]
        if path != ":memory:":
            path = os.path.expanduser(path)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.ttl_seconds = ttl_seconds
        self.max_responses = max_responses
        # One connection, shared by the event loop and its threads under a lock: the calls
        # are single-row reads and writes of a few milliseconds.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout = 5000")
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode = WAL")
        self._db.executescript(_SCHEMA)
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(responses)")]
        if "owner" not in columns:  # a file written before rows named their process
            self._db.execute("ALTER TABLE responses ADD COLUMN owner TEXT NOT NULL DEFAULT ''")

    def put(self, stored: StoredResponse) -> None:
        row = (
            stored.id,
            stored.created,
            stored.status,
            stored.response,
            json.dumps(stored.input_items, ensure_ascii=False),
            _OWNER,
        )
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            self._evict()

    def update(self, response_id: str, status: str, response: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE responses SET status = ?, response = ? WHERE id = ?",
                (status, response, response_id),
            )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, created, status, response, input_items, owner FROM responses "
                "WHERE id = ?",
                (response_id,),
            ).fetchone()
        if row is None:
            return None
        if row[1] < time.time() - self.ttl_seconds:
            self.delete(response_id)
            return None
        stored = StoredResponse(row[0], row[1], row[2], row[3], json.loads(row[4]))
        if stored.status in RUNNING and _died(row[5]):
            stored = self._failed(stored)
        return stored

    def _failed(self, stored: StoredResponse) -> StoredResponse:
        """A running turn whose process is gone: failed, with the reason in its error."""
        response = json.loads(stored.response)
        response["status"] = "failed"
        response["error"] = {
            "code": "server_error",
            "message": "the server process running this background response stopped",
        }
        text = json.dumps(response, ensure_ascii=False, separators=(",", ":"))
        self.update(stored.id, "failed", text)
        return StoredResponse(stored.id, stored.created, "failed", text, stored.input_items)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _evict(self) -> None:
        self._db.execute(
            "DELETE FROM responses WHERE created < ?", (time.time() - self.ttl_seconds,)
        )
        self._db.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC "
            "LIMIT -1 OFFSET ?)",
            (self.max_responses,),
        )


def _died(owner: str) -> bool:
    """Whether the process that wrote a row is gone; one on another host is taken as alive."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
