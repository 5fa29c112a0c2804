"""The rootless side of bench/images.py, run by it as an unprivileged user (``/usr/bin/python3``,
the sandbox package installed beside this file): what a daemon without root gets, as on a
cluster. Unpacks the image into a store of the user's own, then times warm opens the way the
benchmark does as root. Prints one JSON line: {"unpack_s": F, "samples": [ms, ...]}.

    python3 _rootless_open.py IMAGE_REF WORK_DIR N SPARES
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import trio
from _opens import warm_opens

from rolloutd.sandbox import open_backend
from rolloutd.sandbox.images import ImageStore


async def main(ref: str, work: Path, n: int, spares: int) -> None:
    store = ImageStore(work / "images")
    t0 = time.perf_counter()
    await trio.to_thread.run_sync(store.resolve, ref)
    unpack_s = time.perf_counter() - t0
    backend = open_backend("bwrap", state_dir=work / "state", boot_id="benchrl", check=True,
                           spares=spares, images=store)
    try:
        backend.warm_up()
        await warm_opens(backend, ref, 3)  # untimed, as the root run
        samples = await warm_opens(backend, ref, n)
    finally:
        await backend.aclose()
    print(json.dumps({"unpack_s": unpack_s, "samples": samples}))


if __name__ == "__main__":
    trio.run(main, sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
