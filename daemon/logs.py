"""Logging setup for the daemon process: JSON lines on stderr (journald and Slurm capture them)."""

from __future__ import annotations

import json
import logging
import sys
import time

_RESERVED = set(vars(logging.makeLogRecord({})))
_SECRETS: set[str] = set()


def redact(secret: str | None) -> None:
    """Never print ``secret`` (the bearer token): every formatted line is scrubbed of it."""
    if secret and len(secret) >= 4:
        _SECRETS.add(secret)


def _scrub(line: str) -> str:
    for secret in _SECRETS:
        if secret in line:
            line = line.replace(secret, "[redacted]")
    return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _scrub(self._format(record))

    def _format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _scrub(super().format(record))


def setup_logging(level: str = "info", *, json_lines: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else _PlainFormatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "hypercorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
