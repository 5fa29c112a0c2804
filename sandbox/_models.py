"""Plain data: what a sandbox should be (SandboxSpec) and what its operations return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

BackendName = Literal["bwrap", "apptainer", "local"]
FileType = Literal["file", "dir", "symlink", "other"]


class Bind(BaseModel, extra="forbid"):
    """A host path made visible inside the sandbox at ``dest``."""

    host: str
    dest: str
    readonly: bool = True

    @field_validator("host", "dest")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value or "," in value or ":" in value:
            raise ValueError(f"bind paths must be absolute, without ',' ':' or NUL: {value!r}")
        return value


class SandboxSpec(BaseModel, extra="forbid"):
    """What a sandbox should be. Limits left as None are not applied."""

    backend: BackendName | None = None  # None = supervisor default
    image: str | None = None  # apptainer: .sif path or docker:// ref
    network: bool = False
    memory_mb: int | None = Field(default=None, gt=0)
    pids_max: int | None = Field(default=None, gt=0)
    cpu_cores: float | None = Field(default=None, gt=0)
    disk_mb: int | None = Field(default=None, gt=0)  # workspace/overlay size where enforceable
    #: size of each of bwrap's memory-backed /tmp and /dev/shm (None: see _limits.tmpfs_mb)
    tmpfs_mb: int | None = Field(default=None, gt=0)
    lifetime_s: float | None = Field(default=None, gt=0)  # torn down after it
    env: dict[str, str] = {}
    binds: list[Bind] = []
    workdir: str = "/workspace"  # where the workspace appears inside the sandbox
    #: where processes start and relative paths resolve, in a sandbox with its own root
    #: (bwrap, apptainer): e.g. an image's repository. None: the image's WorkingDir, else
    #: ``workdir``. The local backend always uses its workspace.
    cwd: str | None = None
    python: str | None = None  # interpreter to use inside (default: a real host python)

    @field_validator("workdir", "cwd")
    @classmethod
    def _workdir(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.field_name == "cwd":
            return None
        if value is None or not value.startswith("/") or value == "/" or "\0" in value:
            raise ValueError(f"{info.field_name} must be an absolute path other than '/': {value!r}")
        return value.rstrip("/")


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of ``Sandbox.run``. ``exit_code`` is None when the command timed out;
    negative when a signal ended it. Captures keep head and tail; ``truncated`` says the
    middle was dropped (a one-line note marks the cut)."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    duration_s: float


@dataclass(frozen=True, slots=True)
class DirEntry:
    name: str
    type: FileType
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True, slots=True)
class FileStat:
    path: str  # the resolved path inside the sandbox
    type: FileType
    size: int
    mode: int
    mtime: float
