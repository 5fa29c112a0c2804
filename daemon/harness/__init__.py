"""Bring your own agent: harness-driven rollouts (DESIGN section 13).

A task with ``agent: {command, env, timeout_s, install}`` runs that command in its sandbox
instead of the built-in loop. The harness talks to the rollout's own OpenAI / Anthropic
endpoint (:class:`Endpoint`, served by the daemon on a loopback port of the sandbox's own
network namespace, whose listening socket the sandbox's helper hands over); every call is sampled token-in/token-out on the group's sticky backend and recorded
exactly into the trajectory's ``segments`` (:class:`Session`).

Public API::

    AgentSpec, AgentInstall     the ``agent`` field of a task (WHEELS_DIR: where install's
                                wheels are shown in the sandbox)
    Session                     one rollout's calls: limits, sampling, segment assembly
    Endpoint                    the HTTP app of one rollout's endpoint
    run_harness, install_agent  RUN and INIT of a harness-driven rollout
    serve_socket                the endpoint's server (h11 on a listening socket)
    HarnessError, ApiError      the package's exceptions
"""

from rolloutd.daemon.harness._endpoint import Endpoint
from rolloutd.daemon.harness._errors import ApiError, HarnessError
from rolloutd.daemon.harness._http import serve_socket
from rolloutd.daemon.harness._runner import install_agent, run_harness
from rolloutd.daemon.harness._session import Session
from rolloutd.daemon.harness._spec import WHEELS_DIR, AgentInstall, AgentSpec

__all__ = [
    "WHEELS_DIR",
    "AgentInstall",
    "AgentSpec",
    "ApiError",
    "Endpoint",
    "HarnessError",
    "Session",
    "install_agent",
    "run_harness",
    "serve_socket",
]
