"""A harness in a task's own image: the busybox image has no Python and no glibc, and its
harness (a shell script around busybox ``wget``) still reaches the rollout's endpoint on the
sandbox's loopback; the scripted backend (TEST DOUBLE) is the policy."""

from __future__ import annotations

from typing import Any

from rolloutd.daemon.trajectory import Status

SCRIPT = r"""
body='{"model": "m", "messages": [{"role": "user", "content": "What is 1+1?"}]}'
wget -q -O /tmp/reply.json --header "Authorization: Bearer $OPENAI_API_KEY" \
     --header "Content-Type: application/json" --post-data "$body" "$OPENAI_BASE_URL/chat/completions"
echo "REPLY $(cat /tmp/reply.json)"
"""


async def test_a_shell_harness_in_a_busybox_image(image_harness: Any, test_images: Any) -> None:
    await image_harness.script(["The answer is 2."])
    task = {"kind": "math", "question": "What is 1+1?", "answer": "2",
            "image": test_images.oci_ref(test_images.busybox_oci),
            "agent": {"command": ["sh", "-c", SCRIPT]}}
    t = await image_harness.run(task)
    assert t.status is Status.completed, (t.error, t.harness)
    assert t.harness is not None and t.harness.exit_code == 0, t.harness
    assert '"content":"The answer is 2."' in t.harness.output_tail, t.harness.output_tail
    assert t.reward == 1.0 and len(t.segments) == 1 and t.harness.calls == 1
