"""Each package's public surface is exactly its ``__all__`` (like httpx's
test_exported_members): every name in it resolves, and every public attribute that is not a
submodule is in it. A package's own tests check what its names mean."""

from __future__ import annotations

import types

import pytest

from rolloutd import daemon, federation, sandbox, tools, trainers
from rolloutd.daemon import api, harness, llm, tasks, ui
from rolloutd.sandbox import images

PACKAGES = [daemon, api, harness, llm, tasks, ui, federation, sandbox, images, tools, trainers]


def _public(module: types.ModuleType) -> set[str]:
    return {n for n, v in vars(module).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)} - {"annotations"}


@pytest.mark.parametrize("module", PACKAGES, ids=lambda m: m.__name__)
def test_all_is_exactly_the_public_api(module: types.ModuleType) -> None:
    names = module.__all__
    assert len(names) == len(set(names))
    for name in names:  # daemon's names load on first use: this loads them
        assert getattr(module, name) is not None, name
    assert _public(module) == set(names)
