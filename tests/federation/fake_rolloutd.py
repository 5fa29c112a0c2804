"""A stand-in for `rolloutd serve` (a labelled test double) for the contrib/slurm test.

Speaks the daemon's contract as far as contrib/slurm depends on it: `serve --host H --port P`,
the env vars ROLLOUTD_TOKEN_FILE, ROLLOUTD_SEEDS, ROLLOUTD_NODE_ID, ROLLOUTD_URL,
ROLLOUTD_STATE_DIR, ROLLOUTD_DRAIN_TIMEOUT_S; GET /healthz, /readyz (token), the federation
routes; SIGTERM -> readiness 503, drain, exit 0. The Federation it runs is the real one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from federation import GOSSIP_PATH, MEMBERS_PATH, Capacity, Federation, check_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    trio.run(run, args.host, args.port)


async def run(host: str, port: int) -> None:
    token = Path(os.environ["ROLLOUTD_TOKEN_FILE"]).read_text().strip()
    state_dir = Path(os.environ["ROLLOUTD_STATE_DIR"])
    assert state_dir.is_dir()
    draining = False

    def capacity() -> Capacity:
        return Capacity(free_slots=4, queued=0, in_flight=0, healthy_backends=1, draining=draining)

    fed = Federation(
        os.environ["ROLLOUTD_NODE_ID"],
        os.environ["ROLLOUTD_URL"],
        seeds=os.environ["ROLLOUTD_SEEDS"].split(","),
        capacity=capacity,
        token=token,
        gossip_interval_s=0.2,
        suspect_after_s=2.0,
        dead_after_s=4.0,
    )

    async def app(scope, receive, send):  # a raw ASGI app with the routes we need
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path = scope["path"]
        if path == "/healthz":
            status, answer = 200, {"ok": True}
        elif not check_token(headers.get("authorization"), token):
            status, answer = 401, {"error": {"type": "Unauthorized", "message": "token"}}
        elif path == "/readyz":
            status, answer = (503, {"ready": False}) if draining else (200, {"ready": True})
        elif path == GOSSIP_PATH:
            status, answer = 200, fed.handle_gossip(json.loads(body))
        elif path == MEMBERS_PATH:
            status, answer = 200, {"node_id": fed.node_id, "members": fed.members()}
        else:
            status, answer = 404, {"error": {"type": "NotFound", "message": path}}
        data = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    cfg = Config()
    cfg.bind = [f"{host}:{port}"]
    cfg.accesslog = None
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve, app, cfg, shutdown_trigger=stop.wait))
            await nursery.start(fed.run)
            print(f"fake-rolloutd {fed.node_id}: ready", file=sys.stderr, flush=True)
            async for signum in signals:
                print(
                    f"fake-rolloutd {fed.node_id}: signal {signum}, draining",
                    file=sys.stderr,
                    flush=True,
                )
                draining = True
                await trio.sleep(1.0)  # "drain"
                break
            stop.set()
            nursery.cancel_scope.cancel()
    print(f"fake-rolloutd {fed.node_id}: drained, exit 0", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
