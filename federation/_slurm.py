"""Seeds from the Slurm allocation: one daemon URL per node (and per port) of the job."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

import trio

from ._exceptions import SlurmError


async def slurm_seeds(
    port: int,
    *,
    ports_per_node: int = 1,
    scheme: str = "http",
    nodelist: str | None = None,
    env: Mapping[str, str] | None = None,
    scontrol: str = "scontrol",
    timeout_s: float = 10.0,
) -> list[str]:
    """Seed URLs for every node of this Slurm job: `{scheme}://{host}:{port + i}`.

    The node list comes from `nodelist`, else $SLURM_JOB_NODELIST (or $SLURM_NODELIST) in
    `env` (default: os.environ), and is expanded with `scontrol show hostnames`, which needs
    no controller. `ports_per_node` > 1 lists ports port..port+n-1 on each host (several
    daemons per node, as in CI). Raises SlurmError outside a Slurm job, when scontrol is
    missing or fails, or when it takes longer than `timeout_s`.
    """
    if not 0 < port < 65536 or ports_per_node < 1 or port + ports_per_node > 65536:
        raise ValueError(f"bad port range {port}..{port + ports_per_node - 1}")
    if nodelist is None:
        env = os.environ if env is None else env
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise SlurmError("not inside a Slurm job: SLURM_JOB_NODELIST is not set")
    try:
        with trio.fail_after(timeout_s):
            done = await trio.run_process(
                [scontrol, "show", "hostnames", nodelist],
                capture_stdout=True,
                capture_stderr=True,
                stdin=subprocess.DEVNULL,
                check=False,
            )
    except trio.TooSlowError:
        raise SlurmError(f"scontrol show hostnames took longer than {timeout_s}s") from None
    except OSError as exc:
        raise SlurmError(f"cannot run {scontrol}: {exc}") from exc
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()
        raise SlurmError(f"scontrol show hostnames {nodelist!r} failed: {err}")
    hosts = done.stdout.decode().split()
    if not hosts:
        raise SlurmError(f"scontrol show hostnames {nodelist!r} printed no host")
    return [f"{scheme}://{h}:{port + i}" for h in hosts for i in range(ports_per_node)]
