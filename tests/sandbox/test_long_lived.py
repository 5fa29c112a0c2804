"""A sandbox outlives trio's idle worker threads (they retire after 10 s).

Regression: forking from a worker thread tied bwrap's --die-with-parent (PR_SET_PDEATHSIG)
to that thread, so every sandbox died about 10 s after it opened.
"""

from __future__ import annotations

import pytest
import trio


@pytest.mark.slow
async def test_sandbox_survives_worker_thread_retirement(backend, base_spec):
    async with backend.open(base_spec) as sb:
        await trio.sleep(12)
        result = await sb.run(["echo", "still here"], timeout_s=10)
        assert result.exit_code == 0 and result.stdout.strip() == b"still here"
