"""Fixtures for harness-driven rollouts: the task tests' real Node with real sandboxes (bwrap
when available) and a scripted policy (a labelled TEST DOUBLE), or the embedded model."""

from tests.tasks.conftest import harness, image_harness, renderer, short_tmp, store_dir  # noqa: F401  (fixtures)
