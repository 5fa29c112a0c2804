"""TEST DOUBLE: a backend that replays a script of replies. Not a model.

For tests and benchmarks of pipeline logic only. Every completion it returns is labelled
``backend="scripted (test double)"``. Replies are text, tokenized with the real tokenizer
(through the renderer) and closed with the family's end token; logprobs are deterministic
fakes (a function of the token id and position), so token-in/token-out bookkeeping can be
checked exactly.

The reply for a request is chosen from the *conversation*, not from a call counter: turn ``k``
is the number of assistant headers in the prompt minus one, and the reply is ``replies[k]``
(the last one repeats). So a rollout that fails over to another scripted backend continues
its script where it was, and concurrent rollouts don't disturb each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from rolloutd.daemon.llm.base import BackendUnavailable, Completion, SamplingParams
from rolloutd.daemon.llm.chat import ChatRenderer

LABEL = "scripted (test double)"

def fake_logprob(token_id: int, position: int) -> float:
    """Deterministic, in (-3.01, -0.01]: lets tests check logprobs pass through untouched."""
    return -((token_id * 7919 + position * 104729) % 9973) / 9973.0 * 3.0 - 0.01


class ScriptedBackend:
    """Replays ``replies`` (strings, or one callable ``(turn, prompt_ids) -> str``);
    ``record=True`` keeps every answer in ``log``.

    ``latency_s`` is slept per request and ``per_token_s`` per returned token (trio.sleep, so
    autojump clocks make them free). ``set_down(True)`` makes it fail like a dead server.
    """

    kind = "scripted"

    def __init__(
        self,
        renderer: ChatRenderer,
        replies: Sequence[str] | Callable[[int, list[int]], str],
        *,
        latency_s: float = 0.0,
        per_token_s: float = 0.0,
        name: str = LABEL,
        record: bool = False,
    ) -> None:
        if not callable(replies) and not replies:
            raise ValueError("a scripted backend needs at least one reply")
        self.renderer = renderer
        self.replies = replies
        self.latency_s = latency_s
        self.per_token_s = per_token_s
        self.name = name
        self.url: str | None = None
        self.calls = 0
        self.down = False
        #: With ``record``: every (prompt ids, completion) answered, in order (for checking
        #: that a trajectory holds exactly what the backend returned).
        self.log: list[tuple[list[int], Completion]] | None = [] if record else None
        self._header = [renderer.start_id, *renderer.encode_text("assistant\n")]

    def set_down(self, down: bool) -> None:
        self.down = down

    def turn_index(self, prompt_ids: Sequence[int]) -> int:
        h, n = self._header, len(self._header)
        count = sum(1 for i in range(len(prompt_ids) - n + 1) if list(prompt_ids[i : i + n]) == h)
        return max(count - 1, 0)

    def reply_text(self, prompt_ids: Sequence[int]) -> str:
        turn = self.turn_index(prompt_ids)
        if callable(self.replies):
            return self.replies(turn, list(prompt_ids))
        return self.replies[min(turn, len(self.replies) - 1)]

    async def complete(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int
    ) -> Completion:
        self.calls += 1
        if self.down:
            raise BackendUnavailable(f"{self.name} is down")
        ids = [*self.renderer.encode_text(self.reply_text(prompt_ids)), self.renderer.end_id]
        stops = set(params.stop_token_ids) | set(self.renderer.stop_ids)
        finish = "stop"
        for i, tid in enumerate(ids):
            if tid in stops:
                ids = ids[: i + 1]
                break
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        await trio.sleep(self.latency_s + self.per_token_s * len(ids))
        if self.down:  # died while "generating"
            raise BackendUnavailable(f"{self.name} went down mid-request")
        start = len(prompt_ids)
        c = Completion(
            token_ids=ids,
            logprobs=[fake_logprob(t, start + i) for i, t in enumerate(ids)],
            finish_reason=finish,
            backend=self.name,
        )
        if self.log is not None:
            self.log.append((list(prompt_ids), c))
        return c

    async def health(self) -> bool:
        await trio.lowlevel.checkpoint()
        return not self.down

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
