from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.config import ConfigError, Settings, load_settings


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
