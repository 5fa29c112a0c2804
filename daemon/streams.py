"""How a client asks for a stream of rollout results (``/v1/rollouts/stream``).

One definition for the Python clients (``rolloutd.daemon.client``) and for a front that relays
a peer's results (``rolloutd.daemon.forward``). A few ids go in the query of a GET; more go in
the JSON body of a POST, because a batch of thousands does not fit in a URL: httpx refuses a
URL over 64 kB (about 3,400 ids) and common proxies a request line over 8 kB (about 430). A
daemon older than the POST route answers it 405, as it would have refused so long a URL.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

#: The most ids one stream takes (the daemon answers 400 above it).
MAX_STREAM_IDS = 10_000
#: The most ids a client puts in the query of ``GET /v1/rollouts/stream`` (about 4.9 kB).
GET_STREAM_IDS = 256
PATH = "/v1/rollouts/stream"


def stream_request(ids: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """The method and httpx keyword arguments of a stream of ``ids`` (at most MAX_STREAM_IDS)."""
    if len(ids) <= GET_STREAM_IDS:
        return "GET", {"params": {"ids": ",".join(ids)}}
    return "POST", {"json": {"ids": list(ids)}}


def stream_chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    """``ids`` in streams of at most MAX_STREAM_IDS, distinct ids in their first order (a
    daemon counts a repeated id once, so a repeat split from its first would wait forever)."""
    unique = list(dict.fromkeys(ids))
    for start in range(0, len(unique), MAX_STREAM_IDS):
        yield unique[start:start + MAX_STREAM_IDS]
