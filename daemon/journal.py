"""The job journal: a small sqlite3 (WAL) file that outlives the daemon process.

It records each job's id, group and status as it changes, and the finished trajectory until
its TTL. At start-up, a job that an earlier process left non-terminal becomes ``lost``, so an
old id answers ``lost`` (or its finished result) rather than 404 after a crash or restart.

Writes are batched: callbacks on the event loop append to a list, and a flusher task writes
the batch every ``FLUSH_INTERVAL_S`` in a worker thread, so no sqlite call blocks the loop.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import trio

from daemon.jobs import Job
from daemon.trajectory import ErrorInfo, Status, Trajectory

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.1
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    group_id TEXT,
    boot_id TEXT NOT NULL,
    status TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    expires_at REAL,
    result TEXT
);
CREATE INDEX IF NOT EXISTS jobs_expires ON jobs (expires_at);
"""
_Op = tuple[str, tuple[Any, ...]]


class Journal:
    def __init__(self, path: Path, *, boot_id: str, ttl_s: float) -> None:
        self.path = path
        self.boot_id = boot_id
        self.ttl_s = ttl_s
        self._pending: list[_Op] = []
        self._wake = trio.Event()
        self._limiter = trio.CapacityLimiter(1)
        self._db: sqlite3.Connection | None = None
        self.lost_at_start = 0

    # ---- called from the event loop (cheap, never blocks) ----------------------------

    def record_submitted(self, jobs: list[Job]) -> None:
        now = time.time()
        for job in jobs:
            self._pending.append((
                "INSERT OR REPLACE INTO jobs (id, group_id, boot_id, status, submitted_at) VALUES (?,?,?,?,?)",
                (job.id, job.group_id, self.boot_id, job.status.value, now),
            ))
        self._wake.set()

    def record_finished(self, job: Job) -> None:
        result = job.trajectory.model_dump_json()
        self._pending.append((
            "UPDATE jobs SET status = ?, expires_at = ?, result = ? WHERE id = ?",
            (job.status.value, time.time() + self.ttl_s, result, job.id),
        ))
        self._wake.set()

    # ---- async API ----------------------------------------------------------------------

    async def lookup(self, job_id: str) -> Trajectory | None:
        """A job this process does not hold in memory: its stored result, or None."""
        row = await trio.to_thread.run_sync(self._select, job_id, limiter=self._limiter)
        if row is None:
            return None
        status, result, group_id = row
        if result:
            return Trajectory.model_validate_json(result)
        return _lost(job_id, group_id) if status == Status.lost.value else None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self._open, limiter=self._limiter)
        try:
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await trio.sleep(FLUSH_INTERVAL_S)
                await self._flush()
        finally:
            with trio.move_on_after(10, shield=True):
                await self._flush()
                await trio.to_thread.run_sync(self._close, limiter=self._limiter)

    async def _flush(self) -> None:
        ops, self._pending = self._pending, []
        if ops:
            await trio.to_thread.run_sync(self._write, ops, limiter=self._limiter)

    # ---- worker-thread side ----------------------------------------------------------

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        now = time.time()
        db.execute("DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at < ?", (now,))
        terminal = tuple(s.value for s in Status if s.terminal)
        marks = ",".join("?" * len(terminal))
        cur = db.execute(
            f"UPDATE jobs SET status = ?, expires_at = ? WHERE boot_id != ? AND status NOT IN ({marks})",
            (Status.lost.value, now + self.ttl_s, self.boot_id, *terminal),
        )
        self.lost_at_start = cur.rowcount
        if cur.rowcount:
            log.warning("journal: %d jobs of an earlier daemon process are now 'lost'", cur.rowcount)
        self._db = db

    def _write(self, ops: list[_Op]) -> None:
        assert self._db is not None
        try:
            self._db.execute("BEGIN")
            for sql, args in ops:
                self._db.execute(sql, args)
            self._db.execute("COMMIT")
        except sqlite3.Error:
            log.exception("journal: write failed; %d records dropped", len(ops))
            self._db.execute("ROLLBACK")

    def _select(self, job_id: str) -> tuple[str, str | None, str | None] | None:
        if self._db is None:
            return None
        row = self._db.execute("SELECT status, result, group_id FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else (row[0], row[1], row[2])

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _lost(job_id: str, group_id: str | None) -> Trajectory:
    return Trajectory(
        id=job_id,
        group_id=group_id,
        status=Status.lost,
        usable=False,
        error=ErrorInfo(stage="unknown", type="lost",
                        message="the daemon process that ran this rollout stopped before it finished"),
    )
