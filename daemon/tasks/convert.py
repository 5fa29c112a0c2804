"""``rolloutd tasks convert``: a published SWE dataset export (JSONL or Parquet) -> a task file.

Each row is mapped by :func:`rolloutd.daemon.tasks.swe_formats.convert_row` and checked as a
``swe`` task; a row that cannot be mapped is reported (``IN:row N (instance_id): reason``)
and skipped, and a summary line ends the report.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.daemon.tasks.swe_formats import RowError, check_template, convert_row


class ConvertError(TaskError):
    """The input cannot be read at all (missing file, not JSON lines, no pyarrow)."""


@dataclass
class Report:
    rows: int = 0
    converted: int = 0
    skipped: int = 0


def read_rows(path: Path, *, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """``(row number, row)`` from a ``.jsonl``/``.json`` file (JSON lines, or one JSON array)
    or a ``.parquet`` file; a line that is not JSON comes as a :class:`RowError` in its place."""
    if path.suffix == ".parquet":
        rows: Iterator[Any] = _parquet_rows(path)
        numbered: Iterator[tuple[int, Any]] = enumerate(rows, 1)
    else:
        numbered = _json_rows(path)
    for n, (number, row) in enumerate(numbered):
        if limit is not None and n >= limit:
            return
        yield number, row


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConvertError(f"{path}: not UTF-8 text (JSON lines, or a .parquet file)") from None
    if text.lstrip().startswith("["):  # one JSON array of rows (SWE-smith's task files)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        yield from enumerate(rows, 1)
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            yield lineno, RowError(f"not valid JSON ({exc.msg} at column {exc.colno})")


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConvertError("reading Parquet needs pyarrow: pip install pyarrow "
                           "(or export the dataset as JSON lines)") from None
    import pyarrow as pa

    try:
        file = pq.ParquetFile(path)
        batches = file.iter_batches(batch_size=256)
        for batch in batches:
            yield from batch.to_pylist()
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException) as exc:  # unreadable, or not a Parquet file
        raise ConvertError(f"{path}: cannot read as Parquet ({exc})") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def convert_file(path: Path, out: TextIO, err: TextIO, *, fmt: str = "auto",
                 image_template: str | None = None, limit: int | None = None,
                 registry: TaskRegistry | None = None) -> Report:
    """Convert every row of ``path`` to ``out`` (JSONL tasks), reporting skipped rows to
    ``err``; the summary line is the caller's. Raises ConvertError if nothing can be read."""
    if image_template is not None:
        try:
            check_template(image_template)
        except ValueError as exc:
            raise ConvertError(str(exc)) from None
    registry = registry or TaskRegistry.default()
    report = Report()
    for number, row in read_rows(path, limit=limit):
        report.rows += 1
        iid = row.get("instance_id") if isinstance(row, dict) else None
        if iid is None and isinstance(row, dict) and "repo_name" in row:
            iid = f"{row.get('repo_name')}-{row.get('commit_hash')}"
        try:
            if isinstance(row, RowError):
                raise row
            task = convert_row(row, fmt=fmt, image_template=image_template)
            registry.validate(task)
            line = json.dumps(task, ensure_ascii=False, default=_json_default)
        except TaskError as exc:
            report.skipped += 1
            where = f"{path}:row {number}" + (f" ({iid})" if iid is not None else "")
            print(f"{where}: {exc}", file=err)
            continue
        out.write(line + "\n")
        report.converted += 1
    return report


def run_convert(path: Path, *, out: Path | None = None, fmt: str = "auto",
                image_template: str | None = None, limit: int | None = None,
                strict: bool = False) -> int:
    """The command: convert ``path`` to ``out`` (stdout if None), report skipped rows and a
    summary on stderr. Exit status 0 if a row converted (and, with ``strict``, none was
    skipped), else 1."""
    if limit is not None and limit < 1:
        raise ConvertError("--limit must be at least 1")
    if not path.exists():
        raise ConvertError(f"{path}: no such file")
    if out is None:
        report = convert_file(path, sys.stdout, sys.stderr, fmt=fmt,
                              image_template=image_template, limit=limit)
    else:
        tmp = out.with_name(out.name + ".part")
        try:
            with tmp.open("w", encoding="utf-8") as stream:
                report = convert_file(path, stream, sys.stderr, fmt=fmt,
                                      image_template=image_template, limit=limit)
            tmp.replace(out)
        except OSError as exc:
            raise ConvertError(f"{out}: cannot write ({exc.strerror})") from None
        finally:
            tmp.unlink(missing_ok=True)
    print(f"converted {report.converted} of {report.rows} rows; {report.skipped} skipped",
          file=sys.stderr)
    if report.converted == 0 or (strict and report.skipped):
        return 1
    return 0
