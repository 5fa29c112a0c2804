"""The front node's record of which rollouts it forwarded to which peer."""

from __future__ import annotations

from collections import OrderedDict

from ._exceptions import DuplicateJobError


class ForwardedJobs:
    """job id -> node id of the peer that runs it, kept by the front node.

    The front records a job before it forwards it and forgets it once the final result
    (or a cancel) went through. When a peer dies the daemon calls `fail_node`, turns every
    returned id into an explicit failure, and never re-runs them on its own: a job
    therefore never has two live copies. The failed ids are remembered per node (bounded)
    so that, should the "dead" peer come back, `take_orphans` says what to cancel there.

        tracker.add(job_id, member.node_id)       # before forwarding
        tracker.discard(job_id)                   # result delivered / cancelled / forward failed
        for job_id in tracker.fail_node(node_id): # on_dead
            ...mark failed (status "failed", error stage "federation")...
        for job_id in tracker.take_orphans(node_id):  # on_rejoin
            ...DELETE {peer}/v1/rollouts/{job_id}...
    """

    def __init__(self, *, max_orphans: int = 100_000) -> None:
        self._node_of: dict[str, str] = {}
        self._jobs_on: dict[str, set[str]] = {}
        self._orphans: OrderedDict[str, str] = OrderedDict()  # job id -> node id, oldest first
        self._max_orphans = max_orphans

    def __len__(self) -> int:
        return len(self._node_of)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._node_of

    def add(self, job_id: str, node_id: str) -> None:
        """Record that `job_id` runs on `node_id`; DuplicateJobError if it is already tracked."""
        if job_id in self._node_of:
            raise DuplicateJobError(f"job {job_id} is already forwarded to {self._node_of[job_id]}")
        self._node_of[job_id] = node_id
        self._jobs_on.setdefault(node_id, set()).add(job_id)

    def node_of(self, job_id: str) -> str | None:
        """The peer running `job_id`, or None when it is not (or no longer) forwarded."""
        return self._node_of.get(job_id)

    def discard(self, job_id: str) -> None:
        """Forget a job (its result went through, it was cancelled, or forwarding failed)."""
        node_id = self._node_of.pop(job_id, None)
        if node_id is not None:
            jobs = self._jobs_on[node_id]
            jobs.discard(job_id)
            if not jobs:
                del self._jobs_on[node_id]

    def jobs_on(self, node_id: str) -> list[str]:
        """The ids of the jobs forwarded to `node_id`, sorted."""
        return sorted(self._jobs_on.get(node_id, ()))

    def fail_node(self, node_id: str) -> list[str]:
        """Forget every job on a dead node and return their ids (sorted) to fail them.

        The ids are kept as orphans of that node until `take_orphans` (bounded, oldest
        dropped first)."""
        jobs = sorted(self._jobs_on.pop(node_id, ()))
        for job_id in jobs:
            del self._node_of[job_id]
            self._orphans[job_id] = node_id
        while len(self._orphans) > self._max_orphans:
            self._orphans.popitem(last=False)
        return jobs

    def fail(self, job_id: str) -> str | None:
        """Forget one job whose peer may or may not have it (its forward went unanswered) and
        keep it as an orphan of that node; returns the node, None when it was not tracked."""
        node_id = self._node_of.get(job_id)
        if node_id is None:
            return None
        self.discard(job_id)
        self._orphans[job_id] = node_id
        while len(self._orphans) > self._max_orphans:
            self._orphans.popitem(last=False)
        return node_id

    def take_orphans(self, node_id: str) -> list[str]:
        """Ids failed by `fail_node(node_id)` not taken yet: cancel them if the node is back."""
        taken = sorted(j for j, n in self._orphans.items() if n == node_id)
        for job_id in taken:
            del self._orphans[job_id]
        return taken

    def statistics(self) -> dict[str, int]:
        return {
            "forwarded": len(self._node_of),
            "peers": len(self._jobs_on),
            "orphans": len(self._orphans),
        }
