"""The job journal: a small sqlite3 (WAL) file that outlives the daemon process.

It records each job's id, group and status as it changes, and the finished trajectory until
its TTL. At start-up, a job that an earlier process left non-terminal becomes ``lost``, so an
old id answers ``lost`` (or its finished result) rather than 404 after a crash or restart.
Dynamic-sampling batches are recorded the same way: their progress as it changes (at most
every ``BATCH_PROGRESS_S``) and their last status; a batch an earlier process left running
answers with state ``lost``.

Writes are batched: callbacks on the event loop append records to the open commit, and a
flusher task writes it every ``FLUSH_INTERVAL_S`` in a worker thread, so no sqlite call blocks
the loop. ``sync`` writes the open commit at once and waits for it: the API answers an accepted
rollout only after that, so an id a client was given is never forgotten (it answers ``lost``
after a crash). Later changes (a job finishing) stay batched.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.jobs import Job
from rolloutd.daemon.trajectory import ErrorInfo, Status, Trajectory

if TYPE_CHECKING:
    from rolloutd.daemon.batch import Batch

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.1
#: A running batch's progress is recorded at most this often.
BATCH_PROGRESS_S = 1.0
LOST_MESSAGE = "the daemon process that ran this {} stopped before it finished"
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
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    boot_id TEXT NOT NULL,
    state TEXT NOT NULL,
    expires_at REAL,
    status TEXT NOT NULL
);
"""
_Op = tuple[str, tuple[Any, ...]]


class JournalError(DaemonError):
    """Records could not be written (the sqlite file is unwritable, the disk is full, ...)."""


