from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.daemon.config import ConfigError, Settings, load_settings


def test_defaults_are_loopback_without_token():
    s = load_settings(environ={})
    assert s.host == "127.0.0.1" and s.is_loopback and s.read_token() is None


def test_file_then_env_then_overrides(tmp_path: Path):
    cfg = tmp_path / "r.toml"
    cfg.write_text('port = 9000\nn_run = 4\nseeds = ["http://a:1"]\n[[backends]]\nkind = "vllm"\nurl = "http://x"\n')
    s = load_settings(cfg, environ={"ROLLOUTD_N_RUN": "7", "ROLLOUTD_SEEDS": "http://b:2, http://c:3"},
                      overrides={"port": 9100})
    assert (s.port, s.n_run) == (9100, 7)
    assert s.seeds == ["http://b:2", "http://c:3"]
    assert s.backends == [{"kind": "vllm", "url": "http://x"}]


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match=r"'prot'.*bad\.toml"):
        load_settings(cfg, environ={})


def test_unknown_env_variable_is_named():
    with pytest.raises(ConfigError, match="ROLLOUTD_PROT"):
        load_settings(environ={"ROLLOUTD_PROT": "1"})


def test_bad_value_names_key_and_source(tmp_path: Path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('n_init = "many"\n')
    with pytest.raises(ConfigError, match=r"n_init \(from .*c\.toml\)"):
        load_settings(cfg, environ={})
    with pytest.raises(ConfigError, match="ROLLOUTD_PORT"):
        load_settings(environ={"ROLLOUTD_PORT": "99999"})


def test_invalid_toml(tmp_path: Path):
    cfg = tmp_path / "d.toml"
    cfg.write_text("port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(cfg, environ={})


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(Exception):
        s.port = 1  # type: ignore[misc]


def test_non_loopback_bind_requires_token(tmp_path: Path):
    with pytest.raises(ConfigError, match="requires a token"):
        load_settings(environ={"ROLLOUTD_HOST": "0.0.0.0"})
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    os.chmod(tok, 0o600)
    s = load_settings(environ={"ROLLOUTD_HOST": "0.0.0.0", "ROLLOUTD_TOKEN_FILE": str(tok)})
    assert s.read_token() == "s3cret"
    assert "s3cret" not in repr(s)


def test_token_file_must_be_private(tmp_path: Path):
    tok = tmp_path / "tok"
    tok.write_text("x")
    os.chmod(tok, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_settings(environ={"ROLLOUTD_TOKEN_FILE": str(tok)}).read_token()


# ---- federation: the documented gossip settings, checked together at load (issue 15, 18) ----

GOSSIP_KEYS = ("gossip_interval_s", "fanout", "suspect_after_s", "dead_after_s", "request_timeout_s")


def test_every_documented_federation_setting_is_accepted(tmp_path: Path, repo_root: Path):
    table = (repo_root / "docs" / "federation.md").read_text().split("## Settings", 1)[1]
    documented = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert set(documented) == {*GOSSIP_KEYS, "work_stealing", "steal_interval_s", "gossip_udp"}
    on = load_settings(environ={"ROLLOUTD_WORK_STEALING": "true", "ROLLOUTD_STEAL_INTERVAL_S": "0.5",
                                "ROLLOUTD_GOSSIP_UDP": "false"})
    assert (on.work_stealing, on.steal_interval_s, on.gossip_udp) == (True, 0.5, False)
    assert load_settings(environ={}).work_stealing is True
    assert load_settings(environ={}).gossip_udp is True
    cfg = tmp_path / "fed.toml"
    cfg.write_text("gossip_interval_s = 0.5\nfanout = 5\nsuspect_after_s = 3\ndead_after_s = 9\n")
    s = load_settings(cfg, environ={"ROLLOUTD_REQUEST_TIMEOUT_S": "0.75"})
    assert (s.gossip.gossip_interval_s, s.gossip.fanout, s.gossip.suspect_after_s,
            s.gossip.dead_after_s, s.gossip.request_timeout_s) == (0.5, 5, 3.0, 9.0, 0.75)
    d = load_settings(environ={}).gossip
    assert (d.gossip_interval_s, d.fanout, d.suspect_after_s, d.dead_after_s, d.request_timeout_s) == (
        1.0, 3, 5.0, 15.0, 2.0)  # the defaults docs/federation.md states


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ROLLOUTD_DEAD_AFTER_S": "4"},
         r"dead_after_s \(from environment ROLLOUTD_DEAD_AFTER_S\): must be greater than "
         r"suspect_after_s \(5\), not 4; suspect_after_s is from defaults"),
        ({"ROLLOUTD_SUSPECT_AFTER_S": "20"},
         r"dead_after_s \(from defaults\): must be greater than suspect_after_s \(20\), not 15; "
         r"suspect_after_s is from environment ROLLOUTD_SUSPECT_AFTER_S"),
        ({"ROLLOUTD_GOSSIP_INTERVAL_S": "10"},
         r"suspect_after_s \(from defaults\): must be greater than gossip_interval_s \(10\), not 5; "
         r"gossip_interval_s is from environment ROLLOUTD_GOSSIP_INTERVAL_S"),
        ({"ROLLOUTD_SUSPECT_AFTER_S": "0.5"}, r"suspect_after_s .*greater than gossip_interval_s \(1\)"),
        ({"ROLLOUTD_FANOUT": "0"}, r"fanout \(from environment ROLLOUTD_FANOUT\): must be .*at least 1"),
        ({"ROLLOUTD_FANOUT": "-3"}, r"fanout \(from environment ROLLOUTD_FANOUT\)"),
        ({"ROLLOUTD_FANOUT": "2.5"}, r"fanout \(from environment ROLLOUTD_FANOUT\)"),
        ({"ROLLOUTD_REQUEST_TIMEOUT_S": "-1"}, r"request_timeout_s \(from .*\): must be a positive"),
        ({"ROLLOUTD_REQUEST_TIMEOUT_S": "0"}, r"request_timeout_s \(from .*\): must be a positive"),
        ({"ROLLOUTD_REQUEST_TIMEOUT_S": "nan"}, r"request_timeout_s .*finite"),
        ({"ROLLOUTD_GOSSIP_INTERVAL_S": "-1"}, r"gossip_interval_s \(from .*\): must be a positive"),
        ({"ROLLOUTD_GOSSIP_INTERVAL_S": "inf"}, r"gossip_interval_s .*finite"),
        ({"ROLLOUTD_DEAD_AFTER_S": "inf"}, r"dead_after_s .*finite"),
        ({"ROLLOUTD_SUSPECT_AFTER_S": "-5"}, r"suspect_after_s \(from .*\): must be a positive"),
    ],
)
def test_inconsistent_federation_settings_fail_at_load_naming_the_setting(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=environ)


