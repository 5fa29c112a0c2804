"""The dashboard's files (served at ``GET /ui/`` by ``rolloutd.daemon.api``).

Plain hand-written HTML, JavaScript and CSS beside this file, shipped as package data: no
build step, no CDN, nothing fetched from outside the daemon. The page reads the daemon's
JSON API (``/v1/status``, ``/v1/rollouts``, ``/v1/rollouts/{id}``) with the bearer token the
user types in, kept in ``sessionStorage``.
"""

from pathlib import Path as _Path

#: The directory of the dashboard's files.
STATIC_DIR = _Path(__file__).resolve().parent

__all__ = ["STATIC_DIR"]
