"""The README documents every setting and the quick start."""

from __future__ import annotations

from rolloutd.daemon.config import Settings


def test_readme_lists_every_setting(repo_root):
    text = (repo_root / "README.md").read_text()
    missing = [name for name in Settings.model_fields if f"`{name}`" not in text]
    assert not missing, f"README.md does not document: {missing}"
    assert "make demo" in text and "make test" in text