def test_inconsistent_federation_settings_in_a_file_name_the_file(tmp_path: Path):
    cfg = tmp_path / "fed.toml"
    cfg.write_text("suspect_after_s = 8\ndead_after_s = 6\n")
    with pytest.raises(ConfigError, match=r"dead_after_s \(from .*fed\.toml\):.*suspect_after_s is from .*fed\.toml"):
        load_settings(cfg, environ={})
    # A consistent change of all three together is fine.
    cfg.write_text("gossip_interval_s = 10\nsuspect_after_s = 30\ndead_after_s = 60\n")
    assert load_settings(cfg, environ={}).gossip.dead_after_s == 60


def test_settings_made_in_code_are_checked_too():
    with pytest.raises(ValueError, match="dead_after_s"):
        Settings(suspect_after_s=20.0)


def test_serve_with_inconsistent_federation_settings_exits_2_naming_the_setting(tmp_path: Path):
    """The real `rolloutd serve`: a message naming the setting and exit 2, not a traceback
    from Federation() after the daemon had started (as before the fix)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_")}
    env.update(ROLLOUTD_STATE_DIR=str(tmp_path / "state"), ROLLOUTD_CACHE_DIR=str(tmp_path / "cache"),
               ROLLOUTD_SEEDS="http://127.0.0.1:9", ROLLOUTD_GOSSIP_INTERVAL_S="10")
    proc = subprocess.run([sys.executable, "-m", "rolloutd.daemon.cli", "serve", "--port", "0",
                           "--sandbox-backend", "local"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("rolloutd serve: invalid settings: suspect_after_s (from defaults)")
    assert "gossip_interval_s is from environment ROLLOUTD_GOSSIP_INTERVAL_S" in proc.stderr
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_sandbox_tmpfs_size_is_a_setting_below_half_the_memory_limit(tmp_path: Path):
    """`/tmp` and `/dev/shm` are memory-backed and charged to the sandbox's memory limit
    (issue 15, point 2): their size is a setting, refused at load when both full would leave
    the processes no room, and it reaches the sandboxes that take the daemon's memory limit."""
    from rolloutd.daemon.pipeline import Pipeline, Services
    from rolloutd.sandbox import SandboxSpec

    s = load_settings(environ={"ROLLOUTD_SANDBOX_TMPFS_MB": "300"})
    assert s.sandbox_tmpfs_mb == 300
    with pytest.raises(ConfigError, match=r"sandbox_tmpfs_mb \(from environment .*\): .*below half"):
        load_settings(environ={"ROLLOUTD_SANDBOX_TMPFS_MB": "1024"})  # 2048 MiB memory
    with pytest.raises(ConfigError, match="sandbox_tmpfs_mb"):
        load_settings(environ={"ROLLOUTD_SANDBOX_TMPFS_MB": "100", "ROLLOUTD_SANDBOX_MEMORY_MB": "200"})
    pipeline = Pipeline(s, Services())
    spec = pipeline.complete_spec(SandboxSpec(), lifetime_s=60)
    assert (spec.memory_mb, spec.tmpfs_mb, spec.lifetime_s) == (2048, 300, 60)
    # a task that names its own memory limit gets /tmp sized from it, not the daemon's size
    assert pipeline.complete_spec(SandboxSpec(memory_mb=256), lifetime_s=60).tmpfs_mb is None
    assert pipeline.complete_spec(SandboxSpec(tmpfs_mb=8), lifetime_s=60).tmpfs_mb == 8


def test_max_samples_per_request_stops_at_what_one_forwarded_request_carries():
    """A group goes to one peer whole, its ids in one header that a peer takes up to
    MAX_FORWARDED_IDS of: a larger setting would give groups a peer refuses, so it is a
    clear error at load, naming the setting (it used to load and fail at forwarding)."""
    from rolloutd.federation import MAX_FORWARDED_IDS

    assert load_settings(environ={"ROLLOUTD_MAX_SAMPLES_PER_REQUEST": str(MAX_FORWARDED_IDS)}) \
        .max_samples_per_request == MAX_FORWARDED_IDS
    with pytest.raises(ConfigError, match=r"max_samples_per_request \(from .*\).*10000"):
        load_settings(environ={"ROLLOUTD_MAX_SAMPLES_PER_REQUEST": str(MAX_FORWARDED_IDS + 1)})
