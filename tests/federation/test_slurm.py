"""slurm_seeds: seed URLs from the Slurm allocation (real scontrol when installed)."""

from __future__ import annotations

import shutil
import stat

import pytest

from rolloutd.federation import SlurmError, slurm_seeds

needs_scontrol = pytest.mark.skipif(shutil.which("scontrol") is None, reason="no scontrol")


@needs_scontrol
async def test_expands_the_job_nodelist():
    seeds = await slurm_seeds(8000, env={"SLURM_JOB_NODELIST": "gpu[01-02],cpu7"})
    assert seeds == ["http://gpu01:8000", "http://gpu02:8000", "http://cpu7:8000"]


@needs_scontrol
async def test_several_daemons_per_node_get_consecutive_ports():
    seeds = await slurm_seeds(9100, nodelist="vm", ports_per_node=3, scheme="https")
    assert seeds == ["https://vm:9100", "https://vm:9101", "https://vm:9102"]


async def test_outside_a_slurm_job_is_an_error():
    with pytest.raises(SlurmError, match="not inside a Slurm job"):
        await slurm_seeds(8000, env={})


async def test_missing_or_failing_or_hanging_scontrol_is_an_error(tmp_path):
    with pytest.raises(SlurmError, match="cannot run"):
        await slurm_seeds(8000, nodelist="a", scontrol=str(tmp_path / "nope"))
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'bad list' >&2\nexit 1\n")
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SlurmError, match="bad list"):
        await slurm_seeds(8000, nodelist="a[", scontrol=str(failing))
    hanging = tmp_path / "hanging"
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    hanging.chmod(hanging.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SlurmError, match="longer than"):
        await slurm_seeds(8000, nodelist="a", scontrol=str(hanging), timeout_s=0.3)


async def test_bad_ports_are_refused():
    with pytest.raises(ValueError):
        await slurm_seeds(0, nodelist="a")
    with pytest.raises(ValueError):
        await slurm_seeds(65535, nodelist="a", ports_per_node=2)