class _Commit:
    """Records written in one transaction; ``written`` is set once the write has ended."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.written = trio.Event()
        self.ok = False


class Journal:
    def __init__(self, path: Path, *, boot_id: str, ttl_s: float) -> None:
        self.path = path
        self.boot_id = boot_id
        self.ttl_s = ttl_s
        self._open_commit = _Commit()
        self._writing: _Commit | None = None
        self._wake = trio.Event()
        self._urgent = trio.Event()
        self._running = False
        self._followers: trio.Nursery | None = None
        self._limiter = trio.CapacityLimiter(1)
        self._db: sqlite3.Connection | None = None
        self.lost_at_start = 0

    # ---- called from the event loop (cheap, never blocks) ----------------------------

    def record_submitted(self, jobs: list[Job]) -> None:
        now = time.time()
        for job in jobs:
            self._record(
                "INSERT OR REPLACE INTO jobs (id, group_id, boot_id, status, submitted_at) VALUES (?,?,?,?,?)",
                (job.id, job.group_id, self.boot_id, job.status.value, now),
            )

    def record_finished(self, job: Job) -> None:
        result = job.trajectory.model_dump_json()
        self._record(
            "UPDATE jobs SET status = ?, expires_at = ?, result = ? WHERE id = ?",
            (job.status.value, time.time() + self.ttl_s, result, job.id),
        )

    def record_batch(self, status: dict[str, Any]) -> None:
        """A batch's progress, as GET /v1/batches/{id} answers it."""
        ended = status["state"] != "running"
        self._record(
            "INSERT OR REPLACE INTO batches (id, boot_id, state, expires_at, status) VALUES (?,?,?,?,?)",
            (status["id"], self.boot_id, status["state"], time.time() + self.ttl_s if ended else None,
             json.dumps(status)),
        )

    def follow_batch(self, batch: Batch) -> None:
        """Record a batch's progress until it ends (run by the journal, which outlives the
        sampler, so a batch's last status is recorded when the daemon stops)."""
        if self._followers is not None:
            self._followers.start_soon(self._follow_batch, batch, name=f"journal-{batch.id}")

    def _record(self, sql: str, args: tuple[Any, ...]) -> None:
        self._open_commit.ops.append((sql, args))
        self._wake.set()

    # ---- async API ----------------------------------------------------------------------

    async def sync(self) -> None:
        """Return once every record made so far is on disk; raise JournalError if writing
        them failed. A journal that is not running (a test that starts only the pipeline, or
        after shutdown) writes nothing, so there is nothing to wait for."""
        commit = self._open_commit if self._open_commit.ops else self._writing
        if commit is None or not self._running:
            return
        self._urgent.set()
        await commit.written.wait()
        if not commit.ok:
            raise JournalError(f"writing the job journal {self.path} failed; see the daemon log")

    async def lookup(self, job_id: str) -> Trajectory | None:
        """A job this process does not hold in memory: its stored result, or None."""
        row = await trio.to_thread.run_sync(self._select, job_id, limiter=self._limiter)
        if row is None:
            return None
        status, result, group_id = row
        if result:
            return Trajectory.model_validate_json(result)
        return _lost(job_id, group_id) if status == Status.lost.value else None

    async def lookup_batch(self, batch_id: str) -> dict[str, Any] | None:
        """The last recorded status of a batch this process does not hold, or None."""
        row = await trio.to_thread.run_sync(self._select_batch, batch_id, limiter=self._limiter)
        if row is None:
            return None
        state, status = row
        out: dict[str, Any] = json.loads(status)
        if state == "lost":
            out.update(state="lost", stop_reason=LOST_MESSAGE.format("batch"), in_flight=0)
        return out

    async def _follow_batch(self, batch: Batch) -> None:
        try:
            while not batch.done.is_set():
                await batch.wait_changed()
                self.record_batch(batch.status())
                await trio.sleep(BATCH_PROGRESS_S)
        finally:
            self.record_batch(batch.status())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self._open, limiter=self._limiter)
        self._running = True
        try:
            async with trio.open_nursery() as self._followers:
                task_status.started()
                while True:
                    await self._wake.wait()
                    with trio.move_on_after(FLUSH_INTERVAL_S):
                        await self._urgent.wait()  # a sync() waits: write now
                    await self._flush()
        finally:
            self._running = False
            self._followers = None
            with trio.move_on_after(10, shield=True):
                await self._flush()
                await trio.to_thread.run_sync(self._close, limiter=self._limiter)

    async def _flush(self) -> None:
        commit, self._open_commit = self._open_commit, _Commit()
        self._wake, self._urgent = trio.Event(), trio.Event()
        if not commit.ops:
            commit.ok = True
            commit.written.set()
            return
        self._writing = commit
        try:
            commit.ok = await trio.to_thread.run_sync(self._write, commit.ops, limiter=self._limiter)
        finally:
            self._writing = None
            commit.written.set()

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
        db.execute("DELETE FROM batches WHERE expires_at IS NOT NULL AND expires_at < ?", (now,))
        cur = db.execute(
            "UPDATE batches SET state = 'lost', expires_at = ? WHERE boot_id != ? AND state = 'running'",
            (now + self.ttl_s, self.boot_id),
        )
        if cur.rowcount:
            log.warning("journal: %d batches of an earlier daemon process are now 'lost'", cur.rowcount)
        self._db = db

    def _write(self, ops: list[_Op]) -> bool:
        assert self._db is not None
        try:
            self._db.execute("BEGIN")
            for sql, args in ops:
                self._db.execute(sql, args)
            self._db.execute("COMMIT")
        except sqlite3.Error:
            log.exception("journal: write failed; %d records dropped", len(ops))
            try:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            except sqlite3.Error:
                log.exception("journal: rollback failed")
            return False
        return True

    def _select(self, job_id: str) -> tuple[str, str | None, str | None] | None:
        if self._db is None:
            return None
        row = self._db.execute("SELECT status, result, group_id FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else (row[0], row[1], row[2])

    def _select_batch(self, batch_id: str) -> tuple[str, str] | None:
        if self._db is None:
            return None
        row = self._db.execute("SELECT state, status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else (row[0], row[1])

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
        error=ErrorInfo(stage="unknown", type="lost", message=LOST_MESSAGE.format("rollout")),
    )
